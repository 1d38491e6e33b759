"""Resume a half-sent streamed answer on another replica (issue 41; docs/resume.md).

When a replica fails after the first byte reached the client (the connection reset or closed, a
truncated or malformed stream, an error event mid-stream, the idle timeout) or is drained, the
answer goes on elsewhere: a `/v1/completions` request whose prompt is the prompt's token ids
plus the ids already relayed (`IdsTap`'s ledger), `max_tokens` less what was sent, the same
sampling fields. It is routed like any request (the replicas holding the prompt's prefix first,
the failed one excluded), and its chunks are rewritten into the original's shape (chat deltas or
completions text; the same id, created and model; usage counting each token once). Without ids
(an engine that did not send them) a chat answer continues from its text
(`continue_final_message`), counted inexact. What cannot be continued exactly ends with one
OpenAI-shaped error event (`not_resumable`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.api.openai import ParsedRequest
from gateway.api.streams import StreamTap
from gateway.api.token_tap import IdsTap, Ledger
from gateway.config import ResumeConfig
from gateway.errors import GatewayError, UpstreamTimeout
from gateway.forwarding.outbound import Forwarded, Links, Outbound
from gateway.forwarding.relay import (
    Opened,
    Retryable,
    attempt_outcome,
    open_upstream,
    read_stream,
)
from gateway.routing.router import Dispatch, Routing
from gateway.telemetry.trace import RESUMED
from gateway.transport.response import UpstreamResponse
from gateway.transport.writer import ResponseWriter

if TYPE_CHECKING:
    from gateway.fleet.pools import Pool
    from gateway.fleet.replicas import ReplicaState

# sampling fields a continuation carries over as they are (vLLM's and SGLang's names)
CARRIED = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "logit_bias", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "bad_words", "allowed_token_ids", "cache_salt", "priority",
    "user", "vllm_xargs", "lora_request",
)  # fmt: skip
# request fields whose answers a continuation cannot reproduce, and why (docs/resume.md)
REFUSED = (
    ("n", "n > 1: several choices"),
    ("best_of", "best_of"),
    ("echo", "echo"),
    ("logprobs", "logprobs"),
    ("top_logprobs", "logprobs"),
    ("prompt_logprobs", "logprobs"),
    ("response_format", "structured output"),
    ("guided_json", "structured output"),
    ("guided_regex", "structured output"),
    ("guided_choice", "structured output"),
    ("guided_grammar", "structured output"),
    ("structured_outputs", "structured output"),
    ("json_schema", "structured output"),
    ("regex", "structured output"),
    ("ebnf", "structured output"),
    ("tools", "tool calls"),
    ("functions", "tool calls"),
    ("frequency_penalty", "frequency/presence penalty"),
    ("presence_penalty", "frequency/presence penalty"),
    ("suffix", "suffix"),
)
_REFUSED_KEYS = frozenset(key for key, _ in REFUSED)
_TRIVIAL: dict[str, Any] = {"n": 1, "best_of": 1, "echo": False, "logprobs": False,
                            "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0,
                            "tools": [], "response_format": {"type": "text"}}  # fmt: skip
REASONS = {
    "n": "n > 1: several choices",
    "logprobs": "logprobs",
    "tool_calls": "tool calls",
    "reasoning": "a reasoning model's thinking",
}


def refused(req: ParsedRequest) -> str | None:
    """Why `req`'s answer cannot be continued exactly, from the request alone (None: it can)."""
    body = req.body
    if req.kind not in ("chat", "completions"):
        return f"a {req.kind} answer"
    if req.kind == "completions" and isinstance(req.prompt, list) and req.prompt \
            and isinstance(req.prompt[0], (str, list)) and len(req.prompt) > 1:  # fmt: skip
        return "a batch of prompts"
    if _REFUSED_KEYS.isdisjoint(body):  # the usual request: none of them set
        return _thinking(body)
    for key, why in REFUSED:
        v = body.get(key)
        if v is None or v is False or (key in _TRIVIAL and v == _TRIVIAL[key]):
            continue
        if key == "tools" and body.get("tool_choice") == "none":
            continue
        return why
    return _thinking(body)


def _thinking(body: dict[str, Any]) -> str | None:
    if body.get("chat_template_kwargs", {}).get("enable_thinking") is True:
        return "a reasoning model's thinking"
    return None


def wants_ids(req: ParsedRequest, engine: str) -> bool:
    """Whether the gateway asks this request's engine for token ids (`return_token_ids`): vLLM's
    chat and completions streams, SGLang's completions (its chat refuses the field streamed)."""
    if req.kind == "completions":
        return True
    return req.kind == "chat" and engine == "vllm"


def with_ids(raw: bytes, body: dict[str, Any]) -> bytes:
    """The body with `return_token_ids: true` (spliced in before the last brace)."""
    if body.get("return_token_ids") is True:
        return raw
    end = raw.rstrip()
    if end.endswith(b"}"):
        head = end[:-1].rstrip()
        sep = b"" if head.endswith(b"{") else b","
        return head + sep + b'"return_token_ids":true}'
    return orjson.dumps({**body, "return_token_ids": True})


@dataclass(slots=True)
class Continuation:
    path: bytes
    body: bytes
    offset: int  # tokens already relayed
    exact: bool  # by token ids (else from the text)


def continuation(
    req: ParsedRequest, sent: dict[str, Any], ledger: Ledger, bound: int | None
) -> Continuation | None:
    """The request that continues `ledger`'s answer (`sent`: the body as first sent on, gateway
    fields set); None when nothing is left to generate. `bound`: max_tokens for a request
    that set none (the engine's context left after the prompt)."""
    body = sent
    left: int | None = None
    if req.max_tokens is not None:
        left = req.max_tokens - ledger.offset if ledger.exact else req.max_tokens - ledger.chunks
        if left <= 0:
            return None
    elif bound:
        left = bound
    out: dict[str, Any] = {k: body[k] for k in CARRIED if k in body}
    if "model" in body:
        out["model"] = body["model"]
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        out["min_tokens"] = max(0, min_tokens - ledger.offset)
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    if left is not None:
        out["max_tokens"] = left
    if ledger.exact:
        assert ledger.prompt_ids is not None
        out["prompt"] = [*ledger.prompt_ids, *ledger.ids]
        out["return_token_ids"] = True
        return Continuation(b"/v1/completions", orjson.dumps(out), ledger.offset, True)
    text = "".join(ledger.text)
    if req.kind == "chat":
        for key in ("messages", "chat_template", "chat_template_kwargs", "add_special_tokens"):
            if key in body:
                out[key] = body[key]
        out["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
        return Continuation(b"/v1/chat/completions", orjson.dumps(out), ledger.chunks, False)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return None
    out["prompt"] = prompt + text
    return Continuation(b"/v1/completions", orjson.dumps(out), ledger.chunks, False)


_BLANK = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class Reshaper:
    """A continuation's events rewritten into the original answer's shape, appended to its
    ledger (the ids relayed, the text, the finish): what goes to the client is
    `feed(chunk)`'s bytes; the continuation's usage is folded into the original's."""

    def __init__(self, ledger: Ledger, exact: bool, prompt_tokens: int | None) -> None:
        self.ledger = ledger
        self.exact = exact
        self.prompt_tokens = prompt_tokens  # the original prompt's (None: from the ledger)
        self.base = ledger.offset if exact else ledger.chunks  # tokens before this continuation
        self.tap = StreamTap(strip_usage=False)  # checks the events, keeps a partial one back
        self.usage: dict[str, Any] | None = None
        self.tokens = 0  # tokens this continuation relayed

    @property
    def broken(self) -> str | None:
        return self.tap.broken

    @property
    def done(self) -> bool:
        return self.tap.done

    def discard(self) -> bool:
        return self.tap.discard()

    def feed(self, chunk: bytes) -> bytes:
        whole = self.tap.feed(chunk)
        if not whole:
            return b""
        out: list[bytes] = []
        for event in _BLANK.split(whole):
            event = event.strip()
            if not event.startswith(b"data:"):
                continue
            data = event[5:].strip()
            if data == b"[DONE]":
                out.append(self._end())
                break
            obj = orjson.loads(data)
            if "error" in obj and "choices" not in obj:
                self.tap.broken = "an error event"
                break
            out.append(self._event(obj))
        return b"".join(out)

    def _event(self, obj: dict[str, Any]) -> bytes:
        ledger = self.ledger
        choices = obj.get("choices") or []
        if not choices:
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            return b""
        choice = choices[0]
        if ledger.chat and not self.exact:
            delta = choice.get("delta") or {}
            piece = delta.get("content")
            if "role" in delta and not delta.get("content"):
                return b""  # the continuation's own role chunk: the client had one
        else:
            piece = choice.get("text")
        ids = choice.get("token_ids")
        ledger.add(piece, ids, choice)
        self.tokens += len(ids) if isinstance(ids, list) else 1 if piece else 0
        reason = choice.get("finish_reason")
        shaped: dict[str, Any] = dict(ledger.template)
        if ledger.chat:
            shaped["object"] = "chat.completion.chunk"
            c: dict[str, Any] = {"index": 0, "delta": {"content": piece or ""}, "logprobs": None,
                                 "finish_reason": reason}  # fmt: skip
        else:
            shaped["object"] = "text_completion"
            c = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
        if reason is not None:
            c["stop_reason"] = choice.get("stop_reason")
        if ledger.asked_ids and isinstance(ids, list):
            c["token_ids"] = ids
        shaped["choices"] = [c]
        return b"data: " + orjson.dumps(shaped) + b"\n\n"

    def folded_usage(self) -> dict[str, Any] | None:
        """The answer's usage: the original prompt once, every completion token once."""
        if self.usage is None:
            return None
        ledger = self.ledger
        prompt = self.prompt_tokens
        if prompt is None:
            prompt = len(ledger.prompt_ids) if ledger.prompt_ids is not None else None
        if prompt is None:
            prompt = int(self.usage.get("prompt_tokens", 0)) - self.base
        completion = self.base + int(self.usage.get("completion_tokens", self.tokens))
        use: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                               "completion_tokens": completion}  # fmt: skip
        details = self.usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            use["prompt_tokens_details"] = {"cached_tokens": min(prompt, details["cached_tokens"])}
        return use

    def _end(self) -> bytes:
        """The usage chunk (when the client asked) and `[DONE]`."""
        return finish_bytes(self.ledger, self.folded_usage())


def finish_bytes(ledger: Ledger, usage: dict[str, Any] | None) -> bytes:
    out = b""
    ledger.usage = usage if usage is not None else ledger.usage
    if ledger.include_usage and ledger.usage is not None:
        shaped = dict(ledger.template)
        shaped["object"] = "chat.completion.chunk" if ledger.chat else "text_completion"
        shaped["choices"] = []
        shaped["usage"] = ledger.usage
        out = b"data: " + orjson.dumps(shaped) + b"\n\n"
    return out + b"data: [DONE]\n\n"


# --- the resume itself ---------------------------------------------------------------------------
class StreamResume:
    """One streamed request's resume: its ledger and tap, the replica it streams from now (told
    to hand over when that replica drains), the attempts left."""

    def __init__(self, cfg: ResumeConfig, req: ParsedRequest, asked_ids: bool) -> None:
        self.cfg = cfg
        self.req = req
        self.ledger = Ledger(chat=req.kind == "chat", asked_ids=asked_ids,
                             include_usage=req.include_usage)  # fmt: skip
        self.refused = refused(req)
        self.left = cfg.attempts
        self.drained = False  # the stream now relayed was ended by a drain
        self._resp: UpstreamResponse | None = None
        self._on: ReplicaState | None = None
        self._pool: Pool | None = None

    def tap(self, strip_usage: bool) -> IdsTap:
        return IdsTap(strip_usage, self.ledger, strip_ids=not self.ledger.asked_ids)

    def watch(self, replica: ReplicaState, resp: UpstreamResponse, pool: Pool) -> None:
        """Relaying `resp` from `replica` of `pool`: a drain of it hands this stream over."""
        self.unwatch()
        self._resp, self._on, self._pool = resp, replica, pool
        replica.streams.add(self.leave)
        if replica.cordoned:
            self.leave()

    def unwatch(self) -> None:
        if self._on is not None:
            self._on.streams.discard(self.leave)
        self._resp = self._on = self._pool = None

    def leave(self) -> None:
        """The replica drains: end its stream here, for the relay to resume it elsewhere, when
        it can be (else it finishes where it is, as before)."""
        ledger, on, pool = self.ledger.settle(), self._on, self._pool
        if self._resp is None or on is None or pool is None or "drain" not in self.cfg.on:
            return
        if self.left <= 0:
            return
        if self.refused is not None or ledger.unresumable is not None or ledger.finish:
            return
        if not ledger.exact and not (self.cfg.from_text and ledger.text):
            return
        now = time.monotonic()
        if not any(r is not on and not r.draining and r.available(now)
                   for r in pool.replicas):  # fmt: skip
            return
        self.drained = True
        self._resp.abort()


def trigger_of(broke: GatewayError, broken: str | None, drained: bool) -> str:
    """What ended a stream mid-way, as `resume.on` names it."""
    if drained:
        return "drain"
    if isinstance(broke, UpstreamTimeout):
        return "idle_timeout"
    if broken == "an error event":
        return "error_event"
    if broken is not None:
        return "malformed"
    if "without [DONE]" in broke.message:
        return "truncated"
    return "reset"


class Resumer:
    """Continues broken streams of a plain pool (`Failover`'s): `resume` is called once the
    relay of the first replica's stream broke, with the client's stream still open."""

    def __init__(self, links: Links) -> None:
        self.gw = links

    async def resume(
        self, out: Outbound, state: StreamResume, broke: GatewayError, trigger: str,
        writer: ResponseWriter, fwd: Forwarded, failed: str, last_ns: int,
    ) -> GatewayError | None:  # fmt: skip
        """Continue the answer until it ends; the error to end the client's stream with when it
        cannot (None: it ended properly). `last_ns`: when the last chunk came (time_ns)."""
        gw, pool, ledger = self.gw, out.pool, state.ledger.settle()
        pc = pool.config
        deadline = fwd.t_sent + int(pc.timeouts.total_s * 1e9)
        excluded = {failed}
        while True:
            why = self._why_not(state, trigger)
            if why is not None:
                gw.metrics.resumes.labels(pool.name, trigger, why[0]).inc()
                if why[1] is None:
                    return broke
                return type(broke)(f"{broke.message}; not resumed: {why[1]}", code=broke.code)
            if ledger.finish is not None:  # only the end was lost: the answer is whole
                await writer.write(finish_bytes(ledger, ledger.usage or _usage_of(ledger)))
                gw.metrics.resumes.labels(pool.name, trigger, "resumed").inc()
                return None
            room = None  # what the context leaves a request that set no max_tokens
            if state.req.max_tokens is None:
                context = pool.max_model_len()
                used = len(ledger.prompt_ids or ()) + (ledger.offset or ledger.chunks)
                room = None if context is None or not ledger.exact else context - used
                if room is None or room <= 0:
                    why_len = "no max_tokens, and the engine's context is not known"
                    gw.metrics.resumes.labels(pool.name, trigger, "not_resumable").inc()
                    return type(broke)(f"{broke.message}; not resumed: {why_len}", code=broke.code)
            state.left -= 1
            cont = continuation(state.req, orjson.loads(out.body), ledger, room)
            if cont is None:  # max_tokens reached, its finish chunk lost
                ledger.finish = "length"
                await writer.write(_length_chunk(ledger) + finish_bytes(ledger, _usage_of(ledger)))
                gw.metrics.resumes.labels(pool.name, trigger, "resumed").inc()
                return None
            outcome = "resumed" if cont.exact else "inexact"
            got = await self._open(out, cont, excluded, deadline, fwd)
            if got is None:
                gw.metrics.resumes.labels(pool.name, trigger, "failed").inc()
                return type(broke)(f"{broke.message}; no replica could resume it", code=broke.code)
            disp, opened = got
            name = disp.replica.name
            fwd.resumes.append((name, cont.offset, trigger, outcome))
            state.drained = False
            state.watch(disp.replica, opened.resp, pool)
            reshaper = Reshaper(ledger, cont.exact, fwd.input_tokens)
            first_at = [0]  # time_ns of its first token to the client
            t_sent = time.time_ns()
            try:
                broke2 = await self._relay(opened, reshaper, writer, first_at)
            except BaseException:
                opened.resp.abort()
                await disp.abandoned()
                disp.done()
                state.unwatch()
                raise
            state.unwatch()
            gw.metrics.resumes.labels(pool.name, trigger, outcome).inc()
            self._count_tokens(pool.name, cont.offset, reshaper.usage)
            if first_at[0]:
                gw.metrics.resume_gap.labels(pool.name).observe((first_at[0] - last_ns) / 1e9)
                fwd.resume_gaps.append((first_at[0] - last_ns) / 1e9)
                last_ns = reshaper.tap.last_ns or last_ns
            fwd.replica = name
            fwd.tried.append(name)
            fwd.t_last = time.perf_counter_ns()
            ok = broke2 is None
            ttft = (first_at[0] - t_sent) / 1e9 if first_at[0] else None
            await disp.finished(ok, True, ttft, "upstream ok" if ok else "upstream broken_mid_stream")
            disp.done()
            gw.notify_capacity(pool.name)
            if broke2 is None:
                return None
            for i in range(len(fwd.attempts) - 1, -1, -1):  # its span ends here, broken
                a = fwd.attempts[i]
                if a[0] == name and a[5] == f"{RESUMED}{cont.offset}":
                    fwd.attempts[i] = (*a[:3], fwd.t_last, a[4], f"{a[5]}:broken_mid_stream")
                    break
            broke, excluded = broke2, excluded | {name}
            trigger = trigger_of(broke2, reshaper.broken, state.drained)

    def _count_tokens(self, pool: str, offset: int, usage: dict[str, Any] | None) -> None:
        tokens = self.gw.metrics.resume_tokens
        tokens.labels(pool, "relayed").inc(offset)
        if usage is None:
            return
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(prompt, int):
            hit = cached if isinstance(cached, int) else 0
            tokens.labels(pool, "prefilled").inc(max(0, prompt - hit))
            tokens.labels(pool, "cached").inc(hit)

    def _why_not(self, state: StreamResume, trigger: str) -> tuple[str, str | None] | None:
        """(outcome, why) when the answer is not resumed now; why None: the break is told as
        it was (resume off for this trigger, attempts used up)."""
        ledger, cfg = state.ledger, state.cfg
        if trigger not in cfg.on:
            return ("off", None)
        why = state.refused or REASONS.get(ledger.unresumable or "")
        if why is not None:
            return ("not_resumable", why)
        if not ledger.exact and not (cfg.from_text and ledger.text):
            return ("not_resumable", "the engine sent no token ids")
        if state.left <= 0:
            return ("failed", f"{cfg.attempts} resume attempts used")
        return None

    async def _open(
        self, out: Outbound, cont: Continuation, excluded: set[str], deadline: int, fwd: Forwarded
    ) -> tuple[Dispatch, Opened] | None:
        """The continuation sent to the best replica for the prompt's prefix, the failed ones
        and draining ones excluded; the next one on a failure before its first byte."""
        gw, pool, router = self.gw, out.pool, out.router
        pc = pool.config
        routing = Routing(out.routing.routed, out.routing.prompt, 0)
        await router.match(pool, routing)
        decision = router.choose(pool, routing)
        # never the replica that just failed; those that failed before or drain, last
        later = excluded | {r.name for r in pool.replicas if r.draining}
        names = [n for n in decision.ranked if n != fwd.replica and n not in later]
        names += [n for n in decision.ranked if n != fwd.replica and n in later]
        for name in names[: pc.retries + 1]:
            left = (deadline - time.perf_counter_ns()) / 1e9
            if left <= 0:
                return None
            disp = await router.dispatch(pool, routing, name)
            t0 = time.perf_counter_ns()
            try:
                opened = await open_upstream(
                    gw.upstream, disp.replica.url, cont.path, cont.body, out.headers,
                    pc.timeouts, True, left,
                )  # fmt: skip
            except Retryable as exc:
                await disp.failed(exc.reason, exc.busy)
                outcome = attempt_outcome(exc)
                fwd.attempts.append((name, disp.replica.url, t0, time.perf_counter_ns(),
                                     exc.status or 0, outcome))  # fmt: skip
                gw.metrics.attempts.labels(pool.name, name, outcome).inc()
                disp.done()
                continue
            except BaseException:
                await disp.abandoned()
                disp.done()
                raise
            if opened.status != 200:  # the continuation refused: not this answer's to fix
                opened.resp.release()
                await disp.finished(opened.status < 500, False, None, f"upstream {opened.status}")
                disp.done()
                continue
            fwd.attempts.append((name, disp.replica.url, t0, 0, 200, f"{RESUMED}{cont.offset}"))
            disp.prefilled()
            return disp, opened
        return None

    async def _relay(
        self, opened: Opened, reshaper: Reshaper, writer: ResponseWriter, first_at: list[int]
    ) -> GatewayError | None:
        """The continuation's events, reshaped, to the client; the error that broke it."""

        async def write(data: bytes) -> None:
            if not first_at[0]:
                first_at[0] = time.time_ns()
            await writer.write(data)

        return await read_stream(opened.resp, reshaper, write, opened.first,
                                 live=self.gw.live_streams)  # fmt: skip


def _usage_of(ledger: Ledger) -> dict[str, Any] | None:
    if ledger.prompt_ids is None:
        return None
    p, c = len(ledger.prompt_ids), ledger.offset
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}


def _length_chunk(ledger: Ledger) -> bytes:
    shaped: dict[str, Any] = dict(ledger.template)
    if ledger.chat:
        shaped["object"] = "chat.completion.chunk"
        c: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None}
    else:
        shaped["object"] = "text_completion"
        c = {"index": 0, "text": "", "logprobs": None}
    c["finish_reason"], c["stop_reason"] = "length", None
    shaped["choices"] = [c]
    return b"data: " + orjson.dumps(shaped) + b"\n\n"


# --- non-streamed answers, streamed from the engine (`resume.whole`) ------------------------------
class NoClient:
    """What a resume writes to when the client waits for a whole answer: nothing goes out; the
    ledger keeps the answer."""

    async def write(self, chunk: bytes) -> None:
        return None


def streamed_body(sent: dict[str, Any]) -> bytes:
    """A non-streamed request's body as sent on, asked as a stream with ids and usage."""
    return orjson.dumps({**sent, "stream": True, "stream_options": {"include_usage": True},
                         "return_token_ids": True})  # fmt: skip


def whole_answer(ledger: Ledger) -> bytes:
    """The non-streamed answer the ledger holds, in the engine's shape."""
    ledger.settle()
    text = "".join(ledger.text)
    out: dict[str, Any] = {k: v for k, v in ledger.template.items() if k != "object"}
    choice: dict[str, Any]
    if ledger.chat:
        out["object"] = "chat.completion"
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": ledger.finish, "stop_reason": ledger.stop_reason}  # fmt: skip
    else:
        out["object"] = "text_completion"
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ledger.finish,
                  "stop_reason": ledger.stop_reason}  # fmt: skip
    if ledger.asked_ids:
        choice["token_ids"] = ledger.ids
        if ledger.chat:
            out["prompt_token_ids"] = ledger.prompt_ids
        else:
            choice["prompt_token_ids"] = ledger.prompt_ids
    out["choices"] = [choice]
    out["usage"] = ledger.usage or _usage_of(ledger)
    return orjson.dumps(out)
