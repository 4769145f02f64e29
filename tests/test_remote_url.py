"""A slip in ``KERNELCACHE_REMOTE`` is one clear error at once, never a broken build (issue 20, item 1).

Before: ``?namspace=team`` reached redis-py as an unknown keyword; ``Cache()``
was made, then every ``get`` and ``put`` raised ``TypeError``, the launcher
exited 1 without an object file and ``kernelcache stats`` printed a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_run import kc
from kernelcache import Cache, DiskStore, Entry, MemoryStore, Settings
from kernelcache.errors import ConfigError, StoreError
from kernelcache.stores.base import EntryInfo, Store
from kernelcache.stores.redis import RedisStore
from launcher_env import Project
from redis_server import RedisServer

TYPO = "redis://127.0.0.1:1/0?namspace=team"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        pytest.param(TYPO, "unknown parameter 'namspace'", id="typo"),
        pytest.param("redis://h/0?socket_timeout=3", "unknown parameter 'socket_timeout'", id="redis-py-timeout"),
        pytest.param("redis://h/0?readonly=maybe", "bad value 'maybe' for 'readonly'", id="bad-flag"),
        pytest.param("redis://h/0?ttl=soon", "bad value 'soon' for 'ttl'", id="bad-ttl"),
        pytest.param("redis://h/0?timeout=0", "bad value '0' for 'timeout'", id="zero-timeout"),
        pytest.param("redis://h/0?namespace=a/b", "bad value 'a/b' for 'namespace'", id="bad-namespace"),
        pytest.param("redis://h/0?max_entry_size=0", "bad value '0' for 'max_entry_size'", id="zero-size"),
        pytest.param("redis://h/0?ttl=1d&ttl=2d", "'ttl' is given twice", id="twice"),
        pytest.param("redis://h/zero", "must be a number", id="bad-db"),
        pytest.param("redis://h:port/0", "bad port", id="bad-port"),
        pytest.param("redis+cluster://h:1/2", "only database 0", id="cluster-db"),
        pytest.param("redis://h/0?ssl_cert_reqs=none", "unknown parameter 'ssl_cert_reqs'", id="tls-without-tls"),
        pytest.param("ftp://h/0", "scheme must be one of", id="scheme"),
    ],
)  # fmt: skip
def test_a_bad_url_is_a_config_error_naming_it_when_settings_load(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match="KERNELCACHE_REMOTE") as caught:
        Settings.load(environ={"KERNELCACHE_REMOTE": url})
    assert message in str(caught.value)
    if "unknown parameter" in message:  # and it lists the valid ones
        assert "valid: namespace, ttl, timeout, readonly" in str(caught.value)


def test_a_typo_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'namespace'"):
        Settings.load(environ={"KERNELCACHE_REMOTE": TYPO})


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6390/0?namespace=team&ttl=30d&timeout=2&readonly=1&max_entry_size=1G",
        "redis+cluster://127.0.0.1:7000?replicas=yes&client_name=ci",
        "rediss://127.0.0.1:6390/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem",
        "unix:///run/redis.sock?db=2&health_check_interval=10",
    ],
)
def test_good_urls_load(url: str) -> None:
    assert Settings.load(environ={"KERNELCACHE_REMOTE": url}).remote == url


class _Broken(Store):
    """A tier that raises what no tier should: a bug, or a client refusing its configuration."""

    kind = "broken"

    def get(self, key: str) -> Entry | None:
        raise TypeError("__init__() got an unexpected keyword argument 'namspace'")

    def put(self, key: str, entry: Entry) -> Entry:
        raise TypeError("__init__() got an unexpected keyword argument 'namspace'")

    def delete(self, key: str) -> bool:
        raise AttributeError("no")

    def keys(self) -> Iterator[str]:
        return iter(())

    def info(self, key: str) -> EntryInfo | None:
        return None


def test_nothing_a_tier_raises_escapes_get_put_or_delete(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    broken = _Broken()
    cache = Cache([MemoryStore(), broken], persist_stats=False)
    with caplog.at_level(logging.WARNING, logger="kernelcache"):
        assert cache.get("k") is None
        stored = cache.put("k", Entry({"a": b"x"}))
        assert stored["a"] == b"x"
        assert cache.get("k") is not None  # the memory tier still serves
        cache.delete("k")
        assert cache.get_or_compile("k2", lambda: b"y")["data"] == b"y"
    assert broken.counters.errors >= 4
    # Behind a disk tier, the single-flight path looks again after its lock: same rule.
    with Cache([MemoryStore(), DiskStore(tmp_path), broken], persist_stats=False) as locked:
        assert locked.get_or_compile("k3", lambda: b"z")["data"] == b"z"
    said = [r.getMessage() for r in caplog.records if "TypeError" in r.getMessage()]
    assert len(said) == 1  # once per kind of failure, not per call
    assert "_Broken" in said[0] or "broken" in said[0].lower()


def test_a_redis_client_that_refuses_its_keywords_is_a_counted_miss(
    redis_server: RedisServer, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard (the Redis tier's boundary) turns redis-py's TypeError into a StoreError."""
    import redis

    store = RedisStore(redis_server.url, namespace=ns)

    def refuse(*args: object, **kwargs: object) -> None:
        raise TypeError(
            "AbstractConnection.__init__() got an unexpected keyword argument 'namspace'"
        )

    monkeypatch.setattr(redis.Connection, "__init__", refuse)
    with pytest.raises(StoreError, match="misconfigured"):
        store.get("k")
    cache = Cache([MemoryStore(), store], persist_stats=False)
    assert cache.get("k") is None
    cache.put("k", Entry({"a": b"x"}))
    assert store.counters.errors >= 3


@pytest.mark.parametrize(
    "command", [["stats"], ["ls"], ["config"], ["prune", "--max-entries", "5"]]
)
def test_the_cli_says_one_line_and_exits_2(tmp_path: Path, command: list[str]) -> None:
    out = kc(*command, env={"KERNELCACHE_DIR": str(tmp_path), "KERNELCACHE_REMOTE": TYPO})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1
    assert "unknown parameter 'namspace'" in out.stderr


def test_the_launcher_compiles_without_the_cache_with_one_warning(tmp_path: Path) -> None:
    project = Project(tmp_path)
    out = project.run(KERNELCACHE_REMOTE=TYPO)
    assert out.returncode == 0, out.stderr
    assert (project.project / "k.cubin").is_file()
    warnings = [line for line in out.stderr.decode().splitlines() if line.startswith("kernelcache")]
    assert len(warnings) == 1, out.stderr
    assert "compiling without it" in warnings[0]
    assert "namspace" in warnings[0]
