"""Defaults and the Redis key layout of the prefix index, stated once.

Every Redis key the index touches is built here; docs/prefix_index.md draws the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

DEFAULT_CAPACITY_BLOCKS = 200_000  # per replica (and scope), unless set_capacity says otherwise
# The bound on the whole index: entries (a block one replica holds in one scope) over every
# scope and replica, each scope also counting SCOPE_COST_BLOCKS for its own bookkeeping. Past
# it the least recently recorded scopes lose entries first. Measured (tracemalloc, CPython
# 3.11; MEMORY USAGE and INFO memory, Redis 7.0): the memory backend takes ~160 B per entry
# (~105 B per further replica of a block) and ~1.2 KB per scope, so the default holds it near
# 300 MB; Redis ~240-310 B per entry (~170 B with four replicas a block), ~450 B per scope.
DEFAULT_MAX_BLOCKS = 2_000_000
SCOPE_COST_BLOCKS = 8
DEFAULT_BLOCK_BYTES = 64  # bytes mode: about 16 tokens of English
DEFAULT_BLOCK_SIZE = 16  # tokens mode: vLLM's default block size
DEFAULT_REDIS_TTL_S = 600.0
DEFAULT_NAMESPACE = "kvgw"
DEFAULT_LOCAL_CACHE_S = 0.05
DEFAULT_ROUTED_TTL_S = 10.0  # precise mode: a routing decision bridges until the engine reports
DEFAULT_ENGINE_CAPACITY_BLOCKS = 1_000_000  # precise mode: engine-reported blocks per replica
#                                             and scope (a safety cap; the engine evicts itself)

# Redis key layout. `{...}` is the Redis Cluster hash tag: every key of one scope shares it, so
# one Lua call (match, record, evict, forget) only ever touches one slot.
#   <ns>:{<sid>}:b<8 raw bytes>   HASH   replica -> expiry (ms, client clock; "0" = never)
#   <ns>:{<sid>}:l:<replica>      ZSET   block hash (8 raw bytes) -> recency sequence (LRU)
#   <ns>:{<sid>}:h:<replica>      ZSET   explicitly evicted block -> expiry of what it cut off
#   <ns>:{<sid>}:holey            SET    replicas whose `h:` set is not empty
#   <ns>:{<sid>}:seq              STRING recency counter of the scope
#   <ns>:rs:<replica>             SET    sids the replica holds blocks in (for forget)
#   <ns>:replicas                 SET    replica names (for stats, forget and trimming)
#   <ns>:{<ns>}:scopes            ZSET   sid -> last record (ms, client clock): the scope LRU
#   <ns>:{<ns>}:sizes             HASH   sid -> entries; "#" -> load (entries + scope costs),
#                                        "#evicted" -> entries the bound pushed out
#   <ns>:{<ns>}:epoch             STRING a token, no TTL: gone or changed = Redis lost the index
#                                        (on a Cluster 16 keys <ns>:{e<i>}:epoch, spread over
#                                        the slots so every shard holds some; prefix_index/_rebuild.py)
# With a TTL every key expires (PEXPIRE, refreshed by each write): an abandoned scope, replica
# or namespace disappears by itself.
KEY_BLOCK = "b"
KEY_LRU = "l:"
KEY_HOLES = "h:"
KEY_HOLEY = "holey"
KEY_SEQ = "seq"
KEY_REPLICA_SCOPES = "rs:"
KEY_REPLICAS = "replicas"
KEY_SCOPES = "scopes"
KEY_SIZES = "sizes"
KEY_EPOCH = "epoch"
SIZES_LOAD = "#"
SIZES_EVICTED = "#evicted"


def scope_id(scope: str) -> str:
    """A short stable id for a scope string: 16 hex digits, safe inside a hash tag."""
    return xxhash.xxh3_64_hexdigest(scope.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class ScopeKeys:
    """The key names of one scope in one namespace (all in one Redis Cluster slot)."""

    prefix: bytes  # b"<ns>:{<sid>}:"; block, LRU and hole keys append to it inside Lua
    seq: bytes  # the key passed as KEYS[1], so a cluster client routes the call to the slot
    sid: str

    @classmethod
    def of(cls, namespace: str, scope: str) -> ScopeKeys:
        return cls.from_sid(namespace, scope_id(scope))

    @classmethod
    def from_sid(cls, namespace: str, sid: str) -> ScopeKeys:
        prefix = f"{namespace}:{{{sid}}}:".encode()
        return cls(prefix=prefix, seq=prefix + KEY_SEQ.encode(), sid=sid)

    def lru(self, replica: str) -> bytes:
        return self.prefix + KEY_LRU.encode() + replica.encode("utf-8")

    def block(self, block_hash: int) -> bytes:
        return self.prefix + KEY_BLOCK.encode() + block_hash.to_bytes(8, "big")


def replica_scopes_key(namespace: str, replica: str) -> str:
    return f"{namespace}:{KEY_REPLICA_SCOPES}{replica}"


def replicas_key(namespace: str) -> str:
    return f"{namespace}:{KEY_REPLICAS}"


def scopes_key(namespace: str) -> str:
    return f"{namespace}:{{{namespace}}}:{KEY_SCOPES}"


def sizes_key(namespace: str) -> str:
    return f"{namespace}:{{{namespace}}}:{KEY_SIZES}"


def epoch_key(namespace: str, tag: str) -> str:
    return f"{namespace}:{{{tag}}}:{KEY_EPOCH}"


def sid_of_prefix(prefix: bytes) -> str:
    """The sid inside a scope's key prefix (b"<ns>:{<sid>}:")."""
    return prefix[prefix.index(b"{") + 1 : prefix.index(b"}")].decode()
