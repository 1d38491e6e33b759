"""bench.overhead's chat bodies are what its docs and the hot-path issue say they are: about 2 KB
each, one shared system prompt, then a user turn of each body's own that reaches past the shared
blocks. Hashed through the gateway's own parse, prompt and router code (the default chunker), so
the blocks are the ones the gateway would route on. (They were 5.6 KB, and all 256 hashed to one
chain: the user turns differed only inside the partial last block.)"""

from __future__ import annotations

from bench.overhead import MODEL, chat_bodies
from gateway.api.kinds import PATHS
from gateway.routing.router import Router
from prefix_index.chunking import ByteChunker, scope_key


def test_the_bodies_are_2_kb_with_a_shared_prefix_and_blocks_of_their_own() -> None:
    bodies = chat_bodies(256, False, MODEL)
    kind = PATHS["/v1/chat/completions"]
    chunker = ByteChunker()
    router = Router(chunker, None)
    chains = []
    for raw in bodies:
        assert 1900 <= len(raw) <= 2100
        text = router.prompt(kind.parse(raw, b"application/json"), kind.prompt).text
        assert isinstance(text, str)
        chains.append(chunker.hash_text(scope_key(MODEL), text))
    assert len({tuple(c) for c in chains}) == len(bodies)  # every body a chain of its own
    shared = min(
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        for a, b in zip(chains, chains[1:], strict=False)
    )
    assert shared >= 10  # the system prompt is a shared prefix of several blocks...
    assert all(len(c) - shared >= 5 for c in chains)  # ...and each turn adds blocks of its own
