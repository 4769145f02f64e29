"""Configuration of the Redis tier: URL options and their validation."""

from __future__ import annotations

import urllib.parse
from typing import Any

from kernelcache.errors import ConfigError
from kernelcache.stores.base import is_valid_key
from kernelcache.stores.redis.format import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from kernelcache.units import parse_age, parse_size

URL_OPTIONS = ("namespace", "ttl", "timeout", "readonly", "cluster", "replicas", "max_entry_size")
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_TRUE = ("1", "true", "yes", "on")
#: Entries larger than this are neither stored nor read (``max_entry_size=`` in the URL).
DEFAULT_MAX_ENTRY_SIZE = 512 << 20


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """Remove kernelcache's own query parameters from a Redis URL; the rest go to redis-py.

    ``?namespace=team&ttl=30d&timeout=0.5&readonly=1&max_entry_size=1G`` become
    typed options; ``redis+cluster://`` (or ``rediss+cluster://``, or
    ``?cluster=1``) selects Redis Cluster, ``replicas=1`` lets a cluster's
    reads go to replicas too.
    """
    schemes = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
    if not isinstance(url, str) or not url.startswith(schemes):
        raise ConfigError(
            f"remote URL must start with redis://, rediss://, unix:// or redis+cluster://, "
            f"not {url!r}"
        )
    parts = urllib.parse.urlsplit(url)
    options: dict[str, Any] = {}
    if parts.scheme in _CLUSTER_SCHEMES:
        options["cluster"] = True
        parts = parts._replace(scheme=_CLUSTER_SCHEMES[parts.scheme])
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    for name, text in query:
        if name == "namespace":
            options[name] = text
        elif name == "ttl":
            options[name] = parse_age(text)
        elif name == "timeout":
            options[name] = _seconds(text)
        elif name == "max_entry_size":
            options[name] = parse_size(text)
        elif name in ("readonly", "cluster", "replicas"):
            options[name] = options.get(name, False) or text.strip().lower() in _TRUE
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k not in URL_OPTIONS])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), options


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"timeout in the remote URL must be seconds, not {text!r}") from None


def check_options(
    namespace: str,
    ttl: float | None,
    timeout: float,
    chunk_size: int,
    compress_min: int,
    max_entry_size: int,
) -> None:
    if not isinstance(namespace, str) or not is_valid_key(namespace) or len(namespace) > 64:
        raise ConfigError(f"namespace {namespace!r}: use 1-64 characters of [A-Za-z0-9_.-]")
    if ttl is not None and not ttl > 0:
        raise ConfigError(f"ttl must be > 0 seconds or None, not {ttl!r}")
    if not timeout > 0:
        raise ConfigError(f"timeout must be > 0 seconds, not {timeout!r}")
    if not isinstance(chunk_size, int) or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ConfigError(
            f"chunk_size must be an int from {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE}, "
            f"not {chunk_size!r}"
        )
    if not isinstance(compress_min, int) or compress_min < 0:
        raise ConfigError(f"compress_min must be a non-negative int, not {compress_min!r}")
    if not isinstance(max_entry_size, int) or max_entry_size < 1:
        raise ConfigError(f"max_entry_size must be a positive int, not {max_entry_size!r}")


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    """The signing secret as bytes; set but empty (or blank) is an error, never "signing off"."""
    if secret is None:
        return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw.strip():
        raise ConfigError(
            "the signing secret is set but empty: give the team's secret, "
            "or unset it to turn signing off"
        )
    return raw


def redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))
