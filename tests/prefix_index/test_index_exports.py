"""The package's public surface, pinned (a change here is an API change for the gateway)."""

from __future__ import annotations

import inspect

import prefix_index
from prefix_index import chunking


def test_the_public_surface_is_pinned() -> None:
    assert sorted(prefix_index.__all__) == [
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
    for name in prefix_index.__all__:
        assert getattr(prefix_index, name) is not None
    for name in (
        "scope_key",
        "render_chat",
        "Chunker",
        "ByteChunker",
        "TokenChunker",
        "make_chunker",
    ):
        assert getattr(chunking, name) is getattr(prefix_index, name)


def test_backends_keep_the_protocol_signatures() -> None:
    for backend in (prefix_index.MemoryIndex, prefix_index.RedisIndex):
        for method in ("match", "record", "evict", "forget", "aclose", "stats"):
            assert inspect.iscoroutinefunction(getattr(backend, method)), (backend, method)
        want = inspect.signature(prefix_index.PrefixIndex.match).parameters
        assert list(inspect.signature(backend.match).parameters) == list(want)
