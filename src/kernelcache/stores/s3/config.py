"""Where an ``s3://bucket/prefix`` URL points and with which credentials, as the AWS tools read them.

Endpoint: ``?endpoint=``, else ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
else AWS's own for the region. Region: ``?region=``, ``AWS_REGION``,
``AWS_DEFAULT_REGION``, the profile's ``region`` in ``~/.aws/config``, else
``us-east-1``. Credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
(/ ``AWS_SESSION_TOKEN``), else the profile (``?profile=``, ``AWS_PROFILE``,
``default``) in ``AWS_SHARED_CREDENTIALS_FILE`` or ``~/.aws/credentials``;
none at all means anonymous requests (a public bucket, read-only in practice).
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernelcache.errors import ConfigError
from kernelcache.stores.http.config import S3_OPTIONS, check_prefix, parse_options
from kernelcache.stores.s3.sigv4 import Credentials


@dataclass(frozen=True)
class Target:
    """The parsed URL: bucket, prefix, endpoint parts, addressing, options."""

    bucket: str
    prefix: str
    scheme: str
    host: str
    port: int | None
    region: str
    path_style: bool
    options: dict[str, Any]


def _bucket(url: str, name: str) -> str:
    ok = 3 <= len(name) <= 63 and all(c.islower() or c.isdigit() or c in ".-" for c in name)
    if not ok or name[0] in ".-" or name[-1] in ".-":
        raise ConfigError(
            f"bad bucket name {name!r} in the remote URL {url!r}: 3-63 characters of a-z, 0-9, . and -"
        )
    return name


def split_s3(url: str, environ: Mapping[str, str] | None = None) -> Target:
    """Check an ``s3://bucket/prefix?...`` URL whole; :class:`ConfigError` names any slip."""
    env = os.environ if environ is None else environ
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ConfigError(f"an S3 remote URL is s3://bucket/prefix, not {url!r}")
    if "@" in parts.netloc:
        raise ConfigError(
            "credentials in an S3 remote URL would show in stats and logs: "
            "use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile"
        )
    bucket = _bucket(url, parts.netloc)
    options = parse_options(url, parts.query, S3_OPTIONS)
    profile = options.get("profile") or env.get("AWS_PROFILE") or "default"
    region = (
        options.get("region")
        or env.get("AWS_REGION")
        or env.get("AWS_DEFAULT_REGION")
        or _profile_value(env, "config", profile, "region")
        or "us-east-1"
    )
    endpoint = (
        options.get("endpoint")
        or env.get("AWS_ENDPOINT_URL_S3")
        or env.get("AWS_ENDPOINT_URL")
        or f"https://s3.{region}.amazonaws.com"
    )
    where = urllib.parse.urlsplit(endpoint)
    if where.scheme not in ("http", "https") or not where.hostname or where.path.strip("/"):
        raise ConfigError(f"the S3 endpoint must be http(s)://host[:port], not {endpoint!r}")
    try:
        port = where.port
    except ValueError:
        raise ConfigError(f"bad port in the S3 endpoint {endpoint!r}") from None
    # Virtual-hosted addressing needs DNS for every bucket; a bucket with dots breaks TLS.
    path_style = options.get("path_style", "." in bucket or "amazonaws.com" not in where.hostname)
    return Target(
        bucket,
        check_prefix(url, parts.path),
        where.scheme,
        where.hostname,
        port,
        region,
        bool(path_style),
        options,
    )


def credentials(target: Target, environ: Mapping[str, str] | None = None) -> Credentials | None:
    """The credentials to sign with, or ``None`` for anonymous requests."""
    env = os.environ if environ is None else environ
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return Credentials(key, secret, env.get("AWS_SESSION_TOKEN") or None)
    profile = target.options.get("profile") or env.get("AWS_PROFILE") or "default"
    key = _profile_value(env, "credentials", profile, "aws_access_key_id")
    secret = _profile_value(env, "credentials", profile, "aws_secret_access_key")
    if key and secret:
        token = _profile_value(env, "credentials", profile, "aws_session_token")
        return Credentials(key, secret, token)
    if target.options.get("profile") or env.get("AWS_PROFILE"):
        raise ConfigError(
            f"the AWS profile {profile!r} has no aws_access_key_id/aws_secret_access_key"
        )
    return None


def _profile_value(env: Mapping[str, str], kind: str, profile: str, name: str) -> str | None:
    home = os.path.expanduser("~")
    if kind == "credentials":
        path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
        section = profile
    else:
        path = env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")
        section = profile if profile == "default" else f"profile {profile}"
    import configparser  # only without credentials in the environment

    parser = configparser.RawConfigParser()
    try:
        parser.read(path)
    except configparser.Error as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    value = parser.get(section, name, fallback=None)
    return value.strip() if value else None
