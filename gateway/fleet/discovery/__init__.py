"""Where a pool's replicas are: a fixed list, a DNS name, or a Kubernetes Service's EndpointSlices.

A `Discovery` yields the pool's whole current endpoint set, first once known, then on every change;
errors keep the last set. Imports nothing from the gateway but its control-plane HTTP client (which
imports nothing from it either), so `config.py` can import it.

```yaml
pools:
  chat:
    discovery: {kind: dns, name: vllm-headless.llm.svc, port: 8000}
    # or {kind: kubernetes, service: vllm, port_name: http}
    # or {kind: static, endpoints: [http://10.0.0.11:8000]}
```

`base` holds what every backend speaks; `static`, `dns` and `kubernetes` one backend each; `config`
the `discovery:` models, each building its backend.
"""

from __future__ import annotations

from gateway.fleet.discovery.base import Discovery, DiscoveryError, Endpoint, Resolver, endpoint
from gateway.fleet.discovery.config import (
    DiscoveryConfig,
    DnsDiscoveryConfig,
    KubernetesDiscoveryConfig,
    StaticDiscoveryConfig,
    open_discovery,
)
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
