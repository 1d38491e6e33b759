"""Where a gateway's traces go: the `tracing:` section and the standard OTEL_* variables, resolved
once into `Settings` and an exporter (`build_exporter`). Config values win over the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

from opentelemetry.sdk.trace import sampling
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "ExporterName",
    "Settings",
    "TracingConfig",
    "TracingError",
    "build_exporter",
    "resolve",
    "resolve_exporter",
]

ExporterName = Literal["none", "console", "otlp_http", "otlp_grpc"]

DEFAULT_SERVICE_NAME = "kv-gateway"
_HTTP_PATH = "/v1/traces"
_DEFAULT_HTTP = "http://localhost:4318"
_DEFAULT_GRPC = "http://localhost:4317"
_EXTRAS = {
    "otlp_http": ("opentelemetry-exporter-otlp-proto-http", "kvgateway"),
    "otlp_grpc": ("opentelemetry-exporter-otlp-proto-grpc", "kvgateway[otlp-grpc]"),
}


class TracingError(ValueError):
    """Tracing settings (config or OTEL_* environment) are invalid, or need a package not installed."""


class TracingConfig(BaseModel):
    """The `tracing:` section; every unset key falls back to the standard OTEL_* variable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exporter: ExporterName | None = None
    endpoint: str | None = None
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    sampling_ratio: float | None = Field(default=None, ge=0, le=1)
    service_name: str | None = Field(default=None, min_length=1)

    @field_validator("endpoint")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None:
            parts = urlsplit(v)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"not an http(s) URL: {v!r}")
        return v

    @model_validator(mode="after")
    def _otlp_only(self) -> TracingConfig:
        if self.exporter in ("none", "console") and (self.endpoint or self.headers):
            raise ValueError(
                f"endpoint and headers apply only to the otlp exporters, not to '{self.exporter}'"
            )
        return self


@dataclass(frozen=True, slots=True)
class Settings:
    """What the config and the environment resolve to; `endpoint` is where spans are sent.

    `root_bound` is the sampler's decision for a trace that starts here, as the TraceIdRatioBased
    bound on the low 64 bits of the trace id (2**64: always, 0: never), so the request path can
    decide without calling the sampler; with a parent the sampler decides.
    """

    exporter: ExporterName
    endpoint: str | None
    headers: dict[str, str]
    sampler: sampling.Sampler
    service_name: str
    resource: dict[str, str]
    root_bound: int = 1 << 64


def resolve(config: TracingConfig | None, environ: Mapping[str, str]) -> Settings:
    """Config values first, then the standard OTEL_* variables of `environ`, then defaults."""
    cfg = config if config is not None else TracingConfig()
    name = _exporter_name(cfg, environ)
    resource = _parse_pairs(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES")
    service = (
        cfg.service_name
        or environ.get("OTEL_SERVICE_NAME", "").strip()
        or resource.get("service.name")
        or DEFAULT_SERVICE_NAME
    )
    headers: dict[str, str] = {}
    if name in ("otlp_http", "otlp_grpc"):
        var = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
        if not environ.get(var):
            var = "OTEL_EXPORTER_OTLP_HEADERS"
        raw = _parse_pairs(environ.get(var, ""), var)
        headers = {k.lower(): v for k, v in raw.items()}
        headers.update((k.lower(), v.get_secret_value()) for k, v in cfg.headers.items())
    sampler, root_ratio = _sampler(cfg, environ)
    return Settings(
        exporter=name,
        endpoint=_endpoint(name, cfg, environ),
        headers=headers,
        sampler=sampler,
        service_name=service,
        resource=resource,
        root_bound=sampling.TraceIdRatioBased.get_bound_for_rate(root_ratio),
    )


def build_exporter(settings: Settings) -> SpanExporter | None:
    """The exporter the settings name; None for `none`. The OTLP packages are imported lazily."""
    if settings.exporter == "none":
        return None
    if settings.exporter == "console":
        return ConsoleSpanExporter(service_name=settings.service_name)
    try:
        if settings.exporter == "otlp_http":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            return HttpExporter(endpoint=settings.endpoint, headers=settings.headers)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        grpc: SpanExporter = GrpcExporter(endpoint=settings.endpoint, headers=settings.headers)
        return grpc
    except ImportError as exc:
        package, extra = _EXTRAS[settings.exporter]
        raise TracingError(
            f"tracing exporter '{settings.exporter}' needs {package}: pip install '{extra}'"
        ) from exc


def resolve_exporter(
    config: TracingConfig | None, environ: Mapping[str, str]
) -> SpanExporter | None:
    return build_exporter(resolve(config, environ))


def _exporter_name(cfg: TracingConfig, env: Mapping[str, str]) -> ExporterName:
    if cfg.exporter is not None:
        return cfg.exporter
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return "none"
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "none"
    if raw in ("none", "console"):
        return raw  # type: ignore[return-value]
    if raw == "otlp":
        var = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
        if not env.get(var):
            var = "OTEL_EXPORTER_OTLP_PROTOCOL"
        protocol = env.get(var, "").strip().lower() or "http/protobuf"
        if protocol == "http/protobuf":
            return "otlp_http"
        if protocol == "grpc":
            return "otlp_grpc"
        raise TracingError(f"{var}={protocol!r}: supported are 'http/protobuf' and 'grpc'")
    raise TracingError(
        f"OTEL_TRACES_EXPORTER={raw!r}: supported are one of 'otlp', 'console', 'none'"
    )


def _endpoint(name: ExporterName, cfg: TracingConfig, env: Mapping[str, str]) -> str | None:
    if name == "otlp_http":
        if cfg.endpoint:
            # a bare base URL gets the traces path; a URL with a path is used as written
            path = urlsplit(cfg.endpoint).path
            return cfg.endpoint.rstrip("/") + _HTTP_PATH if path in ("", "/") else cfg.endpoint
        if url := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
            return url
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or _DEFAULT_HTTP
        return base.rstrip("/") + _HTTP_PATH
    if name == "otlp_grpc":
        return (
            cfg.endpoint
            or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
            or _DEFAULT_GRPC
        )
    return None


def _sampler(cfg: TracingConfig, env: Mapping[str, str]) -> tuple[sampling.Sampler, float]:
    """The sampler, and the ratio of the traces it keeps among those that start here."""
    if cfg.sampling_ratio is not None:
        ratio = cfg.sampling_ratio
        return sampling.ParentBased(sampling.TraceIdRatioBased(ratio)), ratio
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if name == "always_on":
        return sampling.ALWAYS_ON, 1.0
    if name == "always_off":
        return sampling.ALWAYS_OFF, 0.0
    if name == "parentbased_always_on":
        return sampling.ParentBased(sampling.ALWAYS_ON), 1.0
    if name == "parentbased_always_off":
        return sampling.ParentBased(sampling.ALWAYS_OFF), 0.0
    if name in ("traceidratio", "parentbased_traceidratio"):
        ratio = _ratio(env.get("OTEL_TRACES_SAMPLER_ARG", ""))
        root = sampling.TraceIdRatioBased(ratio)
        return (root if name == "traceidratio" else sampling.ParentBased(root)), ratio
    raise TracingError(
        f"OTEL_TRACES_SAMPLER={name!r}: supported are always_on, always_off, traceidratio, "
        "parentbased_always_on, parentbased_always_off, parentbased_traceidratio"
    )


def _ratio(raw: str) -> float:
    if not raw.strip():
        return 1.0
    try:
        ratio = float(raw)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise TracingError(f"OTEL_TRACES_SAMPLER_ARG={raw!r}: not a ratio in [0, 1]")
    return ratio


def _parse_pairs(raw: str, var: str) -> dict[str, str]:
    """`k1=v1,k2=v2` with percent-encoded values, as the OTEL_* list variables are written."""
    out: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TracingError(f"{var}: {item.strip()!r} is not key=value")
        out[unquote(key).strip()] = unquote(value).strip()
    return out
