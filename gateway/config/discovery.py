"""`pools.<name>.discovery` (and a P/D set's `pools.<name>.prefill|decode.discovery`): one model
per kind; gateway/fleet/discovery's `open_discovery` builds each kind's backend."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StaticDiscoveryConfig(_Strict):
    kind: Literal["static"]
    endpoints: tuple[str, ...] = Field(min_length=1)  # http(s)://host:port; name is host:port

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for i, url in enumerate(v):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
                raise ValueError(f"[{i}]: not an http(s)://host:port URL")
            if parts.path not in ("", "/") or parts.query or parts.fragment:
                raise ValueError(f"[{i}]: must be scheme://host:port with no path")
        return v



class DnsDiscoveryConfig(_Strict):
    kind: Literal["dns"]
    name: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(5.0, gt=0)



class KubernetesDiscoveryConfig(_Strict):
    kind: Literal["kubernetes"]
    service: str = Field(pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
    namespace: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    port_name: str | None = None  # unset: the slice's only TCP port
    label_selector: str | None = None  # ANDed with kubernetes.io/service-name=<service>
    api_url: str | None = None  # unset: in-cluster (KUBERNETES_SERVICE_HOST/PORT, SA token, CA)
    token_path: str | None = None
    ca_path: str | None = None
    scheme: Literal["http", "https"] = "http"  # of the replica URLs
    retry_s: float = Field(2.0, gt=0)  # first backoff after an API error (doubles, up to 30 s)
    watch_timeout_s: int = Field(300, ge=1)



DiscoveryConfig = Annotated[
    StaticDiscoveryConfig | DnsDiscoveryConfig | KubernetesDiscoveryConfig,
    Field(discriminator="kind"),
]

