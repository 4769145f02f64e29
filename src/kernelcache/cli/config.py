"""``kernelcache config``: every setting, its variable, its value and where it came from.

The core settings come from :class:`~kernelcache.settings.Settings`; the
Triton and launcher variables are read here by the same functions their
modules use, so what is shown is what they would see. Sizes are printed in
binary units (``10.0 GiB``) in the table, in bytes in ``--json``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

from kernelcache.cli.output import print_json, table
from kernelcache.errors import ConfigError
from kernelcache.settings import VARIABLES, Settings
from kernelcache.units import format_size

_SIZES = ("max_bytes", "memory_max_bytes", "triton_max_bytes")


def _flag(default: bool) -> Callable[[Mapping[str, str], str], Any]:
    def read(env: Mapping[str, str], var: str) -> Any:
        from kernelcache.nvcc.key import flag

        return flag(env, var, default)

    return read


def _text(env: Mapping[str, str], var: str) -> Any:
    return env.get(var) or None


def _seconds(default: float) -> Callable[[Mapping[str, str], str], Any]:
    def read(env: Mapping[str, str], var: str) -> Any:
        try:
            value = float(env.get(var, default))
        except ValueError:
            return default  # as the launcher reads it: a bad value gives the default
        return value if value > 0 else default

    return read


def _triton_timeout(env: Mapping[str, str], var: str) -> Any:
    from kernelcache.cache import DEFAULT_TIMEOUT  # what kernelcache.triton uses, without triton

    text = env.get(var, "").strip()
    return float(text) if text else DEFAULT_TIMEOUT


def _size(env: Mapping[str, str], var: str) -> Any:
    try:  # read as the Triton integration reads it: a cap through the settings
        return Settings.load(environ={}, dir="/", max_bytes=env[var]).max_bytes
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _sloppiness(env: Mapping[str, str], var: str) -> Any:
    from kernelcache.nvcc.key import sloppiness

    return ",".join(sorted(sloppiness(env))) or None


def _compiled_client(env: Mapping[str, str], var: str) -> Any:
    from kernelcache.nvcc.native import wanted

    return wanted(env)


def _flight_timeout(env: Mapping[str, str], var: str) -> Any:
    from kernelcache.nvcc.flight import timeout

    return timeout(env)


#: name, variable, reader(env, variable), what the default is when unset.
INTEGRATION_VARIABLES: tuple[tuple[str, str, Callable[[Mapping[str, str], str], Any], str], ...] = (
    ("triton_dir", "KERNELCACHE_TRITON_DIR", _text, "TRITON_CACHE_DIR if set, else dir"),
    ("triton_max_bytes", "KERNELCACHE_TRITON_MAX_SIZE", _size, "max_bytes"),
    ("triton_timeout", "KERNELCACHE_TRITON_TIMEOUT", _triton_timeout, "300 s"),
    ("triton_namespace", "KERNELCACHE_TRITON_NAMESPACE", _text, "none"),
    ("basedir", "KERNELCACHE_BASEDIR", _text, "none"),
    ("hash_dir", "KERNELCACHE_HASH_DIR", _flag(True), "on"),
    ("sloppiness", "KERNELCACHE_SLOPPINESS", _sloppiness, "none"),
    ("nvcc_preprocessed", "KERNELCACHE_NVCC_PREPROCESSED", _flag(True), "on"),
    ("server", "KERNELCACHE_SERVER", _flag(True), "on"),
    ("server_idle", "KERNELCACHE_SERVER_IDLE", _seconds(600.0), "600 s"),
    ("server_timeout", "KERNELCACHE_SERVER_TIMEOUT", _seconds(120.0), "120 s"),
    ("compiled_client", "KERNELCACHE_COMPILED_CLIENT", _compiled_client, "on"),
    ("nvcc_flight_timeout", "KERNELCACHE_NVCC_FLIGHT_TIMEOUT", _flight_timeout, "600 s"),
    ("vllm", "KERNELCACHE_VLLM", _flag(False), "off"),
)

#: What each integration variable means, for the documentation's settings page
#: (scripts/docs_gen.py, Markdown; a test fails for a variable without one).
MEANINGS: dict[str, str] = {
    "KERNELCACHE_TRITON_DIR": "Triton's cache directory, whatever TRITON_CACHE_DIR says",
    "KERNELCACHE_TRITON_MAX_SIZE": "the cap of Triton's cache directory",
    "KERNELCACHE_TRITON_TIMEOUT": "seconds a Triton compile holds its claim and others wait "
    "for it (inf: no limit)",
    "KERNELCACHE_TRITON_NAMESPACE": "mixed into Triton keys: setups sharing a directory kept apart",
    "KERNELCACHE_BASEDIR": "launcher: absolute paths under it are keyed relative to it",
    "KERNELCACHE_HASH_DIR": "launcher: key the working directory of debug compiles",
    "KERNELCACHE_SLOPPINESS": "`time_macros` caches sources that use `__TIME__` and co. "
    "(launcher, NVRTC, `header_digest`)",
    "KERNELCACHE_NVCC_PREPROCESSED": "launcher: try the preprocessed key after a direct miss",
    "KERNELCACHE_SERVER": "launcher: ask the warm per-user server for hits",
    "KERNELCACHE_SERVER_IDLE": "launcher: seconds without a call before the server exits",
    "KERNELCACHE_SERVER_TIMEOUT": "launcher: seconds a client waits for the server's answer",
    "KERNELCACHE_COMPILED_CLIENT": "launcher: the server builds the compiled client "
    "(with cc or gcc)",
    "KERNELCACHE_NVCC_FLIGHT_TIMEOUT": "launcher: seconds a call waits for another's compile "
    "of the same command before it compiles itself",
    "KERNELCACHE_VLLM": "vLLM's plugin sets FlashInfer's, DeepGEMM's, torch's and Triton's "
    "launchers in every vLLM process",
}


def rows(settings: Settings, env: Mapping[str, str]) -> list[dict[str, Any]]:
    """One row per setting: name, variable, value (bytes for sizes), source."""
    out = [
        {
            "name": name,
            "variable": variable,
            "value": None if name == "secret" else getattr(settings, name),
            "set": getattr(settings, name) is not None,
            "source": source,
        }
        for (name, _shown, source), variable in zip(settings.describe(), VARIABLES, strict=True)
    ]
    for name, variable, read, default in INTEGRATION_VARIABLES:
        given = variable in env
        value: Any
        if name == "triton_dir" and not given:
            value = env.get("TRITON_CACHE_DIR") or settings.dir
        elif name == "triton_max_bytes" and not given:
            value = settings.max_bytes
        else:
            try:
                value = read(env if given else {}, variable)
            except ValueError as exc:  # shown, not raised: `config` is where one looks
                value = f"invalid: {exc}"
        source = f"environment {variable}" if given else f"default ({default})"
        out.append({"name": name, "variable": variable, "value": value, "set": value is not None,
                    "source": source})  # fmt: skip
    out.append(_filesystem(settings.dir))
    return out


def _filesystem(directory: str) -> dict[str, Any]:
    """The cache directory's filesystem: no setting, but it decides the disk tier's rules
    (lease locks, no stat trusted across nodes) on a network one (issue 22)."""
    from kernelcache import fstype

    found = fstype.report(directory)
    kind = "a network filesystem" if found["network"] else "local"
    return {"name": "filesystem", "variable": None, "value": found["type"], "set": True,
            "network": found["network"], "source": f"detected ({kind})"}  # fmt: skip


def _shown(row: dict[str, Any]) -> str:
    value = row["value"]
    if row["name"] == "secret":
        return "<set>" if row["set"] else "None"
    if row["name"] in _SIZES:
        return "no cap" if value is None else format_size(value)
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    listed = rows(settings, os.environ)
    if args.json:
        print_json(listed)
        return 0
    print(
        table(
            ("SETTING", "VARIABLE", "VALUE", "SOURCE"),
            [(r["name"], r["variable"] or "-", _shown(r), r["source"]) for r in listed],
        )
    )
    return 0
