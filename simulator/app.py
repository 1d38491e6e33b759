"""The replica's HTTP surface: vLLM's OpenAI endpoints (chat, completions, responses, the pooling
and tokenizer endpoints, audio) plus the simulator's /sim/* switches.

`create_app(parts)` builds a Starlette app from the `AppParts` one replica hands it; nothing
lives at module level.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from simulator import audio, pooling
from simulator.faults import Fault, FaultSwitch
from simulator.kv_cache import PrefixCache
from simulator.lora import LoraState
from simulator.lora_api import adapter_cards, lora_routes
from simulator.metrics import CONTENT_TYPE
from simulator.openai_api import ApiError, bad, not_found_model
from simulator.responses import ResponsesService
from simulator.serving import CompletionService, json_body, json_object
from simulator.tokenizer import Tokenizer

if TYPE_CHECKING:
    from simulator.kv_publisher import KvEventPublisher  # imports pyzmq


@dataclass(frozen=True, slots=True)
class AppParts:
    """What the routes read and call, each named by the routes that use it."""

    model_name: str  # /v1/models, the served name
    model_root: str  # /v1/models' root: the Hugging Face name, else the served name
    max_model_len: int  # /v1/models, /tokenize
    service: CompletionService  # /v1/chat/completions, /v1/completions
    tokenizer: Tokenizer  # /tokenize
    load: Callable[[], int]  # /load: requests running and waiting
    render_metrics: Callable[[], bytes]  # /metrics
    stats: Callable[[], dict[str, Any]]  # /sim/stats
    reset_stats: Callable[[], None]  # /sim/stats/reset
    faults: FaultSwitch  # /sim/fault
    cache: PrefixCache  # /sim/cache
    kv_publisher: Callable[[], KvEventPublisher | None]  # /sim/kv_events, /kv_event_sources
    reset_prefix_cache: Callable[[], object]  # /reset_prefix_cache
    lora: LoraState | None = None  # /v1/models' adapter cards, /v1/load_lora_adapter, ...
    server_info: Callable[[], dict[str, Any]] | None = None  # /server_info, /get_server_info


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


# vLLM's scale-out endpoints: 403 unless its server runs with --enable-scale-out
SCALE_OUT = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render",
             "/v1/chat/completions/derender", "/v1/completions/derender")
POOLED = {  # path -> the answer for a parsed body (simulator/pooling.py)
    "/v1/embeddings": pooling.embeddings, "/pooling": pooling.pooling,
    "/classify": pooling.classify, "/score": pooling.score, "/v1/score": pooling.score,
    "/rerank": pooling.rerank, "/v1/rerank": pooling.rerank, "/v2/rerank": pooling.rerank,
}


def create_app(parts: AppParts) -> Starlette:
    service, tok, max_model_len = parts.service, parts.tokenizer, parts.max_model_len
    created = int(time.time())

    async def chat(request: Request) -> Response:
        return await service.handle(request, chat=True)

    async def completions(request: Request) -> Response:
        return await service.handle(request, chat=False)

    responses = ResponsesService(service)

    async def create_response(request: Request) -> Response:
        return await responses.handle(request)

    async def pooled(request: Request) -> Response:
        body = await json_object(request)
        model = body.get("model")
        if model is not None and model != parts.model_name:
            raise not_found_model(model, parts.model_name)
        if request.url.path == "/detokenize":
            return json_response(pooling.detokenize(body, tok))
        return json_response(POOLED[request.url.path](body, tok, parts.model_name))

    async def audio_upload(request: Request) -> Response:
        answer, is_json = audio.transcribe(await request.body(),
                                           request.headers.get("content-type", ""),
                                           parts.model_name)
        if is_json:
            return json_response(answer)
        return Response(answer.encode(), media_type="text/plain; charset=utf-8")

    async def models(request: Request) -> Response:
        name = parts.model_name
        card = {"id": name, "object": "model", "created": created, "owned_by": "vllm",
                "root": parts.model_root, "parent": None,
                "max_model_len": max_model_len,
                "permission": [{"id": f"modelperm-{name}", "object": "model_permission",
                                "created": created, "allow_create_engine": False,
                                "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*",
                                "group": None, "is_blocking": False}]}
        cards = [card, *adapter_cards(parts.lora, name, created)]
        return json_response({"object": "list", "data": cards})

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def load(request: Request) -> Response:
        return json_response({"server_load": parts.load()})

    async def metrics(request: Request) -> Response:
        return Response(parts.render_metrics(), media_type=CONTENT_TYPE)

    async def tokenize(request: Request) -> Response:
        body = await json_body(request)
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
            raise bad("send either prompt or messages")
        model = body.get("model")
        if model is not None and model != parts.model_name:
            raise not_found_model(model, parts.model_name)
        if "messages" in body:
            if not isinstance(body["messages"], list):
                raise bad("messages must be a list", "messages")
            add_gen = body.get("add_generation_prompt", True) is not False
            tools = body.get("tools")
            try:
                tokens = tok.encode_chat(body["messages"], add_gen,
                                         tools if isinstance(tools, list) else None)
            except AttributeError:
                raise bad("messages must be objects with role and content", "messages") from None
            except ValueError as exc:  # a content of the wrong type, or the template rejects it
                raise bad(str(exc), "messages") from None
        elif isinstance(body["prompt"], str):
            tokens = tok.encode(body["prompt"])
        else:
            raise bad("prompt must be a string", "prompt")
        return json_response({"count": len(tokens), "max_model_len": max_model_len,
                              "tokens": tokens, "token_strs": None})

    async def sim_stats(request: Request) -> Response:
        return json_response(parts.stats())

    async def sim_stats_reset(request: Request) -> Response:
        parts.reset_stats()
        return json_response(parts.stats())

    async def sim_fault(request: Request) -> Response:
        if request.method == "POST":
            try:
                parts.faults.set(Fault.from_json(await json_body(request)))
            except ValueError as exc:
                raise bad(str(exc)) from None
        return json_response(parts.faults.state())

    async def sim_cache(request: Request) -> Response:
        cache = parts.cache
        return json_response({"block_size": cache.block_size, "num_blocks": cache.num_blocks,
                              "hash": "xxh3_64 chain: h_i = xxh3_64(int64le(tokens_i), "
                                      "seed=h_{i-1}), h_-1 = 0 or xxh3_64(cache_salt)",
                              "blocks": cache.dump()})

    async def sim_kv_events(request: Request) -> Response:
        publisher = parts.kv_publisher()
        if publisher is None:
            raise ApiError(404, "this replica publishes no KV events (start it with "
                                "--kv-events-port)")
        if request.method == "POST":
            body = await json_body(request)
            if not isinstance(body, dict) or set(body) - {"drop", "replayable"}:
                raise bad('send {"drop": N, "replayable": true|false}')
            drop, replayable = body.get("drop", 0), body.get("replayable", True)
            if isinstance(drop, bool) or not isinstance(drop, int) or drop < 0:
                raise bad("drop must be an integer >= 0", "drop")
            if not isinstance(replayable, bool):
                raise bad("replayable must be a boolean", "replayable")
            publisher.drop(drop, replayable=replayable)
        return json_response(publisher.state())

    async def kv_event_sources(request: Request) -> Response:
        publisher = parts.kv_publisher()
        if publisher is None:
            return json_response({})
        opts = publisher.options
        return json_response({"0": {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint, "buffer_steps": opts.buffer_steps,
            "topic": opts.topic, "encoding": opts.encoding}})

    async def reset_prefix_cache(request: Request) -> Response:
        parts.reset_prefix_cache()
        return json_response({"success": True})  # vLLM 0.32's answer

    async def server_info(request: Request) -> Response:
        if parts.server_info is None:
            raise ApiError(404, "Not Found")
        return json_response(parts.server_info())

    async def scale_out(request: Request) -> Response:
        # vLLM serves /render only when started with --enable-scale-out (the simulator never is)
        raise ApiError(403, "Scale-out endpoints are disabled. Restart vllm serve with "
                       "--enable-scale-out to enable them.")

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return json_response(exc.body(), exc.status)

    async def internal_error(request: Request, exc: Exception) -> Response:
        return json_response(ApiError(500, f"{type(exc).__name__}: {exc}").body(), 500)

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", pooled, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        *(Route(path, pooled, methods=["POST"]) for path in POOLED),
        Route("/v1/audio/transcriptions", audio_upload, methods=["POST"]),
        Route("/v1/audio/translations", audio_upload, methods=["POST"]),
        Route("/sim/stats", sim_stats, methods=["GET"]),
        Route("/sim/stats/reset", sim_stats_reset, methods=["POST"]),
        Route("/sim/fault", sim_fault, methods=["GET", "POST"]),
        Route("/sim/cache", sim_cache, methods=["GET"]),
        Route("/sim/kv_events", sim_kv_events, methods=["GET", "POST"]),
        Route("/kv_event_sources", kv_event_sources, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/server_info", server_info, methods=["GET"]),
        *(Route(p, scale_out, methods=["POST"]) for p in SCALE_OUT),
        Route("/get_server_info", server_info, methods=["GET"]),
        *lora_routes(parts.lora),
    ]
    return Starlette(routes=routes,
                     exception_handlers={ApiError: api_error, Exception: internal_error})
