"""Rebuild, do not forget: what the Redis backend needs to refill Redis after it lost the index.

`Journal` keeps this gateway's most recent routed records (one per scope, replica and chain,
the newest last), bounded in writes and blocks, as the commands that wrote them. `EpochMarker`
is a token kept in Redis beside the index (one key, or a spread of keys on a Cluster so that
each shard holds some); a marker gone or changed means Redis lost the index since the last
look (FLUSHALL, a restart without persistence, a failover to an empty replica), and the
backend replays the journal. The first gateway to notice writes a new token (SET NX); the
others adopt it and replay theirs too.
"""

from __future__ import annotations

import secrets
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from prefix_index._writes import Write
from prefix_index.constants import epoch_key

_EXPIRY = 10  # index of the expiry (ms, 0: none) in a record command (see RedisIndex)
CLUSTER_MARKERS = 16  # marker keys on a Cluster, one per 1/16 of the slots


class Journal:
    """The last routed records of this gateway, oldest first; `replay` gives them as writes."""

    def __init__(self, max_writes: int, max_blocks: int) -> None:
        self._max_writes = max_writes
        self._max_blocks = max_blocks
        self._entries: OrderedDict[tuple[str, str, int], tuple[list[tuple[Any, ...]], int]] = (
            OrderedDict()
        )
        self.blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, scope: str, replica: str, hashes: Sequence[int], write: Write) -> None:
        if self._max_writes <= 0 or write.blocks > self._max_blocks:
            return
        key = (scope, replica, hashes[-1])  # a chain's last hash names the whole chain
        old = self._entries.pop(key, None)
        if old is not None:
            self.blocks -= old[1]
        self._entries[key] = (write.commands, write.blocks)
        self.blocks += write.blocks
        while len(self._entries) > self._max_writes or self.blocks > self._max_blocks:
            _, (_, blocks) = self._entries.popitem(last=False)
            self.blocks -= blocks

    def drop_chain(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        """Forget the records of `replica` in `scope` that hold an evicted block."""
        if not hashes or not self._entries:
            return
        cut = struct.pack(">Q", hashes[0])
        for key in [k for k in self._entries if k[0] == scope and k[1] == replica]:
            if any(_holds(c, cut) for c in self._entries[key][0]):
                self.blocks -= self._entries.pop(key)[1]

    def drop_replica(self, replica: str) -> None:
        for key in [k for k in self._entries if k[1] == replica]:
            self.blocks -= self._entries.pop(key)[1]

    def replay(self, now_ms: int) -> list[Write]:
        """Writes for the records whose entries have not expired yet, oldest first (so the
        newest end up the most recent in Redis' LRUs); expired records leave the journal."""
        out: list[Write] = []
        for key, (commands, blocks) in list(self._entries.items()):
            expiry = int(commands[0][_EXPIRY])
            if expiry and expiry <= now_ms:
                self.blocks -= self._entries.pop(key)[1]
                continue
            out.append(Write(list(commands), blocks=blocks))
        return out


def _holds(command: tuple[Any, ...], packed: bytes) -> bool:
    if command[0] != "EVALSHA" or len(command) <= 9 or not isinstance(command[9], bytes):
        return False
    blob = command[9]
    at = blob.find(packed)
    while at >= 0:
        if at % 8 == 0:
            return True
        at = blob.find(packed, at + 1)
    return False


def _marker_tags() -> list[str]:
    """Hash tags whose slots fall one in each 1/16 of the slot space."""
    width = REDIS_CLUSTER_HASH_SLOTS // CLUSTER_MARKERS
    tags: dict[int, str] = {}
    i = 0
    while len(tags) < CLUSTER_MARKERS:
        tag = f"e{i}"
        tags.setdefault(key_slot(tag.encode()) // width, tag)
        i += 1
    return [tags[k] for k in sorted(tags)]


class EpochMarker:
    """The namespace's marker keys (no TTL) and the token this gateway saw in them."""

    def __init__(self, namespace: str, cluster: bool) -> None:
        tags = _marker_tags() if cluster else [namespace]
        self.keys = [epoch_key(namespace, tag) for tag in tags]
        self.token: bytes | None = None

    async def check(self, client: Any, live: bool, remaining_ms: int | None) -> bool:
        """Whether Redis lost the index since the last check: the markers are gone or changed
        while this gateway has live entries (`live`; the newest expires in `remaining_ms`, None:
        never). The markers live as long as the newest entry of any gateway (PEXPIRE GT), so an
        abandoned namespace still disappears by itself. One round trip unless they need writing."""
        pipe = client.pipeline(transaction=False)
        for key in self.keys:
            pipe.get(key)
            if live and remaining_ms is not None:
                pipe.pexpire(key, remaining_ms, gt=True)
        replies = await pipe.execute()
        seen = replies[:: 2 if live and remaining_ms is not None else 1]
        if all(v is not None and v == (self.token or seen[0]) for v in seen):
            self.token = seen[0]
            return False
        if not live:  # nothing of this gateway's to lose, or to keep a marker for
            self.token = None
            return False
        had = self.token is not None
        # The first marker decides the token (SET NX); every gateway copies it to the others.
        await client.set(self.keys[0], secrets.token_hex(8), nx=True, px=remaining_ms)
        token = await client.get(self.keys[0])
        pipe = client.pipeline(transaction=False)
        for key in self.keys[1:]:
            pipe.set(key, token, px=remaining_ms)
        await pipe.execute()
        self.token = token
        return had
