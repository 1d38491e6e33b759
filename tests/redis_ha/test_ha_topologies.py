"""The prefix index and the rate limiter on every topology operators run: a 3-master Cluster (each
scope's keys in one slot, scripts on every master), a Sentinel set behind passwords, one node over
TLS with an ACL user. Real redis-server processes on loopback, started here."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from gateway.limits.ratelimit import RedisRateLimiter, Rule
from prefix_index import RedisIndex, RedisTuning
from prefix_index.constants import scope_id
from tests.redis_ha.servers import Cluster, Node, cluster, data_node, sentinel_set
from tests.support import free_port

TUNING = RedisTuning(timeout_s=2.0)


def chain(seed: int, n: int) -> list[int]:
    return [seed * 1_000_003 + i + 1 for i in range(n)]


@pytest.fixture(scope="module")
def three_masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    found = cluster(tmp_path_factory.mktemp("cluster"), masters=3)
    try:
        yield found
    finally:
        found.stop()


async def exercise_index(url: str, namespace: str, scopes: int = 12) -> RedisIndex:
    """Records, matches, an evict and a forget through `url`; the index, still open."""
    index = RedisIndex(url, namespace=namespace, local_cache_s=0, tuning=TUNING, ttl_s=60)
    assert await index.connect()
    for s in range(scopes):
        await index.record(f"m:{s}", "r1", chain(s, 40))
        await index.record(f"m:{s}", "r2", chain(s, 10))
    for s in range(scopes):
        assert await index.match(f"m:{s}", chain(s, 40), ["r1", "r2", "r3"]) == {
            "r1": 40, "r2": 10, "r3": 0
        }  # fmt: skip
    await index.evict("m:0", "r1", chain(0, 40)[20:])
    assert (await index.match("m:0", chain(0, 40), ["r1"]))["r1"] == 20
    await index.forget("r2")
    assert (await index.match("m:1", chain(1, 40), ["r2"]))["r2"] == 0
    stats = await index.stats()
    assert stats.healthy and stats.blocks_per_replica["r1"] == scopes * 40 - 20
    assert index.health.outages == 0
    return index


async def test_the_index_on_a_cluster_keeps_each_scope_in_one_slot(
    three_masters: Cluster,
) -> None:
    ns = f"ha-{uuid.uuid4().hex[:8]}"
    index = await exercise_index(three_masters.url(), ns)
    await index.aclose()
    by_slot: dict[str, set[int]] = {}
    masters = set()
    for node in three_masters.nodes:
        c = node.client()
        for key in c.scan_iter(match=f"{ns}:*", count=1000):
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))  # as the server hashes it
            assert slot == key_slot(key)
            tag = key.split(b"{", 1)[1].split(b"}", 1)[0].decode() if b"{" in key else ""
            by_slot.setdefault(tag, set()).add(slot)
            masters.add(node.port)
    sids = {scope_id(f"m:{s}") for s in range(12)}
    assert sids <= set(by_slot), "every scope wrote keys"
    assert all(len(by_slot[sid]) == 1 for sid in sids), "a scope's keys share one slot"
    assert len({next(iter(by_slot[sid])) for sid in sids}) > 1
    assert len(masters) == 3, "the scopes spread over every master"


async def test_scripts_reach_every_master_after_a_flush_of_the_script_cache(
    three_masters: Cluster,
) -> None:
    ns = f"ha-{uuid.uuid4().hex[:8]}"
    index = await exercise_index(three_masters.url(), ns, scopes=6)
    limiter = RedisRateLimiter(three_masters.url(), namespace=f"{ns}:rl", timeout_s=2.0)
    rules = [Rule("rpm", 1.0, 5.0, "requests"), Rule("tpm", 1.0, 1000.0, "tokens")]
    try:
        for node in three_masters.nodes:
            node.client().script_flush()
        for s in range(6):  # every master answers NOSCRIPT at least once; nothing fails
            held = 20 if s == 0 else 40  # exercise_index evicted half of m:0
            assert (await index.match(f"m:{s}", chain(s, 40), ["r1"]))["r1"] == held
            await index.record(f"m:{s}", "r3", chain(s, 5))
        assert await index.flush() and index.health.outages == 0
        tenants = [f"tenant-{i}" for i in range(9)]  # tags on every master
        assert len({three_masters.master_of(f"{{{t}}}").port for t in tenants}) == 3
        for t in tenants:
            verdicts = [await limiter.acquire(t, rules, [1.0, 300.0]) for _ in range(4)]
            # all or nothing across the two rules (one script call, one slot): the 4th request
            # is refused by the token rule (4 x 300 > 1000) and takes nothing from rpm either
            assert [v.allowed for v in verdicts] == [True, True, True, False]
            assert not any(v.degraded for v in verdicts)
            assert verdicts[3].blocked == ("tpm",)
            assert 2.0 - 1e-6 <= verdicts[3].states[0].remaining < 2.9  # 3 of 5 taken, no 4th
        assert limiter.health.outages == 0
    finally:
        await index.aclose()
        await limiter.aclose()


async def test_sentinel_with_passwords_from_the_url_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = sentinel_set(tmp_path, replicas=1, password="node-pw", sentinel_password="sent-pw")
    try:
        monkeypatch.setenv("KVGW_REDIS_SENTINEL_PASSWORD", "sent-pw")
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in found.sentinels)
        url = f"redis+sentinel://:node-pw@{hosts}/{found.name}/1"
        index = await exercise_index(url, "ha-sentinel", scopes=3)
        await index.aclose()
        assert found.master().client(db=1).exists("ha-sentinel:replicas")
        limiter = RedisRateLimiter(url, namespace="rl", timeout_s=2.0)
        rule = [Rule("rpm", 1.0, 2.0, "requests")]
        allowed = [(await limiter.acquire("t", rule, [1.0])).allowed for _ in range(3)]
        assert allowed == [True, True, False]
        await limiter.aclose()
        monkeypatch.setenv("KVGW_REDIS_SENTINEL_PASSWORD", "wrong")
        limiter = RedisRateLimiter(url, namespace="rl", timeout_s=0.5)
        verdict = await limiter.acquire("t", rule, [1.0])
        assert verdict.allowed and verdict.degraded and limiter.health.outages == 1  # fails open
        assert (
            "sent-pw" not in limiter.health.last_error and "wrong" not in limiter.health.last_error
        )
        await limiter.aclose()
    finally:
        found.stop()


def tls_files(tmp: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, by the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make test certificates")
    ca, ca_key, cert, key = tmp / "ca.pem", tmp / "ca.key", tmp / "server.pem", tmp / "server.key"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = {"check": True, "capture_output": True, "timeout": 30}
    subprocess.run([openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1",
                    "-subj", "/CN=kvgw-test-ca"], **run)  # type: ignore[call-overload]  # fmt: skip
    csr = tmp / "server.csr"
    subprocess.run([openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
                   **run)  # type: ignore[call-overload]  # fmt: skip
    ext = tmp / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    subprocess.run([openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
                    "-CAcreateserial", "-out", cert, "-days", "1", "-extfile", ext],
                   **run)  # type: ignore[call-overload]  # fmt: skip
    return ca, cert, key


async def test_tls_and_an_acl_user_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca, cert, key = tls_files(tmp_path)
    tls_port = free_port()
    node: Node = data_node(
        tmp_path, "--tls-port", str(tls_port), "--tls-cert-file", str(cert),
        "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
        "--user", "default", "off", "--user", "gw", "on", ">gw-secret", "~*", "&*", "+@all",
    )  # fmt: skip
    try:
        with pytest.raises(redis.AuthenticationError):
            node.client().ping()  # the plain port demands the ACL user too
        monkeypatch.setenv("KVGW_REDIS_USERNAME", "gw")
        monkeypatch.setenv("KVGW_REDIS_PASSWORD", "gw-secret")
        monkeypatch.setenv("KVGW_REDIS_SSL_CA_CERTS", str(ca))
        url = f"rediss://127.0.0.1:{tls_port}/0"
        index = await exercise_index(url, "ha-tls", scopes=2)
        await index.aclose()
        limiter = RedisRateLimiter(url, namespace="rl", timeout_s=2.0)
        v = await limiter.acquire("t", [Rule("rpm", 1.0, 5.0, "requests")], [1.0])
        assert v.allowed and not v.degraded
        await limiter.aclose()
        assert node.client(username="gw", password="gw-secret").exists("ha-tls:replicas")
        # a CA that did not sign the server's certificate: no connection, an outage, no crash
        (tmp_path / "other").mkdir()
        other_ca, _, _ = tls_files(tmp_path / "other")
        monkeypatch.setenv("KVGW_REDIS_SSL_CA_CERTS", str(other_ca))
        index = RedisIndex(url, namespace="ha-tls", tuning=RedisTuning(timeout_s=0.5))
        assert not await index.connect()
        assert not index.healthy and index.health.outages == 1
        assert await index.match("m:0", chain(0, 40), ["r1"]) == {"r1": 0}
        await index.aclose()
    finally:
        node.kill()


async def shared_load_works(url: str) -> None:
    """Two gateway apps share their load through `url`: ticks (the fleet's one Lua call) find the
    peer; with ticks 2 s apart, the requests' start and end reach it by push (PUBLISH on the
    fleet's lane, the listener's subscription), whatever the topology."""
    import asyncio

    import aiohttp

    from tests.gateway.fake_replica import Upstream
    from tests.gateway.test_gw_fleet import fleet_of, peer_inflight, post
    from tests.support import poll_until

    over = {"fleet": {"redis_url": url, "publish_interval_ms": 2000, "stale_after_s": 30}}
    async with fleet_of(2, [Upstream("u0", delay_s=0.6)], **over) as (apps, gws, _), \
            aiohttp.ClientSession() as h:  # fmt: skip
        await poll_until(lambda: all(a.gateway.fleet.peers == 1 for a in apps), 10)
        sent = [asyncio.create_task(post(h, gws[0], f"q{i}")) for i in range(2)]
        await poll_until(lambda: peer_inflight(apps[1]) == 2, 5)
        assert [s for s, _ in await asyncio.gather(*sent)] == [200, 200]
        await poll_until(lambda: peer_inflight(apps[1]) == 0, 5)
        fleet = apps[1].gateway.fleet
        assert fleet.status == "ok" and fleet.errors == 0
        assert apps[0].gateway.fleet.push.sent >= 2 and fleet.push.applied >= 2


async def test_shared_load_on_a_cluster(three_masters: Cluster) -> None:
    await shared_load_works(three_masters.url())


async def test_shared_load_through_sentinel(tmp_path: Path) -> None:
    found = sentinel_set(tmp_path, replicas=1)
    try:
        await shared_load_works(found.url())
    finally:
        found.stop()
