"""The gateway's memory of which replica holds which KV blocks: chunking, hashing, backends.

Pure data structures and a Redis client; nothing here speaks HTTP or imports the gateway.
"""

from __future__ import annotations

from prefix_index.base import EngineEventSink, IndexStats, PrefixIndex
from prefix_index.chunking import (
    ByteChunker,
    Chunker,
    TokenChunker,
    make_chunker,
    render_chat,
    scope_key,
)
from prefix_index.events import EngineBlockMap, KvEventApplier, decode_batch
from prefix_index.factory import open_index
from prefix_index.memory import MemoryIndex
from prefix_index.redis import RedisIndex, RedisTuning

__all__ = [
    "ByteChunker",
    "Chunker",
    "EngineBlockMap",
    "EngineEventSink",
    "IndexStats",
    "KvEventApplier",
    "MemoryIndex",
    "PrefixIndex",
    "RedisIndex",
    "RedisTuning",
    "TokenChunker",
    "decode_batch",
    "make_chunker",
    "open_index",
    "render_chat",
    "scope_key",
]
