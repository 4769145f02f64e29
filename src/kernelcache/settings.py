"""All configuration in one typed object: arguments, then environment, then defaults.

Each value remembers where it came from, so ``kernelcache config`` can say why
a setting has the value it has.
"""

from __future__ import annotations

import os
import sys

from kernelcache.errors import ConfigError
from kernelcache.units import parse_size

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ENV_PREFIX = "KERNELCACHE_"
DEFAULT_MAX_SIZE = 10 << 30
DEFAULT_MEMORY_MAX_SIZE = 256 << 20
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def default_dir() -> str:
    """The platform's user cache directory for kernelcache (platformdirs' ``user_cache_dir``)."""
    if sys.platform == "linux" and not _maybe_android():
        # platformdirs' own answer on Linux (the XDG base directory spec), in
        # the cases where every platformdirs version agrees, without importing
        # it: ~10 ms on each launcher call that relies on the default directory.
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        if os.path.isabs(xdg):
            return os.path.join(xdg, "kernelcache")
        home = os.environ.get("HOME", "")
        if not xdg.strip() and os.path.isabs(home):
            return os.path.join(os.path.expanduser("~/.cache"), "kernelcache")
    import platformdirs  # other platforms and unusual environments

    return str(platformdirs.user_cache_dir("kernelcache", appauthor=False))


def _maybe_android() -> bool:
    """Whether platformdirs might take this for Android (its own test, or its environment one)."""
    return hasattr(sys, "getandroidapilevel") or "ANDROID_DATA" in os.environ


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(
        f"{ENV_PREFIX}{name} must be one of 1/0, true/false, yes/no, on/off; got {text!r}"
    )


#: The kinds of local tier ``KERNELCACHE_LOCAL`` can choose.
LOCAL_TIERS = ("disk", "sqlite")


def _parse_local(name: str, text: str) -> str:
    value = text.strip().lower() or "disk"
    if value not in LOCAL_TIERS:
        raise ConfigError(
            f"{ENV_PREFIX}{name} must be one of {', '.join(LOCAL_TIERS)}; got {text!r}"
        )
    return value


def _parse_secret(name: str, text: str) -> str:
    # Set but empty (an unset variable expanded, a missing file read) must not
    # silently turn signing off: unsigned values would then be accepted.
    if not text.strip():
        raise ConfigError(
            f"{ENV_PREFIX}{name} is set but empty: give the team's secret, "
            "or unset it to turn signing off"
        )
    return text


def _parse_optional_size(name: str, text: str | int) -> int | None:
    """A cap: ``0`` in any unit (``0``, ``0M``, ``0.0G``), ``none`` or empty mean no cap."""
    if isinstance(text, str) and text.strip().lower() in ("", "none", "unlimited"):
        return None
    try:
        size = parse_size(text)
    except ConfigError as exc:
        where = name if name.islower() else ENV_PREFIX + name  # an argument, or a variable
        raise ConfigError(f"{where}: {exc}") from None
    return size or None


# name -> (parser of the environment text, default factory)
_FIELDS: dict[str, tuple[Any, Any]] = {
    "dir": (lambda name, text: os.path.expanduser(text), default_dir),
    "max_size": (_parse_optional_size, lambda: DEFAULT_MAX_SIZE),
    "memory_max_size": (_parse_optional_size, lambda: DEFAULT_MEMORY_MAX_SIZE),
    "local": (_parse_local, lambda: "disk"),
    "remote": (lambda name, text: text or None, lambda: None),
    "disable": (_parse_bool, lambda: False),
    "readonly": (_parse_bool, lambda: False),
    "secret": (_parse_secret, lambda: None),
}


class Settings:
    """Effective configuration; build it with :meth:`load`.

    Immutable, compared and hashed by value (``sources`` excluded). A plain
    class, not a dataclass: see :class:`kernelcache.stores.base.Counters`.
    """

    __slots__ = (
        "dir",
        "disable",
        "local",
        "max_size",
        "memory_max_size",
        "readonly",
        "remote",
        "secret",
        "sources",
    )

    dir: str
    max_size: int | None
    memory_max_size: int | None
    local: str
    remote: str | None
    disable: bool
    readonly: bool
    secret: str | None
    sources: dict[str, str]

    def __init__(
        self,
        dir: str,
        max_size: int | None,
        memory_max_size: int | None,
        local: str,
        remote: str | None,
        disable: bool,
        readonly: bool,
        secret: str | None,
        sources: dict[str, str] | None = None,
    ) -> None:
        values = (dir, max_size, memory_max_size, local, remote, disable, readonly, secret)
        for name, value in zip(_FIELDS, values, strict=True):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "sources", {} if sources is None else sources)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(
            f"Settings are immutable; make new ones with Settings.load({name}=...)"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Settings are immutable")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={value!r}" for name, value, _ in self._described())
        return f"Settings({shown})"

    @classmethod
    def load(cls, environ: dict[str, str] | None = None, **arguments: Any) -> Settings:
        """Arguments win over ``KERNELCACHE_*`` variables, which win over defaults."""
        env = os.environ if environ is None else environ
        unknown = set(arguments) - set(_FIELDS)
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, (parse, default) in _FIELDS.items():
            var = ENV_PREFIX + name.upper()
            if arguments.get(name) is not None:
                value = arguments[name]
                if name.endswith("max_size"):
                    value = _parse_optional_size(name, value)
                elif name == "local":
                    value = _parse_local(name.upper(), value)
                values[name] = value
                sources[name] = "argument"
            elif env.get(var, "").strip() or (var in env and name != "dir"):
                # An empty KERNELCACHE_DIR is unset (not the working directory).
                values[name] = parse(name.upper(), env[var])
                sources[name] = f"environment {var}"
            else:
                values[name] = default()
                sources[name] = "default"
        return cls(**values, sources=sources)

    def replaced(self, **changes: Any) -> Settings:
        """A copy with some values changed (their source becomes "argument")."""
        unknown = set(changes) - set(_FIELDS)
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        values = {name: changes.get(name, getattr(self, name)) for name in _FIELDS}
        sources = {**self.sources, **dict.fromkeys(changes, "argument")}
        return Settings(**values, sources=sources)

    def describe(self) -> list[tuple[str, str, str]]:
        """``(name, value, source)`` rows; the secret is never shown."""
        return [(name, str(value), source) for name, value, source in self._described()]

    def _described(self) -> list[tuple[str, object, str]]:
        rows: list[tuple[str, object, str]] = []
        for name in _FIELDS:
            value = getattr(self, name)
            shown = "<set>" if name == "secret" and value else value
            rows.append((name, shown, self.sources.get(name, "default")))
        return rows
