"""bench.trace_encode times the one pass against build-then-encode on the same traces: the two
ways give the same bytes for them (with the child span ids drawn from the same random state),
and the bench prints both and their ratio (no figure is asserted: no test asserts a time)."""

from __future__ import annotations

import random

import pytest

from bench.trace_encode import main, traces
from gateway.telemetry.otlp import OtlpHttpSink
from gateway.telemetry.tracing import Tracing, TracingConfig


@pytest.mark.parametrize("streamed", [False, True])
def test_both_ways_give_the_same_bytes(streamed: bool) -> None:
    tracing = Tracing(
        TracingConfig(exporter="otlp_http", endpoint="http://127.0.0.1:9"), environ={}
    )
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    for rt in traces(tracing, 20, streamed):
        state = random.getstate()
        one = sink.encoder.encode(rt)
        assert rt.given is not None  # the one pass ran: nothing was built
        random.setstate(state)
        rt.build()
        assert one == sink.encoder.built(rt)
    tracing.shutdown()


def test_it_prints_both_ways_and_their_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--traces", "20", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "two passes" in out and "one pass" in out and "one pass / two passes" in out
