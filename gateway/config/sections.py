"""The models of routes.yaml's sections (`server:`, `pools:` and what a pool holds, `routes:`,
`index:`, `admission:`), each checking its own fields. The whole file, the rules across sections
and loading are the package's (`gateway/config/__init__.py`).

A disaggregated (prefill/decode) pool's: `pools.<p>.prefill`, `.decode`, `.protocol`.

```yaml
pools:
  chat-pd:
    protocol: vllm-nixl          # or sglang
    policy: ttft                 # picks the prefill replica (prefix hit + prefill queue)
    prefill:
      replicas: [http://10.0.0.21:8000]
      bootstrap_port: 8998       # sglang: the prefill servers' --disaggregation-bootstrap-port
                                 # (a replica may set its own: {url: ..., bootstrap_port: 9000})
    decode:
      replicas: [http://10.0.0.31:8000]
      max_inflight_per_replica: 128
```

Each set takes `replicas` or `discovery` (the same `discovery:` an aggregated pool takes: dns,
kubernetes, static; `bootstrap_port` at the set level then applies to every discovered replica)
and, optionally, its own `max_inflight_per_replica`, `health`, `timeouts` and `retries` (else the
pool's). `role_config(…)` turns a set into the plain pool config its replicas are built, probed,
timed and discovered with (docs/pd.md). A set written as a list, `prefill: [url, ...]`, is
`prefill: {replicas: [url, ...]}`.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from gateway.config.discovery import DiscoveryConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestLogConfig(_Strict):
    """`server.request_log:` one `gateway.access` line at info per finished request; `sample`
    is the share of requests logged (0 turns it off). A tenant's `request_log: false` drops its."""

    sample: float = Field(1.0, ge=0, le=1)


class MetricsConfig(_Strict):
    """`server.metrics:` the `model` and `tenant` labels of the request and token counters take
    at most `max_label_values` distinct values each per process; later values read `other`."""

    max_label_values: int = Field(100, ge=1, le=10_000)


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

    `keep_alive_s`: a kept-alive client connection idle this long is closed. Longer than the
    idle time of the clients' connection pools (aiohttp 15 s, httpx and the OpenAI SDK 5 s, Go
    90 s, load balancers 60 s), so that the client, not the gateway, ends an idle connection: a
    server that closes one first races the client's next request on it. Every close the gateway
    makes is a lingering one (FIN, then the client's bytes read and dropped), never a reset.
    """

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_body_bytes_in_flight: int | None = Field(256 * 1024 * 1024, ge=1024)  # None: no cap
    max_answer_bytes_in_flight: int | None = Field(256 * 1024 * 1024, ge=1024)  # None: no cap
    graceful_shutdown_s: float = Field(30.0, ge=0)
    keep_alive_s: float = Field(120.0, gt=0)  # idle client connections close after this
    body_timeout_s: float = Field(30.0, gt=0)  # deadline for a WHOLE request body, from its start
    max_connections: int | None = Field(None, ge=1)  # requests in flight; health probes exempt
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    # true: error bodies also name replicas, their addresses and why each attempt failed
    expose_upstream_errors: bool = False
    request_log: RequestLogConfig = RequestLogConfig()
    metrics: MetricsConfig = MetricsConfig()
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
    """`pools.<p>.health:`. A replica that refuses or resets a connection, answers 5xx or breaks
    a stream fails; one that only times out (a connect, a first byte, a probe) is busy, not dead,
    as long as it was heard from (it sent a byte of anything: a request's answer, a probe's, a
    scrape's) within `dead_after_s`: its timeouts fail over but open no circuit. Silent longer,
    its timeouts count as failures too (a hung process, a host out of reach)."""

    path: str = "/health"
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    failures_to_open: int = Field(3, ge=1)
    open_s: float = Field(5.0, gt=0)  # how long an open circuit waits before a half-open probe
    dead_after_s: float = Field(10.0, gt=0)  # silent this long, timeouts count as failures


class TimeoutsConfig(_Strict):
    connect_s: float = Field(2.0, gt=0)
    first_byte_s: float = Field(60.0, gt=0)
    idle_s: float = Field(60.0, gt=0)  # longest gap between two streamed chunks
    total_s: float = Field(600.0, gt=0)


class ScrapeConfig(_Strict):
    """`pools.<p>.scrape:`. A busy replica answers `/metrics` slowly: a scrape waits for it up
    to `timeout_s` (its answer is still fresh load), and a slow or failed scrape never counts
    against the replica's health."""

    enabled: bool = True
    path: str = "/metrics"
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(4.0, gt=0)
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


ResumeTrigger = Literal["reset", "truncated", "malformed", "error_event", "idle_timeout", "drain"]
RESUME_TRIGGERS: tuple[ResumeTrigger, ...] = (
    "reset", "truncated", "malformed", "error_event", "idle_timeout", "drain",
)  # fmt: skip


class ResumeConfig(_Strict):
    """`pools.<p>.resume:` a streamed chat or completions answer whose replica fails after the
    first byte goes on on another replica (docs/resume.md). `attempts`: resumes a request may
    use; `on`: the failures that trigger one; `engine`: how its replicas give token ids (vLLM:
    chat and completions; SGLang: completions only); `from_text`: an answer without ids (a
    SGLang chat) goes on from its text (`continue_final_message`), counted inexact; `whole`: a
    non-streamed request is streamed from the engine and answered whole, so that it resumes too."""

    enabled: bool = True
    attempts: int = Field(2, ge=1, le=10)
    on: tuple[ResumeTrigger, ...] = RESUME_TRIGGERS
    engine: Literal["vllm", "sglang"] = "vllm"
    from_text: bool = False
    whole: bool = False  # non-streamed answers are streamed from the engine, answered whole


class LoraConfig(_Strict):
    """LoRA adapters of a pool's replicas (docs/lora.md). Read from the replicas by default;
    `manage: true` lets the gateway load `adapters` onto replicas that allow runtime updates."""

    refresh_s: float = Field(5.0, gt=0)  # how often each replica's /v1/models is read
    max_loras: int | None = Field(None, ge=1)  # GPU adapter slots; else the metric's, else 1
    manage: bool = False
    adapters: dict[str, str] = {}  # name -> path the replica loads it from (manage)
    max_replicas_per_adapter: int = Field(2, ge=1)  # managed: replicas an adapter may hold
    requests_per_replica: int = Field(4, ge=1)  # managed: in flight per replica before another
    idle_unload_s: float = Field(60.0, gt=0)  # managed: unload an adapter idle this long
    load_timeout_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _adapters_to_manage(self) -> LoraConfig:
        if self.manage and not self.adapters:
            raise ValueError("adapters: required with manage: true (name: path of each adapter)")
        return self


class PoolConfig(_Strict):
    replicas: tuple[ReplicaConfig, ...] = ()
    discovery: DiscoveryConfig | None = None  # instead of `replicas`: dns or kubernetes
    policy: str | dict[str, Any] = (
        "ttft"  # the routing benchmark's pick (docs/routing-benchmark.md)
    )
    max_inflight_per_replica: int = Field(64, ge=1)
    health: HealthConfig = HealthConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    retries: int = Field(2, ge=0, le=10)
    capacity_blocks: int | None = Field(None, ge=1)
    upstream_api_key: SecretStr | None = None
    # tokens-per-minute limits: what a request that sets no max_tokens is charged for its
    # answer (None: the engine's context less the prompt, from its /v1/models max_model_len)
    default_max_tokens: int | None = Field(None, ge=1, le=10_000_000)
    lora: LoraConfig = LoraConfig()
    resume: ResumeConfig = ResumeConfig()
    protocol: Literal["vllm-nixl", "sglang"] | None = None  # P/D: two sets (PdSetConfig)
    prefill: PdSetConfig | None = None
    decode: PdSetConfig | None = None

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
        from gateway.config.sections import pd_problem

        if (problem := pd_problem(self)) is not None:
            raise ValueError(problem)
        if self.prefill is not None:
            return self
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


def redis_url_problem(url: str) -> str | None:
    """Why `url` is not a Redis URL the client can open, or None: one node (redis://, rediss://,
    unix://), Sentinel (redis+sentinel://) or Cluster (redis+cluster://), options and the
    KVGW_REDIS_* environment as prefix_index/redis_client.py reads them. The URL itself is never
    part of the answer: it may hold a password."""
    from prefix_index.redis_client import redis_url_problem as problem

    return problem(url)


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
    # memory backend: written on shutdown, read at start when younger than snapshot_max_age_s
    snapshot_path: str | None = None
    snapshot_max_age_s: float = Field(600.0, gt=0)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        problem = redis_url_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _events_need_tokens(self) -> IndexConfig:
        if self.events.enabled and self.chunking.mode != "tokens":
            raise ValueError(
                "events.enabled: KV events require chunking.mode: tokens (the engine reports token ids)"
            )
        if self.snapshot_path is not None and self.backend != "memory":
            raise ValueError(
                "snapshot_path: only the memory index writes a snapshot (the redis index "
                "outlives a gateway by itself)"
            )
        return self


class AdmissionConfig(_Strict):
    shed_status: Literal[429, 503] = 429
    forward_priority: bool = False  # send the class rank as vLLM's `priority` (lower runs first)


class FleetConfig(_Strict):
    """`fleet:` gateways that front the same replicas share their load through Redis
    (gateway/fleet/shared_load.py, docs/scaleout.md). `shared_load: null` (the default) follows the
    index: on with `index.backend: redis`, off with the memory index. With it on,
    `max_inflight_per_replica` is a fleet-wide cap: each gateway counts its own requests plus
    the others' as of their last tick or push (gateway/fleet/shared_load.py)."""

    shared_load: bool | None = None  # None: on when index.backend is redis
    redis_url: str | None = None  # None: index.redis_url
    name: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    gateway_id: str | None = Field(None, min_length=1, max_length=128)  # None: host-pid-random
    # the tick (liveness, learned sums, the whole picture); the pushes carry load between ticks
    publish_interval_ms: float = Field(100.0, ge=1, le=10_000)
    # between ticks, own figures are pushed within this long of a change (0: ticks only)
    push_interval_ms: float = Field(2.0, ge=0, le=10_000)
    stale_after_s: float = Field(3.0, gt=0, le=600)

    @field_validator("gateway_id", mode="before")
    @classmethod
    def _empty_id_is_default(cls, v: Any) -> Any:
        return None if v == "" else v  # `${POD_NAME:-}` outside Kubernetes

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        problem = None if v is None else redis_url_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _tick_inside_staleness(self) -> FleetConfig:
        if self.publish_interval_ms / 1000 * 3 > self.stale_after_s:
            raise ValueError(
                "stale_after_s: must be at least 3 publish intervals, or live gateways would "
                "count as gone between their ticks"
            )
        return self


Protocol = Literal["vllm-nixl", "sglang"]
ROLES = ("prefill", "decode")


class PdReplicaConfig(ReplicaConfig):
    """A replica of a P/D set; an SGLang prefill replica may name its own bootstrap port."""

    bootstrap_port: int | None = Field(None, ge=1, le=65535)


class PdSetConfig(_Strict):
    """One role's replica set of a disaggregated pool."""

    replicas: tuple[PdReplicaConfig, ...] = ()
    discovery: DiscoveryConfig | None = None  # instead of `replicas`: dns, kubernetes or static
    max_inflight_per_replica: int | None = Field(None, ge=1)
    health: HealthConfig | None = None
    timeouts: TimeoutsConfig | None = None
    retries: int | None = Field(None, ge=0, le=10)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)  # sglang prefill: bootstrap server

    @model_validator(mode="before")
    @classmethod
    def _a_set(cls, v: Any) -> Any:
        if isinstance(v, list):  # `prefill: [url, ...]`: its replicas, as a pool's `replicas`
            return {"replicas": v}
        if isinstance(v, dict) and "replicas" not in v and "discovery" not in v:
            raise ValueError(
                "expected a replica set: a mapping with `replicas` (a list of replica URLs) "
                "or `discovery`"
            )
        return v

    @model_validator(mode="after")
    def _replicas_or_discovery(self) -> PdSetConfig:
        if self.discovery is not None and self.replicas:
            raise ValueError("replicas: set either `replicas` or `discovery`, not both")
        if self.discovery is None and not self.replicas:
            raise ValueError("replicas: required (a list of replica URLs), unless `discovery` is set")
        return self

    @field_validator("replicas", mode="before")
    @classmethod
    def _short_form(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("expected at least one replica URL")
            return [{"url": r} if isinstance(r, str) else r for r in v]
        return v


def pd_problem(pc: PoolConfig) -> str | None:
    """What is wrong with a pool's P/D keys, as `key: message`; None when they are consistent."""
    sets = {r: getattr(pc, r) for r in ROLES}
    given = [r for r, s in sets.items() if s is not None]
    if not given:
        return (
            "protocol: only for a disaggregated pool (with prefill: and decode:)"
            if pc.protocol
            else None
        )
    if len(given) == 1:
        missing = next(r for r in ROLES if r not in given)
        return f"{missing}: required with {given[0]}: (a disaggregated pool has both sets)"
    if pc.protocol is None:
        return "protocol: required for a disaggregated pool (vllm-nixl or sglang)"
    if pc.replicas or pc.discovery is not None:
        return "replicas: a disaggregated pool lists its replicas under prefill: and decode:"
    for role in ROLES:
        s = sets[role]
        assert s is not None
        ports = [("", s.bootstrap_port)] + [
            (f".replicas[{i}]", r.bootstrap_port) for i, r in enumerate(s.replicas)
        ]
        for where, port in ports:
            if port is not None and (role == "decode" or pc.protocol != "sglang"):
                return f"{role}{where}.bootstrap_port: only an sglang pool's prefill set has a bootstrap server"
    seen: dict[str, str] = {}
    for role in ROLES:
        s = sets[role]
        assert s is not None
        for i, r in enumerate(s.replicas):
            where = f"{role}.replicas[{i}]"
            if r.display_name in seen:
                return f"{where}: name {r.display_name!r} repeats {seen[r.display_name]}"
            seen[r.display_name] = where
    return None


def role_config(pc: PoolConfig, role: str) -> PoolConfig:
    """The plain pool config of one role's set: its replicas, its settings over the pool's."""
    s: PdSetConfig | None = getattr(pc, role)
    assert s is not None
    return pc.model_copy(
        update={
            "replicas": s.replicas,
            "discovery": s.discovery,
            "max_inflight_per_replica": s.max_inflight_per_replica or pc.max_inflight_per_replica,
            "health": s.health or pc.health,
            "timeouts": s.timeouts or pc.timeouts,
            "retries": pc.retries if s.retries is None else s.retries,
            "prefill": None,
            "decode": None,
            "protocol": None,
        }
    )

# PoolConfig names PdSetConfig before it is defined: resolve that now, so every model's fields
# hold types (the error wording walks them: gateway/config/errors.py)
PoolConfig.model_rebuild()
