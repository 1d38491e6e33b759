"""The config of a disaggregated (prefill/decode) pool: `pools.<p>.prefill`, `.decode`, `.protocol`.

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
timed and discovered with (docs/pd.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.sections import HealthConfig, ReplicaConfig, TimeoutsConfig, _Strict
from gateway.fleet.discovery import DiscoveryConfig

if TYPE_CHECKING:
    from gateway.config.sections import PoolConfig

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
