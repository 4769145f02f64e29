"""URL options shared by the object tiers (``http(s)://`` and ``s3://``), checked whole at load.

A parameter that is not one of the tier's, a value that does not parse, a
parameter given twice, or credentials written into the URL is one
:class:`~kernelcache.errors.ConfigError` naming it: as for Redis URLs, a slip
is an error when the settings load, not a broken build later.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from kernelcache.errors import ConfigError
from kernelcache.stores.redis.config import _flag, _seconds, _size

#: Options every object tier reads from its URL.
COMMON_OPTIONS: dict[str, Callable[[str], Any]] = {
    "timeout": _seconds,
    "readonly": _flag,
    "max_entry_size": _size,
}


def _variable(text: str) -> str:
    if not text or not text.replace("_", "").isalnum() or text[0].isdigit():
        raise ValueError("use the name of an environment variable")
    return text


#: Options of ``http(s)://`` URLs: the variable holding a bearer token or ``user:password``.
HTTP_OPTIONS: dict[str, Callable[[str], Any]] = {
    **COMMON_OPTIONS,
    "bearer": _variable,
    "basic": _variable,
}
#: Options of ``s3://`` URLs.
S3_OPTIONS: dict[str, Callable[[str], Any]] = {
    **COMMON_OPTIONS,
    "endpoint": str,
    "region": str,
    "profile": str,
    "path_style": _flag,
}


def parse_options(
    url: str, query: str, parsers: Mapping[str, Callable[[str], Any]]
) -> dict[str, Any]:
    """Typed options from ``query``; anything unknown, unparsable or repeated is an error."""
    options: dict[str, Any] = {}
    for name, text in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if name not in parsers:
            import difflib

            close = difflib.get_close_matches(name, list(parsers), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown parameter {name!r} in the remote URL {url!r}{hint}; "
                f"valid: {', '.join(parsers)}"
            )
        if name in options:
            raise ConfigError(f"parameter {name!r} is given twice in the remote URL {url!r}")
        try:
            options[name] = parsers[name](text)
        except (ValueError, ConfigError) as exc:
            raise ConfigError(
                f"bad value {text!r} for {name!r} in the remote URL {url!r}: {exc}"
            ) from None
    return options


def check_prefix(url: str, prefix: str) -> str:
    """The object prefix of ``url``, without slashes at its ends; refuse ``.``/``..`` parts."""
    prefix = urllib.parse.unquote(prefix).strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ConfigError(f"the prefix in the remote URL {url!r} has an empty, . or .. part")
    return prefix


def split_http(url: str) -> tuple[urllib.parse.SplitResult, str, dict[str, Any]]:
    """``(parts, prefix, options)`` of an ``http(s)://host[:port]/prefix?...`` URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"an HTTP remote URL is http(s)://host[:port]/prefix, not {url!r}")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            "credentials in an HTTP remote URL would show in stats and logs: "
            "name a variable instead (?bearer=VAR holding a token, or ?basic=VAR holding user:password)"
        )
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:
        raise ConfigError(f"bad port in the remote URL {url!r}") from None
    options = parse_options(url, parts.query, HTTP_OPTIONS)
    if "bearer" in options and "basic" in options:
        raise ConfigError(f"give one of bearer= and basic= in the remote URL {url!r}, not both")
    return parts, check_prefix(url, parts.path), options


def auth_header(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str | None:
    """The ``Authorization`` header the ``bearer``/``basic`` variable gives, or ``None``."""
    import base64

    env = os.environ if environ is None else environ
    for scheme in ("bearer", "basic"):
        var = options.get(scheme)
        if var is None:
            continue
        value = env.get(var, "")
        if not value.strip():
            raise ConfigError(
                f"the remote URL takes its {scheme} credentials from {var}, which is unset or empty"
            )
        if scheme == "bearer":
            return f"Bearer {value.strip()}"
        if ":" not in value:
            raise ConfigError(f"{var} must hold user:password for basic authentication")
        return "Basic " + base64.b64encode(value.encode()).decode()
    return None
