"""Prefill/decode disaggregation, the engine side: what a vLLM-NIXL or SGLang P/D replica does.

Flags (`python -m simulator`) and what they expose:
  --role prefill|decode|both      (default both: a plain aggregated replica)
  --pd-protocol vllm-nixl|sglang  (default vllm-nixl)
  --kv-link-gbps 400              the P->D link; a transfer lasts KV bytes x 8 / (gbps x 1e9)
  --pd-side-channel-port BASE     replica i listens on BASE+i (0: ephemeral). vLLM-NIXL: the side
                                  channel P advertises as `remote_host`/`remote_port` (vLLM's
                                  VLLM_NIXL_SIDE_CHANNEL_PORT, default 5600); SGLang: the prefill
                                  replica's bootstrap port (--disaggregation-bootstrap-port, 8998)
  --kv-lease-s 30                 how long P keeps unread blocks (vLLM `kv_lease_duration`, 30 s)
  --kv-load-failure-policy fail|recompute   D when the pull fails (vLLM's default: fail)
  --pd-bootstrap-timeout-s 300    SGLang P waiting for its D (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)
  --pd-waiting-timeout-s 300      SGLang D waiting for the KV (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)
Endpoints: `/server_info` and `/get_server_info` carry `disaggregation_mode` (prefill|decode|null);
`/sim/stats` carries `pd` (held blocks, transfers); `/metrics` adds `vllm:nixl_xfer_time_seconds`,
`vllm:nixl_bytes_transferred`, `vllm:nixl_num_failed_transfers`, `vllm:nixl_num_kv_expired_reqs`
and `vllm:external_prefix_cache_queries`/`_hits`.

vLLM NIXL (serial; ../shared/reference/pd-lora-tiers.md §1.2-1.6, §1.11):
- P leg: top-level `kv_transfer_params.do_remote_decode: true` -> the prefill and ONE token
  (`finish_reason: "length"`); a non-streamed answer carries top-level `kv_transfer_params`
  {do_remote_prefill: true, do_remote_decode: false, remote_block_ids: [[...]], remote_engine_id,
  remote_request_id, remote_host, remote_port, tp_size, remote_num_tokens, transfer_mode: "pull"};
  a streamed answer carries none (vLLM's stream chunks have no such field). P keeps the prompt's
  blocks until D's read notification or the lease ends (then `nixl_num_kv_expired_reqs`++).
  A request that did not finish normally returns `kv_transfer_params: null` and frees at once.
- D leg: `do_remote_prefill: true` with remote_block_ids, remote_engine_id, remote_request_id,
  remote_host, remote_port -> D allocates the prompt's blocks (locally cached blocks are not
  pulled), reads the rest from P over the side channel (the transfer time in simulated seconds),
  notifies P (which frees), then decodes only: its first step computes one token, no prefill.
  Missing keys -> vLLM's "invalid KVTransferParams": local recompute, HTTP 200. Stale params (P
  freed or never had them, P unreachable) -> a KV load failure: policy `fail` -> HTTP 500,
  policy `recompute` -> local prefill. A client gone during the transfer frees D's blocks and
  still notifies P, as vLLM's empty read does.
SGLang (concurrent; §2.3-2.6): both legs carry bootstrap_host/bootstrap_port/bootstrap_room. P
prefills (one token) and answers once its D has pulled the KV (500 after the bootstrap timeout);
D connects to P's bootstrap port, waits for the KV (500 after the waiting timeout), then decodes
and streams. Batches of prompts are refused on a P/D leg (400).

The side channel's wire (the simulator's own JSON lines) is in docs/pd.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from simulator.engine import Engine
from simulator.openai_api import ApiError, bad
from simulator.pd_kv import adopt, reserve_blocks, transfer_seconds
from simulator.runner import EngineRunner
from simulator.sequence import Sequence as Seq

Role = Literal["prefill", "decode", "both"]
Protocol = Literal["vllm-nixl", "sglang"]
ROLES: tuple[str, ...] = ("prefill", "decode", "both")
PROTOCOLS: tuple[str, ...] = ("vllm-nixl", "sglang")
NIXL_REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                 "remote_port")
XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BYTES_BUCKETS = tuple(float(2 ** k) for k in range(11, 35, 2))  # 2 KiB .. 16 GiB


@dataclass(frozen=True, slots=True)
class PdOptions:
    role: Role = "both"
    protocol: Protocol = "vllm-nixl"
    kv_link_gbps: float = 400.0
    side_channel_port: int = 0
    lease_s: float = 30.0
    load_failure_policy: Literal["fail", "recompute"] = "fail"
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"--pd-protocol must be one of {', '.join(PROTOCOLS)}")
        if self.kv_link_gbps <= 0 or self.lease_s <= 0:
            raise ValueError("--kv-link-gbps and --kv-lease-s must be > 0")
        if self.load_failure_policy not in ("fail", "recompute"):
            raise ValueError("--kv-load-failure-policy must be fail or recompute")

    @property
    def disaggregation_mode(self) -> str:
        return "null" if self.role == "both" else self.role


@dataclass(slots=True)
class Leg:
    """What one request is on a P/D replica."""

    kind: Literal["nixl_prefill", "nixl_decode", "sglang_prefill", "sglang_decode"]
    params: dict[str, Any] = field(default_factory=dict)
    room: int | None = None
    seq: Seq | None = None
    blocks: list[int] = field(default_factory=list)  # D: reserved before the transfer
    n_hit: int = 0  # D: leading blocks found in the local prefix cache


class _Collector(Collector):
    def __init__(self, pd: PdService, labels: list[str]) -> None:
        self.pd, self.labels = pd, labels

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        c = self.pd.counts
        for name, doc, key in (
            ("vllm:nixl_num_failed_transfers", "Failed NIXL KV transfers.", "failed"),
            ("vllm:nixl_num_kv_expired_reqs", "Requests whose held KV expired on P.", "expired"),
            ("vllm:external_prefix_cache_queries", "External prefix cache queries (tokens).",
             "ext_queries"),
            ("vllm:external_prefix_cache_hits", "External prefix cache hits (tokens).",
             "ext_hits"),
        ):
            m = CounterMetricFamily(name, doc, labels=("model_name", "engine"))
            m.add_metric(self.labels, c[key])
            yield m


class PdService:
    """One replica's P/D side: the legs it serves, the blocks it holds, its side channel."""

    def __init__(self, options: PdOptions, engine: Engine, runner: EngineRunner, *,
                 host: str, model_name: str, registry: CollectorRegistry) -> None:
        self.opts, self.engine, self.runner, self.host = options, engine, runner, host
        self.engine_id = str(uuid.uuid4())
        self.port = options.side_channel_port
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.rooms: dict[int, asyncio.Future[Seq]] = {}  # SGLang P: room -> its finished prefill
        self.pulled: dict[int, asyncio.Future[None]] = {}
        self.counts = dict.fromkeys(("failed", "expired", "ext_queries", "ext_hits",
                                     "transfers", "bytes", "recomputed"), 0)
        self._server: asyncio.Server | None = None
        lv = [model_name, "0"]
        registry.register(_Collector(self, lv))
        self.xfer_time = Histogram("vllm:nixl_xfer_time_seconds", "KV transfer duration.",
                                   ("model_name", "engine"), registry=registry,
                                   buckets=XFER_BUCKETS).labels(*lv)
        self.xfer_bytes = Histogram("vllm:nixl_bytes_transferred", "Bytes per KV transfer.",
                                    ("model_name", "engine"), registry=registry,
                                    buckets=BYTES_BUCKETS).labels(*lv)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self.opts.role != "decode":
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
            self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for h in self.timers.values():
            h.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def server_info(self) -> dict[str, Any]:
        cfg = self.engine.config
        info: dict[str, Any] = {"disaggregation_mode": self.opts.disaggregation_mode,
                                "pd_protocol": self.opts.protocol,
                                "tp_size": cfg.tensor_parallel_size, "dp_size": 1,
                                "max_running_requests": cfg.max_num_seqs}
        if self.opts.protocol == "sglang" and self._server is not None:
            info["disaggregation_bootstrap_port"] = self.port
        return info

    def stats(self) -> dict[str, Any]:
        return {"role": self.opts.role, "protocol": self.opts.protocol,
                "held_requests": len(self.engine.held),
                "held_blocks": sum(len(b) for b in self.engine.held.values()), **self.counts}

    # -- parsing --------------------------------------------------------------------------
    def leg(self, body: Mapping[str, Any], n_prompts: int) -> Leg | None:
        """The P/D leg a request body asks for; None: an ordinary (or recomputed) request."""
        if self.opts.protocol == "sglang":
            room = body.get("bootstrap_room")
            if room is None or self.opts.role == "both":  # disaggregation_mode null: ignored
                if self.opts.role == "prefill":
                    raise bad("a prefill replica needs bootstrap_host, bootstrap_port and "
                              "bootstrap_room", "bootstrap_room")
                return None
            if isinstance(room, list) or n_prompts != 1:
                raise bad("the simulator serves one prompt per P/D request", "bootstrap_room")
            if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2 ** 63:
                raise bad("bootstrap_room must be an integer in [0, 2^63)", "bootstrap_room")
            if self.opts.role == "prefill":
                return Leg("sglang_prefill", room=room)
            host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
            if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
                raise bad("bootstrap_host and bootstrap_port are required on the decode leg",
                          "bootstrap_port")
            return Leg("sglang_decode", params={"host": host, "port": port}, room=room)
        params = body.get("kv_transfer_params")
        if params is None:
            return None
        if not isinstance(params, dict):
            raise bad("kv_transfer_params must be an object", "kv_transfer_params")
        if n_prompts != 1 and (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            raise bad("the simulator serves one prompt per P/D request", "kv_transfer_params")
        if params.get("do_remote_decode") is True:
            return Leg("nixl_prefill", params=params)
        if params.get("do_remote_prefill") is True:
            if any(params.get(k) is None for k in NIXL_REQUIRED):
                self.counts["recomputed"] += 1  # "Got invalid KVTransferParams": recompute
                return None
            return Leg("nixl_decode", params=params)
        return None

    # -- prefill side ---------------------------------------------------------------------
    def submitted(self, leg: Leg, seq: Seq) -> None:
        """After `seq` is queued: a P leg keeps its blocks when it finishes."""
        leg.seq = seq
        if leg.kind in ("nixl_prefill", "sglang_prefill"):
            self.engine.hold_ids.add(seq.id)
        else:
            self._adopt(leg, seq)

    def finished(self, leg: Leg) -> dict[str, Any] | None:
        """A P leg's answer is complete: the `kv_transfer_params` it returns (NIXL), lease on."""
        seq = leg.seq
        assert seq is not None
        engine = self.engine
        engine.hold_ids.discard(seq.id)
        if seq.id not in engine.held or seq.finish_reason not in ("length", "stop"):
            engine.release_held(seq.id)
            return None
        self._lease(seq.id)
        if leg.kind == "sglang_prefill":
            assert leg.room is not None
            fut = self.rooms.setdefault(leg.room, asyncio.get_running_loop().create_future())
            if not fut.done():
                fut.set_result(seq)
            return None
        cfg = engine.config
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(engine.held[seq.id])],
                "remote_engine_id": self.engine_id, "remote_request_id": seq.id,
                "remote_host": self.host, "remote_port": self.port,
                "tp_size": cfg.tensor_parallel_size, "remote_num_tokens": seq.prompt_len,
                "remote_blocks_expiry_time": None, "transfer_mode": "pull"}

    def _lease(self, rid: str) -> None:
        delay = self.opts.lease_s / self.runner.speedup
        self.timers[rid] = asyncio.get_running_loop().call_later(delay, self._expire, rid)

    def _expire(self, rid: str) -> None:
        self.timers.pop(rid, None)
        if self.engine.release_held(rid):
            self.counts["expired"] += 1

    def _free(self, rid: str) -> None:
        h = self.timers.pop(rid, None)
        if h is not None:
            h.cancel()
        self.engine.release_held(rid)

    async def sglang_prefill_done(self, leg: Leg) -> None:
        """SGLang P answers once its D has pulled the KV, or fails after the bootstrap timeout."""
        assert leg.room is not None
        fut = self.pulled.setdefault(leg.room, asyncio.get_running_loop().create_future())
        try:
            await asyncio.wait_for(asyncio.shield(fut),
                                   self.opts.bootstrap_timeout_s / self.runner.speedup)
        except TimeoutError:
            raise ApiError(500, f"KVTransferError(bootstrap_room={leg.room}): Request "
                                f"{leg.room} timed out after {self.opts.bootstrap_timeout_s}s "
                                "in KVPoll.Bootstrapping") from None
        finally:
            self.pulled.pop(leg.room, None)
            self.rooms.pop(leg.room, None)
            if leg.seq is not None:
                self._free(leg.seq.id)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rid: str | None = None
        room: int | None = None
        try:
            msg = orjson.loads(await reader.readline())
            if msg.get("op") == "room":
                room = int(msg["room"])
                fut = self.rooms.setdefault(room, asyncio.get_running_loop().create_future())
                try:
                    seq = await asyncio.wait_for(
                        asyncio.shield(fut), self.opts.bootstrap_timeout_s / self.runner.speedup)
                except TimeoutError:
                    writer.write(orjson.dumps({"ok": False, "error": "no prefill for room"}) + b"\n")
                    return
                rid = seq.id
            else:
                rid = str(msg.get("id"))
                if msg.get("engine_id") != self.engine_id or rid not in self.engine.held:
                    writer.write(orjson.dumps({"ok": False, "error": f"request {rid} is not "
                                               "held (expired, already read or unknown)"}) + b"\n")
                    rid = None
                    return
            h = self.timers.pop(rid, None)
            if h is not None:
                h.cancel()  # a read in progress keeps the blocks (vLLM: heartbeats)
            tokens = len(self.engine.held[rid]) * self.engine.config.block_size
            writer.write(orjson.dumps({"ok": True, "tokens": tokens}) + b"\n")
            await writer.drain()
            await reader.readline()  # "done", or the connection dropped: free either way
        except (OSError, ValueError, KeyError, TypeError, asyncio.IncompleteReadError):
            pass
        finally:
            if rid is not None:
                self._free(rid)
            if room is not None:
                fut2 = self.pulled.get(room)
                if fut2 is not None and not fut2.done():
                    fut2.set_result(None)
            with contextlib.suppress(Exception):
                writer.close()

    # -- decode side ----------------------------------------------------------------------
    def reserve(self, leg: Leg, prompt: Sequence[int], hashes: list[int]) -> None:
        """D allocates the prompt's blocks before the transfer; 503 when they do not fit."""
        got = reserve_blocks(self.engine, len(prompt), hashes)
        if got is None:
            raise ApiError(503, "not enough free KV blocks on the decode replica for the "
                                f"prompt's {len(prompt)} tokens")
        leg.blocks, leg.n_hit = got

    def unreserve(self, leg: Leg) -> None:
        if leg.blocks and leg.seq is None:
            self.engine.cache.release(leg.blocks)
        leg.blocks = []

    def _adopt(self, leg: Leg, seq: Seq) -> None:
        adopt(seq, leg.blocks, leg.n_hit)
        leg.blocks = []

    async def pull(self, leg: Leg, prompt_len: int) -> bool:
        """Read the KV from P; True when the blocks arrived, False to recompute locally."""
        bs = self.engine.config.block_size
        try:
            if leg.kind == "nixl_decode":
                p = leg.params
                host, port, msg = p["remote_host"], int(p["remote_port"]), {
                    "op": "read", "id": p["remote_request_id"], "engine_id": p["remote_engine_id"]}
                wait = 30.0
            else:
                host, port = leg.params["host"], leg.params["port"]
                msg, wait = {"op": "room", "room": leg.room}, self.opts.waiting_timeout_s
            reader, writer = await asyncio.open_connection(host, port)
        except (OSError, ValueError, TypeError) as exc:
            return self._failed(leg, f"cannot reach the prefill side channel: {exc}")
        try:
            writer.write(orjson.dumps(msg) + b"\n")
            try:
                line = await asyncio.wait_for(reader.readline(), wait / self.runner.speedup)
            except TimeoutError:
                raise ApiError(500, f"KVTransferError(bootstrap_room={leg.room}): timed out "
                                    f"after {wait}s in KVPoll.WaitingForInput") from None
            answer: dict[str, Any] = orjson.loads(line) if line else {
                "ok": False, "error": "connection closed"}
            if not answer.get("ok"):
                return self._failed(leg, str(answer.get("error")))
            remote = min(int(answer["tokens"]), prompt_len) - leg.n_hit * bs
            remote = max(0, remote)
            nbytes = remote * self.engine.perf.kv_bytes_per_token
            xfer = transfer_seconds(remote, self.engine.perf.kv_bytes_per_token,
                                    self.opts.kv_link_gbps)
            await asyncio.sleep(xfer / self.runner.speedup)
            writer.write(b'{"op":"done"}\n')
            with contextlib.suppress(OSError):
                await writer.drain()
            c = self.counts
            c["transfers"] += 1
            c["bytes"] += int(nbytes)
            c["ext_queries"] += prompt_len
            c["ext_hits"] += remote
            self.xfer_time.observe(xfer)
            self.xfer_bytes.observe(nbytes)
            return True
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _failed(self, leg: Leg, why: str) -> bool:
        self.counts["failed"] += 1
        if self.opts.load_failure_policy == "recompute":
            self.counts["recomputed"] += 1
            self.unreserve(leg)
            return False
        raise ApiError(500, f"KV transfer failed (kv_load_failure_policy=fail): {why}")
