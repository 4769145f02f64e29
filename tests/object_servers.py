"""Real object servers for the tests: Ceph's radosgw (S3) and nginx's WebDAV (HTTP).

Each runs on free loopback ports with everything (config, data, logs, admin
sockets, pid files) inside the test's directory, and is stopped by its own
process ids. radosgw runs over a one-monitor, one-OSD (memstore) cluster
without cephx; the settings that make it start in ~2 s are in issue 41.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

CEPH = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool")
MISSING_CEPH = [name for name in CEPH if shutil.which(name) is None]
MISSING_NGINX = shutil.which("nginx") is None
SKIP_CEPH = (
    f"{', '.join(MISSING_CEPH)} not found: apt-get install radosgw ceph-mon ceph-osd ceph-common "
    "(scripts/test.sh installs them when missing)"
)
SKIP_NGINX = "nginx not found: apt-get install nginx (scripts/test.sh installs it when missing)"
ACCESS_KEY = "kernelcachetest"
SECRET_KEY = "kernelcachetestsecret0123456789"
HTTP_USER, HTTP_PASSWORD = "kc", "kc-password"


def free_port() -> int:
    """A loopback port no one listens on now (never 6379: a server there is not ours). The
    server bound to it later may lose it to another process meanwhile: starters check."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 6379:
            return port


def _wait(check: object, what: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
    raise RuntimeError(f"{what} did not start in {timeout} s; {log}:\n{tail}")


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def quiet(args: list[str]) -> None:
    subprocess.run(
        args, check=True, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def background(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class _Server:
    processes: list[subprocess.Popen[bytes]]

    def kill(self) -> None:
        """SIGKILL the front process (the one clients talk to): an outage."""
        front = self.processes[-1]
        if front.poll() is None:
            front.kill()
            front.wait()

    def pause(self) -> None:
        os.kill(self.processes[-1].pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.processes[-1].pid, signal.SIGCONT)

    #: How a server is stopped: nginx cleanly, Ceph at once (its data is thrown away).
    stop_signal = signal.SIGTERM

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                os.kill(process.pid, self.stop_signal)
        for process in reversed(self.processes):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class Nginx(_Server):
    """nginx with WebDAV PUT/DELETE and JSON listings, serving ``directory/data``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.data = directory / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        (directory / "tmp").mkdir(exist_ok=True)
        self.port = free_port()
        self.processes = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        d = self.directory
        conf = d / "nginx.conf"
        conf.write_text(
            f"""daemon off;
{"user root;" if os.geteuid() == 0 else ""}
master_process off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {d}/tmp/body;
    proxy_temp_path {d}/tmp/proxy;
    fastcgi_temp_path {d}/tmp/fastcgi;
    uwsgi_temp_path {d}/tmp/uwsgi;
    scgi_temp_path {d}/tmp/scgi;
    server {{
        listen 127.0.0.1:{self.port};
        root {self.data};
        location / {{
            dav_methods PUT DELETE;
            create_full_put_path on;
            client_max_body_size 0;
            client_body_temp_path {self.data}/.tmp;
            autoindex on;
            autoindex_format json;
        }}
        location /broken/ {{
            return 503;
        }}
        location /private/ {{
            auth_basic "kernelcache";
            auth_basic_user_file {d}/htpasswd;
            dav_methods PUT DELETE;
            create_full_put_path on;
            client_max_body_size 0;
            client_body_temp_path {self.data}/.tmp;
        }}
    }}
}}
"""
        )
        (self.data / ".tmp").mkdir(exist_ok=True)
        (d / "htpasswd").write_text(f"{HTTP_USER}:{{PLAIN}}{HTTP_PASSWORD}\n")
        self.processes = [
            subprocess.Popen(
                ["nginx", "-p", str(d), "-c", str(conf), "-e", str(d / "error.log")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ]
        _wait(lambda: _listening(self.port), "nginx", d / "error.log", 20.0)


class RadosGW(_Server):
    """A single-node Ceph cluster (memstore) and radosgw with fixed S3 keys."""

    stop_signal = signal.SIGKILL

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.mon_port = free_port()
        self.mon_port1 = free_port()
        self.port = free_port()
        self.processes = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def mon_addrs(self) -> str:
        return f"[v2:127.0.0.1:{self.mon_port},v1:127.0.0.1:{self.mon_port1}]"

    def _conf(self) -> Path:
        d = self.directory
        fsid = self.fsid = str(uuid.uuid4())
        conf = d / "ceph.conf"
        conf.write_text(
            f"""[global]
fsid = {fsid}
mon host = {self.mon_addrs}
public addr = 127.0.0.1
cluster addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
ms mon client mode = crc secure
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
osd crush chooseleaf type = 0
osd pool default pg num = 8
osd pool default pgp num = 8
mon max pg per osd = 1000
mon data avail crit = 0
mon data avail warn = 0
paxos propose interval = 0.05
run dir = {d}/run
admin socket = {d}/run/$name.asok
log file = {d}/log/$name.log
pid file = {d}/run/$name.pid
keyring = {d}/keyring
osd objectstore = memstore
memstore device bytes = 2147483648
osd data = {d}/osd
mon data = {d}/mon
osd max object size = 4294967296
rgw frontends = beast endpoint=127.0.0.1:{self.port} tcp_nodelay=1
rgw dns name = 127.0.0.1
rgw max put size = 5368709120
rgw data = {d}/rgw
"""
        )
        return conf

    def start(self) -> None:
        d = self.directory
        for sub in ("run", "log", "osd", "mon", "rgw"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        conf = str(self._conf())
        monmap = str(d / "monmap")
        quiet(
            ["monmaptool", "--create", "--fsid", self.fsid, "--addv", "a", self.mon_addrs, monmap]
        )
        quiet(["ceph-mon", "-c", conf, "--mkfs", "-i", "a", "--monmap", monmap])
        self.processes = [background(["ceph-mon", "-c", conf, "-f", "-i", "a"])]
        created = subprocess.run(
            ["ceph", "-c", conf, "osd", "create"], check=True, capture_output=True, timeout=60
        )
        osd_id = created.stdout.decode().strip()
        quiet(["ceph-osd", "-c", conf, "-i", osd_id, "--mkfs"])
        self.processes.append(background(["ceph-osd", "-c", conf, "-f", "-i", osd_id]))
        self.processes.append(background(["radosgw", "-c", conf, "-f", "-n", "client.rgw"]))
        _wait(lambda: self._answers(), "radosgw", d / "log" / "client.rgw.log", 90.0)
        subprocess.run(
            ["radosgw-admin", "-c", conf, "-n", "client.rgw", "user", "create", "--uid", "kc",
             "--display-name", "kc", "--access-key", ACCESS_KEY, "--secret", SECRET_KEY],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip

    def _answers(self) -> bool:
        if not _listening(self.port):
            return False
        try:
            with urllib.request.urlopen(self.endpoint, timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False


def make_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on the radosgw at ``endpoint`` (a signed PUT of the bucket)."""
    import http.client
    import urllib.parse

    from kernelcache.stores.s3 import sigv4

    where = urllib.parse.urlsplit(endpoint)
    headers = {"Host": where.netloc}
    path = f"/{bucket}"
    creds = sigv4.Credentials(ACCESS_KEY, SECRET_KEY)
    sigv4.sign(creds, "us-east-1", "PUT", path, "", headers, sigv4.EMPTY_SHA256)
    conn = http.client.HTTPConnection(where.hostname or "", where.port, timeout=30)
    try:
        conn.request("PUT", path, body=b"", headers=headers)
        reply = conn.getresponse()
        body = reply.read()
        if reply.status not in (200, 409):
            raise RuntimeError(f"creating bucket {bucket}: {reply.status} {body[:300]!r}")
    finally:
        conn.close()


# Fixtures ----------------------------------------------------------------------------
import hashlib  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

BUCKET = "kctest"


@pytest.fixture(scope="session")
def radosgw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RadosGW]:
    """One radosgw per test worker, with the bucket ``kctest``."""
    if MISSING_CEPH:
        pytest.skip(SKIP_CEPH)
    server = RadosGW(tmp_path_factory.mktemp("radosgw"))
    try:
        server.start()
        make_bucket(server.endpoint, BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nginx_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    """One nginx WebDAV server per test worker."""
    if MISSING_NGINX:
        pytest.skip(SKIP_NGINX)
    server = Nginx(tmp_path_factory.mktemp("nginx"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def prefix_of(tmp_path: Path) -> str:
    """A prefix of the test's own, like a directory per test for the disk tier."""
    return "t" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:16]


@pytest.fixture
def s3_env(radosgw: RadosGW, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The AWS variables that reach the test radosgw (set in this process too)."""
    env = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_ENDPOINT_URL": radosgw.endpoint,
        "AWS_REGION": "us-east-1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def s3_url(s3_env: dict[str, str], tmp_path: Path) -> str:
    return f"s3://{BUCKET}/{prefix_of(tmp_path)}"


@pytest.fixture
def http_url(nginx_server: Nginx, tmp_path: Path) -> str:
    return f"{nginx_server.url}/{prefix_of(tmp_path)}"
