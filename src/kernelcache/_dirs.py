"""Where kernelcache keeps its files by default, for code that needs nothing else.

The toolchain probes' memo lives in the cache directory, but the key layer
must not load :class:`~kernelcache.settings.Settings` (sizes, tiers, remote
URL) to find it; the settings take their ``dir`` default from here too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: The variable that names the cache directory (see :class:`~kernelcache.settings.Settings`).
DIR_VARIABLE = "KERNELCACHE_DIR"


def default_dir() -> str:
    """The platform's user cache directory for kernelcache (``~/.cache/kernelcache`` on Linux).

    The launcher's client (:func:`kernelcache.nvcc.client.cache_dir`) applies
    the same rules without importing anything; a test keeps the two equal.
    """
    import platformdirs  # ~20 ms with pathlib and tempfile: only when the default is used

    return str(platformdirs.user_cache_dir("kernelcache", appauthor=False))


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """The cache directory the environment gives (``KERNELCACHE_DIR``, else the default).

    For code below the settings (the toolchain probes' memo) that needs the
    directory and nothing else. An empty ``KERNELCACHE_DIR`` is unset.
    """
    env = os.environ if environ is None else environ
    text = env.get(DIR_VARIABLE, "")
    return os.path.expanduser(text) if text.strip() else default_dir()


#: The variable that makes every tier read-only (see :class:`~kernelcache.settings.Settings`).
READONLY_VARIABLE = "KERNELCACHE_READONLY"


def read_only(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KERNELCACHE_READONLY`` forbids writing into the cache directory.

    For code below the settings (memo files). A value the settings would
    reject counts as read-only here: when unsure, write nothing (the settings
    say what is wrong with it).
    """
    env = os.environ if environ is None else environ
    return env.get(READONLY_VARIABLE, "").strip().lower() not in ("", "0", "false", "no", "off")
