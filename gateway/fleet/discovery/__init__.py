"""Where a pool's replicas are: a fixed list, a DNS name, or a Kubernetes Service's EndpointSlices.

A `Discovery` yields the pool's whole current endpoint set, first once known, then on every change;
errors keep the last set. Imports nothing from the gateway but its control-plane HTTP client and
the `discovery:` models (gateway/config/discovery.py).

```yaml
pools:
  chat:
    discovery: {kind: dns, name: vllm-headless.llm.svc, port: 8000}
    # or {kind: kubernetes, service: vllm, port_name: http}
    # or {kind: static, endpoints: [http://10.0.0.11:8000]}
```

`base` holds what every backend speaks; `static`, `dns` and `kubernetes` one backend each;
`open_discovery` builds the backend a `discovery:` model names.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from gateway.config.discovery import (
    DiscoveryConfig,
    DnsDiscoveryConfig,
    KubernetesDiscoveryConfig,
    StaticDiscoveryConfig,
)
from gateway.fleet.discovery.base import Discovery, DiscoveryError, Endpoint, Resolver, endpoint
from gateway.fleet.discovery.dns import DnsDiscovery, getaddrinfo_resolver
from gateway.fleet.discovery.kubernetes import SERVICE_ACCOUNT_DIR, KubernetesDiscovery
from gateway.fleet.discovery.static import StaticDiscovery

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "Discovery",
    "DiscoveryConfig",
    "DiscoveryError",
    "DnsDiscovery",
    "DnsDiscoveryConfig",
    "Endpoint",
    "KubernetesDiscovery",
    "KubernetesDiscoveryConfig",
    "Resolver",
    "StaticDiscovery",
    "StaticDiscoveryConfig",
    "endpoint",
    "getaddrinfo_resolver",
    "open_discovery",
]


def open_discovery(config: DiscoveryConfig) -> Discovery:
    """The backend a `discovery:` model names."""
    if isinstance(config, StaticDiscoveryConfig):
        found = []
        for url in config.endpoints:
            parts = urlsplit(url)
            assert parts.hostname is not None and parts.port is not None  # checked by the model
            found.append(endpoint(parts.scheme, parts.hostname, parts.port))
        return StaticDiscovery(found)
    if isinstance(config, DnsDiscoveryConfig):
        return DnsDiscovery(
            config.name, config.port, config.scheme, config.interval_s, timeout_s=config.timeout_s
        )
    return KubernetesDiscovery(
        config.service,
        config.namespace,
        port_name=config.port_name,
        label_selector=config.label_selector,
        api_url=config.api_url,
        token_path=config.token_path,
        ca_path=config.ca_path,
        scheme=config.scheme,
        retry_s=config.retry_s,
        watch_timeout_s=config.watch_timeout_s,
    )
