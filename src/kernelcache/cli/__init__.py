"""The ``kernelcache`` command line: a thin layer over the public API.

``main.py`` parses arguments and dispatches; each family of commands has its
module (``stats.py``, ``maint.py``), and ``output.py`` prints tables and JSON.
"""

from __future__ import annotations

from kernelcache.cli.main import main

__all__ = ["main"]
