"""Precise prefix learning: subscribe to each replica's KV cache events (ZMQ) and feed the index.

One subscriber per replica with `kv_events` set: it tracks sequence numbers, fills gaps from the
replica's replay socket, and forgets the replica when the engine restarts or a gap cannot be
filled. `check_parity` compares the gateway's token ids with the engine's (`/tokenize`).

While a subscriber is not caught up (its catch-up replay timed out, or it died), the index
holds the replica's blocks as stale: it leaves precise mode, so routing learns from its own
decisions as for a replica without KV events (routed entries live `index.ttl_s`, not
`routed_ttl_s`), and a dead subscriber's engine-reported entries are dropped (no eviction would
reach them). The replay is asked again every REPLAY_RETRY_S, a dead subscriber starts again
after RESTART_S (doubling up to RESTART_MAX_S); caught up, the replica is precise again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.transport.control import ControlClient, post_json
from prefix_index.chunking import scope_key
from prefix_index.events import EventDecodeError, KvEventApplier, decode_batch

log = logging.getLogger("gateway.kv_subscriber")

POLL_MS = 250
REPLAY_TIMEOUT_MS = 2000
REPLAY_RETRY_S = 10.0  # a catch-up replay that timed out is asked again this often
RESTART_S = 1.0  # a subscriber that died starts again after this, doubling up to RESTART_MAX_S
RESTART_MAX_S = 30.0
_END = (1 << 64) - 1  # the replay stream's end marker: seq -1 as 8 unsigned bytes
PARITY_PROBE = (
    "The quick brown fox jumps over the lazy dog. Prefix caching saves prefill: "
    "1234567890 \u00e9\u00e8\u00fc \u4f60\u597d"
)
# the chat probe: a system message, two turns; checks the chat template, not only the tokenizer
PARITY_CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": PARITY_PROBE},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "And the second question?"},
]


@dataclass(slots=True)
class SubscriberStats:
    received: int = 0
    applied: int = 0
    dropped: int = 0  # batches that could not be decoded
    gaps: int = 0
    replays: int = 0
    replayed: int = 0
    forgets: int = 0
    restarts: int = 0
    duplicates: int = 0  # batches the replay had given already (live ones that overlapped it)
    last_seq: int | None = None
    connected: bool = False
    # live, and the catch-up replay is done: the index holds what the engine said (else the
    # replica's blocks are stale: see the module's docstring)
    caught_up: bool = False
    deaths: int = 0  # the subscriber failed and was started again
    extra: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class KvEventSubscriber:
    """One replica's KV events: the live stream from `pub_url`, after a replay of what was
    published before it joined (`replay_url`), applied to the index (`applier`)."""

    replica: str
    pub_url: str
    replay_url: str | None
    applier: KvEventApplier
    ctx: Any  # the zmq.asyncio.Context the sockets are made in
    stats: SubscriberStats = field(default_factory=SubscriberStats, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    # the start-up replay's last sequence number; live batches up to it repeat it
    _replayed_to: int | None = field(default=None, init=False, repr=False)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events:{self.replica}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        """Subscribe until stopped; a subscriber that fails (never taking the gateway down)
        leaves the replica's blocks stale and starts again after a pause."""
        loop = asyncio.get_running_loop()
        pause = RESTART_S
        while True:
            began = loop.time()
            try:
                await self._subscribe()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.stats.deaths += 1
                log.exception(
                    "replica %s: KV event subscriber stopped; its blocks are stale (routing "
                    "learns from its own decisions) until it starts again in %.0f s",
                    self.replica,
                    pause,
                )
            await self._stale(dead=True)
            if loop.time() - began > RESTART_MAX_S:
                pause = RESTART_S  # it ran a good while: this is a new failure, not a loop
            await asyncio.sleep(pause)
            pause = min(pause * 2, RESTART_MAX_S)

    async def _subscribe(self) -> None:
        import zmq

        loop = asyncio.get_running_loop()
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.pub_url)
        self.stats.connected = True
        try:
            # a new subscriber misses what was published before it joined: catch up from the start
            retry_at = await self._catch_up(loop.time())
            while True:
                if retry_at is not None and loop.time() >= retry_at:
                    retry_at = await self._catch_up(loop.time())
                if not await sub.poll(POLL_MS):  # poll, then a non-blocking receive: no lost frames
                    continue
                frames = await sub.recv_multipart(zmq.NOBLOCK)
                await self._handle(frames)
        finally:
            self.stats.connected = self.stats.caught_up = False
            sub.close(0)

    async def _catch_up(self, now: float) -> float | None:
        """Replay what the engine published from the start; None when caught up, else when to
        ask again (the replay timed out: the replica's blocks are stale meanwhile)."""
        if self.replay_url is None:
            self._fresh()
            return None
        if self.stats.last_seq is not None:  # a retry: the replay gives every block again
            await self._reset_engine()
        done = await self._replay(0, None)
        # batches published while the replay ran also sit in the SUB socket: seen ones
        self._replayed_to = self.stats.last_seq
        if done:
            self._fresh()
            return None
        log.warning(
            "replica %s: the KV event replay at %s did not answer within %d ms; its blocks are "
            "stale (routing learns from its own decisions) until a replay answers (next in %.0f s)",
            self.replica, self.replay_url, REPLAY_TIMEOUT_MS, REPLAY_RETRY_S,
        )  # fmt: skip
        await self._stale(dead=False)
        return now + REPLAY_RETRY_S

    def _fresh(self) -> None:
        """Caught up: the index takes the engine's word for the replica again."""
        self.stats.caught_up = True
        self.applier.index.set_precise(self.replica, True)

    async def _stale(self, dead: bool) -> None:
        """Not caught up: the replica is routed as one without KV events; a dead stream's
        engine-reported entries go (nothing would evict them), a live one's stay current."""
        self.stats.caught_up = False
        self.applier.index.set_precise(self.replica, False)
        if dead:
            await self._reset_engine()

    async def _reset_engine(self) -> None:
        """Forget what the engine reported (and the sequence), keep what routing taught."""
        self.stats.last_seq = None
        self.applier.blocks.clear()
        self.applier.tier_blocks.clear()
        await self.applier.index.forget_engine(self.replica)

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self.stats.dropped += 1
            return
        seq, payload = int.from_bytes(frames[-2], "big"), frames[-1]
        self.stats.received += 1
        last = self.stats.last_seq
        replayed, self._replayed_to = self._replayed_to, None
        if last is not None and seq <= last and (
            seq == last or (replayed is not None and seq <= replayed)
        ):
            # the replay gave it already (vLLM publishes a sequence number once; only a restart
            # starts again from 0): a duplicate, not a restart
            self.stats.duplicates += 1
            self._replayed_to = replayed
            return
        if last is not None and seq <= last:
            self.stats.restarts += 1
            log.warning(
                "replica %s: KV event sequence went back (%d after %d): engine restarted, forgetting it",
                self.replica,
                seq,
                last,
            )
            await self._forget()
        elif last is not None and seq > last + 1:
            self.stats.gaps += 1
            if not await self._replay(last + 1, seq):
                log.warning(
                    "replica %s: KV events %d..%d lost and not replayable: forgetting it",
                    self.replica,
                    last + 1,
                    seq - 1,
                )
                await self._forget()
        await self._apply(seq, payload)

    async def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventDecodeError:
            self.stats.dropped += 1
        else:
            await self.applier.apply(batch)
            self.stats.applied += 1
        self.stats.last_seq = seq

    async def _forget(self) -> None:
        self.stats.forgets += 1
        self.stats.last_seq = None
        await self.applier.reset()

    async def _replay(self, start: int, until: int | None) -> bool:
        """Ask the replay socket for batches from `start`; True when everything before `until` came."""
        if self.replay_url is None:
            return False
        import zmq

        self.stats.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_url)
        got_to = start - 1
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT_MS):
                    return False
                frames = await dealer.recv_multipart(zmq.NOBLOCK)
                # [b"", (topic,) seq, payload]; the end marker has seq -1 and an empty payload
                if len(frames) < 3 or len(frames[-2]) != 8:
                    continue
                seq = int.from_bytes(frames[-2], "big")
                if seq == _END:
                    break
                if until is not None and seq >= until:
                    continue
                if self.stats.last_seq is not None and seq <= self.stats.last_seq:
                    continue  # already applied
                self.stats.replayed += 1
                await self._apply(seq, frames[-1])
                got_to = seq
        finally:
            dealer.close(0)
        return until is None or got_to >= until - 1


class KvEvents:
    """All subscribers of one gateway, sharing one ZMQ context (no global one)."""

    def __init__(self) -> None:
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self._ctx: Any = None

    def add(
        self,
        replica: str,
        pub_url: str,
        replay_url: str | None,
        index: Any,
        chunker: Any,
        model: str | None,
    ) -> None:
        import zmq.asyncio

        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        index.set_precise(replica)
        applier = KvEventApplier(index, chunker, _scopes(model), replica)
        sub = KvEventSubscriber(replica, pub_url, replay_url, applier, self._ctx)
        self.subscribers[replica] = sub
        sub.start()

    async def remove(self, replica: str) -> None:
        sub = self.subscribers.pop(replica, None)
        if sub is not None:
            await sub.stop()

    async def aclose(self) -> None:
        for name in list(self.subscribers):
            await self.remove(name)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


def _scopes(model: str | None) -> Callable[[str | None], str | None]:
    """An event's LoRA name to the scope requests for it hash under (the model a client names)."""

    def scope_for(lora_name: str | None) -> str | None:
        if lora_name:
            return scope_key(lora_name)
        return scope_key(model) if model else None

    return scope_for


async def check_parity(
    client: ControlClient, url: str, model: str | None, chunker: Any
) -> bool | None:
    """Does the engine tokenize as the gateway does? A completion probe against
    `chunker.encode`, then a chat probe against `chunker.chat_prompt` (the chat template).
    None when the replica cannot say; a replica that tokenizes no chats is judged on the first."""
    text = await _tokenize(client, url, model, {"prompt": PARITY_PROBE})
    if text is None:
        return None
    if text != list(chunker.encode(PARITY_PROBE)):
        return False
    chat = await _tokenize(
        client, url, model, {"messages": PARITY_CHAT, "add_generation_prompt": True}
    )
    return True if chat is None else chat == list(chunker.chat_prompt(PARITY_CHAT))


async def _tokenize(
    client: ControlClient, url: str, model: str | None, body: dict[str, Any]
) -> list[int] | None:
    """The engine's token ids for `body` (`/tokenize`); None when it cannot say."""
    if model:
        body = {**body, "model": model}
    data = await post_json(client, url + "/tokenize", body, timeout_s=5)
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list):
        return None
    return [int(t) for t in tokens]
