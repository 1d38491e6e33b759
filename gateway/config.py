"""Typed, validated gateway configuration (routes.yaml), checked once at load.

Every error names its key path (`pools.chat.replicas[1].url: not an http(s) URL`); unknown keys are
errors; `${ENV}` / `${ENV:-default}` in any string is replaced from the environment before checks.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from .discovery import DiscoveryConfig
from .ratelimit import RateLimitConfig
from .tenants import AuthMode, PriorityClassConfig, TenantConfig, check_tenants, default_classes
from .tracing import TracingConfig

_RELATIVE = re.compile(r"^[a-z_][a-z0-9_]*(\[\d+\])?(\.[a-z_][a-z0-9_]*(\[\d+\])?)*: ")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """The configuration is invalid; `problems` holds one `key.path: what is wrong` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    """`server:`. Memory held by request bodies is bounded twice: each body by `max_body_bytes`
    (read only once its API key checks out, and only until `body_timeout_s` after it started), and
    all bodies in flight together by `max_body_bytes_in_flight` (past it a new body gets 503);
    with that cap off, the bound is `max_body_bytes` × `max_connections`.

    Non-streamed answers (each at most 64 MiB, `proxy.MAX_RESPONSE_BYTES`) are held whole until
    sent; all held at once are capped by `max_answer_bytes_in_flight`: an answer that would pass it
    gets an OpenAI-shaped 503 (`answer_bytes_in_flight`, Retry-After) and is not read. So the
    bound is `max_answer_bytes_in_flight` plus, per connection, what the socket buffers hold (a
    large answer is sent in 256 KiB slices, each after the last drained); with the cap off, 64 MiB
    × `max_connections`. Streams hold no answer: each event is relayed as it arrives.

    `graceful_shutdown_s`: on SIGTERM, requests in flight may finish for this long; a stream still
    running shortly before it ends (1 s, or a quarter of it if less) gets a `server_shutting_down`
    error event and a terminated body, and its replica connection is closed.

    `max_connections` counts requests in flight (each holds a connection), per gateway process;
    beyond it a request gets an OpenAI-shaped 503 at once. `/health`, `/ready` and `/metrics` are exempt: probes answer
    while every slot is taken. Idle connections are not counted: they are closed by the header
    deadline and the keep-alive timeout.
    """

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_body_bytes_in_flight: int | None = Field(256 * 1024 * 1024, ge=1024)  # None: no cap
    max_answer_bytes_in_flight: int | None = Field(256 * 1024 * 1024, ge=1024)  # None: no cap
    graceful_shutdown_s: float = Field(30.0, ge=0)
    body_timeout_s: float = Field(30.0, gt=0)  # deadline for a WHOLE request body, from its start
    max_connections: int | None = Field(None, ge=1)  # requests in flight; health probes exempt
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    expose_upstream_errors: bool = True
    admin_key: SecretStr | None = (
        None  # required (Bearer) on /dashboard, /admin/*, /debug/*; unset: those are off
    )

    @model_validator(mode="after")
    def _cap_holds_one_body(self) -> ServerConfig:
        cap = self.max_body_bytes_in_flight
        if cap is not None and cap < self.max_body_bytes:
            raise ValueError(
                f"max_body_bytes_in_flight: {cap} is less than max_body_bytes ({self.max_body_bytes}); "
                "the cap must hold at least one whole body"
            )
        return self


class HealthConfig(_Strict):
    path: str = "/health"
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    failures_to_open: int = Field(3, ge=1)
    open_s: float = Field(5.0, gt=0)  # how long an open circuit waits before a half-open probe


class TimeoutsConfig(_Strict):
    connect_s: float = Field(2.0, gt=0)
    first_byte_s: float = Field(60.0, gt=0)
    idle_s: float = Field(60.0, gt=0)  # longest gap between two streamed chunks
    total_s: float = Field(600.0, gt=0)


class ScrapeConfig(_Strict):
    enabled: bool = True
    path: str = "/metrics"
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    stale_after_s: float = Field(5.0, gt=0)  # after this, scraped load counts as unknown


class ReplicaConfig(_Strict):
    url: str
    name: str | None = None
    models: tuple[str, ...] = ()
    capacity_blocks: int | None = Field(None, ge=1)
    kv_events: str | None = None  # the engine's KV event publisher, e.g. tcp://10.0.0.5:5557
    kv_events_replay: str | None = (
        None  # its replay socket (vLLM's replay_endpoint), e.g. tcp://10.0.0.5:5558
    )

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq_url(cls, v: str | None) -> str | None:
        if v is not None:
            parts = urlsplit(v)
            if parts.scheme not in ("tcp", "ipc") or (parts.scheme == "tcp" and not parts.port):
                raise ValueError("not a ZMQ endpoint like tcp://host:port")
        return v

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http(s) URL")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError("must be scheme://host:port with no path, query or fragment")
        return v.rstrip("/")

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


class PoolConfig(_Strict):
    replicas: tuple[ReplicaConfig, ...] = ()
    discovery: DiscoveryConfig | None = None  # instead of `replicas`: dns or kubernetes
    policy: str | dict[str, Any] = "ttft"  # the routing benchmark's pick (docs/routing-benchmark.md)
    max_inflight_per_replica: int = Field(64, ge=1)
    health: HealthConfig = HealthConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    retries: int = Field(2, ge=0, le=10)
    capacity_blocks: int | None = Field(None, ge=1)
    upstream_api_key: SecretStr | None = None

    @field_validator("replicas", mode="before")
    @classmethod
    def _short_form(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"url": r} if isinstance(r, str) else r for r in v]
        return v

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
        from policies import PolicyConfigError, build_policy

        try:
            build_policy(v, seed=0)
        except PolicyConfigError as exc:
            raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _replicas_or_discovery(self) -> PoolConfig:
        if self.discovery is None and not self.replicas:
            raise ValueError(
                "replicas: required (a list of replica URLs), unless `discovery` is set"
            )
        if self.discovery is not None and self.replicas:
            raise ValueError("replicas: set either `replicas` or `discovery`, not both")
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> PoolConfig:
        seen: dict[str, int] = {}
        for i, r in enumerate(self.replicas):
            if r.display_name in seen:
                raise ValueError(
                    f"replicas[{i}]: name {r.display_name!r} repeats replicas[{seen[r.display_name]}]"
                )
            seen[r.display_name] = i
        return self


class RouteMatch(_Strict):
    model: str | None = None  # glob, e.g. "qwen*"
    min_prompt_tokens: int | None = Field(None, ge=0)
    max_prompt_tokens: int | None = Field(None, ge=0)

    def matches(self, model: str, prompt_tokens: int) -> bool:
        if self.model is not None and not fnmatch.fnmatchcase(model, self.model):
            return False
        if self.min_prompt_tokens is not None and prompt_tokens < self.min_prompt_tokens:
            return False
        return self.max_prompt_tokens is None or prompt_tokens <= self.max_prompt_tokens


class RouteConfig(_Strict):
    match: RouteMatch = RouteMatch()
    pool: str


class ChunkingConfig(_Strict):
    mode: Literal["bytes", "tokens"] = "bytes"
    block_bytes: int = Field(64, ge=8)
    tokenizer: str | None = None  # a tokenizer.json, or a tokenizer directory holding one
    block_size: int = Field(16, ge=1)
    # tokens mode, chat: None = the tokenizer directory's own template (ChatML when it has
    # none), "chatml" = ChatML, else a template file (.jinja) to render with instead
    chat_template: str | None = None

    @field_validator("chat_template")
    @classmethod
    def _canonical_is_the_default(cls, v: str | None) -> str | None:
        return None if v == "canonical" else v  # the name of the default before templates

    @model_validator(mode="after")
    def _tokens_need_tokenizer(self) -> ChunkingConfig:
        if self.chat_template not in (None, "chatml") and not Path(self.chat_template).is_file():
            raise ValueError(
                f"chat_template: no such file {self.chat_template!r} (null: the tokenizer's "
                "own template; chatml: ChatML; else a .jinja file)"
            )
        if self.mode == "tokens":
            if not self.tokenizer:
                raise ValueError("tokenizer: required when mode is tokens")
            path = Path(self.tokenizer)
            if path.is_dir():
                if not (path / "tokenizer.json").is_file():
                    raise ValueError(
                        f"tokenizer: directory {self.tokenizer!r} has no tokenizer.json"
                    )
            elif not path.is_file():
                raise ValueError(f"tokenizer: no such file or directory {self.tokenizer!r}")
            self._check_template()
        return self

    def _check_template(self) -> None:
        """Compile the template now, so a broken one fails the config, not the first chat."""
        if self.chat_template == "chatml" or self.tokenizer is None:
            return
        key = "chat_template" if self.chat_template else "tokenizer"
        try:
            from prefix_index.templates import load_chat_template

            load_chat_template(self.tokenizer, self.chat_template)
        except ImportError as exc:
            raise ValueError(
                f"{key}: rendering a chat template needs {exc.name} (pip install 'kvgateway[tokens]')"
            ) from None
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None


class EventsConfig(_Strict):
    enabled: bool = False
    routed_ttl_s: float = Field(10.0, gt=0)  # life of a routed-but-not-yet-reported entry
    parity_interval_s: float = Field(300.0, gt=0)  # how often token parity is checked


class IndexConfig(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    chunking: ChunkingConfig = ChunkingConfig()
    capacity_blocks: int = Field(200_000, ge=1)
    # All scopes and replicas together (a scope also counts 8): ~300 MB in memory, see
    # prefix_index/constants.py DEFAULT_MAX_BLOCKS. Past it the least recent scopes go first.
    max_blocks: int = Field(2_000_000, ge=1_000)
    ttl_s: float | None = Field(600.0, gt=0)
    events: EventsConfig = EventsConfig()

    @model_validator(mode="after")
    def _events_need_tokens(self) -> IndexConfig:
        if self.events.enabled and self.chunking.mode != "tokens":
            raise ValueError(
                "events.enabled: KV events require chunking.mode: tokens (the engine reports token ids)"
            )
        if self.events.enabled and self.backend != "memory":
            raise ValueError(
                "events.enabled: KV events require backend: memory (the redis index keeps no engine-reported entries yet)"
            )
        return self


class AdmissionConfig(_Strict):
    shed_status: Literal[429, 503] = 429
    forward_priority: bool = False  # send the class rank as vLLM's `priority` (lower runs first)


class Config(_Strict):
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


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s\"'<>]+")


def _mask_url(m: re.Match[str]) -> str:
    url = m.group()
    scheme, _, rest = url.partition("://")
    # the last @ of the URL ends the userinfo: a password may hold an unescaped / ? # or @
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        return url
    user, colon, password = userinfo.partition(":")
    if not colon or not password:
        return url
    return f"{scheme}://{user}:***@{hostpart}"


def mask_url_passwords(value: Any) -> Any:
    """`value` with the password of every URL's userinfo shown as `***` (`redis://u:***@host/0`):
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


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before", "function-wrap"):
            continue
        elif part.startswith(("function-", "tagged-union")) or part in (
            "str",
            "dict[str,any]",
            "static",
            "dns",
            "kubernetes",
        ):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _message(err: Mapping[str, Any]) -> str:
    kind = err.get("type")
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    msg = str(err.get("msg", "invalid"))
    return msg.removeprefix("Value error, ")


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
        problems = []
        for err in exc.errors():
            loc = _format_loc(tuple(err["loc"]))
            msg = _message(err)
            # a model-level validator names the path below its model: join the two paths
            if loc and _RELATIVE.match(msg):
                parent, _, last = loc.rpartition(".")
                if msg.startswith((last + ".", last + ":", last + "[")):  # the path repeats our key
                    problems.append(f"{parent}.{msg}" if parent else msg)
                else:
                    problems.append(f"{loc}.{msg}")
            else:
                problems.append(f"{loc}: {msg}" if loc else msg)
        raise ConfigError(problems) from None


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
