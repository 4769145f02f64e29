"""The HTTP tier: entries as objects ``<prefix>/<key>`` on a plain HTTP cache server.

GET, PUT, HEAD and DELETE, as ccache's ``http://`` remote storage and Bazel's
remote cache speak to nginx's WebDAV module, bazel-remote and the like.
Credentials come from a variable the URL names (``?bearer=VAR`` or
``?basic=VAR``), never from the URL itself, which statistics and logs show.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator

from kernelcache.errors import StoreError
from kernelcache.stores.base import EntryInfo, is_valid_key
from kernelcache.stores.http import config
from kernelcache.stores.http.objects import DEFAULT_MAX_ENTRY_SIZE, DEFAULT_TIMEOUT, ObjectStore
from kernelcache.stores.http.transport import Transport, check_status


class HTTPStore(ObjectStore):
    """Entries on an HTTP server under ``<prefix>/<key>``; every failure a counted StoreError.

    A reader never gets a wrong entry: each object is verified whole (see
    :class:`~kernelcache.stores.http.objects.ObjectStore`). Listing (``ls``,
    ``prune --remote``, ``verify``) needs the server to list a folder as JSON
    (nginx: ``autoindex on; autoindex_format json;``); without it those
    commands say so, and gets and puts work as ever.
    """

    kind = "http"

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
        parts, self.prefix, options = config.split_http(url)
        super().__init__(
            read_only=read_only or options.get("readonly", False),
            secret=secret,
            timeout=options.get("timeout", DEFAULT_TIMEOUT) if timeout is None else timeout,
            max_entry_size=max_entry_size or options.get("max_entry_size", DEFAULT_MAX_ENTRY_SIZE),
            breaker_threshold=breaker_threshold,
            breaker_cooldown=breaker_cooldown,
        )
        self.url = urllib.parse.urlunsplit(parts._replace(query=""))
        self._auth = config.auth_header(options)
        self._base = "/" + urllib.parse.quote(self.prefix) if self.prefix else ""
        self.transport = Transport(
            parts.scheme,
            parts.hostname or "",
            parts.port,
            timeout=self.timeout,
            breaker=self.breaker,
            counters=self.counters,
            label=repr(self),
        )

    def __repr__(self) -> str:
        return f"HTTPStore({self.url!r})"

    def request_for(
        self, method: str, key: str | None, query: str = ""
    ) -> tuple[str, dict[str, str]]:
        path = f"{self._base}/{key}" if key is not None else f"{self._base}/"
        headers = {"Host": self.transport.host_header}
        if self._auth is not None:
            headers["Authorization"] = self._auth
        return path + (f"?{query}" if query else ""), headers

    def keys(self) -> Iterator[str]:
        for info in self.scan():
            yield info.key

    def scan(self) -> Iterator[EntryInfo]:
        path, headers = self.request_for("GET", None)
        headers["Accept"] = "application/json"
        status, _reply, body = self.transport.request("GET", path, headers, limit=256 << 20)
        if status == 404:
            return
        check_status(repr(self), "GET", status, self.counters, (200,))
        try:
            listing = json.loads(body)
        except ValueError:
            listing = None
        if not isinstance(listing, list):
            raise StoreError(
                f"{self!r}: the server does not list {self.prefix or '/'} as JSON "
                "(nginx: autoindex on; autoindex_format json;): ls, verify and prune "
                "--remote need a listing"
            )
        from kernelcache.stores.http.transport import http_time

        for item in listing:
            if not isinstance(item, dict) or item.get("type") != "file":
                continue
            name, size = item.get("name"), item.get("size")
            if is_valid_key(name) and isinstance(size, int):
                modified = http_time(item.get("mtime"))
                yield EntryInfo(str(name), size, modified, modified)
