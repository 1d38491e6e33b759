"""The benchmark's request shapes: valid OpenAI bodies, repeats that share the engine's leading
tokens with their group's first request, determinism, and the simulator's rendering of them
(Qwen2.5-style tool calls and results; the ByteTokenizer's memo keeps its ids)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest

from bench.routing_workloads import TRACE, profile
from bench.shapes import SHAPES, ShapedRequest, to_sim_requests
from gateway.api.openai import parse_body
from simulator.des import SimRequest
from simulator.openai_api import parse_request
from simulator.tokenizer import ByteTokenizer, render_chatml

N = 60
SMALL_DOCS = {"docs": 5, "doc_tokens": (200, 400), "question_tokens": (5, 20)}
SMALL_PREFIX = {"k": 3, "prefix_tokens": (200, 400), "suffix_tokens": (5, 20)}
WHOLE = -1  # a repeat extends the previous request of its group, whole

# shape -> (params for a small run, tokens a repeat shares with its group's first at least)
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "system": ({"k": 3, "system_tokens": (200, 400), "user_tokens": (5, 20)}, 200),
    "doc_question": (SMALL_DOCS, 200),
    "text_parts": (SMALL_DOCS, 200),
    "multi_turn": (
        {"turns": 4, "system_tokens": 50, "user_tokens": (5, 20), "reply_tokens": 10},
        WHOLE,
    ),
    "agent": (
        {
            "turns": 4,
            "system_tokens": 50,
            "task_tokens": (5, 20),
            "result_tokens": (20, 60),
            "parallel": 0.5,
        },
        WHOLE,
    ),
    "completion_text": (SMALL_PREFIX, 200),
    "completion_ids": (SMALL_PREFIX, 200),
    "trace": ({"block_tokens": 32}, 32),  # every fixture record's first block is full
}
# {timestamp ms, input_length, output_length, hash_ids}; groups h0 (3), h4 (2), h8 (1)
RECORDS = [
    (0, 80, 5, [0, 1, 2]),
    (100, 90, 900, [0, 1, 3]),
    (250, 40, 7, [4, 5]),
    (300, 100, 3, [0, 1, 2, 6]),
    (700, 64, 2, [4, 7]),
    (1000, 10, 1, [8]),
]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + "\n"
        for t, n, o, ids in RECORDS
    ))  # fmt: skip
    return path


def build(name: str, seed: int, trace_file: Path) -> list[ShapedRequest]:
    params = dict(CASES[name][0])
    if name == "trace":
        params["path"] = trace_file
    return SHAPES[name](N, 5.0, seed, **params)


def common_prefix(a: Any, b: Any) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_every_shape_is_in_the_table() -> None:
    assert set(CASES) == set(SHAPES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bodies_are_what_clients_send_and_both_parsers_take_them(
    name: str, trace_file: Path
) -> None:
    shaped = build(name, 0, trace_file)
    assert shaped and len(shaped) == (len(RECORDS) if name == "trace" else N)
    assert [r.arrival_s for r in shaped] == sorted(r.arrival_s for r in shaped)
    tok = ByteTokenizer()
    for r in shaped:
        assert r.kind in ("chat", "completions")
        parsed = parse_body(r.kind, r.raw)  # type: ignore[arg-type]  # the gateway's parser
        assert parsed.body == r.body and parsed.model == "bench-model"
        assert parsed.stream and parsed.include_usage and parsed.max_tokens == r.body["max_tokens"]
        assert ("messages" in r.body) == (r.kind == "chat") != ("prompt" in r.body)
        engine = parse_request(r.body, tok, chat=r.kind == "chat")  # the simulator's HTTP path
        assert engine.max_tokens == r.body["max_tokens"] and len(engine.prompts) == 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_repeats_share_the_engine_prompt_of_their_groups_first(name: str, trace_file: Path) -> None:
    shaped = build(name, 0, trace_file)
    sims = to_sim_requests(shaped)
    firsts: dict[str, SimRequest] = {}
    last: dict[str, SimRequest] = {}
    repeats = 0
    for r, s in zip(shaped, sims, strict=True):
        assert r.first == (r.group not in firsts), r.group
        if r.first:
            firsts[r.group] = s
        else:
            repeats += 1
            head = firsts[r.group].prompt_tokens
            shared = common_prefix(head, s.prompt_tokens)
            if CASES[name][1] == WHOLE:  # the history resent: the previous prompt, extended
                prev = last[r.group].prompt_tokens
                assert common_prefix(prev, s.prompt_tokens) == len(prev) < len(s.prompt_tokens)
                assert shared == len(head)
            else:
                assert shared >= CASES[name][1], (r.group, shared)
        last[r.group] = s
    assert repeats and len(firsts) > 1
    assert 0 < profile(sims, 16).oracle_hit_ratio < 1  # the oracle, from routing_workloads


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_seed_gives_the_same_requests(name: str, trace_file: Path) -> None:
    def key(rs: list[ShapedRequest]) -> list[tuple[float, str, bytes, str, bool]]:
        return [(r.arrival_s, r.kind, r.raw, r.group, r.first) for r in rs]

    one = key(build(name, 1, trace_file))
    assert one == key(build(name, 1, trace_file))
    if name != "trace":  # the trace is the trace
        assert one != key(build(name, 2, trace_file))


@pytest.mark.parametrize("name", sorted(CASES))
def test_sim_requests_carry_the_engines_tokens_and_the_wire_body(
    name: str, trace_file: Path
) -> None:
    shaped = build(name, 0, trace_file)[:20]
    tok = ByteTokenizer()
    for r, s in zip(shaped, to_sim_requests(shaped, tok), strict=True):
        engine = parse_request(r.body, tok, chat=r.kind == "chat")
        assert list(s.prompt_tokens) == engine.prompts[0]
        assert s.arrival_s == r.arrival_s and s.max_tokens == r.body["max_tokens"]
        assert s.meta == {"kind": r.kind, "raw": r.raw, "body": r.body, "group": r.group,
                          "first": r.first}  # fmt: skip


def test_the_trace_keeps_lengths_blocks_and_rescales_arrivals(trace_file: Path) -> None:
    shaped = SHAPES["trace"](10, 2.0, 0, path=trace_file, block_tokens=32, max_output=100)
    tok = ByteTokenizer()
    for r, (_, n, out, ids) in zip(shaped, RECORDS, strict=True):
        content = r.body["messages"][0]["content"]
        assert len(tok.encode(content)) == n and r.group == f"h{ids[0]}"
        assert r.body["max_tokens"] == min(out, 100)
        assert content.count("\n") == n // 32  # one line per full hash-id block
    assert shaped[-1].arrival_s == pytest.approx((len(RECORDS) - 1) / 2.0)
    h0 = [tok.encode(r.body["messages"][0]["content"]) for r in shaped if r.group == "h0"]
    assert common_prefix(h0[0], h0[1]) == 64  # hash ids [0, 1, 2] and [0, 1, 3]: two blocks


@pytest.mark.skipif(not TRACE.is_file(), reason="the public trace is not beside the checkout")
def test_the_public_trace_renders_each_record_at_its_length() -> None:
    shaped = SHAPES["trace"](8, 1.0, 0)
    recs = [json.loads(line) for line in TRACE.read_text().splitlines()[:8]]
    tok = ByteTokenizer()
    for r, rec in zip(shaped, recs, strict=True):
        assert len(tok.encode(r.body["messages"][0]["content"])) == rec["input_length"]


# --- the simulator's rendering of these shapes ---------------------------------------------------
def reference_encode(text: str) -> list[int]:
    """ByteTokenizer.encode as it was before its memo: one crc32 per 4 bytes of each run."""
    import re

    specials = {"<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3}
    out: list[int] = []
    for part in re.split(r"(<\|endoftext\|>|<\|im_start\|>|<\|im_end\|>|\n)", text):
        if part in specials:
            out.append(specials[part])
        elif part:
            raw = part.encode()
            out.extend(16 + zlib.crc32(raw[i:i + 4]) % (151_936 - 16)
                       for i in range(0, len(raw), 4))  # fmt: skip
    return out


def test_the_memo_keeps_the_ids_exactly() -> None:
    texts = [
        "The quick brown fox jumps over the lazy dog",
        "é" * 10 + "\n\nnaïve 日本語 text\n",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "a<|endoftext|>b\n<|im_end|>",
        "",
        "\n",
    ]
    texts += [render_chatml(r.body["messages"]) for r in SHAPES["agent"](12, 5.0, 0, turns=3)]
    for memo in (1 << 22, 64, 0):  # the default; evicting all the time; too small to keep any
        tok = ByteTokenizer(memo_tokens=memo)
        for _ in range(3):  # cold, then from the memo
            for t in texts:
                assert tok.encode(t) == reference_encode(t)
        assert tok._memo_size <= memo


def test_tool_calls_and_results_render_as_qwen_does() -> None:
    calls = [
        {"id": "c1", "type": "function",
         "function": {"name": "search", "arguments": '{"query": "kv", "limit": 3}'}},
        {"id": "c2", "type": "function", "function": {"name": "read", "arguments": "{}"}},
    ]  # fmt: skip
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "find it"},
        {"role": "assistant", "content": "Looking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "r2"}]},
        {"role": "assistant", "content": None, "tool_calls": calls[1:]},
        {"role": "tool", "tool_call_id": "c2", "content": "r3"},
    ]
    assert render_chatml(messages) == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nfind it<|im_end|>\n"
        "<|im_start|>assistant\nLooking.\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "kv", "limit": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
        "<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "read", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # append-only, but for one tool message followed by another (they share one user block)
    for k in range(1, len(messages)):
        head = render_chatml(messages[:k], add_generation_prompt=False)
        assert render_chatml(messages).startswith(head) == (k != 4), k
    with pytest.raises(ValueError, match="JSON"):  # vLLM refuses arguments that are not JSON
        bad = {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
        render_chatml([{"role": "assistant", "tool_calls": [bad]}])


@pytest.mark.parametrize("name", ["agent", "multi_turn", "system"])
def test_chatml_matches_a_qwen25_template_on_the_chat_shapes(name: str) -> None:
    pytest.importorskip("jinja2")
    qwen = pytest.importorskip("tests.simulator.template_dirs").QWEN25
    from prefix_index.templates import ChatTemplate

    template = ChatTemplate(qwen, origin="qwen2.5")
    for r in SHAPES[name](12, 5.0, 0, **CASES[name][0]):  # each starts with a system message
        assert render_chatml(r.body["messages"]) == template.render(r.body["messages"])
