"""The S3 tier: entries as objects ``<prefix>/<key>`` in an S3-compatible bucket.

AWS S3, Ceph's radosgw, MinIO and the like, spoken with the standard
library (:mod:`http.client` and SigV4 in ``sigv4.py``); see
docs/object-storage.md for why not boto3, and the figures.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator

from kernelcache.errors import StoreError
from kernelcache.stores.base import EntryInfo, is_valid_key
from kernelcache.stores.http.objects import DEFAULT_MAX_ENTRY_SIZE, DEFAULT_TIMEOUT, ObjectStore
from kernelcache.stores.http.transport import Transport, check_status
from kernelcache.stores.s3 import config, sigv4

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


class S3Store(ObjectStore):
    """Entries in an S3 bucket under ``<prefix>/<key>``; every failure a counted StoreError.

    S3 publishes a PUT whole, so a reader sees no object or a complete one;
    each is verified before use (see
    :class:`~kernelcache.stores.http.objects.ObjectStore`). Listings come
    from ListObjectsV2, a page of 1000 keys a call; an object's
    ``last_access`` is its last write (S3 records no reads).
    """

    kind = "s3"
    delete_says_missing = False

    def __init__(
        self,
        url: str,
        *,
        read_only: bool = False,
        secret: str | bytes | None = None,
        timeout: float | None = None,
        max_entry_size: int | None = None,
        breaker_threshold: int = 3,
        breaker_cooldown: float = 10.0,
    ) -> None:
        target = config.split_s3(url)
        options = target.options
        super().__init__(
            read_only=read_only or options.get("readonly", False),
            secret=secret,
            timeout=options.get("timeout", DEFAULT_TIMEOUT) if timeout is None else timeout,
            max_entry_size=max_entry_size or options.get("max_entry_size", DEFAULT_MAX_ENTRY_SIZE),
            breaker_threshold=breaker_threshold,
            breaker_cooldown=breaker_cooldown,
        )
        self.where = target
        self.url = url.split("?", 1)[0]
        self.prefix = target.prefix
        self._creds = config.credentials(target)
        host = target.host if target.path_style else f"{target.bucket}.{target.host}"
        self._root = f"/{target.bucket}" if target.path_style else ""
        self.transport = Transport(
            target.scheme,
            host,
            target.port,
            timeout=self.timeout,
            breaker=self.breaker,
            counters=self.counters,
            label=repr(self),
        )

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    def _object(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def request_for(
        self, method: str, key: str | None, query: str = ""
    ) -> tuple[str, dict[str, str]]:
        path = sigv4.quote_path(f"{self._root}/{self._object(key)}" if key else f"{self._root}/")
        headers = {"Host": self.transport.host_header}
        if self._creds is not None:
            payload = sigv4.UNSIGNED if method == "PUT" else sigv4.EMPTY_SHA256
            sigv4.sign(self._creds, self.where.region, method, path, query, headers, payload)
        return path + (f"?{query}" if query else ""), headers

    def keys(self) -> Iterator[str]:
        for info in self.scan():
            yield info.key

    def scan(self) -> Iterator[EntryInfo]:
        import xml.etree.ElementTree as ET  # listings only: not on a hit's import path

        from kernelcache.stores.http.objects import _iso_time

        start = f"{self.prefix}/" if self.prefix else ""
        token: str | None = None
        while True:
            params = [("list-type", "2"), ("prefix", start), ("max-keys", "1000")]
            if token:
                params.append(("continuation-token", token))
            query = urllib.parse.urlencode(params, quote_via=urllib.parse.quote)
            path, headers = self.request_for("GET", None, query)
            status, _reply, body = self.transport.request("GET", path, headers, limit=64 << 20)
            if status == 404:
                raise StoreError(f"{self!r}: no bucket {self.where.bucket!r} there")
            check_status(repr(self), "GET", status, self.counters, (200,))
            try:
                root = ET.fromstring(body)
            except ET.ParseError as exc:
                raise StoreError(f"{self!r}: the bucket listing is not XML: {exc}") from exc
            for item in root.iter(f"{_NS}Contents"):
                name = item.findtext(f"{_NS}Key") or ""
                key = name[len(start) :]
                size = item.findtext(f"{_NS}Size") or ""
                if name.startswith(start) and is_valid_key(key) and size.isdigit():
                    modified = _iso_time(item.findtext(f"{_NS}LastModified"))
                    yield EntryInfo(key, int(size), modified, modified)
            token = root.findtext(f"{_NS}NextContinuationToken")
            if root.findtext(f"{_NS}IsTruncated") != "true" or not token:
                return
