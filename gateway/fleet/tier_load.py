"""A replica's load rates from its lower KV tiers, as its engine measures them (docs/tiers.md).

The `ttft` scorer prices a lower-tier hit at tokens x bytes per token / the tier's bandwidth.
A configured bandwidth is a guess, and learning it from TTFT residuals is biased where queueing
dominates the TTFT, so the default price is what the engine itself counts: vLLM's
OffloadingConnector adds up the bytes it moved into the GPU from each tier and the seconds that
took, LMCache the tokens its store served and the seconds it spent retrieving them
(gateway/fleet/scrape.py parses both). `TierLoadMeter` turns successive scrapes of those counters into
seconds per byte (vLLM) or per token (LMCache): the ratio of their increases, decayed per scrape
in which something moved so that it follows a link whose speed changes. A counter that went down
(the engine restarted) restarts the tier's sums, its value counted from 0.
"""

from __future__ import annotations

from gateway.fleet.scrape import LoadSample
from prefix_index.tiers import SHARED

DECAY = 0.9  # weight of the past, per scrape in which a tier's loads moved something
_BYTE, _TOKEN = 0, 1


class TierLoadMeter:
    """Per tier: decayed sums of the amount loaded (bytes, or LMCache tokens) and its seconds.

    `rates` is what routing reads (`ReplicaView.tier_load_rates`): tier -> (seconds per byte,
    seconds per token), one of them 0, so that a load of n tokens takes
    n x (kv_bytes_per_token x the first + the second) seconds. A new dict replaces it whenever
    it changes (a view taken earlier keeps the rates it was priced with); None until the engine
    has reported a load."""

    __slots__ = ("rates", "_last", "_sums")

    def __init__(self) -> None:
        self.rates: dict[str, tuple[float, float]] | None = None
        self._last: dict[tuple[str, int], tuple[float, float]] = {}  # counters at the last scrape
        self._sums: dict[tuple[str, int], tuple[float, float]] = {}  # decayed (amount, seconds)

    def update(self, sample: LoadSample) -> None:
        """One scrape's counters (each is the engine's total since it started)."""
        moved = False
        if sample.transfer_bytes is not None and sample.transfer_s is not None:
            spent = sample.transfer_s
            for tier, n in sample.transfer_bytes.items():
                s = spent.get(tier)
                if s is not None:
                    moved |= self._add((tier, _BYTE), n, s)
        if sample.retrieve_tokens is not None and sample.retrieve_s is not None:
            moved |= self._add((SHARED, _TOKEN), sample.retrieve_tokens, sample.retrieve_s)
        if moved:
            self.rates = self._rates()

    def _add(self, key: tuple[str, int], amount: float, seconds: float) -> bool:
        last = self._last.get(key, (0.0, 0.0))
        self._last[key] = (amount, seconds)
        d_amount, d_s = amount - last[0], seconds - last[1]
        old = self._sums.get(key, (0.0, 0.0))
        if d_amount < 0 or d_s < 0:  # the engine restarted: its counters count from 0 again
            d_amount, d_s, old = amount, seconds, (0.0, 0.0)
        if d_amount <= 0:
            return False
        self._sums[key] = (DECAY * old[0] + d_amount, DECAY * old[1] + d_s)
        return True

    def _rates(self) -> dict[str, tuple[float, float]]:
        out: dict[str, tuple[float, float]] = {}
        for (tier, unit), (amount, seconds) in self._sums.items():
            if unit == _BYTE:
                out[tier] = (seconds / amount, 0.0)
        token = self._sums.get((SHARED, _TOKEN))
        if token is not None and SHARED not in out:  # a transfer counter for it says more
            out[SHARED] = (0.0, token[1] / token[0])
        return out
