"""render_chat: shaped like an engine's prompt, append-only, content contiguous.

The property that matters: equal leading content (in the engine's rendering) gives equal
leading blocks in the gateway's chain, for every prompt shape; different scopes share nothing.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_index.chunking import ByteChunker, render_chat, scope_key

ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
PART = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, TEXT),
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, TEXT),
)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": st.one_of(st.none(), TEXT, st.lists(PART, max_size=3)),
        "name": TEXT,
        "tool_call_id": TEXT,
    },
)
CONVERSATION = st.lists(MESSAGE, max_size=6)
BLOCK = 64
CHUNKER = ByteChunker(BLOCK)
SCOPE = scope_key("m")


@settings(max_examples=200, deadline=None)
@given(CONVERSATION, CONVERSATION)
def test_earlier_turns_render_to_a_prefix(first: list[Any], later: list[Any]) -> None:
    assert render_chat(first + later).startswith(render_chat(first))


def doc(n: int, key: str = "d") -> str:
    return "".join(f"{key}{i:05d} lorem ipsum dolor. " for i in range(n))


DOC = doc(400)  # ~10 KB
CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


# (shape, a, b, shared): two prompts that an engine's template renders with a long common
# prefix, and the bytes of leading content they share (what the chains must share, in blocks).
SHAPES: list[tuple[str, list[Any], list[Any], int]] = [
    (
        "system message",
        [{"role": "system", "content": DOC}, user("question one?")],
        [{"role": "system", "content": DOC}, user("a different, longer question two?")],
        len(DOC),
    ),
    (
        "document + question in one user message",
        [user(DOC + "\nWhat is item 7?")],
        [user(DOC + "\nSummarise the whole thing, please, in three sentences.")],
        len(DOC),
    ),
    (
        "document as a text part, question as another",
        [user(parts(DOC, "What is item 7?"))],
        [user(parts(DOC, "Summarise the whole thing."))],
        len(DOC),
    ),
    (
        "text parts vs the same text joined by the engine's separator",
        [user(parts(DOC, "q?"))],
        [user(DOC + "\nq?")],
        len(DOC) + 3,
    ),
    (
        "growing history",
        [{"role": "system", "content": "be brief"}, user(DOC), {"role": "assistant", "content": "ok"}],
        [
            {"role": "system", "content": "be brief"},
            user(DOC),
            {"role": "assistant", "content": "ok"},
            user("and now?"),
        ],
        len(DOC) + 20,
    ),
    (
        "agent transcript: tool call, then a growing tool result",
        [user("find it"), {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": DOC}],
        [user("find it"), {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": DOC + " and more results"}],
        len(DOC) + 40,
    ),
    (
        "image then text: the same image, different questions",
        [user([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 9000}},
               {"type": "text", "text": DOC + " first?"}])],
        [user([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 9000}},
               {"type": "text", "text": DOC + " second, longer question?"}])],
        len(DOC),
    ),
]


def common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize(("shape", "a", "b", "shared"), SHAPES, ids=[s[0] for s in SHAPES])
def test_shared_leading_content_gives_shared_leading_blocks(
    shape: str, a: list[Any], b: list[Any], shared: int
) -> None:
    ha = CHUNKER.hash_text(SCOPE, render_chat(a))
    hb = CHUNKER.hash_text(SCOPE, render_chat(b))
    # everything before the point where the two prompts differ, less the partial block
    assert common_blocks(ha, hb) >= shared // BLOCK - 1, shape


@pytest.mark.parametrize(("shape", "a", "b", "shared"), SHAPES, ids=[s[0] for s in SHAPES])
def test_different_scopes_share_nothing(shape: str, a: list[Any], b: list[Any], shared: int) -> None:
    text = render_chat(a)
    chains = [
        CHUNKER.hash_text(scope_key("m"), text),
        CHUNKER.hash_text(scope_key("other-model"), text),
        CHUNKER.hash_text(scope_key("m", lora="adapter"), text),
        CHUNKER.hash_text(scope_key("m", salt="tenant-a"), text),
        CHUNKER.hash_text(scope_key("m", salt="tenant-b"), text),
    ]
    seen = [set(c) for c in chains]
    for i in range(len(seen)):
        for j in range(i + 1, len(seen)):
            assert not seen[i] & seen[j], (shape, i, j)


def test_content_starts_right_after_the_role_marker() -> None:
    """The offset of a message's content depends on its role (and name) only, never on the
    content's length: the defect a length prefix caused."""
    short = render_chat([user("x" * 10)])
    long = render_chat([user("x" * 10_000)])
    assert short.index("x") == long.index("x")
    assert render_chat([user(DOC + "A")])[:-10].startswith(render_chat([user(DOC)])[:-10])


def test_different_conversations_render_differently() -> None:
    base = [user("x")]
    assert render_chat(base) != render_chat([{"role": "system", "content": "x"}])
    assert render_chat(base) != render_chat([{"role": "user", "name": "bob", "content": "x"}])
    assert render_chat(base) != render_chat([{"role": "user", "content": "x", "weight": 0}])
    assert render_chat(base) == render_chat([{"role": "user", "content": "x", "refusal": None}])
    assert render_chat([user("hello")]) == render_chat([user(parts("hello"))])
    assert render_chat([user(parts("hel", "lo"))]) != render_chat([user("hello")])
    assert render_chat([user("a"), user("b")]) != render_chat([user("a\nb")])


def test_images_become_stable_digests() -> None:
    big = "data:image/png;base64," + "A" * 100_000

    def msg(url: str, detail: str = "auto") -> list[dict[str, Any]]:
        part = {"type": "image_url", "image_url": {"url": url, "detail": detail}}
        return [user([{"type": "text", "text": "what is this?"}, part])]

    rendered = render_chat(msg(big))
    assert len(rendered) < 200  # the image is a digest, not its bytes
    assert rendered == render_chat(msg(big))
    assert rendered != render_chat(msg(big + "B"))
    assert rendered != render_chat(msg(big, detail="high"))
    reordered = [
        user(
            [
                {"type": "text", "text": "what is this?"},
                {"image_url": {"detail": "auto", "url": big}, "type": "image_url"},
            ]
        )
    ]
    assert render_chat(reordered) == rendered  # key order does not matter


def test_tool_calls_and_tool_results_are_part_of_the_prefix() -> None:
    def call(arguments: str, call_id: str = "call_1") -> list[dict[str, Any]]:
        c = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return [
            user("weather?"),
            {"role": "assistant", "content": None, "tool_calls": [c]},
            {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
        ]

    a = render_chat(call('{"city": "Paris"}'))
    assert a == render_chat(call('{"city": "Paris"}'))
    assert a != render_chat(call('{"city": "Rome"}'))
    assert "get_weather" in a and "call_1" in a
    assert render_chat(call('{"city": "Paris"}', "call_2")) != a


def test_odd_shapes_render_without_raising() -> None:
    odd: list[Any] = [
        {"role": "user", "content": {"not": "a list"}},
        {"role": "assistant", "tool_calls": {"odd": True}},
        {"role": 3, "content": [7, {"type": "input_audio", "input_audio": {"data": "QUJD"}}]},
        {"content": b"bytes"},
        "not a message",
    ]
    assert render_chat(odd) == render_chat(odd)
    assert render_chat([]) == ""


@settings(max_examples=200, deadline=None)
@given(st.lists(MESSAGE, max_size=5))
def test_the_plain_text_message_shortcut_renders_what_the_general_path_does(
    messages: list[dict[str, Any]],
) -> None:
    # a read-only mapping is not a dict: it always takes the general path
    assert render_chat(messages) == render_chat([MappingProxyType(m) for m in messages])
