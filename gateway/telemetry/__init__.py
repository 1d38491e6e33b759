"""What the gateway tells operators, as a sink that imports nothing of the gateway above it:
Prometheus metrics (and the tallies behind them), the route receipt, the rolling window for the
status page, the request log, and tracing (spans, OTLP export). Collectors of other floors'
state stand with that state (gateway/fleet/metrics.py, gateway/limits/metrics.py)."""
