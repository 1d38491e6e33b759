"""Disaggregated (prefill/decode) pools end to end: the gateway over HTTP in front of simulated
P/D replicas (simulator/pd.py) for both protocols, vllm-nixl and sglang (docs/pd.md)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from gateway import create_app, parse_config
from gateway.config import ConfigError
from simulator.fleet import Fleet
from simulator.pd import PdOptions
from tests.support import free_port, poll_until, serving, start_server

PROTOCOLS = ("vllm-nixl", "sglang")
LONG = "You are a careful assistant. " * 60  # a prompt of many blocks


@dataclass
class PdRig:
    url: str
    prefill: Fleet
    decode: Fleet
    app: Any
    model: str

    def body(self, stream: bool = False, content: str = LONG, **kw: Any) -> dict[str, Any]:
        msgs = [{"role": "system", "content": content}, {"role": "user", "content": "hi"}]
        return {"model": self.model, "messages": msgs, "stream": stream, "max_tokens": 8, **kw}


def _set(fleet: Fleet, role: str, sglang: bool, dead: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, r in enumerate(fleet.replicas):
        item: dict[str, Any] = {"url": r.url, "name": f"{role[0]}{i}"}
        if sglang and role == "prefill":
            assert r.pd is not None
            item["bootstrap_port"] = r.pd.port
        out.append(item)
    out += [
        {"url": f"http://127.0.0.1:{free_port()}", "name": f"{role[0]}dead{i}"} for i in range(dead)
    ]
    return out


@contextlib.asynccontextmanager
async def pd_rig(
    protocol: str, *, n_prefill: int = 1, n_decode: int = 1, dead_prefill: int = 0,
    dead_decode: int = 0, pool: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
    speedup: float = 1000.0, decode_opts: dict[str, Any] | None = None, tracing: Any = None,
) -> AsyncIterator[PdRig]:  # fmt: skip
    """Simulated prefill and decode replicas (dead ones first in each set's order, so the
    policy's pick can be steered with `policy: round_robin`) behind a gateway on loopback."""
    sglang = protocol == "sglang"
    # the lease and timeouts are simulated seconds: at this speedup 30 s would be 30 ms of ours
    p_opts = PdOptions("prefill", protocol, lease_s=speedup * 5, bootstrap_timeout_s=speedup * 5)  # type: ignore[arg-type]
    d_opts = PdOptions(
        "decode",
        protocol,
        waiting_timeout_s=speedup * 5,
        **(decode_opts or {}),  # type: ignore[arg-type]
    )
    async with (
        Fleet(n=n_prefill, speedup=speedup, pd=p_opts) as pf,
        Fleet(n=n_decode, speedup=speedup, pd=d_opts, seed=100) as df,
    ):
        pool_cfg: dict[str, Any] = {
            "protocol": protocol,
            "policy": "ttft",
            "prefill": {"replicas": _set(pf, "prefill", sglang, dead_prefill)},
            "decode": {"replicas": _set(df, "decode", sglang, dead_decode)},
            "health": {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_open": 2, "open_s": 1.0},
            "timeouts": {"connect_s": 1, "first_byte_s": 5, "idle_s": 5, "total_s": 20},
            "scrape": {"interval_s": 0.2},
            **(pool or {}),
        }
        cfg = {
            "pools": {"pd": pool_cfg},
            "server": {"expose_upstream_errors": True, "admin_key": "adm"},
            **(extra or {}),
        }
        app = create_app(parse_config(cfg), tracing=tracing)
        gw = await start_server(app, lifespan="on")
        try:
            yield PdRig(gw.url, pf, df, app, pf.replicas[0].model_name)
        finally:
            await gw.stop()


async def stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as h:
        return (await h.get(url + "/sim/stats")).json()  # type: ignore[no-any-return]


def sse_events(raw: bytes) -> list[Any]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(orjson.loads(line[6:]))
    return out


# --- answers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_whole_and_streamed_answers_come_from_the_decode_replica(protocol: str) -> None:
    async with pd_rig(protocol) as r, httpx.AsyncClient(timeout=20) as h:
        res = await h.post(
            r.url + "/v1/chat/completions", json=r.body(), headers={"x-gateway-explain": "1"}
        )
        assert res.status_code == 200, res.text
        answer = res.json()
        assert answer["usage"]["completion_tokens"] == 8
        assert answer["usage"]["prompt_tokens"] > 100
        assert "kv_transfer_params" not in answer or answer["kv_transfer_params"] is None
        decision = orjson.loads(res.headers["x-gateway-decision"])
        assert decision["prefill_replica"] == "p0" and decision["decode_replica"] == "d0"
        assert decision["decode"]["policy"] == "pd_decode"

        raw = await h.post(r.url + "/v1/chat/completions", json=r.body(stream=True))
        assert raw.status_code == 200, raw.text
        events = sse_events(raw.content)
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
        )
        assert text and raw.content.endswith(b"data: [DONE]\n\n")
        assert not any("usage" in e and e["usage"] for e in events)  # the client did not ask

        comp = await h.post(
            r.url + "/v1/completions", json={"model": r.model, "prompt": LONG, "max_tokens": 5}
        )
        assert comp.status_code == 200 and comp.json()["usage"]["completion_tokens"] == 5

        p, d = await stats(r.prefill.urls[0]), await stats(r.decode.urls[0])
        assert p["pd"]["role"] == "prefill" and d["pd"]["role"] == "decode"
        if protocol == "vllm-nixl":  # every decode leg pulled the KV its prefill leg kept
            assert d["pd"].get("transfers", 0) >= 3, d["pd"]
        decisions = (
            await h.get(r.url + "/debug/decisions", headers={"authorization": "Bearer adm"})
        ).json()
        last = decisions["decisions"][-1] if isinstance(decisions, dict) else decisions[-1]
        assert last["prefill_replica"] == "p0" and last["decode_replica"] == "d0"


async def fault(url: str, **f: Any) -> None:
    async with httpx.AsyncClient() as h:
        assert (await h.post(url + "/sim/fault", json=f)).status_code == 200


async def legs(url: str) -> dict[tuple[str, str, str], float]:
    """gateway_pd_legs_total by (role, replica, outcome)."""
    async with httpx.AsyncClient() as h:
        text = (await h.get(url + "/metrics")).text
    out: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("gateway_pd_legs_total{"):
            labels = dict(
                kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            key = tuple(labels[k].strip('"') for k in ("role", "replica", "outcome"))
            out[key] = float(line.rsplit(" ", 1)[1])  # type: ignore[index]
    return out


def total(
    counts: dict[tuple[str, str, str], float], role: str, outcome: str | None = None
) -> float:
    return sum(
        v for (r, _, o), v in counts.items() if r == role and (outcome is None or o == outcome)
    )


# --- failover -----------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_failed_prefill_moves_to_the_next_prefill_replica(protocol: str) -> None:
    async with pd_rig(protocol, n_prefill=2, pool={"policy": "round_robin"}) as r:
        await fault(r.prefill.urls[0], mode="error_503", count=1)
        async with httpx.AsyncClient(timeout=20) as h:
            # round robin picks p0 for one of the two: it fails (503 before any byte) and the
            # other prefill replica serves that request
            for i in range(2):
                res = await h.post(r.url + "/v1/chat/completions", json=r.body(stream=i == 1))
                assert res.status_code == 200, res.text
        counts = await legs(r.url)
        assert counts[("prefill", "p0", "status_503")] == 1
        assert counts[("prefill", "p1", "ok")] == 2
        assert total(counts, "decode") == 2  # the decode leg went once per request


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_failed_decode_moves_to_the_next_decode_replica_with_a_fresh_prefill(
    protocol: str,
) -> None:
    async with pd_rig(protocol, n_decode=2) as r:
        await fault(r.decode.urls[0], mode="error_503", count=1)
        async with httpx.AsyncClient(timeout=20) as h:
            for stream in (False, True, False):  # d0 is picked for one (ties go by name)
                res = await h.post(
                    r.url + "/v1/chat/completions",
                    json=r.body(stream=stream, content=f"{stream} {LONG}"),
                )
                assert res.status_code == 200, res.text
        counts = await legs(r.url)
        assert counts[("decode", "d0", "status_503")] == 1
        assert total(counts, "decode", "ok") == 3
        if protocol == "vllm-nixl":  # the failed pair's prefill was run again for the new one
            assert total(counts, "prefill", "ok") == 4


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_an_error_answer_of_either_leg_is_the_clients_answer(
    protocol: str, role: str
) -> None:
    async with pd_rig(protocol) as r:
        fleet = r.prefill if role == "prefill" else r.decode
        await fault(fleet.urls[0], mode="error_500", count=1)
        async with httpx.AsyncClient(timeout=20) as h:
            res = await h.post(r.url + "/v1/chat/completions", json=r.body())
        assert res.status_code == 500, res.text
        err = res.json()["error"]
        assert err["type"] == "server_error" and isinstance(err["message"], str)
        counts = await legs(r.url)
        assert total(counts, role, "status_500") == 1
        if role == "prefill" and protocol == "vllm-nixl":
            assert total(counts, "decode") == 0  # no decode leg after a failed serial prefill


async def test_a_prefill_replica_without_kv_transfer_params_is_a_502() -> None:
    """A prefill 'replica' that is a plain engine (no KV connector) answers 200 with no
    kv_transfer_params: the gateway says so, and does not let the decode recompute silently."""
    async with (
        Fleet(n=1, speedup=1000.0) as plain,
        Fleet(n=1, speedup=1000.0, pd=PdOptions("decode", "vllm-nixl")) as df,
    ):
        cfg = {
            "pools": {"pd": {
                "protocol": "vllm-nixl", "prefill": {"replicas": plain.urls},
                "decode": {"replicas": df.urls},
            }},
        }  # fmt: skip
        app = create_app(parse_config(cfg))
        async with serving(app, lifespan="on") as gw, httpx.AsyncClient(timeout=20) as h:
            body = {"model": plain.replicas[0].model_name, "prompt": LONG, "max_tokens": 4}
            res = await h.post(gw.url + "/v1/completions", json=body)
            assert res.status_code == 502, res.text
            err = res.json()["error"]
            assert err["code"] == "bad_gateway" and "kv_transfer_params" in err["message"]
            assert (await stats(df.urls[0]))["requests_received"] == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_nothing_is_retried_after_the_first_byte(protocol: str) -> None:
    async with pd_rig(protocol, n_decode=2) as r:
        for u in r.decode.urls:  # whichever is picked breaks after its first bytes
            await fault(u, mode="die_midstream", after_chunks=2, count=1)
        async with httpx.AsyncClient(timeout=20) as h:
            res = await h.post(
                r.url + "/v1/chat/completions", json=r.body(stream=True, max_tokens=20)
            )
            assert res.status_code == 200
            body = res.content
        assert b"error" in body and not body.endswith(b"data: [DONE]\n\n")
        counts = await legs(r.url)
        assert total(counts, "decode") == 1  # one decode leg: the broken stream was not re-sent
        assert total(counts, "prefill") == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_client_that_leaves_frees_the_decode_replicas_blocks(protocol: str) -> None:
    # a slow decode (2000 tokens at speedup 5: ~12 s wall), so a busy machine cannot let it
    # finish between the first chunk and the look at the decode replica
    async with pd_rig(protocol, speedup=5.0) as r, httpx.AsyncClient(timeout=20) as h:
        body = r.body(stream=True, max_tokens=2000)
        async with h.stream("POST", r.url + "/v1/chat/completions", json=body) as res:
            assert res.status_code == 200
            chunks = res.aiter_bytes()
            await chunks.__anext__()
            d = await stats(r.decode.urls[0])
            assert d["running"] == 1 and d["kv_usage"] > 0
        # the gateway closes the decode leg's socket: the engine aborts and frees its blocks
        await poll_until_async(
            lambda: stats(r.decode.urls[0]), lambda s: s["kv_usage"] == 0 and s["running"] == 0
        )
        d = await stats(r.decode.urls[0])
        assert d["requests_aborted"] == 1
        p = await stats(r.prefill.urls[0])
        assert p["pd"]["held_blocks"] == 0  # the prefill replica's were read (and freed) before


async def poll_until_async(get: Any, cond: Any, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond(await get()):
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_a_first_config_in_a_fresh_process_gets_the_did_you_mean() -> None:
    """The pool's P/D sets are typed after the pool: the wording walks their fields, which must
    be types in a process that has validated nothing yet (`gateway check` is such a process)."""
    code = (
        "from gateway import parse_config\n"
        "try:\n"
        "    parse_config({'pools': {'pd': {'protocol': 'vllm-nixl', 'decode': {'replicas': "
        "['http://b:1']}, 'prefill': {'replicas': ['http://a:1'], 'retires': 1}}}})\n"
        "except Exception as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pools.pd.prefill.retires: unknown key (did you mean 'retries'?)" in out.stdout


# --- routes, config -----------------------------------------------------------------------------
async def test_long_prompts_go_to_the_pd_pool_and_short_ones_to_the_aggregated_pool() -> None:
    async with (
        Fleet(n=1, speedup=1000.0, seed=7) as agg,
        Fleet(n=1, speedup=1000.0, pd=PdOptions("prefill", "vllm-nixl", lease_s=5000)) as pf,
        Fleet(n=1, speedup=1000.0, pd=PdOptions("decode", "vllm-nixl"), seed=100) as df,
    ):
        cfg = {
            "pools": {
                "pd": {
                    "protocol": "vllm-nixl",
                    "prefill": {"replicas": pf.urls},
                    "decode": {"replicas": df.urls},
                },
                "agg": {"replicas": agg.urls},
            },
            "routes": [{"match": {"min_prompt_tokens": 200}, "pool": "pd"}, {"pool": "agg"}],
        }
        app = create_app(parse_config(cfg))
        model = agg.replicas[0].model_name
        async with serving(app, lifespan="on") as gw, httpx.AsyncClient(timeout=20) as h:
            for content in (LONG, "short question"):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 3,
                }
                res = await h.post(gw.url + "/v1/chat/completions", json=body)
                assert res.status_code == 200, res.text
            a, p, d = await stats(agg.urls[0]), await stats(pf.urls[0]), await stats(df.urls[0])
        assert a["requests_served"] == 1 and a["prompt_tokens"] < 50
        assert p["requests_served"] == 1 and d["requests_served"] == 1 and d["prompt_tokens"] > 200


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        (
            {"protocol": "vllm-nixl", "prefill": {"replicas": ["http://a:1"]}},
            "pools.pd.decode: required with prefill:",
        ),
        (
            {"prefill": {"replicas": ["http://a:1"]}, "decode": {"replicas": ["http://b:1"]}},
            "pools.pd.protocol: required for a disaggregated pool",
        ),
        (
            {
                "protocol": "grpc",
                "prefill": {"replicas": ["http://a:1"]},
                "decode": {"replicas": ["http://b:1"]},
            },
            "pools.pd.protocol:",
        ),
        (
            {
                "protocol": "sglang",
                "prefill": {"replicas": ["http://a:1"]},
                "decode": {"replicas": ["http://a:1"]},
            },
            "pools.pd.decode.replicas[0]: name 'a:1' repeats prefill.replicas[0]",
        ),
        (
            {
                "protocol": "sglang",
                "replicas": ["http://c:1"],
                "prefill": {"replicas": ["http://a:1"]},
                "decode": {"replicas": ["http://b:1"]},
            },
            "pools.pd.replicas: a disaggregated pool lists",
        ),
        (
            {
                "protocol": "vllm-nixl",
                "prefill": {
                    "replicas": [],
                },
                "decode": {"replicas": ["http://b:1"]},
            },
            "pools.pd.prefill.replicas: expected at least one replica URL",
        ),
        (
            {
                "protocol": "vllm-nixl",
                "prefill": {"replicas": [{"url": "http://a:1", "bootstrap_port": 8998}]},
                "decode": {"replicas": ["http://b:1"]},
            },
            "pools.pd.prefill.replicas[0].bootstrap_port: only an sglang",
        ),
        (
            {
                "protocol": "sglang",
                "prefill": {"replicas": ["http://a:1"]},
                "decode": {"replicas": ["http://b:1"], "bootstrap_port": 1},
            },
            "pools.pd.decode.bootstrap_port:",
        ),
        (
            {
                "protocol": "sglang",
                "prefill": {"replicas": ["http://a:1"], "retires": 1},
                "decode": {"replicas": ["http://b:1"]},
            },
            "pools.pd.prefill.retires: unknown key (did you mean 'retries'?)",
        ),
        (
            {"protocol": "vllm-nixl", "replicas": ["http://a:1"]},
            "pools.pd.protocol: only for a disaggregated pool",
        ),
    ],
)
def test_config_errors_name_their_key(pool: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({"pools": {"pd": pool}})
    assert message in str(exc.value), str(exc.value)


def test_a_set_takes_its_own_settings_over_the_pools() -> None:
    cfg = parse_config({"pools": {"pd": {
        "protocol": "sglang", "retries": 1, "timeouts": {"total_s": 30},
        "prefill": {"replicas": ["http://a:1"], "bootstrap_port": 8998, "timeouts": {"first_byte_s": 3}},
        "decode": {"replicas": ["http://b:1"], "max_inflight_per_replica": 200, "retries": 0},
    }}})  # fmt: skip
    from gateway.fleet.pools import build_pools

    pool = build_pools(cfg, {}, lambda r: None, [])["pd"]
    assert pool.pd is not None and pool.pd.protocol == "sglang"
    assert pool.pd.prefill.config.timeouts.first_byte_s == 3 and pool.pd.prefill.config.retries == 1
    assert pool.pd.decode.config.timeouts.total_s == 30 and pool.pd.decode.config.retries == 0
    assert [r.max_inflight for r in pool.pd.decode.replicas] == [200]
    assert [r.name for r in pool.replicas] == ["a:1", "b:1"]


def test_a_set_written_as_a_list_is_its_replicas() -> None:
    """`prefill: [url, ...]` is `prefill: {replicas: [url, ...]}`, as a pool's `replicas` is a list
    (issue 39): it used to be refused as "expected a mapping"."""
    short = parse_config({"pools": {"pd": {
        "protocol": "sglang",
        "prefill": ["http://a:1", {"url": "http://c:1", "bootstrap_port": 9000}],
        "decode": ["http://b:1"],
    }}})  # fmt: skip
    long = parse_config({"pools": {"pd": {
        "protocol": "sglang",
        "prefill": {"replicas": ["http://a:1", {"url": "http://c:1", "bootstrap_port": 9000}]},
        "decode": {"replicas": ["http://b:1"]},
    }}})  # fmt: skip
    assert short.pools["pd"] == long.pools["pd"]
    with pytest.raises(ConfigError) as exc:  # an empty list is still no set
        parse_config({"pools": {"pd": {"protocol": "sglang", "prefill": [], "decode": ["http://b:1"]}}})
    assert "pools.pd.prefill.replicas: expected at least one replica URL" in str(exc.value)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_trace_shows_prefill_transfer_and_decode(protocol: str) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.telemetry.tracing import Tracing

    exporter = InMemorySpanExporter()
    tracing = Tracing(None, exporter=exporter, environ={})
    try:
        async with (
            pd_rig(protocol, tracing=tracing, speedup=100.0) as r,
            httpx.AsyncClient(timeout=20) as h,
        ):
            res = await h.post(r.url + "/v1/chat/completions", json=r.body(stream=True))
            assert res.status_code == 200
        await poll_until(
            lambda: any(s.name == "gateway.request" for s in exporter.get_finished_spans())
        )
        spans = exporter.get_finished_spans()
        names = [s.name for s in spans]
        segs = [
            n
            for n in names
            if n
            in (
                "gateway.route",
                "gateway.queue",
                "upstream.prefill",
                "kv.transfer",
                "upstream.decode",
            )
        ]
        assert segs == [
            "gateway.route",
            "gateway.queue",
            "upstream.prefill",
            "kv.transfer",
            "upstream.decode",
        ]
        by = {s.name: s for s in spans}
        pre, xfer, dec = by["upstream.prefill"], by["kv.transfer"], by["upstream.decode"]
        assert pre.end_time == xfer.start_time and xfer.end_time == dec.start_time
        attempts = [s for s in spans if s.name == "upstream.attempt"]
        replicas = sorted(str((s.attributes or {}).get("gateway.replica")) for s in attempts)
        assert replicas == ["d0", "p0"]  # one attempt span per leg
        root = by["gateway.request"].attributes or {}
        assert root["gateway.replica"] == "d0" and root["gateway.ttft_s"] > 0
    finally:
        tracing.shutdown()


async def test_ready_needs_a_proven_replica_in_each_set() -> None:
    dead = [{"url": f"http://127.0.0.1:{free_port()}", "name": "ddead"}]
    async with pd_rig("vllm-nixl", pool={"decode": {"replicas": dead}}) as r:
        sets = r.app.gateway.pools["pd"].pd
        prefill, decode = sets.prefill.replicas[0], sets.decode.replicas[0]
        await poll_until(  # the dead decode replica's circuit opens after its failed probes
            lambda: prefill.proven(time.monotonic()) and not decode.proven(time.monotonic()),
            timeout_s=10,
        )
        async with httpx.AsyncClient(timeout=5) as h:
            res = await h.get(r.url + "/ready")
        assert res.status_code == 503, res.text  # the prefill set alone serves nothing
        assert res.json()["available_replicas"] == {"pd": 0}
