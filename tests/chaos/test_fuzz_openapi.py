"""Schemathesis against the gateway's own `/openapi.json`, positive and negative cases for every
operation, on a real gateway process: no 5xx, status codes, content types and bodies as documented.

Fixed budget: derandomized, a few dozen examples per operation (~10 s for the module).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from gateway.api.kinds import PATHS
from gateway.http.openapi import openapi_document
from tests.chaos.conftest import TENANT_KEY, GatewayProc


def test_document_is_served_and_lists_the_public_endpoints(gw: GatewayProc) -> None:
    res = httpx.get(gw.url + "/openapi.json")
    assert res.status_code == 200 and res.headers["content-type"] == "application/json"
    doc = res.json()
    assert doc == openapi_document()
    assert set(doc["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        *PATHS,  # every proxied endpoint kind (gateway/api/kinds.py)
        "/v1/responses/{response_id}",  # by id, to the replica that made it
        "/v1/responses/{response_id}/cancel",
        "/v1/models",
        "/v1/models/{model_id}",
        "/version",
        "/health",
        "/ready",
        "/metrics",
    }
    assert not any(p.startswith(("/admin", "/debug")) for p in doc["paths"])


# the document the gateway serves (the test above checks it is the same), loaded at collection:
# one test per operation, each with its own id (the suite's xdist workers run a test by its id;
# schemathesis's own parametrize gives all of them one), the requests to the module's gateway
schema = schemathesis.openapi.from_dict(openapi_document())
OPERATIONS = [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_openapi_contract(gw: GatewayProc, operation: Any) -> None:
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                      operation.as_strategy(GenerationMode.NEGATIVE))  # fmt: skip

    @given(case=cases)
    @settings(
        max_examples=40,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        case.call_and_validate(
            base_url=gw.url,
            headers={"authorization": f"Bearer {TENANT_KEY}"},
            timeout=15,
        )

    check()


def test_405_names_the_allowed_methods(gw: GatewayProc) -> None:
    for method, path in [
        ("GET", "/v1/chat/completions"),
        ("TRACE", "/health"),
        ("POST", "/metrics"),
    ]:
        res = httpx.request(method, gw.url + path)
        assert res.status_code == 405 and res.json()["error"]["code"] == "method_not_allowed"
        assert "allow" in res.headers, (method, path)
