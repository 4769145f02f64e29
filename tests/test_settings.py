"""Settings: argument > environment > default, each value with its source; bad values refused."""

from __future__ import annotations

import dataclasses

import pytest

from kernelcache import ConfigError, Settings
from kernelcache.settings import VARIABLES
from kernelcache.units import format_size, parse_age, parse_size


def test_precedence_and_sources() -> None:
    env = {"KERNELCACHE_DIR": "/env/dir", "KERNELCACHE_MAX_SIZE": "2G", "KERNELCACHE_SECRET": "s3"}
    settings = Settings.load(environ=env, max_bytes="5G")
    assert settings.dir == "/env/dir"
    assert settings.sources["dir"] == "environment KERNELCACHE_DIR"
    assert settings.max_bytes == 5 << 30
    assert settings.sources["max_bytes"] == "argument"
    assert settings.remote is None
    assert settings.sources["remote"] == "default"
    described = {name: (value, source) for name, value, source in settings.describe()}
    assert described["secret"] == ("<set>", "environment KERNELCACHE_SECRET")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param({"KERNELCACHE_MAX_SIZE": "lots"}, "invalid size", id="size"),
        pytest.param({"KERNELCACHE_DISABLE": "maybe"}, "KERNELCACHE_DISABLE", id="bool"),
    ],
)
def test_bad_environment_values_raise_config_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.load(environ=env)


def test_unknown_argument() -> None:
    with pytest.raises(ConfigError, match="unknown setting"):
        Settings.load(environ={}, colour="blue")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ("512", 512),
        ("4K", 4096),
        ("1.5M", 3 << 19),
        ("5G", 5 << 30),
        ("2gib", 2 << 30),
        ("1TB", 1 << 40),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "seconds"), [("30", 30), ("90s", 90), ("5m", 300), ("2h", 7200), ("30d", 2592000)]
)
def test_parse_age(text: str, seconds: float) -> None:
    assert parse_age(text) == seconds


@pytest.mark.parametrize("text", ["", "G", "-1G", "5X", "1.2.3"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(3 << 20) == "3.0 MiB"


def test_settings_are_immutable_values_that_never_show_the_secret() -> None:
    settings = Settings.load(environ={"KERNELCACHE_SECRET": "s3cret"}, dir="/tmp/x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.dir = "/elsewhere"  # type: ignore[misc]
    again = Settings.load(environ={"KERNELCACHE_SECRET": "s3cret"}, dir="/tmp/x")
    assert settings == again
    assert hash(settings) == hash(again)
    assert "s3cret" not in repr(settings)
    assert ("secret", "<set>", "environment KERNELCACHE_SECRET") in settings.describe()


def test_one_field_list_names_every_variable() -> None:
    assert tuple(f"KERNELCACHE_{v}" for v in (
        "DIR", "MAX_SIZE", "MEMORY_MAX_SIZE", "LOCAL", "REMOTE", "DISABLE", "READONLY", "SECRET",
        "STRICT_VERSIONS",
    )) == VARIABLES  # fmt: skip
    loaded = Settings.load(
        environ={"KERNELCACHE_READONLY": "1", "KERNELCACHE_MEMORY_MAX_SIZE": "1M"}
    )
    assert loaded.read_only is True
    assert loaded.memory_max_bytes == 1 << 20


def test_replaced_changes_values_and_their_sources() -> None:
    base = Settings.load(environ={"KERNELCACHE_DISABLE": "1"}, dir="/tmp/x")
    changed = base.replaced(disable=False, read_only=True)
    assert (changed.disable, changed.read_only, changed.dir) == (False, True, "/tmp/x")
    assert changed.sources["disable"] == "argument"
    assert base.disable is True
    with pytest.raises(ConfigError, match="unknown setting"):
        base.replaced(colour="blue")
