"""Test kits for kernelcache's extension points (they need pytest).

:class:`StoreContract` is the contract suite every storage tier passes; a
third-party tier inherits it in its own tests (:mod:`kernelcache.testing.contract`).
"""

from __future__ import annotations

from kernelcache.testing.contract import (
    ARTIFACTS,
    BAD_KEYS,
    StoreContract,
    StoreFactory,
    make_entry,
)

__all__ = ["ARTIFACTS", "BAD_KEYS", "StoreContract", "StoreFactory", "make_entry"]
