"""Real Redis topologies on loopback for the HA tests: one node, a Sentinel set, a Cluster.

Every process is a `redis-server` on a free port with its own directory under the test's tmp
dir (Sentinel is `redis-server <conf> --sentinel`); `stop()` kills what is left. Nothing persists
(`save ""`, no AOF), so a node killed and started again comes back empty.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support import free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
MISSING = "needs redis-server and redis-cli (Debian package redis-server; scripts/ensure-deps)"


def ping(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def wait_for(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.02)


@dataclass
class Node:
    """One redis-server process (a data node or a sentinel)."""

    port: int
    args: tuple[str, ...]
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    password: str | None = None  # what the test's own clients authenticate with

    def start(self) -> Node:
        assert REDIS_SERVER is not None, MISSING
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        with log:
            self.proc = subprocess.Popen(
                [REDIS_SERVER, *self.args], cwd=self.dir, stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(lambda: ping(self.port) or self.proc.poll() is not None, 10, f"redis :{self.port}")
        assert self.proc.poll() is None, (self.dir / "redis.log").read_text()[-2000:]
        return self

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as a crashed host would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def client(self, **kwargs: object) -> redis.Redis:
        kwargs = {"port": self.port, "socket_timeout": 2, "password": self.password, **kwargs}
        return redis.Redis(**kwargs)  # type: ignore[arg-type]


def cluster_port() -> int:
    """A free port below 55536 whose bus port (+10000) is free too (Redis Cluster needs both)."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def data_node(tmp: Path, *extra: str, port: int | None = None, password: str | None = None) -> Node:
    port = port or free_port()
    if password:
        extra = (*extra, "--requirepass", password, "--masterauth", password)
    args = ("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--repl-diskless-sync-delay", "0", "--dir", str(tmp / f"n{port}"), *extra)  # fmt: skip
    return Node(port, args, tmp / f"n{port}", password=password).start()


@dataclass
class SentinelSet:
    """A master, its replicas and three sentinels that watch it as `name`."""

    name: str
    nodes: list[Node]
    sentinels: list[Node]
    extra: list[Node] = field(default_factory=list)

    def url(self, scheme: str = "redis+sentinel", db: int = 0, query: str = "") -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"{scheme}://{hosts}/{self.name}/{db}{query}"

    def master_port(self) -> int:
        for s in self.sentinels:
            with contextlib.suppress(redis.RedisError, TypeError):
                host, port = s.client().sentinel_get_master_addr_by_name(self.name)
                return int(port)
        raise AssertionError("no sentinel answers")

    def master(self) -> Node:
        port = self.master_port()
        return next(n for n in self.nodes if n.port == port)

    def wait_failover(self, old: int, timeout_s: float = 20) -> int:
        """Until every sentinel names a new master that answers as one; its port."""

        def moved() -> bool:
            try:
                ports = {int(s.client().sentinel_get_master_addr_by_name(self.name)[1])
                         for s in self.sentinels}  # fmt: skip
                if len(ports) != 1 or old in ports:
                    return False
                (port,) = ports
                role = self.nodes[0].client(port=port, socket_timeout=1).role()
                return bool(role[0] == b"master")
            except (redis.RedisError, TypeError):
                return False

        wait_for(moved, timeout_s, "sentinel failover")
        return self.master_port()

    def stop(self) -> None:
        for n in [*self.sentinels, *self.nodes, *self.extra]:
            n.kill()


def sentinel_set(
    tmp: Path, replicas: int = 1, down_after_ms: int = 500, failover_timeout_ms: int = 2000,
    name: str = "kvgw-ha", password: str | None = None, sentinel_password: str | None = None,
) -> SentinelSet:  # fmt: skip
    """`password`: the data nodes' (requirepass, masterauth); `sentinel_password`: the sentinels'."""
    master = data_node(tmp, password=password)
    nodes = [master]
    for _ in range(replicas):
        nodes.append(
            data_node(tmp, "--replicaof", "127.0.0.1", str(master.port), password=password)
        )
    wait_for(
        lambda: master.client().info("replication").get("connected_slaves") == replicas
        and all(n.client().info("replication").get("master_link_status") == "up"
                for n in nodes[1:]),
        10, "replicas in sync",
    )  # fmt: skip
    # Each sentinel is told the others' ids and the replicas up front (as a restarted sentinel
    # reads them from its rewritten config), so none waits for the hello messages (2 s apart).
    ids = {free_port(): f"{i + 1:040x}" for i in range(3)}
    sentinels = []
    for port, myid in ids.items():
        d = tmp / f"s{port}"
        d.mkdir(parents=True)
        lines = [f"port {port}", "bind 127.0.0.1", f"dir {d}", f"sentinel myid {myid}",
                 f"sentinel monitor {name} 127.0.0.1 {master.port} 2",
                 f"sentinel down-after-milliseconds {name} {down_after_ms}",
                 f"sentinel failover-timeout {name} {failover_timeout_ms}",
                 f"sentinel parallel-syncs {name} 1"]  # fmt: skip
        lines += [f"sentinel known-replica {name} 127.0.0.1 {n.port}" for n in nodes[1:]]
        if password:
            lines.append(f"sentinel auth-pass {name} {password}")
        if sentinel_password:
            lines += [
                f"requirepass {sentinel_password}",
                f"sentinel sentinel-pass {sentinel_password}",
            ]
        lines += [f"sentinel known-sentinel {name} 127.0.0.1 {p} {i}"
                  for p, i in ids.items() if p != port]  # fmt: skip
        (d / "sentinel.conf").write_text("\n".join(lines) + "\n")
        node = Node(port, (str(d / "sentinel.conf"), "--sentinel"), d, password=sentinel_password)
        sentinels.append(node.start())
    found = SentinelSet(name, nodes, sentinels)

    def known() -> bool:  # every sentinel sees the replicas and the other sentinels
        try:
            for s in sentinels:
                info = s.client().sentinel_master(name)
                if info["num-other-sentinels"] < 2 or info["num-slaves"] < replicas:
                    return False
            return True
        except redis.RedisError:
            return False

    wait_for(known, 15, "sentinels discovering each other")
    return found


@dataclass
class Cluster:
    """A Redis Cluster: `masters` primaries, each with `replicas` replicas."""

    nodes: list[Node]

    def url(self, scheme: str = "redis+cluster") -> str:
        return f"{scheme}://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=2)

    def master_of(self, key: bytes | str) -> Node:
        c = self.client()
        try:
            node = c.get_node_from_key(key)
            return next(n for n in self.nodes if n.port == node.port)
        finally:
            c.close()

    def wait_ok(self, timeout_s: float = 20, skip: tuple[Node, ...] = ()) -> None:
        def ok() -> bool:
            try:
                for n in self.nodes:
                    if n in skip:
                        continue
                    info = n.client().cluster("info")
                    if info.get("cluster_state") != "ok":
                        return False
                return True
            except redis.RedisError:
                return False

        wait_for(ok, timeout_s, "cluster_state:ok")

    def wait_failover(self, dead: Node, timeout_s: float = 20) -> None:
        """Until a replica took over the dead master's slots and every live node says ok."""

        def moved() -> bool:
            try:
                for n in self.nodes:
                    if n is dead:
                        continue
                    if n.client().cluster("info").get("cluster_state") != "ok":
                        return False
                    for line in (
                        n.client().execute_command("CLUSTER", "NODES").decode().splitlines()
                    ):
                        f = line.split()
                        if f[1].startswith(f"127.0.0.1:{dead.port}@") and "master" in f[2] \
                                and len(f) > 8:  # fmt: skip
                            return False  # still a master with slots in this node's view
                return True
            except redis.RedisError:
                return False

        wait_for(moved, timeout_s, "cluster failover")

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()


def cluster(tmp: Path, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000) -> Cluster:
    assert REDIS_CLI is not None, MISSING
    nodes = [
        data_node(tmp, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                  "--cluster-node-timeout", str(node_timeout_ms), port=cluster_port())
        for _ in range(masters * (1 + replicas))
    ]  # fmt: skip
    subprocess.run(
        [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
         "--cluster-replicas", str(replicas), "--cluster-yes"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    found = Cluster(nodes)
    found.wait_ok()
    if replicas:

        def linked() -> bool:
            for n in nodes:
                info = n.client().info("replication")
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
            return True

        wait_for(linked, 15, "cluster replicas in sync")
    return found


@contextlib.contextmanager
def running(topology: SentinelSet | Cluster | Node) -> Iterator[None]:
    try:
        yield
    finally:
        if isinstance(topology, Node):
            topology.kill()
        else:
            topology.stop()
