"""Typed, validated gateway configuration (routes.yaml), checked once at load.

Every error names its key path (`pools.chat.replicas[1].url: not an http(s) URL`); unknown keys are
errors; `${ENV}` / `${ENV:-default}` in any string is replaced from the environment before checks.
Here: the whole file (`Config`, with the rules across its sections), masking secrets, loading.
Each section's model is in `sections.py` (re-exported here), `discovery:`'s in `discovery.py`;
config errors' wording in `errors.py`; hot reload in gateway/runtime/reload.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.config.errors import describe_errors
from gateway.config.sections import (
    AdmissionConfig,
    ChunkingConfig,
    EventsConfig,
    FleetConfig,
    HealthConfig,
    IndexConfig,
    PoolConfig,
    ReplicaConfig,
    ResumeConfig,
    RouteConfig,
    RouteMatch,
    ScrapeConfig,
    ServerConfig,
    TimeoutsConfig,
    redis_url_problem,
)
from gateway.limits.ratelimit import RateLimitConfig
from gateway.limits.tenants import (
    AuthMode,
    PriorityClassConfig,
    TenantConfig,
    check_tenants,
    default_classes,
    merge_builtin_classes,
)
from gateway.telemetry.tracing_config import TracingConfig

__all__ = [
    "AdmissionConfig",
    "ChunkingConfig",
    "Config",
    "ConfigError",
    "EventsConfig",
    "FleetConfig",
    "HealthConfig",
    "IndexConfig",
    "PoolConfig",
    "ReplicaConfig",
    "ResumeConfig",
    "RouteConfig",
    "RouteMatch",
    "ScrapeConfig",
    "ServerConfig",
    "TimeoutsConfig",
    "load_config",
    "mask_url_passwords",
    "parse_config",
]

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """The configuration is invalid; `problems` holds one `key.path: what is wrong` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    server: ServerConfig = ServerConfig()
    pools: dict[str, PoolConfig] = Field(min_length=1)
    routes: tuple[RouteConfig, ...] = ()
    index: IndexConfig = IndexConfig()
    auth: AuthMode | None = None  # None: required when any tenant has a key, else off
    tenants: tuple[TenantConfig, ...] = ()
    priority_classes: dict[str, PriorityClassConfig] = Field(
        default_factory=default_classes, min_length=1
    )
    ratelimit: RateLimitConfig = RateLimitConfig()
    admission: AdmissionConfig = AdmissionConfig()
    tracing: TracingConfig = TracingConfig()
    # extra engine paths exposed as they are (GET or POST), e.g. ["/v1/load_lora_adapter"]
    passthrough: tuple[str, ...] = ()
    fleet: FleetConfig = FleetConfig()

    @field_validator("passthrough")
    @classmethod
    def _passthrough_paths(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for i, path in enumerate(v):
            problem = passthrough_problem(path)
            if problem is not None:
                raise ValueError(f"[{i}]: {problem}")
        if len(set(v)) != len(v):
            raise ValueError("a path is listed twice")
        return v

    # the built-in classes stay unless removed (`batch: null`); see tenants.merge_builtin_classes
    @field_validator("priority_classes", mode="before")
    @classmethod
    def _keep_builtin_classes(cls, v: Any) -> Any:
        return merge_builtin_classes(v)

    @field_validator("ratelimit")
    @classmethod
    def _ratelimit_redis_url(cls, v: RateLimitConfig) -> RateLimitConfig:
        problem = redis_url_problem(v.redis_url)
        if problem is not None:
            raise ValueError(f"redis_url: {problem}")
        return v

    @model_validator(mode="after")
    def _tenants_consistent(self) -> Config:
        check_tenants(self.tenants, self.priority_classes)
        if self.auth == "required" and not any(
            t.api_keys or t.api_key_sha256 for t in self.tenants
        ):
            raise ValueError("auth: 'required' but no tenant has an API key")
        return self

    @model_validator(mode="after")
    def _routes_name_pools(self) -> Config:
        if not self.routes and len(self.pools) > 1:
            raise ValueError("routes: required when more than one pool is defined")
        for i, route in enumerate(self.routes):
            if route.pool not in self.pools:
                raise ValueError(
                    f"routes[{i}].pool: unknown pool {route.pool!r} "
                    f"(defined: {', '.join(sorted(self.pools))})"
                )
        names: dict[str, str] = {}
        for pool_name, pool in self.pools.items():
            for r in pool.replicas:
                if r.display_name in names:
                    raise ValueError(
                        f"pools.{pool_name}.replicas: name {r.display_name!r} is also "
                        f"in pool {names[r.display_name]!r}; replica names are global"
                    )
                names[r.display_name] = pool_name
        return self

    def pool_for(self, model: str, prompt_tokens: int) -> str | None:
        """The first route whose match fits; the only pool when there are no routes."""
        if not self.routes:
            return next(iter(self.pools))
        for route in self.routes:
            if route.match.matches(model, prompt_tokens):
                return route.pool
        return None

    def redacted(self) -> dict[str, Any]:
        """The resolved configuration as plain data, secrets masked (`gateway check`,
        `/admin/config`): SecretStr fields, and the password of every URL's userinfo."""
        shown: dict[str, Any] = mask_url_passwords(self.model_dump(mode="json"))
        return shown


_GATEWAY_PATHS = ("/health", "/ready", "/metrics", "/version", "/dashboard", "/openapi.json")
_GATEWAY_PREFIXES = ("/v1/models", "/admin/", "/debug/", "/v1/responses/")


def passthrough_problem(path: str) -> str | None:
    """Why `path` cannot be a `passthrough:` path, or None: an exact absolute path, not one the
    gateway answers itself."""
    from gateway.api.kinds import PATHS  # the proxied kinds' paths

    if not path.startswith("/") or any(c in path for c in "?# \t\r\n") or "//" in path:
        return f"{path!r} is not an exact absolute path (no query, fragment or spaces)"
    if path in PATHS or path in _GATEWAY_PATHS or path.startswith(_GATEWAY_PREFIXES):
        return f"{path!r} is a path the gateway serves itself"
    return None


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s\"'<>]+")


def _mask_url(m: re.Match[str]) -> str:
    # the userinfo's password (the last @ ends it: a password may hold an unescaped / ? # or @)
    # and password options (`?sentinel_password=`), as prefix_index.redis_client redacts them
    from prefix_index.redis_client import redact_url

    return redact_url(m.group())


def mask_url_passwords(value: Any) -> Any:
    """`value` with the password of every URL's userinfo, and every `password`, `sentinel_password`
    or `ssl_password` option in its query, shown as `***` (`redis://u:***@host/0`):
    a string (a URL, or text that holds URLs), or lists and dicts of them, recursively."""
    if isinstance(value, str):
        return _URL_IN_TEXT.sub(_mask_url, value) if "://" in value else value
    if isinstance(value, dict):
        return {k: mask_url_passwords(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mask_url_passwords(v) for v in value]
    return value


def _substitute_env(node: Any, path: str) -> Any:
    if isinstance(node, str):

        def repl(m: re.Match[str]) -> str:
            value = os.environ.get(m.group(1), m.group(2))
            if value is None:
                raise ConfigError(
                    [f"{path or '<root>'}: environment variable {m.group(1)} is not set"]
                )
            return value

        return _ENV.sub(repl, node)
    if isinstance(node, dict):
        return {k: _substitute_env(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute_env(v, f"{path}[{i}]") for i, v in enumerate(node)]
    return node


def parse_config(data: Any) -> Config:
    """Validate already-loaded YAML data; raises ConfigError listing every problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(["<root>: expected a mapping of top-level keys"])
    data = _substitute_env(data, "")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc.errors(), Config)) from None


def load_config(path: str | os.PathLike[str]) -> Config:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read ({exc.strerror})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML ({exc})"]) from None
    return parse_config(data)
