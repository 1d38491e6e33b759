"""Counters and histograms kept as plain numbers, turned into Prometheus families at scrape time.

prometheus-client's own metrics take a lock per `inc`/`observe` and look their labelled child up
per call; the request path records about a dozen of them per request. Here a labelled child is a
slot object found once per label set, and `inc`/`observe` are an addition (and a bisect). All of
it runs on the event loop's thread, scrapes included, so nothing needs a lock. The exposition is
the same as prometheus-client's: `<name>_total` for counters; `_bucket`/`_sum`/`_count` with
cumulative `le` buckets for histograms; no `_created` series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["OTHER", "CounterTally", "HistogramTally", "LabelCap", "Tallies"]

Labels = tuple[str, ...]


class _Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, n: float = 1) -> None:
        self.value += n


class _Hist:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1  # the first bucket whose bound >= v
        self.sum += v


Child = TypeVar("Child", _Count, _Hist)


class _Tally(Generic[Child]):
    """A labelled metric: one child per label set, made on first use."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str]) -> None:
        self.name, self.doc, self.labelnames = name, doc, list(labelnames)
        self.children: dict[Labels, Child] = {}

    def labels(self, *values: str) -> Child:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values!r}")
            child = self.children[values] = self._child()
        return child

    def _child(self) -> Child:
        raise NotImplementedError


class CounterTally(_Tally[_Count]):
    """A labelled counter: `labels(*values).inc(n)`."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str]) -> None:
        super().__init__(name.removesuffix("_total"), doc, labelnames)

    def _child(self) -> _Count:
        return _Count()

    def family(self) -> Metric:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, child in self.children.items():
            fam.add_metric(list(values), child.value)
        return fam


class HistogramTally(_Tally[_Hist]):
    """A labelled histogram with fixed upper bounds: `labels(*values).observe(v)`."""

    def __init__(
        self, name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        super().__init__(name, doc, labelnames)
        self.bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"{name}: buckets must increase: {buckets!r}")

    def _child(self) -> _Hist:
        return _Hist(self.bounds)

    def family(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        names = [_le(b) for b in self.bounds] + ["+Inf"]
        for values, child in self.children.items():
            cumulative, buckets = 0, []
            for le, n in zip(names, child.counts, strict=True):
                cumulative += n
                buckets.append((le, cumulative))
            fam.add_metric(list(values), buckets, child.sum)
        return fam


OTHER = "other"


class LabelCap:
    """The values one label may take: the first `limit` distinct ones as they are, every later one
    as `other`, so a label whose values clients choose (a model name) keeps a bounded series count.
    Lowering `limit` folds only values not seen yet; the ones kept keep their series."""

    __slots__ = ("limit", "kept")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept: dict[str, str] = {}

    def __call__(self, value: str) -> str:
        got = self.kept.get(value)
        if got is not None:
            return got
        if len(self.kept) >= self.limit:
            return OTHER
        self.kept[value] = value
        return value


class Tallies(Collector):
    """The collector of a set of tallies (registered once per registry)."""

    def __init__(self, tallies: Sequence[CounterTally | HistogramTally]) -> None:
        self.tallies = list(tallies)

    def collect(self) -> Iterator[Metric]:
        for t in self.tallies:
            yield t.family()


def _le(bound: float) -> str:
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]  # as prometheus-client writes `le`
