"""The replicas and what is known of them: pools, per-replica state (health, circuit, scraped
load, LoRA adapters), probes and scrapes, KV-event subscribers, discovery, the load several
gateways share through Redis, and the replicas' series on /metrics."""
