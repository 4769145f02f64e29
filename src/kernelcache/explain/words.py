"""Two key records compared field by field, each difference said in words.

``differences(miss, stored)`` lists what would have to change for ``stored``
to be the entry ``miss`` asked for: "nvcc: V13.0.88 → V13.1.12",
"header `common.cuh` changed (digest a1b2 → c3d4)", "flags: -O3 → -O2",
"the source's folder (debug info on)".
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["Difference", "differences", "distance"]

_SOURCE_SUFFIXES = (".cu", ".c", ".cc", ".cpp", ".cxx", ".py")
#: Label (its last part) -> what it is, in words.
_NAMES = {
    "nvcc": "nvcc",
    "host": "the host compiler",
    "args": "flags",
    "options": "flags",
    "nvrtc": "NVRTC",
    "arch": "architecture",
    "target": "target",
    "source": "the source",
    "name": "the kernel's name",
    "name_expressions": "name expressions",
    "sloppiness": "KERNELCACHE_SLOPPINESS",
    "pre_includes": "pre-included headers",
    "torch": "torch",
    "triton": "Triton",
    "xla_flags": "JAX: XLA flags",
    "jax_key": "JAX's key (the program, its compile options, the devices)",
    "torch_key": "torch's key (the graph, its inputs, the compile's configuration)",
}
#: Another tool's hash, partly explained by fields noted beside it: named only when
#: none of those differs.
_OPAQUE = ("jax_key", "torch_key")
#: Labels that hold the folder a compile ran in (keyed because debug info names it).
_FOLDER_LABELS = ("cwd", "paths")


#: One field that differs: ``label``, ``words``, ``before`` and ``after`` digests.
Difference = dict[str, Any]


def _fields(record: dict[str, Any]) -> dict[str, list[Any]]:
    return {
        str(f[0]): f
        for f in record.get("fields", [])
        if isinstance(f, list) and len(f) in (2, 3) and isinstance(f[1], str)
    }


def distance(miss: dict[str, Any], stored: dict[str, Any]) -> int:
    """How many fields differ (a field only one side has counts as one)."""
    a, b = _fields(miss), _fields(stored)
    return sum(
        1 for label in a.keys() | b.keys() if a.get(label, [0, 0])[1] != b.get(label, [0, 1])[1]
    )


def differences(miss: dict[str, Any], stored: dict[str, Any]) -> list[Difference]:
    """The fields of ``miss`` whose digest differs from ``stored``'s, in label order, in words."""
    a, b = _fields(miss), _fields(stored)
    changed = [
        label
        for label in sorted(a.keys() | b.keys())
        if label not in a or label not in b or a[label][1] != b[label][1]
    ]
    # A file read by one compile only (a header that -O pulls in, one the edited
    # source now includes) follows from another difference: said only when alone.
    causes = [label for label in changed if not _consequence(a.get(label), b.get(label))]
    out = []
    for label in causes or changed:
        new, old = a.get(label), b.get(label)
        out.append(
            {
                "label": label,
                "words": _say(label, old, new),
                "before": None if old is None else old[1],
                "after": None if new is None else new[1],
            }
        )
    return out


def _consequence(new: list[Any] | None, old: list[Any] | None) -> bool:
    """Whether a difference follows from others: an input only one side read, or a folder
    of inputs holding another number of files."""
    if str((new or old or [""])[0]) in _OPAQUE:
        return True
    if new is None or old is None:
        return "[" in str((new or old or [""])[0])
    return str(new[0]).endswith("/*]") and new[2:] != old[2:]


def _what(label: str) -> str:
    """The thing a label names, in words."""
    match = re.fullmatch(r"(?:.*\.)?(\w+)\[(.+)\]", label)
    if match:
        if match.group(2).endswith("/*"):
            return f"a header in `{match.group(2)[:-2]}`"
        name = match.group(2).rsplit("/", 1)[-1]
        kind = "source" if name.endswith(_SOURCE_SUFFIXES) else "header"
        return f"{kind} `{name}`"
    parts = label.split(".")
    if len(parts) >= 2 and parts[-2] in ("env", "profile_env", "environment"):
        where = " (read by nvcc.profile)" if parts[-2] == "profile_env" else ""
        return f"environment variable {parts[-1]}{where}"
    if len(parts) >= 2 and parts[-2] == "headers":
        return f"header `{parts[-1]}`"
    return _NAMES.get(parts[-1], f"`{label}`")


def _say(label: str, old: list[Any] | None, new: list[Any] | None) -> str:
    what = _what(label)
    if old is None:
        return f"{what}: not in the stored entry's key"
    if new is None:
        return f"{what}: only in the stored entry's key"
    digests = f" changed (digest {old[1][:4]} → {new[1][:4]})"
    if label.rsplit(".", 1)[-1] in _FOLDER_LABELS:
        return "the source's folder (debug info on)"
    if "[" in label or what.startswith("header") or len(old) < 3 or len(new) < 3:
        return what + digests
    return what + _change(old[2], new[2], digests)


def _change(before: Any, after: Any, otherwise: str) -> str:
    """``: before → after`` of two kept values, else ``otherwise``."""
    if isinstance(before, list) and isinstance(after, list):
        removed = [_item(v) for v in before if v not in after]
        added = [_item(v) for v in after if v not in before]
        if removed and added:
            return f": {' '.join(removed)} → {' '.join(added)}"
        if added:
            return f": added {' '.join(added)}"
        if removed:
            return f": removed {' '.join(removed)}"
        return f": order {' '.join(map(_item, before))} → {' '.join(map(_item, after))}"
    if isinstance(before, str) and isinstance(after, str) and "\n" in before + after:
        old_lines, new_lines = before.splitlines(), after.splitlines()
        for one, two in zip(old_lines, new_lines, strict=False):
            if one != two:
                return f": {_short(one)} → {_short(two)}"
        return otherwise
    if before != after:
        return f": {_value(before)} → {_value(after)}"
    return otherwise


def _item(value: Any) -> str:
    """One item of a list, as a command line says it (``["--optimize", "2"]``: ``--optimize 2``)."""
    if isinstance(value, list):
        return " ".join(str(v) for v in value if v is not None)
    return str(value)


def _value(value: Any) -> str:
    return "unset" if value is None else _short(str(value))


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= 72 else text[:69] + "..."
