"""The object tiers' URLs, credentials and request signing, without a server."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest

from kernelcache.errors import ConfigError
from kernelcache.stores.http import config as http_config
from kernelcache.stores.s3 import config as s3_config
from kernelcache.stores.s3 import sigv4


def test_sigv4_matches_awss_published_example() -> None:
    """The GET Object example of AWS's "Signature Version 4 (AWS4-HMAC-SHA256)" docs."""
    creds = sigv4.Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    headers = {"Host": "examplebucket.s3.amazonaws.com", "Range": "bytes=0-9"}
    when = datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC)
    sigv4.sign(creds, "us-east-1", "GET", "/test.txt", "", headers, sigv4.EMPTY_SHA256, when)
    assert headers["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )
    assert "EXAMPLEKEY" not in repr(creds)


def test_s3_url_endpoint_region_and_addressing() -> None:
    aws = s3_config.split_s3("s3://team-cache/kc/v1", environ={"AWS_REGION": "eu-west-1"})
    assert (aws.bucket, aws.prefix, aws.region) == ("team-cache", "kc/v1", "eu-west-1")
    assert (aws.host, aws.path_style) == ("s3.eu-west-1.amazonaws.com", False)
    local = s3_config.split_s3(
        "s3://team-cache?endpoint=http://127.0.0.1:9000&timeout=1.5", environ={}
    )
    assert (local.scheme, local.host, local.port, local.path_style) == (
        "http",
        "127.0.0.1",
        9000,
        True,
    )
    assert local.prefix == ""
    assert local.options["timeout"] == 1.5


@pytest.mark.parametrize(
    ("url", "message"),
    [
        pytest.param("s3://Bad_Bucket/p", "bad bucket name", id="bucket"),
        pytest.param("s3://key:secret@bkt/p", "credentials in an S3 remote URL", id="creds"),
        pytest.param("s3://bkt/p?endpoint=ftp://h", "endpoint must be http", id="endpoint"),
        pytest.param("s3://bkt/p?endpoint=http://h:x", "bad port", id="port"),
        pytest.param("s3://bkt/a/../b", "empty, . or ..", id="dotdot"),
        pytest.param("s3://bkt/p?timeout=1&timeout=2", "given twice", id="twice"),
        pytest.param("s3://bkt/p?path_style=maybe", "bad value", id="flag"),
        pytest.param("http://h:x/p", "bad port", id="http-port"),
        pytest.param("http://h/p?bearer=A&basic=B", "not both", id="two-auths"),
        pytest.param("http://h/p?bearer=1X", "bad value", id="bad-variable"),
        pytest.param("http:///p", "http(s)://host", id="no-host"),
    ],
)  # fmt: skip
def test_a_slip_in_an_object_url_names_itself(url: str, message: str) -> None:
    split = (lambda u: s3_config.split_s3(u, environ={})) if url.startswith("s3") else None
    with pytest.raises(ConfigError, match=re.escape(message)):
        (split or http_config.split_http)(url)


def test_credentials_from_variables_then_a_profile_then_none(tmp_path: Path) -> None:
    target = s3_config.split_s3("s3://bkt/p", environ={})
    env = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_SESSION_TOKEN": "T"}
    assert s3_config.credentials(target, env) == sigv4.Credentials("AK", "SK", "T")
    shared = tmp_path / "credentials"
    shared.write_text(
        "[default]\naws_access_key_id = DK\naws_secret_access_key = DS\n"
        "[ci]\naws_access_key_id = CK\naws_secret_access_key = CS\n"
    )
    files = {"AWS_SHARED_CREDENTIALS_FILE": str(shared), "AWS_CONFIG_FILE": str(tmp_path / "x")}
    assert s3_config.credentials(target, files) == sigv4.Credentials("DK", "DS")
    ci = {**files, "AWS_PROFILE": "ci"}
    assert s3_config.credentials(target, ci) == sigv4.Credentials("CK", "CS")
    with pytest.raises(ConfigError, match="profile 'nope'"):
        s3_config.credentials(target, {**files, "AWS_PROFILE": "nope"})
    empty = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    assert s3_config.credentials(target, empty) is None  # anonymous
    (tmp_path / "config").write_text("[profile ci]\nregion = ap-south-1\n")
    env = {"AWS_CONFIG_FILE": str(tmp_path / "config"), "AWS_PROFILE": "ci"}
    assert s3_config.split_s3("s3://bkt/p", environ=env).region == "ap-south-1"


def test_http_credentials_come_from_a_named_variable() -> None:
    assert http_config.auth_header({"bearer": "TOKEN"}, {"TOKEN": " abc "}) == "Bearer abc"
    assert http_config.auth_header({"basic": "PW"}, {"PW": "u:p"}) == "Basic dTpw"
    assert http_config.auth_header({}, {}) is None
    with pytest.raises(ConfigError, match="unset or empty"):
        http_config.auth_header({"bearer": "TOKEN"}, {})
    with pytest.raises(ConfigError, match="user:password"):
        http_config.auth_header({"basic": "PW"}, {"PW": "nocolon"})
