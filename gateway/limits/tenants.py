"""Tenants: who sent a request (API key → Tenant), which priority class it may use, its limits.

Keys live in memory only as SHA-256 digests and are compared by digest; no key reaches a message.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from gateway.errors import BadRequest, Forbidden, Unauthorized
from gateway.limits.ratelimit import Rule, Unit

AuthMode = Literal["required", "off"]
ANONYMOUS = "anonymous"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_ECHO = 64  # longest client-sent class name repeated in an error message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RateLimits(_Strict):
    """Bucket rates of one scope. `burst_s` is the bucket depth in seconds of its rate; unset, a
    per-second limit holds 1 s and a per-minute limit 60 s (the whole minute may come at once)."""

    requests_per_second: float | None = Field(default=None, gt=0)
    requests_per_minute: float | None = Field(default=None, gt=0)
    tokens_per_minute: float | None = Field(default=None, gt=0)
    burst_s: float | None = Field(default=None, gt=0)

    def rules(self, prefix: str = "") -> list[Rule]:
        scopes: list[tuple[float | None, float, Unit, str]] = [
            (self.requests_per_second, 1.0, "requests", "requests/s"),
            (_per_s(self.requests_per_minute), 60.0, "requests", "requests/min"),
            (_per_s(self.tokens_per_minute), 60.0, "tokens", "tokens/min"),
        ]
        out: list[Rule] = []
        for per_s, window, unit, name in scopes:
            if per_s is not None:
                depth = max(1.0, per_s * (self.burst_s or window))
                out.append(Rule(prefix + name, per_s, depth, unit))
        return out


def _per_s(per_min: float | None) -> float | None:
    return None if per_min is None else per_min / 60.0


class LimitsConfig(RateLimits):
    """Tenant-wide limits, plus per-model ones: the first glob that matches adds its own buckets."""

    per_model: dict[str, RateLimits] = {}


class PriorityClassConfig(_Strict):
    """One entry of `priority_classes:`. Only `rank` is required; the queue bounds default to the
    `interactive` class's (a class that sheds early rather than one that queues for minutes)."""

    rank: int = Field(ge=0)  # lower is served first (vLLM's direction)
    max_queue_wait_s: float = Field(2.0, gt=0)
    max_queue_len: int = Field(1000, ge=0)


BUILTIN_CLASSES: dict[str, dict[str, Any]] = {
    "interactive": {"rank": 0, "max_queue_wait_s": 2.0, "max_queue_len": 1000},
    "batch": {"rank": 1, "max_queue_wait_s": 120.0, "max_queue_len": 10000},
}


def default_classes() -> dict[str, PriorityClassConfig]:
    return {name: PriorityClassConfig(**raw) for name, raw in BUILTIN_CLASSES.items()}


def merge_builtin_classes(given: Any) -> Any:
    """`priority_classes:` as written, laid over the built-in classes: a class named like a
    built-in one takes the keys it omits from it, other classes are added, and `name: null`
    removes a built-in class. Anything that is not a mapping is returned for the model to refuse."""
    if not isinstance(given, Mapping):
        return given
    merged: dict[Any, Any] = {name: dict(raw) for name, raw in BUILTIN_CLASSES.items()}
    for name, raw in given.items():
        if raw is None:
            if name not in BUILTIN_CLASSES:
                raise ValueError(
                    f"{name}: null removes a built-in class ({', '.join(BUILTIN_CLASSES)}), "
                    f"and {name!r} is not one"
                )
            merged.pop(name)
        elif isinstance(raw, Mapping) and name in BUILTIN_CLASSES:
            merged[name] = {**BUILTIN_CLASSES[name], **raw}
        else:
            merged[name] = raw
    return merged


class TenantConfig(_Strict):
    name: str = Field(min_length=1)
    api_keys: tuple[SecretStr, ...] = ()
    api_key_sha256: tuple[str, ...] = ()
    priority: str = "interactive"
    allowed_priorities: tuple[str, ...] | None = None  # None: only `priority`
    limits: LimitsConfig = LimitsConfig()
    weight: float = Field(default=1.0, gt=0)
    # A secret the gateway sends as `cache_salt` (before the client's own salt): the engine then
    # shares none of this tenant's KV blocks with other tenants, and the index scopes them apart.
    cache_salt: SecretStr | None = Field(default=None, min_length=8)
    request_log: bool = True  # false: none of this tenant's requests is in the request log

    @field_validator("api_keys")
    @classmethod
    def _no_empty_keys(cls, v: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        for i, key in enumerate(v):
            if not key.get_secret_value().strip():
                raise ValueError(f"[{i}]: empty API key")
        return v

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = tuple(d.strip().lower() for d in v)
        for i, d in enumerate(out):
            if not _HEX64.fullmatch(d):
                raise ValueError(f"[{i}]: not a SHA-256 hex digest (64 hex characters)")
        return out

    def digests(self) -> list[str]:
        return [_digest(k.get_secret_value().strip().encode()) for k in self.api_keys] + list(
            self.api_key_sha256
        )


def _digest(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


def check_tenants(
    tenants: Sequence[TenantConfig], classes: Mapping[str, PriorityClassConfig]
) -> None:
    """Cross-field rules; raises ValueError naming the key path (`tenants[1].priority: ...`)."""
    if not classes:
        raise ValueError("priority_classes: at least one class is required")
    ranks: dict[int, str] = {}
    for name, c in classes.items():
        holder = ranks.get(c.rank)
        if holder is not None:
            hint = (
                f" (a built-in class: give one of them another rank, or remove it with "
                f"`{holder}: null`)"
                if holder in BUILTIN_CLASSES and name not in BUILTIN_CLASSES
                else ""
            )
            raise ValueError(
                f"priority_classes.{name}.rank: {c.rank} is also the rank of {holder!r}{hint}"
            )
        ranks[c.rank] = name
    defined = ", ".join(sorted(classes))
    names: dict[str, int] = {}
    keys: dict[str, int] = {}
    for i, t in enumerate(tenants):
        if t.name in names:
            raise ValueError(f"tenants[{i}].name: {t.name!r} repeats tenants[{names[t.name]}]")
        names[t.name] = i
        if t.priority not in classes:
            raise ValueError(
                f"tenants[{i}].priority: unknown priority class {t.priority!r} (defined: {defined})"
            )
        for j, p in enumerate(t.allowed_priorities or ()):
            if p not in classes:
                raise ValueError(
                    f"tenants[{i}].allowed_priorities[{j}]: unknown priority class {p!r} "
                    f"(defined: {defined})"
                )
        for d in t.digests():
            if d in keys:
                other = keys[d]
                where = "twice in this tenant" if other == i else f"also in tenants[{other}]"
                raise ValueError(f"tenants[{i}]: an API key is {where}; keys must be unique")
            keys[d] = i


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: str  # default class
    allowed_priorities: frozenset[str]  # always holds `priority`
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    weight: float = 1.0
    cache_salt: str | None = None  # sent to the engine as cache_salt: this tenant's KV is its own
    request_log: bool = True  # its requests are in the request log (`gateway.access`)

    def rules(self, model: str) -> list[Rule]:
        """Buckets for a request to `model`: tenant-wide, then the first matching per-model glob."""
        out = self.limits.rules()
        for glob, lim in self.limits.per_model.items():
            if fnmatch.fnmatchcase(model, glob):
                out += lim.rules(prefix=f"model[{glob}]:")
                break
        return out


def _tenant(c: TenantConfig) -> Tenant:
    allowed = frozenset(c.allowed_priorities or ()) | {c.priority}
    salt = c.cache_salt.get_secret_value() if c.cache_salt is not None else None
    return Tenant(c.name, c.priority, allowed, c.limits, c.weight, salt, c.request_log)


def requested_priority(header: bytes | None, body: Mapping[str, Any]) -> str | None:
    """The class a request asks for: the `x-priority` header, else a string `priority` in the body.

    An integer body `priority` is vLLM's own field, not a class name, and is ignored here.
    """
    if header is not None:
        return header.decode("latin-1").strip()
    p = body.get("priority")
    return p if isinstance(p, str) else None


class TenantDirectory:
    """Identifies tenants by API key and decides their priority class.

    auth "required": every request needs a known key. auth "off": a known key still picks its
    tenant; a missing or unknown one means the anonymous tenant. A configured tenant named
    "anonymous" replaces the built-in one (to give unauthenticated traffic limits or classes).
    `auth=None` means required when any tenant has a key, off otherwise.
    """

    def __init__(
        self,
        auth: AuthMode | None,
        tenants: Sequence[TenantConfig],
        classes: Mapping[str, PriorityClassConfig],
    ) -> None:
        check_tenants(tenants, classes)
        self.classes = dict(classes)
        self._by_digest: dict[str, Tenant] = {}
        self.tenants: dict[str, Tenant] = {}
        for c in tenants:
            t = _tenant(c)
            self.tenants[t.name] = t
            for d in c.digests():
                self._by_digest[d] = t
        if auth is None:
            auth = "required" if self._by_digest else "off"
        if auth not in ("required", "off"):
            raise ValueError(f"auth: must be 'required' or 'off', not {auth!r}")
        if auth == "required" and not self._by_digest:
            raise ValueError("auth: 'required' but no tenant has an API key")
        self.auth: AuthMode = auth
        default = (
            "interactive"
            if "interactive" in classes
            else min(classes, key=lambda n: classes[n].rank)
        )
        self.anonymous = self.tenants.get(ANONYMOUS) or Tenant(
            ANONYMOUS, default, frozenset({default})
        )
        # tenants whose requests the request log leaves out (`tenants[].request_log: false`)
        self.unlogged = frozenset(n for n, t in self.tenants.items() if not t.request_log)

    def __repr__(self) -> str:
        return f"TenantDirectory(auth={self.auth!r}, tenants={sorted(self.tenants)!r})"

    def identify(self, authorization: bytes | None) -> Tenant:
        key = _bearer(authorization)
        if key is None:
            if self.auth == "off":
                return self.anonymous
            raise Unauthorized(
                "Missing API key: send it in the Authorization header as 'Bearer <key>'"
            )
        tenant = self._by_digest.get(_digest(key))
        if tenant is not None:
            return tenant
        if self.auth == "off":
            return self.anonymous
        raise Unauthorized("Invalid API key")

    def priority_for(self, tenant: Tenant, requested: str | None) -> str:
        if requested is None or requested == "":
            return tenant.priority
        if requested not in self.classes:
            shown = requested[:_MAX_ECHO]
            raise BadRequest(
                f"Unknown priority class {shown!r} (defined: {', '.join(sorted(self.classes))})",
                param="priority",
                code="invalid_priority",
            )
        if requested not in tenant.allowed_priorities:
            raise Forbidden(
                f"Tenant '{tenant.name}' may not use priority class '{requested}' "
                f"(allowed: {', '.join(sorted(tenant.allowed_priorities))})",
                param="priority",
                code="priority_not_allowed",
            )
        return requested

    def vllm_priority(self, class_name: str) -> int:
        """The class rank, for vLLM's integer `priority` (lower is scheduled earlier)."""
        return self.classes[class_name].rank


def _bearer(authorization: bytes | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, rest = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    key = rest.strip()
    return key or None
