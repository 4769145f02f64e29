"""Configuration of the Redis tier: URL options, validation, and the redis-py client."""

from __future__ import annotations

import urllib.parse
from typing import Any

from kernelcache.errors import ConfigError
from kernelcache.stores.base import is_valid_key
from kernelcache.units import parse_age

URL_OPTIONS = ("namespace", "ttl", "timeout", "readonly")


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """Remove kernelcache's own query parameters from a Redis URL; the rest go to redis-py.

    ``?namespace=team&ttl=30d&timeout=0.5&readonly=1`` become typed options.
    """
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"remote URL must start with redis://, rediss:// or unix://, not {url!r}")
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    options: dict[str, Any] = {}
    for name, text in query:
        if name == "namespace":
            options[name] = text
        elif name == "ttl":
            options[name] = parse_age(text)
        elif name == "timeout":
            try:
                options[name] = float(text)
            except ValueError:
                raise ConfigError(
                    f"timeout in the remote URL must be seconds, not {text!r}"
                ) from None
        elif name == "readonly":
            options[name] = text.strip().lower() in ("1", "true", "yes", "on")
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k not in URL_OPTIONS])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), options


def check_options(
    namespace: str, ttl: float | None, timeout: float, chunk_size: int, compress_min: int
) -> None:
    if not isinstance(namespace, str) or not is_valid_key(namespace) or len(namespace) > 64:
        raise ConfigError(f"namespace {namespace!r}: use 1-64 characters of [A-Za-z0-9_.-]")
    if ttl is not None and not ttl > 0:
        raise ConfigError(f"ttl must be > 0 seconds or None, not {ttl!r}")
    if not timeout > 0:
        raise ConfigError(f"timeout must be > 0 seconds, not {timeout!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1024:
        raise ConfigError(f"chunk_size must be an int >= 1024, not {chunk_size!r}")
    if not isinstance(compress_min, int) or compress_min < 0:
        raise ConfigError(f"compress_min must be a non-negative int, not {compress_min!r}")


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    if secret is None:
        return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ConfigError("the signing secret must not be empty")
    return raw


def redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))


def connect(url: str, timeout: float) -> tuple[Any, tuple[Any, Any, Any]]:
    """A redis-py client that tries once, within ``timeout``, and its error classes."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as exc:
        raise ConfigError(
            "the Redis tier needs redis-py: pip install 'kernelcache[redis]'"
        ) from exc
    try:
        import zstandard  # noqa: F401  (checked now, used on the first compressed entry)
    except ImportError as exc:
        raise ConfigError(
            "the Redis tier needs zstandard: pip install 'kernelcache[redis]'"
        ) from exc
    try:
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # redis-py retries 3 times with backoff by default: that multiplies
            # the cost of a dead server; the circuit breaker decides instead.
            retry=Retry(NoBackoff(), 0, ()),
            decode_responses=False,
        )
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL {redact(url)!r}: {exc}") from exc
    errors = redis.exceptions
    # InvalidResponse: whatever listens there does not speak Redis, which is as
    # good as down for the circuit breaker.
    return client, (
        (errors.ConnectionError, errors.TimeoutError, errors.InvalidResponse),
        errors.TimeoutError,
        errors.RedisError,
    )
