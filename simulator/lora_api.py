"""The simulator's LoRA HTTP surface: adapter cards for `/v1/models` and vLLM's runtime routes.

`POST /v1/load_lora_adapter` `{lora_name, lora_path}` and `POST /v1/unload_lora_adapter`
`{lora_name}` exist only with `LoraConfig.runtime_updating` (vLLM: the routes exist only under
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`). Success is a plain-text 200, as in vLLM; a duplicate load
is vLLM's 400 `InvalidUserInput`, a path the replica cannot find (`LoraConfig.missing`) vLLM's
404 `NotFoundError` (`Loading lora <name> failed: No adapter found for <path>`: vLLM writes
`<path>` itself, never the path), an unknown unload a 404 (simulator/lora.py has the slot
model). The messages are vLLM 0.32's (tests/vllm_facts.py).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from simulator.lora import LoraState
from simulator.openai_api import ApiError, bad
from simulator.serving import json_object


def adapter_cards(lora: LoraState | None, parent: str, created: int) -> list[dict[str, Any]]:
    """One card per registered adapter: `root` its path, `parent` the base model."""
    if lora is None:
        return []
    return [{"id": name, "object": "model", "created": created, "owned_by": "vllm",
             "root": path, "parent": parent, "max_model_len": None, "permission": []}
            for name, path in lora.registered.items()]


def lora_routes(lora: LoraState | None) -> list[Route]:
    if lora is None or not lora.config.runtime_updating:
        return []

    async def load(request: Request) -> Response:
        body = await json_object(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise bad("Both 'lora_name' and 'lora_path' must be provided.")
        problem = lora.register(name, path)
        if problem is not None:
            status, message = problem
            raise ApiError(status, message, kind="InvalidUserInput" if status == 400 else None)
        return Response(f"Success: LoRA adapter '{name}' added successfully.",
                        media_type="text/plain; charset=utf-8")

    async def unload(request: Request) -> Response:
        body = await json_object(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad("'lora_name' must be provided.")
        if not lora.unregister(name):
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.",
                        media_type="text/plain; charset=utf-8")

    return [Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload, methods=["POST"])]
