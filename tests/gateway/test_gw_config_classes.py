"""`priority_classes:` is laid over the built-in classes: a class may give only `rank`, naming a
built-in class changes only the keys given, other classes are added, `name: null` removes a
built-in one. Checked at load and on a gateway serving real requests."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from gateway.config import ConfigError, parse_config
from gateway.limits.tenants import BUILTIN_CLASSES
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream

POOL = {"pools": {"chat": {"replicas": ["http://127.0.0.1:9001"]}}}


def classes(given: Any) -> dict[str, dict[str, Any]]:
    cfg = parse_config({**POOL, "priority_classes": given})
    return {name: c.model_dump() for name, c in cfg.priority_classes.items()}


def problems(given: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config({**POOL, "priority_classes": given})
    return info.value.problems


def test_unset_or_empty_means_the_built_in_classes() -> None:
    assert classes({}) == BUILTIN_CLASSES
    assert {n: c.model_dump() for n, c in parse_config(POOL).priority_classes.items()} == (
        BUILTIN_CLASSES
    )


def test_a_new_class_may_give_only_its_rank_and_the_built_in_ones_stay() -> None:
    got = classes({"bulk": {"rank": 5}})
    assert got == {
        **BUILTIN_CLASSES,
        "bulk": {"rank": 5, "max_queue_wait_s": 2.0, "max_queue_len": 1000},
    }


def test_naming_a_built_in_class_changes_only_the_keys_given() -> None:
    got = classes({"batch": {"max_queue_wait_s": 600}})
    assert got["batch"] == {"rank": 1, "max_queue_wait_s": 600.0, "max_queue_len": 10000}
    assert got["interactive"] == BUILTIN_CLASSES["interactive"]


def test_null_removes_a_built_in_class() -> None:
    assert classes({"batch": None}) == {"interactive": BUILTIN_CLASSES["interactive"]}
    assert classes({"interactive": None, "gold": {"rank": 0}}) == {
        "batch": BUILTIN_CLASSES["batch"],
        "gold": {"rank": 0, "max_queue_wait_s": 2.0, "max_queue_len": 1000},
    }


@pytest.mark.parametrize(
    ("given", "line"),
    [
        ({"gold": {"max_queue_len": 3}}, "priority_classes.gold.rank: required"),
        (
            {"gold": None},
            "priority_classes.gold: null removes a built-in class (interactive, batch), "
            "and 'gold' is not one",
        ),
        (
            {"realtime": {"rank": 0}},
            "priority_classes.realtime.rank: 0 is also the rank of 'interactive' (a built-in "
            "class: give one of them another rank, or remove it with `interactive: null`)",
        ),
        ({"interactive": None, "batch": None}, "priority_classes: must hold at least 1 entry"),
        (
            {"gold": {"rank": 4, "max_queue_wait_s": 0}},
            "priority_classes.gold.max_queue_wait_s: must be greater than 0, got 0",
        ),
        ({"gold": 3}, "priority_classes.gold: expected a mapping (key: value), got 3"),
    ],
)
def test_class_errors_name_the_key(given: Any, line: str) -> None:
    assert problems(given) == [line]


def test_a_tenant_may_name_a_built_in_class_beside_its_own() -> None:
    cfg = parse_config(
        {
            **POOL,
            "priority_classes": {"bulk": {"rank": 9}},
            "tenants": [{"name": "t", "priority": "bulk", "allowed_priorities": ["batch"]}],
        }
    )
    assert set(cfg.priority_classes) == {"interactive", "batch", "bulk"}


async def test_a_gateway_with_one_added_class_serves_all_three() -> None:
    extra = {"priority_classes": {"bulk": {"rank": 5}}}
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    async with rig([Upstream("u")], extra=extra) as r, aiohttp.ClientSession() as h:
        anon = r.gateway.tenants.anonymous
        assert anon.priority == "interactive"
        for cls in ("interactive", "batch", "bulk"):
            # the anonymous tenant may use only its default class: the others are known (403),
            # not unknown (400)
            async with h.post(
                r.url + "/v1/chat/completions", json=body, headers={"x-priority": cls}
            ) as res:
                payload = await res.json()
                assert res.status == (200 if cls == "interactive" else 403), payload
        async with h.post(
            r.url + "/v1/chat/completions", json=body, headers={"x-priority": "gold"}
        ) as res:
            assert res.status == 400
            assert (await res.json())["error"]["code"] == "invalid_priority"
        async with h.get(r.url + "/openapi.json") as res:
            doc = await res.json()
        (header,) = [
            p
            for p in doc["paths"]["/v1/chat/completions"]["post"]["parameters"]
            if p["name"] == "x-priority"
        ]
        assert header["schema"]["enum"] == ["batch", "bulk", "interactive", ""]
