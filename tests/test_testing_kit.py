"""kernelcache.testing works for a third-party tier: a correct one passes, a broken one fails."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TIER = '''
import pytest
from kernelcache.stores.base import EntryInfo, Store, bound, validate_key
from kernelcache.testing import StoreContract


class DictStore(Store):
    """A third-party tier: a dict, no caps, nothing persistent."""

    kind = "dict"

    def __init__(self, *, read_only=False, corrupt=False):
        super().__init__(read_only=read_only)
        self.data, self.corrupt = {}, corrupt

    def get(self, key):
        validate_key(key)
        entry = self.data.get(key)
        self.counters.add("hits" if entry is not None else "misses")
        if entry is not None:
            self.counters.add("bytes_read", entry.nbytes)
            if self.corrupt:  # a broken tier: it hands out other bytes
                return type(entry)({n: b"x" + d for n, d in entry.items()}, entry.meta)
        return entry

    def put(self, key, entry):
        validate_key(key)
        self._check_writable()
        self.data[key] = entry = bound(entry, key)
        self.counters.add("puts")
        self.counters.add("bytes_written", entry.nbytes)
        return entry

    def delete(self, key):
        validate_key(key)
        self._check_writable()
        found = self.data.pop(key, None) is not None
        if found:
            self.counters.add("deletes")
        return found

    def keys(self):
        return iter(list(self.data))

    def scan(self):
        return iter([EntryInfo(k, e.nbytes, 0.0) for k, e in list(self.data.items())])


class TestDictStore(StoreContract):
    persistent = False
    capped = False

    @pytest.fixture
    def store_factory(self):
        return lambda **options: DictStore(corrupt=CORRUPT, **options)
'''


@pytest.mark.parametrize("corrupt", [False, True], ids=["correct-tier", "broken-tier"])
def test_a_third_party_tier_runs_the_contract(pytester: pytest.Pytester, corrupt: bool) -> None:
    pytester.makepyfile(test_dict_tier=f"CORRUPT = {corrupt}\n" + TIER)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    if corrupt:
        assert outcomes.get("failed", 0) >= 3  # round trip, overwrite, ... all see other bytes
    else:
        assert outcomes.get("failed", 0) == 0, result.stdout.str()
        assert outcomes["passed"] >= 25, result.stdout.str()
