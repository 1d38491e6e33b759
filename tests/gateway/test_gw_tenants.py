"""Tenants: API keys to tenants by digest, priority classes allowed per tenant, limits to rules."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.errors import BadRequest, Forbidden, Unauthorized
from gateway.limits.tenants import (
    LimitsConfig,
    PriorityClassConfig,
    TenantConfig,
    TenantDirectory,
    check_tenants,
    default_classes,
    requested_priority,
)

KEY_A = "sk-alpha-0123456789"
KEY_B = "sk-beta-9876543210"


def tenants(*raw: dict[str, Any]) -> list[TenantConfig]:
    return [TenantConfig.model_validate(t) for t in raw]


def directory(auth: Any = "required", classes: Any = None) -> TenantDirectory:
    return TenantDirectory(
        auth,
        tenants(
            {"name": "acme", "api_keys": [KEY_A], "allowed_priorities": ["batch"]},
            {
                "name": "bulk",
                "api_key_sha256": [hashlib.sha256(KEY_B.encode()).hexdigest().upper()],
                "priority": "batch",
                "weight": 2,
            },
        ),
        classes or default_classes(),
    )


def test_defaults() -> None:
    c = default_classes()
    assert (c["interactive"].rank, c["interactive"].max_queue_wait_s) == (0, 2.0)
    assert c["interactive"].max_queue_len == 1000
    assert (c["batch"].rank, c["batch"].max_queue_wait_s, c["batch"].max_queue_len) == (
        1,
        120,
        10000,
    )
    t = TenantConfig(name="x")
    assert t.priority == "interactive" and t.allowed_priorities is None and t.weight == 1.0
    assert t.limits == LimitsConfig() and t.limits.rules() == []


def test_identify_by_plaintext_key_and_by_digest() -> None:
    d = directory()
    assert d.identify(b"Bearer " + KEY_A.encode()).name == "acme"
    assert d.identify(b"bearer   " + KEY_B.encode() + b" ").name == "bulk"
    assert d.identify(b"Bearer " + KEY_B.encode()).weight == 2


@pytest.mark.parametrize("header", [None, b"", b"Bearer ", b"Basic abc", b"sk-alpha-0123456789"])
def test_missing_key_is_401(header: bytes | None) -> None:
    with pytest.raises(Unauthorized, match="Missing API key") as info:
        directory().identify(header)
    assert info.value.status == 401


def test_unknown_key_is_401_and_never_echoed() -> None:
    with pytest.raises(Unauthorized) as info:
        directory().identify(b"Bearer sk-wrong-secret")
    assert info.value.message == "Invalid API key"
    assert "sk-wrong" not in str(info.value.headers())


def test_keys_appear_in_no_repr(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    d = directory()
    t = d.identify(b"Bearer " + KEY_A.encode())
    cfg = TenantConfig.model_validate({"name": "acme", "api_keys": [KEY_A]})
    for text in (repr(d), repr(t), repr(cfg), str(cfg.model_dump()), caplog.text, str(vars(d))):
        assert KEY_A not in text
    assert KEY_A not in repr(d.__dict__)


def test_auth_off_known_key_still_identifies_else_anonymous() -> None:
    d = directory("off")
    assert d.identify(None).name == "anonymous"
    assert d.identify(b"Bearer nope").name == "anonymous"
    assert d.identify(b"Bearer " + KEY_A.encode()).name == "acme"
    assert d.anonymous.priority == "interactive"


def test_auth_unset_means_required_when_keys_exist() -> None:
    assert directory(None).auth == "required"
    assert TenantDirectory(None, [], default_classes()).auth == "off"
    with pytest.raises(ValueError, match="no tenant has an API key"):
        TenantDirectory("required", [], default_classes())


def test_anonymous_default_class_is_lowest_rank_without_interactive() -> None:
    classes = {
        "gold": PriorityClassConfig(rank=0, max_queue_wait_s=1, max_queue_len=5),
        "bronze": PriorityClassConfig(rank=3, max_queue_wait_s=9, max_queue_len=5),
    }
    d = TenantDirectory("off", [], classes)
    assert d.anonymous.priority == "gold" and d.anonymous.allowed_priorities == {"gold"}


def test_configured_anonymous_tenant_replaces_builtin() -> None:
    ts = tenants({"name": "anonymous", "priority": "batch", "limits": {"requests_per_second": 1}})
    d = TenantDirectory("off", ts, default_classes())
    anon = d.identify(None)
    assert anon.priority == "batch" and [r.name for r in anon.rules("m")] == ["requests/s"]


def test_priority_for() -> None:
    d = directory()
    acme = d.identify(b"Bearer " + KEY_A.encode())
    bulk = d.identify(b"Bearer " + KEY_B.encode())
    assert d.priority_for(acme, None) == "interactive"
    assert d.priority_for(acme, "batch") == "batch"
    assert d.priority_for(bulk, None) == "batch"
    with pytest.raises(Forbidden, match="'bulk' may not use priority class 'interactive'") as info:
        d.priority_for(bulk, "interactive")
    assert info.value.status == 403 and info.value.param == "priority"
    with pytest.raises(BadRequest, match="Unknown priority class 'gold'") as bad:
        d.priority_for(acme, "gold")
    assert bad.value.param == "priority" and bad.value.status == 400
    assert d.vllm_priority("interactive") == 0 and d.vllm_priority("batch") == 1


def test_requested_priority_header_wins_over_body() -> None:
    assert requested_priority(b" batch ", {"priority": "interactive"}) == "batch"
    assert requested_priority(None, {"priority": "batch"}) == "batch"
    assert requested_priority(None, {"priority": 5}) is None  # vLLM's integer field
    assert requested_priority(None, {}) is None


def test_limits_expand_to_rules_with_burst() -> None:
    lim = LimitsConfig.model_validate(
        {
            "requests_per_second": 5,
            "requests_per_minute": 120,
            "tokens_per_minute": 60000,
            "per_model": {
                "llama*": {"requests_per_minute": 6, "burst_s": 20},
                "*": {"tokens_per_minute": 6},
            },
        }
    )
    rules = {r.name: r for r in lim.rules()}
    assert (rules["requests/s"].rate_per_s, rules["requests/s"].burst) == (5, 5)
    assert (rules["requests/min"].rate_per_s, rules["requests/min"].burst) == (2, 120)
    assert rules["tokens/min"].unit == "tokens" and rules["tokens/min"].burst == 60000
    t = TenantDirectory("off", [TenantConfig(name="t", limits=lim)], default_classes()).tenants["t"]
    llama = {r.name: r for r in t.rules("llama-3-8b")}
    assert llama["model[llama*]:requests/min"].burst == pytest.approx(2.0)  # 0.1/s * 20 s
    assert "model[*]:tokens/min" not in llama  # first matching glob only
    assert [r.name for r in t.rules("qwen")][-1] == "model[*]:tokens/min"
    tiny = LimitsConfig(requests_per_minute=1, burst_s=1)
    assert tiny.rules()[0].burst == 1.0  # never below one request


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([{"name": "a", "priority": "gold"}], "tenants[0].priority: unknown priority class 'gold'"),
        (
            [{"name": "a"}, {"name": "a"}],
            "tenants[1].name: 'a' repeats tenants[0]",
        ),
        (
            [{"name": "a", "api_keys": ["k1"]}, {"name": "b", "api_keys": ["k1"]}],
            "tenants[1]: an API key is also in tenants[0]",
        ),
        (
            [
                {"name": "a", "api_keys": ["k1"]},
                {"name": "b", "api_key_sha256": [hashlib.sha256(b"k1").hexdigest()]},
            ],
            "tenants[1]: an API key is also in tenants[0]",
        ),
        (
            [{"name": "a", "allowed_priorities": ["interactive", "vip"]}],
            "tenants[0].allowed_priorities[1]: unknown priority class 'vip'",
        ),
    ],
)
def test_cross_field_errors(raw: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_tenants(tenants(*raw), default_classes())
    assert str(info.value).startswith(message)
    assert "k1" not in str(info.value)


def test_duplicate_ranks_rejected() -> None:
    classes = {
        "a": PriorityClassConfig(rank=0, max_queue_wait_s=1, max_queue_len=1),
        "b": PriorityClassConfig(rank=0, max_queue_wait_s=1, max_queue_len=1),
    }
    with pytest.raises(ValueError, match="priority_classes.b.rank: 0 is also the rank of 'a'"):
        check_tenants([], classes)


def test_field_errors_are_strict() -> None:
    with pytest.raises(ValidationError, match="not a SHA-256 hex digest"):
        TenantConfig(name="a", api_key_sha256=("abc",))
    with pytest.raises(ValidationError, match="Extra inputs"):
        TenantConfig.model_validate({"name": "a", "wieght": 2})
    with pytest.raises(ValidationError):
        TenantConfig(name="a", weight=0)
    with pytest.raises(ValidationError):
        LimitsConfig.model_validate({"per_model": {"x": {"per_model": {}}}})
