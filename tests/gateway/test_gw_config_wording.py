"""Config errors in an operator's words: every key with a wrong value gets a line naming its key
path and never pydantic's phrasing; an unknown key gets a did-you-mean from the keys valid there;
docs/configuration.md lists every key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel

from gateway.config import ConfigError, IndexConfig, PoolConfig, ServerConfig, parse_config

ROOT = Path(__file__).resolve().parents[2]
POOL = {"replicas": ["http://127.0.0.1:9001"]}
PYDANTIC_WORDS = re.compile(
    r"Input should|valid (tuple|dictionary|integer|string|number|boolean)|Extra inputs|"
    r"Field required|Value error|Assertion failed|after validation|Unable to extract tag|"
    r"does not match any of the expected tags"
)


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def with_pool(**top: Any) -> dict[str, Any]:
    return {"pools": {"chat": dict(POOL)}, **top}


# (data, the exact lines)
CASES: list[tuple[dict[str, Any], list[str]]] = [
    (
        {"pools": {"chat": {"replicas": "http://a:1"}}},
        ["pools.chat.replicas: expected a list, got a string"],
    ),
    (
        {"pools": {"chat": {**POOL, "policy": 5}}},
        ["pools.chat.policy: expected a string or a mapping (key: value), got 5"],
    ),
    (
        {"pools": {"chat": {"replicas": [{"url": "http://a:1", "models": "qwen"}]}}},
        ["pools.chat.replicas[0].models: expected a list, got a string"],
    ),
    (with_pool(server={"port": 1.5}), ["server.port: expected a whole number, got 1.5"]),
    (
        with_pool(server={"max_connections": "lots"}),
        ["server.max_connections: expected a whole number, got 'lots'"],
    ),
    (
        with_pool(server={"log_level": "loud"}),
        ["server.log_level: must be one of 'debug', 'info', 'warning' or 'error', got 'loud'"],
    ),
    (
        with_pool(server={"expose_upstream_errors": "maybe"}),
        ["server.expose_upstream_errors: expected true or false, got 'maybe'"],
    ),
    (
        with_pool(admission={"shed_status": 500}),
        ["admission.shed_status: must be 429 or 503, got 500"],
    ),
    (
        with_pool(tracing={"sampling_ratio": 3}),
        ["tracing.sampling_ratio: must be at most 1, got 3"],
    ),
    (
        {"pools": {"chat": {**POOL, "max_inflight_per_replica": 0}}},
        ["pools.chat.max_inflight_per_replica: must be at least 1, got 0"],
    ),
    ({"pools": [1]}, ["pools: expected a mapping (key: value), got a list"]),
    ({"pools": {}}, ["pools: must hold at least 1 entry"]),
    (with_pool(tenants={"a": 1}), ["tenants: expected a list, got a mapping"]),
    (
        with_pool(tenants=[{"name": "", "api_keys": ["  "], "cache_salt": "short"}]),
        [
            "tenants[0].name: must not be empty",
            "tenants[0].api_keys[0]: empty API key",
            "tenants[0].cache_salt: must be at least 8 characters",
        ],
    ),
    (
        {"pools": {"chat": {"discovery": {"kind": "kubernets"}}}},
        [
            "pools.chat.discovery.kind: 'kubernets' is not one of static, dns, kubernetes "
            "(did you mean 'kubernetes'?)"
        ],
    ),
    (
        {"pools": {"chat": {"discovery": {"service": "vllm"}}}},
        ["pools.chat.discovery.kind: required (one of static, dns, kubernetes)"],
    ),
    (
        {"pools": {"chat": {"discovery": {"kind": "dns", "name": "vllm.svc"}}}},
        ["pools.chat.discovery.port: required"],
    ),
]


@pytest.mark.parametrize(("data", "lines"), CASES, ids=[c[1][0].split(":")[0] for c in CASES])
def test_each_error_in_plain_words(data: dict[str, Any], lines: list[str]) -> None:
    assert problems(data) == lines


def test_secrets_given_the_wrong_type_are_not_echoed() -> None:
    out = problems(
        with_pool(
            tenants=[{"name": "a", "api_keys": "sk-live-0123456789"}],
            server={"admin_key": ["admin-secret-xyz"]},
        )
    )
    assert out == [
        "server.admin_key: expected a string, got a list",
        "tenants[0].api_keys: expected a list, got a string",
    ]
    assert "sk-live" not in str(out) and "admin-secret" not in str(out)


# --- every key, given a value of the wrong kind -------------------------------------------------


def leaves(model: type[BaseModel], prefix: str) -> list[tuple[str, Any]]:
    """(dotted key, annotation) of every scalar key below `model`, nested sections included
    (`health.interval_s`); lists and unions of sections are left to their own tests."""
    out: list[tuple[str, Any]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += leaves(ann, f"{prefix}{name}.")
        elif get_origin(ann) is None or type(None) in get_args(ann):
            out.append((prefix + name, ann))
    return out


def nest(dotted: str, value: Any) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {head: nest(rest, value) if rest else value}


def wrong_value(annotation: Any) -> Any:
    """A value no scalar key accepts: a mapping for everything but mappings."""
    return [["nested"]] if annotation is dict else {"not": "a scalar"}


SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("server.", ServerConfig),
    ("index.", IndexConfig),
    ("pools.chat.", PoolConfig),
]


@pytest.mark.parametrize(
    ("key", "annotation"),
    [leaf for prefix, model in SECTIONS for leaf in leaves(model, prefix)],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_every_key_given_the_wrong_kind_of_value_is_named_in_plain_words(
    key: str, annotation: Any
) -> None:
    if key == "pools.chat.discovery" or key == "pools.chat.replicas":
        pytest.skip("a section of its own (tested above)")
    data = with_pool()
    value = wrong_value(annotation)
    if key.startswith("pools.chat."):
        data["pools"]["chat"] = {**POOL, **nest(key.removeprefix("pools.chat."), value)}
    else:
        data.update(nest(key, value))
    out = problems(data)
    assert out and all(line.startswith(key + ":") for line in out), out
    for line in out:
        assert not PYDANTIC_WORDS.search(line), line


# --- did you mean ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({**with_pool(), "sever": {}}, "sever: unknown key (did you mean 'server'?)"),
        (
            with_pool(server={"max_conections": 10}),
            "server.max_conections: unknown key (did you mean 'max_connections'?)",
        ),
        (
            {"pools": {"chat": {**POOL, "helth": {}}}},
            "pools.chat.helth: unknown key (did you mean 'health'?)",
        ),
        (
            {"pools": {"chat": {**POOL, "health": {"intervl_s": 1}}}},
            "pools.chat.health.intervl_s: unknown key (did you mean 'interval_s'?)",
        ),
        (
            {"pools": {"chat": {"replicas": [{"url": "http://a:1", "nmae": "r"}]}}},
            "pools.chat.replicas[0].nmae: unknown key (did you mean 'name'?)",
        ),
        (
            {
                "pools": {
                    "chat": {"discovery": {"kind": "dns", "name": "n", "port": 1, "intrval_s": 5}}
                }
            },
            "pools.chat.discovery.intrval_s: unknown key (did you mean 'interval_s'?)",
        ),
        (
            with_pool(index={"chunking": {"mdoe": "bytes"}}),
            "index.chunking.mdoe: unknown key (did you mean 'mode'?)",
        ),
        (
            with_pool(tenants=[{"name": "a", "api_key": ["k-0123456789"]}]),
            "tenants[0].api_key: unknown key (did you mean 'api_keys'?)",
        ),
        (
            with_pool(priority_classes={"gold": {"rank": 3, "max_queue_wait": 1}}),
            "priority_classes.gold.max_queue_wait: unknown key (did you mean 'max_queue_wait_s'?)",
        ),
        (
            with_pool(ratelimit={"backnd": "memory"}),
            "ratelimit.backnd: unknown key (did you mean 'backend'?)",
        ),
        (
            with_pool(admission={"zzz": 1}),
            "admission.zzz: unknown key (known here: forward_priority, shed_status)",
        ),
    ],
)
def test_an_unknown_key_suggests_the_nearest_valid_one(data: dict[str, Any], line: str) -> None:
    assert line in problems(data)


# --- docs/configuration.md lists every key----------------------------------------------------------------


def readme_keys(title: str) -> set[str]:
    text = (ROOT / "docs/configuration.md").read_text()
    start = text.index(title)
    end = min(i for i in (text.find("\n## ", start + 1), text.find("\n# ", start + 1), len(text)) if i > 0)
    return set(re.findall(r"^\| `([^`]+)`", text[start:end], re.MULTILINE))


@pytest.mark.parametrize(
    ("title", "model"),
    [
        ("## `server`", ServerConfig),
        ("## `pools.<name>`", PoolConfig),
        ("## `index`", IndexConfig),
    ],
)
def test_the_readme_config_reference_lists_every_key(title: str, model: type[BaseModel]) -> None:
    documented = readme_keys(title)
    for key, _ in leaves(model, ""):
        assert key in documented, f"docs/configuration.md {title}: `{key}` is not in the table"
    assert {"body_timeout_s", "max_connections"} <= readme_keys("## `server`")
