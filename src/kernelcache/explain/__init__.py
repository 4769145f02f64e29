"""Why did it miss? Keys that explain themselves (issue 38).

- :mod:`kernelcache.explain.fields`: a key's labelled fields as an entry keeps them.
- :mod:`kernelcache.explain.record`: kept in each entry's metadata, and each family's last miss.
- :mod:`kernelcache.explain.words`: two records compared, each difference in words.
- :mod:`kernelcache.explain.nearest`: the stored entries nearest to a record.
"""

from __future__ import annotations

from typing import Any

from kernelcache import keys
from kernelcache.explain.fields import META_FIELD, note_fields, note_inputs, summary

__all__ = ["META_FIELD", "note_fields", "note_inputs", "recent_misses", "summary"]


def recent_misses() -> list[dict[str, Any]]:
    """Records of the keys this process missed lately (``Cache.get``), newest last.

    Only keys this process built with a :class:`~kernelcache.keys.KeyBuilder`
    have one; each is ``{"key": ..., "ns": ..., "fields": [...]}``.
    """
    out = []
    for key in list(keys.MISSED):
        record = summary(key)
        if record is not None:
            out.append({"key": key, **record})
    return out
