"""Configuration of the Redis tier: URL options and their validation.

The whole URL is checked when the settings load (``KERNELCACHE_REMOTE``) or a
:class:`~kernelcache.stores.redis.RedisStore` is made: a parameter that is
neither kernelcache's nor one of the few redis-py options passed through, or
a value that does not parse, is a :class:`~kernelcache.errors.ConfigError`
naming it and listing the valid ones. (Before issue 20, ``?namspace=team``
reached redis-py as a keyword and every later call raised ``TypeError``.)
"""

from __future__ import annotations

import difflib
import urllib.parse
from collections.abc import Callable
from typing import Any

from kernelcache.errors import ConfigError
from kernelcache.stores.base import is_valid_key
from kernelcache.stores.redis.format import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from kernelcache.units import parse_age, parse_size

URL_OPTIONS = ("namespace", "ttl", "timeout", "readonly", "cluster", "replicas", "max_entry_size")
#: redis-py's own URL options that are passed through (the rest would fight the
#: tier's deadlines, retries or reply parsing: socket_timeout, retry_on_timeout, protocol...).
PASSED_OPTIONS = ("db", "client_name", "health_check_interval")
#: Passed through for ``rediss://`` (TLS) URLs only.
TLS_OPTIONS = (
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
)
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
#: Entries larger than this are neither stored nor read (``max_entry_size=`` in the URL).
DEFAULT_MAX_ENTRY_SIZE = 512 << 20
#: Seconds each call to Redis may take unless ``timeout=`` says otherwise.
DEFAULT_TIMEOUT = 0.5


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("use 1/0, true/false, yes/no or on/off")


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("use a number of seconds > 0")
    return value


def _whole(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError("use a whole number >= 0")
    return int(text)


def _namespace(text: str) -> str:
    if not is_valid_key(text) or len(text) > 64:
        raise ValueError("use 1-64 characters of [A-Za-z0-9_.-]")
    return text


def _cert_reqs(text: str) -> str:
    if text not in ("none", "optional", "required"):
        raise ValueError("use none, optional or required")
    return text


def _age(text: str) -> float:
    value = parse_age(text)
    if not value > 0:
        raise ValueError("use an age > 0, e.g. 30d")
    return value


def _size(text: str) -> int:
    value = parse_size(text)
    if value < 1:
        raise ValueError("use a size > 0, e.g. 1G")
    return value


#: How each parameter's text is read (a ValueError or ConfigError is a bad value).
_PARSERS: dict[str, Callable[[str], Any]] = {
    "namespace": _namespace,
    "ttl": _age,
    "timeout": _seconds,
    "max_entry_size": _size,
    "readonly": _flag,
    "cluster": _flag,
    "replicas": _flag,
    "db": _whole,
    "client_name": str,
    "health_check_interval": _whole,
    "ssl_cert_reqs": _cert_reqs,
    "ssl_check_hostname": _flag,
    **dict.fromkeys(("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile"), str),
}


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """Check a Redis URL whole and split off kernelcache's own query parameters.

    ``?namespace=team&ttl=30d&timeout=0.5&readonly=1&max_entry_size=1G`` become
    typed options; ``redis+cluster://`` (or ``rediss+cluster://``, or
    ``?cluster=1``) selects Redis Cluster, ``replicas=1`` lets a cluster's
    reads go to replicas too. What remains (the :data:`PASSED_OPTIONS`, and
    :data:`TLS_OPTIONS` for ``rediss``) goes to redis-py. Anything else, a
    value that does not parse, or a parameter given twice raises
    :class:`ConfigError`.
    """
    if not isinstance(url, str) or not url.startswith(tuple(f"{s}://" for s in _SCHEMES)):
        raise ConfigError(
            f"remote URL must start with redis://, rediss://, unix:// or redis+cluster://, "
            f"not {redact(url) if isinstance(url, str) else url!r}"
        )
    parts = urllib.parse.urlsplit(url)
    options: dict[str, Any] = {}
    if parts.scheme in _CLUSTER_SCHEMES:
        options["cluster"] = True
        parts = parts._replace(scheme=_CLUSTER_SCHEMES[parts.scheme])
    valid = URL_OPTIONS + PASSED_OPTIONS + (TLS_OPTIONS if parts.scheme == "rediss" else ())
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    seen: set[str] = set()
    for name, text in query:
        if name not in valid:
            raise ConfigError(_unknown(name, valid))
        if name in seen:
            raise ConfigError(f"parameter {name!r} is given twice in the remote URL")
        seen.add(name)
        try:
            value = _PARSERS[name](text)
        except (ValueError, ConfigError) as exc:
            raise ConfigError(f"bad value {text!r} for {name!r} in the remote URL: {exc}") from None
        if name == "cluster":
            options[name] = options.get(name, False) or value  # the scheme may have said so
        elif name in URL_OPTIONS:
            options[name] = value
    _check_path(parts, options)
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k not in URL_OPTIONS])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), options


def _unknown(name: str, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown parameter {name!r} in the remote URL{hint}; valid: {', '.join(valid)}"


def _check_path(parts: urllib.parse.SplitResult, options: dict[str, Any]) -> None:
    """The database in the path is a number; a cluster has database 0 and TCP only."""
    if parts.scheme == "unix":
        if options.get("cluster"):
            raise ConfigError("a Redis Cluster is reached over TCP, not a unix socket")
        return
    path = urllib.parse.unquote(parts.path).strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"the database in the remote URL must be a number, not {path!r}")
    if options.get("cluster") and path and int(path) != 0:
        raise ConfigError("a Redis Cluster has only database 0: drop the /N from the URL")
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:
        raise ConfigError(f"bad port in the remote URL {redact(parts.geturl())!r}") from None


def validate_url(url: str) -> None:
    """Raise :class:`ConfigError` unless ``url`` makes a working Redis tier (settings load)."""
    _url, options = split_url(url)
    check_options(
        options.get("namespace", "default"),
        options.get("ttl"),
        options.get("timeout", DEFAULT_TIMEOUT),
        MIN_CHUNK_SIZE,
        0,
        options.get("max_entry_size", DEFAULT_MAX_ENTRY_SIZE),
    )


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
