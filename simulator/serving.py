"""Serving one chat or completions request: engine submission, SSE or JSON out, faults applied.

A client that goes away aborts its sequences in the engine, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive

from simulator.faults import Fault, FaultSwitch
from simulator.lora import lora_salt
from simulator.openai_api import (
    ApiError,
    EngineRequest,
    bad,
    full_response,
    invalid,
    not_found_model,
    parse_request,
    stream_chunk,
    usage,
    usage_chunk,
)
from simulator.pd import Leg, PdService
from simulator.runner import EngineRunner
from simulator.sequence import Sequence
from simulator.tokenizer import Tokenizer

GARBAGE = b"data: {\"id\": oops \x00\xff not json\n\n"
Event = tuple[int, int, str | None]  # choice index, token id, finish reason


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def forever() -> None:
    await asyncio.Event().wait()


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[Any], receive: Receive) -> None:
    """Run `work` until it ends or the client disconnects, whichever is first; both are then
    cancelled and awaited (an error of `work` propagates)."""
    tasks = (asyncio.ensure_future(work), asyncio.ensure_future(until_disconnect(receive)))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def json_body(request: Request) -> Any:
    """The request's JSON (400 when it is not JSON, located as vLLM locates it: `body.<pos>`)."""
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"body.{exc.pos}", "json_invalid", "JSON decode error", {}) from None


async def json_object(request: Request) -> dict[str, Any]:
    """The request's JSON object (400 when it is not JSON or not an object)."""
    body = await json_body(request)
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


class CompletionService:
    """Everything `/v1/chat/completions` and `/v1/completions` do."""

    def __init__(self, *, runner: EngineRunner, tokenizer: Tokenizer, model_name: str,
                 faults: FaultSwitch, kill_connection: Callable[[Any], None],
                 pd: PdService | None = None) -> None:
        self.runner = runner
        self.tok = tokenizer
        self.model_name = model_name
        self.faults = faults
        self.kill_connection = kill_connection
        self.pd = pd  # prefill/decode disaggregation (simulator/pd.py); None: aggregated
        cfg = runner.engine.config
        self.max_model_len = cfg.max_model_len
        self._ids = itertools.count()
        self.api = "vllm"  # or "sglang": its chat refuses return_token_ids streamed

    async def handle(self, request: Request, *, chat: bool) -> Response:
        body = await json_body(request)
        req = parse_request(body, self.tok, chat=chat, max_model_len=self.max_model_len)
        leg = self.pd.leg(body, len(req.prompts)) if self.pd is not None else None
        if leg is not None and leg.kind.endswith("prefill"):
            req.max_tokens = 1  # a P leg runs the prefill and one token
        lora = self.runner.engine.lora
        adapter = req.model if lora is not None and req.model in lora.registered else None
        if req.model is not None and req.model != self.model_name and adapter is None:
            raise not_found_model(req.model, self.model_name)
        req.max_tokens = self._check_length(max(len(p) for p in req.prompts), req.max_tokens)
        fault = self.faults.take()
        if fault is not None and fault.mode in ("error_503", "error_500"):
            status = 503 if fault.mode == "error_503" else 500
            raise ApiError(status, f"simulated fault {fault.mode}")
        if fault is not None and fault.mode == "slow_first_byte":
            await asyncio.sleep(fault.delay_s)
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(seq: Sequence) -> None:
            events.put_nowait((seq.tag, seq.output[-1], seq.finish_reason))

        ids = [f"{req.request_id}-{i}-{next(self._ids)}" for i in range(len(req.prompts))]
        if leg is not None and leg.kind.endswith("decode"):
            pulled = await self._pull(leg, req.prompts[0], lora_salt(adapter, req.cache_salt),
                                      request)
            if isinstance(pulled, Response):
                return pulled
            leg = pulled
        if adapter is not None and lora is not None:  # the engine serves it with that adapter
            for rid in ids:
                lora.assign(rid, adapter)
        if self.api == "sglang" and req.chat and req.stream and req.return_token_ids:
            raise bad("return_token_ids is not supported with streaming on /v1/chat/completions. "
                      "Please set stream=false when using return_token_ids=true.")
        seqs = [self.runner.submit(rid, prompt, max_tokens=req.max_tokens, priority=req.priority,
                                   cache_salt=lora_salt(adapter, req.cache_salt), sink=sink, tag=i,
                                   greedy=req.greedy)
                for i, (rid, prompt) in enumerate(zip(ids, req.prompts, strict=True))]
        if leg is not None and self.pd is not None:
            self.pd.submitted(leg, seqs[0])
        if req.stream:
            frames = self._frames(req, seqs, events, leg)
            return StreamingResponse(self._faulty(frames, fault, request), status_code=200,
                                     media_type="text/event-stream")
        return await self._whole(req, seqs, events, fault, request, leg)

    async def _pull(self, leg: Leg, prompt: list[int], salt: str | None,
                    request: Request) -> Leg | Response | None:
        """A P/D decode leg: reserve the blocks, read the KV from P (None: recompute locally;
        a Response: the client went away meanwhile and the blocks are freed)."""
        pd = self.pd
        assert pd is not None
        pd.reserve(leg, prompt, self.runner.engine.prompt_hashes(prompt, salt))
        work = asyncio.ensure_future(pd.pull(leg, len(prompt)))
        gone = asyncio.ensure_future(until_disconnect(request.receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, gone):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
            if not work.done() or work.cancelled() or work.exception() is not None \
                    or not work.result():
                pd.unreserve(leg)
        if not work.done() or work.cancelled():
            return Response(b"", status_code=499)
        return leg if work.result() else None

    async def _leg_done(self, leg: Leg | None) -> dict[str, Any] | None:
        """A P leg's generation ended: its kv_transfer_params (NIXL), or SGLang's wait for D."""
        if leg is None or self.pd is None or not leg.kind.endswith("prefill"):
            return None
        params = self.pd.finished(leg)
        if leg.kind == "sglang_prefill" and leg.seq is not None and \
                leg.seq.id in self.runner.engine.held:
            await self.pd.sglang_prefill_done(leg)
        return params

    def _check_length(self, prompt_len: int, max_tokens: int | None) -> int | None:
        """The output budget, as vLLM sets it: the prompt must fit the context (else 400), and
        max_tokens is cut to what the context has left after it. Unset, vLLM's budget is all
        of that; the simulator's output length model stands in for the EOS a model samples."""
        limit = self.max_model_len
        if prompt_len > limit:
            seen = limit + 1  # vLLM counts no further than one past the limit
            raise bad(f"This model's maximum context length is {limit} tokens. However, your "
                      f"prompt contains at least {seen} input tokens, which exceeds this limit "
                      "even without any output tokens. Please reduce the length of the input "
                      f"prompt. (parameter=input_tokens, value={seen})", "input_tokens")
        left = limit - prompt_len
        budget = left if max_tokens is None else min(max_tokens, left)
        if budget < 1:
            raise bad(f"max_tokens must be at least 1, got {budget}. (parameter=max_tokens, "
                      f"value={budget})", "max_tokens")
        return None if max_tokens is None else budget

    def _usage(self, seqs: list[Sequence]) -> dict[str, Any]:
        return usage(sum(s.prompt_len for s in seqs), sum(len(s.output) for s in seqs),
                     sum(s.cached_tokens for s in seqs))

    def _abort_unfinished(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if not s.finished:
                self.runner.abort(s)

    async def _frames(self, req: EngineRequest, seqs: list[Sequence],
                      events: asyncio.Queue[Event], leg: Leg | None = None,
                      ) -> AsyncIterator[bytes]:
        model, open_choices = req.model or self.model_name, len(seqs)  # an adapter's name echoed
        started: set[int] = set()
        try:
            while open_choices:
                tag, token, reason = await events.get()
                prompt_ids = None
                if tag not in started:
                    started.add(tag)
                    prompt_ids = req.prompts[tag]
                    if req.chat:
                        yield sse(stream_chunk(req, model, tag, None, None, role=True,
                                               prompt_ids=prompt_ids))
                        prompt_ids = None
                text = self.tok.decode_filler(token)
                yield sse(stream_chunk(req, model, tag, text, reason, token_ids=[token],
                                       prompt_ids=prompt_ids))
                if reason is not None:
                    open_choices -= 1
            await self._leg_done(leg)  # streamed: no kv_transfer_params (as vLLM)
            if req.include_usage:
                yield sse(usage_chunk(req, model, self._usage(seqs)))
            yield b"data: [DONE]\n\n"
        finally:
            self._abort_unfinished(seqs)

    async def _faulty(self, frames: AsyncIterator[bytes], fault: Fault | None,
                      request: Request) -> AsyncIterator[bytes]:
        """Pass frames through, until a stream fault's `after_chunks` is reached."""
        try:
            sent = 0
            async for frame in frames:
                if fault is not None and sent >= fault.after_chunks:
                    if fault.mode == "stall":
                        await forever()
                    elif fault.mode == "die_midstream":
                        self.kill_connection(request.scope.get("client"))
                        await forever()
                    elif fault.mode == "garbage_sse":
                        yield GARBAGE
                        return
                    elif fault.mode == "error_midstream":  # as vLLM ends a failed stream
                        yield sse(ApiError(500, "simulated engine error").body())
                        yield b"data: [DONE]\n\n"
                        return
                yield frame
                sent += 1
        finally:
            await frames.aclose()  # type: ignore[attr-defined]

    async def _whole(self, req: EngineRequest, seqs: list[Sequence],
                     events: asyncio.Queue[Event], fault: Fault | None,
                     request: Request, leg: Leg | None = None) -> Response:
        async def collect() -> None:
            left = len(seqs)
            while left:
                if (await events.get())[2] is not None:
                    left -= 1
            if fault is not None and fault.mode == "stall":
                await forever()

        if fault is not None and fault.mode == "die_midstream":
            self.kill_connection(request.scope.get("client"))
        try:
            await unless_gone(collect(), request.receive)
        finally:
            self._abort_unfinished(seqs)
        if fault is not None and fault.mode == "garbage_sse":
            return Response(GARBAGE, media_type="application/json")
        texts = ["".join(self.tok.decode_filler(t) for t in s.output) for s in seqs]
        reasons = [s.finish_reason or "abort" for s in seqs]
        body = full_response(req, req.model or self.model_name, texts, reasons, self._usage(seqs))
        if req.return_token_ids:  # vLLM's: each choice's ids; the prompt's on top (chat) or in it
            for choice, seq, prompt in zip(body["choices"], seqs, req.prompts, strict=True):
                if not req.chat:
                    choice["prompt_token_ids"] = prompt
                choice["token_ids"] = list(seq.output)
            if req.chat:
                body["prompt_token_ids"] = req.prompts[0]
        params = await self._leg_done(leg)
        if leg is not None and leg.kind == "nixl_prefill":
            body["kv_transfer_params"] = params
        return Response(orjson.dumps(body), media_type="application/json")
