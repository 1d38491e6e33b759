"""KV cache events as vLLM publishes them: ZMQ PUB `[topic, seq, msgpack batch]` plus a replay
ROUTER. Imported only when a replica publishes events (pyzmq and msgspec: the `events` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from simulator.config import KvEventsOptions
from simulator.kv_cache import PrefixCache
from simulator.tiers import EventTokens, StoreOutbox

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUB_HWM = 100_000  # vLLM's `hwm`: batches queued per subscriber before PUB drops them


def encode_event(event: tuple[Any, ...], encoding: str, block_size: int) -> Any:
    """One engine event (see PrefixCache.events) in vLLM's shape, before msgpack."""
    kind = event[0]
    if kind == "stored":  # a lower tier's (simulator/tiers.py) has a fifth element: its medium
        _, hashes, parent, tokens = event[:4]
        medium = event[4] if len(event) > 4 else "GPU"
        if not tokens:  # vLLM's legacy placeholder offload event: no tokens, no parent, size 0
            block_size, parent = 0, None
        if encoding == "legacy":  # tag, block_hashes, parent, token_ids, block_size, lora_id, medium
            return ["BlockStored", hashes, parent, tokens, block_size, None, medium]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "extra_keys": [None] * len(hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if kind == "removed":
        medium = event[2] if len(event) > 2 else "GPU"
        if encoding == "legacy":
            return ["BlockRemoved", [event[1]], medium]
        return {"type": "BlockRemoved", "block_hashes": [event[1]], "medium": medium, "group_idx": 0}
    if encoding == "legacy":
        return ["AllBlocksCleared"]
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[tuple[Any, ...]], encoding: str, block_size: int,
                 ts: float, dp_rank: int = 0) -> bytes:
    """`[ts, events, dp_rank]`, as vLLM's EventBatch (array_like) encodes it."""
    body = [encode_event(e, encoding, block_size) for e in events]
    return msgspec.msgpack.encode([float(ts), body, dp_rank])


class KvEventPublisher:
    """Drains one engine's cache events into one batch per engine step and publishes it.

    With a shared store (simulator/tiers.py), the batch also carries the store's events about
    the blocks this replica wrote first (its StoreOutbox), after the engine's own; a removal
    another replica's write caused goes out right after that replica's step, with whatever
    this engine has pending, rather than wait for this engine's next step. A block this
    engine loaded from the store is reported on its GPU with the parent and token ids of the
    replica that announced it (whose pending events are published first, so that it has them).

    Every batch takes the next sequence number (from 0) and joins the replay buffer; the
    drop switch (`drop(n)`) withholds the next n batches from PUB subscribers, and with
    `replayable=False` from the replay buffer too, so a subscriber sees a gap it cannot fill.
    """

    def __init__(self, cache: PrefixCache, options: KvEventsOptions, *,
                 host: str = "127.0.0.1") -> None:
        self.cache = cache
        self.options = options
        self.host = host
        self.port = options.port
        self.replay_port = options.replay_port
        self._topic = options.topic.encode("utf-8")
        self._seq = 0
        self._tokens = EventTokens()
        self._outbox: StoreOutbox | None = None
        self._woken = False
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_steps)
        self._drop = 0
        self._replayable = True
        self.published = 0
        self.dropped = 0
        self.replays = 0
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    async def start(self) -> None:
        ctx = self._ctx = zmq.Context()
        try:
            pub = self._pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, PUB_HWM)
            self.port = _bind(pub, self.host, self.port)
            router = self._router = zmq.asyncio.Context.shadow(ctx).socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 2 * (self.options.buffer_steps + 1))  # whole replays
            self.replay_port = _bind(router, self.host, self.replay_port)
        except zmq.ZMQError as exc:
            await self.stop()
            raise OSError(f"cannot publish KV events on {self.host}: {exc}") from exc
        self.cache.events = []
        tiers = self.cache.tiers
        if tiers is not None and tiers.outbox is not None:
            box = self._outbox = tiers.outbox
            box.events.clear()  # a predecessor's, never published: its subscribers reset anyway
            box.wake = self._wake
            box.tokens = self._announced
        self._task = asyncio.get_running_loop().create_task(
            self._serve_replay(), name=f"kv-replay-{self.replay_port}")

    async def stop(self) -> None:
        self.cache.events = None
        if self._outbox is not None:
            self._outbox.wake = self._outbox.tokens = None
            self._outbox = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._router, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._router = self._pub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def drop(self, batches: int, *, replayable: bool = True) -> None:
        """Withhold the next `batches` batches from subscribers (0: stop dropping)."""
        self._drop = batches
        self._replayable = replayable

    def _wake(self) -> None:
        """The shared store queued an event here from another replica's step: publish it once
        that step is done (one batch however many it queues)."""
        if not self._woken:
            self._woken = True
            asyncio.get_running_loop().call_soon(self._woken_flush)

    def _woken_flush(self) -> None:
        self._woken = False
        self.flush()

    def _announced(self, h: int) -> tuple[int | None, list[int]] | None:
        """Parent and token ids of block `h`, which this replica announced to the shared store
        (asked by a replica that loaded it); what is pending is published first."""
        got = self._tokens.known(h)
        if got is None:
            self.flush()
            got = self._tokens.known(h)
        return got

    def _from_store(self, h: int) -> tuple[int | None, list[int]] | None:
        tiers = self.cache.tiers
        owner = None if tiers is None or tiers.shared is None else tiers.shared.owner(h)
        if owner is None or owner is self._outbox or owner.tokens is None:
            return None
        return owner.tokens(h)

    def flush(self) -> None:
        """Publish what the engine did since the last flush as one batch (nothing: no batch)."""
        events, box = self.cache.events, self._outbox
        if events is None or self._pub is None:
            return
        if box is not None and box.events:  # after the engine's: BlockStored's tokens come first
            events = events + box.events
            box.events.clear()
        if not events:
            return
        self.cache.events = []
        if self.cache.tiers is not None:  # tier events with the tokens vLLM's self-describing ones carry
            events = self._tokens.expand(
                events, placeholders=self.options.tier_placeholders,
                lookup=self._from_store if self._outbox is not None else None)
        payload = encode_batch(events, self.options.encoding, self.cache.block_size, time.time())
        seq = self._seq
        self._seq += 1
        if self._drop > 0:
            self._drop -= 1
            self.dropped += 1
            if self._replayable:
                self._buffer.append((seq, payload))
            return
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:  # above the high-water mark: lost, as with vLLM
            self.dropped += 1

    def state(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
            "encoding": self.options.encoding, "topic": self.options.topic,
            "next_seq": self._seq, "published": self.published, "dropped": self.dropped,
            "drop_remaining": self._drop, "drop_replayable": self._replayable,
            "buffered": len(self._buffer), "buffer_steps": self.options.buffer_steps,
            "oldest_buffered_seq": self._buffer[0][0] if self._buffer else None,
            "replays": self.replays,
        }  # fmt: skip

    async def _serve_replay(self) -> None:
        """ROUTER: `[id, b"", start_seq(8B)]` in; each buffered batch from start_seq out, then
        the end marker seq -1. Map encoding adds the topic frame (vLLM >= 0.26)."""
        router = self._router
        assert router is not None
        topic = self.options.encoding == "map"
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid kv replay request: %d frames", len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays += 1
            head = [ident, b"", self._topic] if topic else [ident, b""]
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end_head = [ident, b"", b""] if topic else [ident, b""]
            await router.send_multipart([*end_head, END_SEQ, b""])


def _bind(sock: zmq.Socket[Any], host: str, port: int) -> int:
    sock.bind(f"tcp://{host}:{port or '*'}")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return int(endpoint.rsplit(b":", 1)[1])
