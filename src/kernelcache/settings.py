"""All configuration in one typed object: arguments, then environment, then defaults.

Each field of :class:`Settings` declares, in one place, its default, the
``KERNELCACHE_*`` variable that sets it and how that variable's text is read.
Each value remembers where it came from, so ``kernelcache config`` can say
why a setting has the value it has.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from kernelcache._dirs import default_dir as default_dir  # public here: the dir when none is set
from kernelcache.errors import ConfigError
from kernelcache.units import parse_size

ENV_PREFIX = "KERNELCACHE_"
DEFAULT_MAX_SIZE = 10 << 30
DEFAULT_MEMORY_MAX_SIZE = 256 << 20
#: The kinds of local tier ``KERNELCACHE_LOCAL`` can choose.
LOCAL_TIERS = ("disk", "sqlite")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(var: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{var} must be one of 1/0, true/false, yes/no, on/off; got {text!r}")


def _parse_local(var: str, text: str) -> str:
    value = text.strip().lower() or "disk"
    if value not in LOCAL_TIERS:
        raise ConfigError(f"{var} must be one of {', '.join(LOCAL_TIERS)}; got {text!r}")
    return value


def _parse_secret(var: str, text: str) -> str:
    # Set but empty (an unset variable expanded, a missing file read) must not
    # silently turn signing off: unsigned values would then be accepted.
    if not text.strip():
        raise ConfigError(
            f"{var} is set but empty: give the team's secret, or unset it to turn signing off"
        )
    return text


def _parse_cap(var: str, text: str | int) -> int | None:
    """A cap: ``0`` in any unit (``0``, ``0M``, ``0.0G``), ``none`` or empty mean no cap."""
    if isinstance(text, str) and text.strip().lower() in ("", "none", "unlimited"):
        return None
    try:
        size = parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"{var}: {exc}") from None
    return size or None


def _parse_remote(var: str, text: str) -> str | None:
    """The team tiers' URLs, space-separated, front first (ccache's ``remote_storage``),
    each checked whole now: a typo is one error here, not a ``TypeError`` from every
    later lookup (issue 20)."""
    if not text.strip():
        return None
    from kernelcache.stores import remotes  # only remote users pay for their tiers' modules

    try:
        remotes.validate(text)
    except ConfigError as exc:
        raise ConfigError(f"{var}: {exc}") from None
    return " ".join(remotes.split(text))


def _parse_dir(var: str, text: str) -> str:
    """An absolute directory (``~`` expanded). A relative ``KERNELCACHE_DIR`` is refused:
    each working directory would get a cache of its own (a build runs its compiles in
    many). A relative argument (``Settings.load(dir=...)``, ``kernelcache --dir``) is
    resolved once, against this process's working directory."""
    path = os.path.expanduser(text)
    if os.path.isabs(path):
        return path
    if var.startswith(ENV_PREFIX):
        raise ConfigError(
            f"{var} must be an absolute path (or start with ~/), not {text!r}: "
            "a relative one would make a separate cache in every working directory"
        )
    return os.path.abspath(path)


def _variable(
    name: str, parse: Callable[[str, Any], Any], *, arguments: bool = False, doc: str = ""
) -> Any:
    """Field metadata: the variable ``KERNELCACHE_<name>`` read by ``parse(var, text)``;
    ``arguments``: constructor arguments go through ``parse`` too (sizes with units);
    ``doc``: what it means, for the documentation's settings page (scripts/docs_gen.py)."""
    return {"variable": ENV_PREFIX + name, "parse": parse, "arguments": arguments, "doc": doc}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Effective configuration; build it with :meth:`load`.

    Immutable, compared and hashed by value (``sources`` excluded); the
    secret never appears in its ``repr``.
    """

    dir: str = dataclasses.field(
        default_factory=default_dir,
        metadata=_variable(
            "DIR",
            _parse_dir,
            arguments=True,
            doc="the cache directory, absolute or ~/... (empty: unset; relative: an error)",
        ),
    )
    max_bytes: int | None = dataclasses.field(
        default=DEFAULT_MAX_SIZE,
        metadata=_variable(
            "MAX_SIZE",
            _parse_cap,
            arguments=True,
            doc="the disk (or SQLite) tier's cap: 500M, 5G; 0 in any unit: no cap",
        ),
    )
    memory_max_bytes: int | None = dataclasses.field(
        default=DEFAULT_MEMORY_MAX_SIZE,
        metadata=_variable(
            "MEMORY_MAX_SIZE", _parse_cap, arguments=True, doc="the memory tier's cap"
        ),
    )
    local: str = dataclasses.field(
        default="disk",
        metadata=_variable(
            "LOCAL",
            _parse_local,
            arguments=True,
            doc="the local tier: disk (one file per entry) or sqlite (cache.sqlite in the directory)",
        ),
    )
    remote: str | None = dataclasses.field(
        default=None,
        metadata=_variable(
            "REMOTE",
            _parse_remote,
            doc="the team tier: redis://host:port/db?namespace=&ttl=&timeout=&readonly="
            "&max_entry_size=, or redis+cluster://host:port?...&replicas=",
        ),
    )
    disable: bool = dataclasses.field(
        default=False,
        metadata=_variable("DISABLE", _parse_bool, doc="no tiers: every lookup misses"),
    )
    read_only: bool = dataclasses.field(
        default=False,
        metadata=_variable("READONLY", _parse_bool, doc="write nothing into the cache directory"),
    )
    secret: str | None = dataclasses.field(
        default=None,
        repr=False,
        metadata=_variable(
            "SECRET",
            _parse_secret,
            doc="sign and verify the team tier's entries (keyed BLAKE3); set but empty: an error",
        ),
    )
    #: Integrations refuse every release of their tool outside the tested range
    #: (by default, an untested release with every seam present installs with a warning).
    strict_versions: bool = dataclasses.field(
        default=False,
        metadata=_variable(
            "STRICT_VERSIONS",
            _parse_bool,
            doc="integrations refuse every release of their tool outside the tested range",
        ),
    )
    #: Where each value came from: "argument", "environment KERNELCACHE_X" or "default".
    sources: dict[str, str] = dataclasses.field(
        default_factory=dict, compare=False, repr=False, metadata={}
    )

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **arguments: Any) -> Settings:
        """Arguments win over ``KERNELCACHE_*`` variables, which win over defaults.

        An argument of ``None`` counts as not given. An empty variable is read
        like any other (an empty ``KERNELCACHE_REMOTE`` is no remote), except
        ``KERNELCACHE_DIR``: empty is unset, never the working directory.
        """
        env = os.environ if environ is None else environ
        _check_names(arguments)
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for field in _SETTINGS:
            meta = field.metadata
            var = meta["variable"]
            if arguments.get(field.name) is not None:
                value = arguments[field.name]
                values[field.name] = (
                    meta["parse"](field.name, value) if meta["arguments"] else value
                )
                sources[field.name] = "argument"
            elif var in env and (env[var].strip() or field.name != "dir"):
                values[field.name] = meta["parse"](var, env[var])
                sources[field.name] = f"environment {var}"
            else:
                sources[field.name] = "default"
        return cls(**values, sources=sources)

    def replaced(self, **changes: Any) -> Settings:
        """A copy with some values changed (their source becomes "argument")."""
        _check_names(changes)
        sources = {**self.sources, **dict.fromkeys(changes, "argument")}
        return dataclasses.replace(self, **changes, sources=sources)

    def describe(self) -> list[tuple[str, str, str]]:
        """``(name, value, source)`` rows; the secret is never shown."""
        rows = []
        for field in _SETTINGS:
            value = getattr(self, field.name)
            shown = "<set>" if field.name == "secret" and value else value
            rows.append((field.name, str(shown), self.sources.get(field.name, "default")))
        return rows


#: The fields read from arguments and the environment (every field but ``sources``).
_SETTINGS = tuple(f for f in dataclasses.fields(Settings) if "variable" in f.metadata)
#: The variables that configure kernelcache, in field order.
VARIABLES = tuple(f.metadata["variable"] for f in _SETTINGS)


def _check_names(given: Mapping[str, Any]) -> None:
    unknown = set(given) - {f.name for f in _SETTINGS}
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """One boolean setting read from the environment alone, without loading the others
    (an integration's ``install()`` must not fail on an unrelated slip elsewhere)."""
    field = next((f for f in _SETTINGS if f.name == name), None)
    if field is None or field.type not in (bool, "bool"):
        raise ConfigError(f"no boolean setting {name!r}")
    env = os.environ if environ is None else environ
    var = field.metadata["variable"]
    return bool(_parse_bool(var, env[var])) if var in env else bool(field.default)
