"""The replicas and what is known of them: pools, per-replica state (health, circuit, scraped
load, LoRA), the background monitors (probes, scrapes, KV-event subscribers, discovery), and the
load several gateways share through Redis."""
