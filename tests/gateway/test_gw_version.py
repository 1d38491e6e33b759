"""What the gateway answers about itself, on a real socket: `gateway --version`, `GET /version`,
`GET /v1/models/{id}` (the merged card, or an OpenAI-shaped 404), `/v1/models` behind the tenant
key when auth is required, the OpenAPI document listing them, and the official SDK's
`models.retrieve` / `models.list` unchanged."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from typing import Any

import aiohttp
import openai
import pytest

from gateway.errors import NotFound
from gateway.http.openapi import openapi_document
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # a slash in the id, as Hugging Face names have
KEY = "sk-tenant-version-0123"
VERSION = metadata.version("kvgateway")
AUTH = {"tenants": [{"name": "t", "api_keys": [KEY]}]}  # a key: auth is required


def test_gateway_version_flag() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "gateway", "--version"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"gateway {VERSION}"


async def get(h: aiohttp.ClientSession, url: str, key: str | None = None) -> tuple[int, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with h.get(url, headers=headers) as res:
        return res.status, await res.json()


async def test_version_and_model_cards_with_auth_off() -> None:
    ups = [Upstream("a", model=MODEL), Upstream("b", model="qwen2.5-14b")]
    async with rig(ups) as r, aiohttp.ClientSession() as h:
        assert await get(h, r.url + "/version") == (200, {"version": VERSION})
        status, listed = await get(h, r.url + "/v1/models")
        assert status == 200 and [m["id"] for m in listed["data"]] == [MODEL, "qwen2.5-14b"]
        status, card = await get(h, r.url + f"/v1/models/{MODEL}")
        assert status == 200 and card == listed["data"][0]
        status, body = await get(h, r.url + "/v1/models/no-such-model")
        assert status == 404
        assert body == {
            "error": {
                "message": "The model `no-such-model` does not exist.",
                "type": NotFound.type,
                "param": "model",
                "code": "model_not_found",
            }
        }


async def test_models_need_the_tenant_key_when_auth_is_required() -> None:
    async with rig([Upstream("a", model=MODEL)], extra=AUTH) as r, aiohttp.ClientSession() as h:
        for path in ("/v1/models", f"/v1/models/{MODEL}", "/v1/models/unknown"):
            for key in (None, "sk-wrong"):
                status, body = await get(h, r.url + path, key)
                assert status == 401, (path, key, body)
                assert body["error"]["type"] == "authentication_error"
        assert (await get(h, r.url + "/v1/models", KEY))[0] == 200
        assert (await get(h, r.url + f"/v1/models/{MODEL}", KEY))[0] == 200
        assert (await get(h, r.url + "/v1/models/unknown", KEY))[0] == 404
        assert (await get(h, r.url + "/version"))[0] == 200  # open, as vLLM's /version is
        assert (await get(h, r.url + "/health"))[0] == 200


async def test_the_official_sdk_lists_and_retrieves_models() -> None:
    async with rig([Upstream("a", model=MODEL)], extra=AUTH) as r:
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0)
        try:
            page = await client.models.list()
            assert [m.id for m in page.data] == [MODEL]
            model = await client.models.retrieve(MODEL)
            assert model.id == MODEL
            with pytest.raises(openai.NotFoundError) as info:
                await client.models.retrieve("no-such-model")
            assert info.value.code == "model_not_found"
            bad = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
            await bad.close()
        finally:
            await client.close()


async def test_the_openapi_document_lists_the_new_paths() -> None:
    doc = openapi_document()
    assert doc["info"]["version"] == VERSION
    card = doc["paths"]["/v1/models/{model_id}"]["get"]
    assert set(card["responses"]) == {"200", "401", "404"}
    assert card["parameters"][0]["in"] == "path"
    assert doc["paths"]["/version"]["get"]["security"] == []
    assert "401" in doc["paths"]["/v1/models"]["get"]["responses"]
    async with rig([Upstream("a", model=MODEL)]) as r, aiohttp.ClientSession() as h:
        status, served = await get(h, r.url + "/openapi.json")
        assert status == 200 and served == doc
