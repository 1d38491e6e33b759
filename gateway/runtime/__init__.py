"""The running gateway: `Gateway` (the current snapshot and what outlives snapshots), the snapshot
and how one is built, the background work (probes, scrapes, discovery, KV events), hot reload."""
