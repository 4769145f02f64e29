"""A real local Redis Cluster for the tests: three masters on loopback ports, no replicas.

Each node is a ``redis-server --cluster-enabled yes`` with its own directory
(its ``nodes.conf`` lives there, so a killed node restarts as itself);
``redis-cli --cluster create`` assigns the slots. Nodes keep serving their
slots while another is down (``cluster-require-full-coverage no``). Every wait
is bounded; teardown stops every process it started.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from redis_server import BINARY, SKIP_REASON, RedisServer

CLI = shutil.which("redis-cli")
NODE_TIMEOUT_MS = 1000


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _node_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 6379 and port + 10000 < 65536 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free pair of ports for a cluster node")


class LocalCluster:
    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.directory = directory
        self.masters = masters
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for i in range(self.masters):
            self.nodes.append(self._start_node(self.directory / f"node{i}"))
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [str(CLI), "--cluster", "create", *addresses, "--cluster-yes"],
            capture_output=True,
            check=True,
            timeout=60,
        )
        self.wait_until_ok()

    def _start_node(self, directory: Path) -> RedisServer:
        extra = (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage", "no",
        )  # fmt: skip
        for _ in range(5):
            node = RedisServer(directory, extra=extra, port=_node_port())
            try:
                node.start(attempts=1)
            except RuntimeError:
                continue  # lost a race for one of the two ports
            return node
        raise RuntimeError(f"a cluster node did not start; see {directory / 'redis.log'}")

    def info(self, node: RedisServer) -> str:
        import redis

        client = redis.Redis(port=node.port, socket_timeout=2, socket_connect_timeout=2)
        try:
            return str(client.execute_command("CLUSTER", "INFO"))
        finally:
            client.close()

    def wait_until_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports the cluster ok with all 16384 slots assigned."""
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                infos = [self.info(node) for node in self.nodes if node.ping()]
            except redis.RedisError:
                infos = []
            if len(infos) == len(self.nodes) and all(
                "cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos
            ):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the cluster did not become ok within {timeout} s")

    def kill(self, index: int) -> None:
        self.nodes[index].kill()

    def restart(self, index: int) -> None:
        """Bring a killed node back on its port; it rejoins with its slots, empty."""
        self.nodes[index].restart()
        self.wait_until_ok()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _serve(directory: Path) -> Iterator[LocalCluster]:
    if BINARY is None or CLI is None:
        pytest.skip(SKIP_REASON + " (and redis-cli, for a cluster)")
    cluster = LocalCluster(directory)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster for the session; tests isolate themselves by namespace, never kill nodes."""
    yield from _serve(tmp_path_factory.mktemp("cluster"))


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster of the test's own, whose nodes it may kill and restart."""
    yield from _serve(tmp_path / "cluster")
