"""What the gateway tells operators: Prometheus metrics (and the tallies behind them), the
request record and its recording, the route receipt, the rolling window for the status page,
the request log, and tracing (spans, OTLP export)."""
