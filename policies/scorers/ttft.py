"""TTFT scorer: the replica expected to produce the first token soonest, learned per replica.

    uncached = max(0, prompt_tokens - hit_blocks * tokens_per_block * kept)
    queued   = inflight_prompt_tokens        (uncached tokens the gateway sent, not yet prefilled)
    ttft     = a + b * uncached + c * queued (+ hold_s * kv_waits, below)           (seconds)
               (opt-in: + d * load + kv_s * k / (1 - k))
    cost     = ttft + recompute * b * redo * (1 + the candidates' mean load)
               (redo: the prefix tokens another candidate holds that this one would recompute)
    score    = min_cost / cost               (1.0 for the cheapest candidate)

`recompute` (1 by default) prices the prefill the fleet redoes when a request leaves the replica
holding most of its prefix; `predict` is the TTFT alone. By default (`recompute_load: fleet`)
it is priced once, and once more for each request in flight per replica of the fleet: a
saturated fleet of n replicas is one server, and the prefill it redoes delays each request it
holds by 1/n of it. `recompute_load: true` prices it by the load of the replica that would redo
it instead, `false` once; `recompute: 0` is the latency-only score, which was the default until
issue 43: on real vLLM under overload it kept fewer shared prefixes than sglang-router by
recomputing what a loaded replica held (engine hit 0.41 vs 0.47 on vLLM's prefix_repetition), and
the fleet's extra prefill came back as queueing (bench/engine_routing.py, docs/benchmarks.md).

`kept` is the share of this replica's predicted hits its engine reported reusing
(`usage.prompt_tokens_details.cached_tokens`, the route receipt's two numbers): a decayed mean
over the requests that expected a hit, pulled toward 1 with `prior_weight` requests' weight; 1
while the engine reports nothing. Where the index lists blocks the engine no longer has (an
engine whose KV is smaller than it reported or configured, a cache reset the gateway did not
see), a score that believed them would keep sending work to the replica that "holds" it; the
receipts correct it (each gateway of a fleet learns it from the answers it relays). The fit learns from the prefill the engine did (the prompt less what it
reported reusing) where it reported.

The other opt-in terms (`load_s`, `kv_s`, 0 by default) did not beat the score without them on
real vLLM (docs/benchmarks.md) nor in the simulator's routing bench; the default already breaks
its near ties by the engine's load. `load` is the requests ahead on the engine
(`ReplicaView.load`: the fresh scrape's running + waiting, or the gateway's own in-flight count
when higher or when the scrape is stale): a request that only decodes still slows every step a
new prefill runs in. `d` is learned for the pool from the fit's residuals, pulled toward
`load_s` (0: off). `k` is the engine's KV use from a fresh scrape; a replica without one is
priced as the fullest known (unknown is not idle).

a, b, c are fitted per replica from Outcomes by exponentially weighted ridge least squares,
pulled toward the prior a = base_s, b = 1 / prefill_tokens_per_s and c = b: a queued token is
prefill on the same replica, so until its requests met queues it costs what an uncached token is
learned to cost there (a fixed prior for c stayed put while b learned the replica's real speed:
over HTTP at a simulated speedup of 5, or on engines 5x faster than the prior, queued tokens were
priced 3-5x an uncached one and repeats left the replica holding their prefix). A replica with no
observations of its own is predicted with the mean fit of the replicas that have some (replicas of
a pool are alike), and with the prior before any observation at all; so a newly learned replica
does not look faster than idle ones that were simply not tried yet. `prior_weight` is how many
observations the prior is worth; `decay` forgets old observations so the fit follows a replica
whose speed changes.

On a replica that serves LoRA adapters (`ReplicaView.lora`), the time the request's adapter
adds is priced on top (policies/scorers/lora.py: 0 when it is active or resident there, one load
with a free slot, a load and a penalty to evict an idle one, a load and a wait when every slot is
busy); the load time is learned from the TTFTs of requests that needed one (their residual
against the fit), and those TTFTs enter the fit without it. Replicas without LoRA: unchanged.

Across a fleet of gateways (shared load, gateway/fleet/shared_load.py) each gateway shares its own
decayed sums (`share`) and folds in the others' (`absorb`): the sums add, so every gateway fits
the same coefficients from all of the fleet's observations (as of the last tick or push).

Each request in flight on a replica also holds KV until it ends (its prompt, in
`ReplicaView.inflight_kv_tokens`). Where the engine's KV (`kv_tokens`, its cache_config_info)
cannot hold a new prompt beside them, the engine admits it only once enough of them have ended,
decode included, whatever its prefix hit: TTFT += hold_s x `ReplicaView.kv_waits(prompt)`, the
requests in flight that must end first. A prefix they share is held once, and needs no room
for a new request that shares it too (`ReplicaView.kv_shared_tokens`; counted per request, a
repeat of a document in flight read as a wait that cost nothing, and hold_s learned too low). `hold_s` is learned per scorer from the residual of
the TTFTs of requests that had to wait so (one-dimensional ridge toward 0, decayed like the
fit), and the fit learns from those TTFTs without it. A replica whose KV holds the request
beside the rest, or that does not report its KV size, is priced as before. Without it, repeats
of a long document piled onto the replica that held it while its KV was full of them, and the
TTFT p99 lost to round robin (bench/tiers.py, issue 42).

Blocks a replica holds on a lower KV tier (`ReplicaView.tier_hits`: host memory, disk, the
pool's shared store; docs/tiers.md) are priced in seconds by default (`tiers: seconds`): they
are not recomputed but loaded, at tokens x `kv_bytes_per_token` / that tier's bandwidth
(`tier_gbps`, GB/s). `tiers: weights` credits them as a fraction of a GPU hit instead
(`tier_weights`, Dynamo's defaults: cpu 0.75, disk 0.25, shared 0.5), for comparison; `tiers:
off` ignores them (GPU-only routing). A tier's seconds per token on a replica are, first, what
its engine measured (`ReplicaView.tier_load_rates`: vLLM's transfer counters, LMCache's retrieve
time; gateway/fleet/tier_load.py); else, with `learn_tiers`, the pool's rate learned from the TTFTs of
requests whose replica served every predicted token, pulled toward `tier_gbps`
(policies/scorers/tier_rates.py; `tier_gbps()` reads them); else `tier_gbps` as configured.
Learning is off by default: the TTFT residual it learns from also holds the queueing the fit
does not model, and in bench/tiers.py --quick, where nearly every answer queued, it learned the
tiers 3 to 11 times too slow (docs/tiers.md).

    scorers:
      ttft: {weight: 1, prefill_tokens_per_s: 8000, base_s: 0.05, prior_weight: 4, decay: 0.99,
             load_s: 0, kv_s: 0, recompute: 1, recompute_load: fleet,
             lora_load_s: 0.3, tiers: seconds, kv_bytes_per_token: 131072,
             tier_gbps: {cpu: 50, disk: 7, shared: 12.5}, learn_tiers: false}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from policies.base import Scorer, SharedState
from policies.scorers.lora import LoraCost
from policies.scorers.ridge import solve3
from policies.scorers.tier_rates import WIDTH as TIER_WIDTH
from policies.scorers.tier_rates import TierRates
from policies.types import Outcome, ReplicaView, RoutedRequest

_KTOK = 1000.0  # the fit works in thousands of tokens, so the three features have similar scale
_FLOOR_S = 1e-4  # a predicted TTFT never reaches 0, so scores stay finite
_MAX_REPLICAS = 4096  # bound on per-replica state if replica names churn
# reference §4.4: PCIe Gen5 DMA ~50 GB/s one way; one Gen4 NVMe ~7 GB/s; a 100 Gb/s store link
TIER_GBPS = {"cpu": 50.0, "disk": 7.0, "shared": 12.5}
TIER_WEIGHTS = {"cpu": 0.75, "disk": 0.25, "shared": 0.5}  # Dynamo's overlap credits
KV_BYTES_PER_TOKEN = 131072  # Llama-3.1-8B (vLLM blog: 2 MB per 16-token block)
TIER_MODES = ("seconds", "weights", "off")


class _Fit:
    """Decayed sums X'X (upper triangle) and X'y for features (1, uncached_k, queued_k)."""

    __slots__ = ("xx", "xy", "n")

    def __init__(self) -> None:
        self.xx = [0.0] * 6  # 00 01 02 11 12 22
        self.xy = [0.0] * 3
        self.n = 0

    def add(self, u: float, q: float, y: float, decay: float) -> None:
        xx, xy = self.xx, self.xy
        for i, term in enumerate((1.0, u, q, u * u, u * q, q * q)):
            xx[i] = decay * xx[i] + term
        for i, term in enumerate((y, u * y, q * y)):
            xy[i] = decay * xy[i] + term
        self.n += 1

    def numbers(self) -> list[float]:
        return [*self.xx, *self.xy, float(self.n)]


class _LoadFit:
    """Seconds a request ahead on the engine (running, decoding, waiting: `ReplicaView.load`)
    adds to a new request's TTFT beyond the queued prefill the main fit prices: a decayed
    one-feature ridge on the main fit's residuals, pulled toward the prior `d0`."""

    __slots__ = ("d", "d0", "w", "decay", "rr", "ry")

    def __init__(self, d0: float, w: float, decay: float) -> None:
        self.d = self.d0 = d0
        self.w, self.decay = w, decay
        self.rr = self.ry = 0.0

    def learn(self, r: float, residual: float) -> None:
        if not self.d0 or not math.isfinite(residual):
            return  # load_s: 0 turns the term off
        self.rr = self.decay * self.rr + r * r
        self.ry = self.decay * self.ry + r * residual
        self.d = max(0.0, (self.ry + self.w * self.d0) / (self.rr + self.w))


def _pressure(k: float | None) -> float:
    """KV pressure as a cost: k / (1 - k) of the KV in use (SGLang's least_load barrier), 0 when
    unknown, capped at 99 % in use."""
    if k is None or k <= 0:
        return 0.0
    k = min(k, 0.99)
    return k / (1.0 - k)


_WIDTH = 10  # numbers a shared fit carries: xx (6), xy (3), n; then a replica's tier sums


class _Hold:
    """Seconds each request in flight on a replica adds to a new one's TTFT (it holds KV the
    new one may need): decayed sums of n x residual and n^2, ridge toward 0 with `prior`."""

    __slots__ = ("nr", "nn", "prior", "decay", "s")

    def __init__(self, prior: float, decay: float) -> None:
        self.nr = self.nn = self.s = 0.0
        self.prior, self.decay = prior, decay

    def learn(self, n: int, residual_s: float) -> None:
        if n <= 0 or not math.isfinite(residual_s):
            return
        d = self.decay
        self.nr = d * self.nr + n * min(max(residual_s, -3600.0), 3600.0)
        self.nn = d * self.nn + n * n
        self.s = max(0.0, self.nr / (self.nn + self.prior))


class _Kept:
    """Per replica, the share of the predicted prefix hit its engine reported reusing (the
    route receipt's two numbers): a decayed mean of min(1, reused / predicted) over requests
    that expected a hit, pulled toward 1 (trusted) with `prior` requests' weight."""

    __slots__ = ("sums", "prior", "decay", "share")

    def __init__(self, prior: float, decay: float) -> None:
        self.sums: dict[str, tuple[float, float]] = {}
        self.share: dict[str, float] = {}  # replica -> kept share now; absent: 1 (trusted)
        self.prior, self.decay = prior, decay

    def learn(self, replica: str, predicted: int, reused: int) -> None:
        if predicted <= 0:
            return
        if replica not in self.sums and len(self.sums) >= _MAX_REPLICAS:
            self.sums.clear()
            self.share.clear()
        got, n = self.sums.get(replica, (0.0, 0.0))
        d = self.decay
        got = d * got + min(1.0, max(0, reused) / predicted)
        n = d * n + 1.0
        self.sums[replica] = (got, n)
        self.share[replica] = (got + self.prior) / (n + self.prior)


class TTFTScorer(Scorer):
    name = "ttft"
    needs_prefix = True  # the uncached part of the prompt is what a replica must prefill
    reason = "ttft"

    def __init__(
        self,
        *,
        prefill_tokens_per_s: float = 8000.0,
        base_s: float = 0.05,
        prior_weight: float = 4.0,
        decay: float = 0.99,
        lora_load_s: float = 0.3,
        tiers: str = "seconds",
        kv_bytes_per_token: float = KV_BYTES_PER_TOKEN,
        tier_gbps: Mapping[str, float] | None = None,
        tier_weights: Mapping[str, float] | None = None,
        learn_tiers: bool = False,
        load_s: float = 0.0,
        kv_s: float = 0.0,
        recompute: float = 1.0,
        recompute_load: bool | str = "fleet",
    ) -> None:
        if not prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s!r}")
        if not base_s >= 0:
            raise ValueError(f"base_s must be >= 0, got {base_s!r}")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        for key, value in (("load_s", load_s), ("kv_s", kv_s), ("recompute", recompute)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"{key} must be a number >= 0, got {value!r}")
        if recompute_load not in (True, False, "fleet"):
            raise ValueError(f"recompute_load must be true, false or fleet: {recompute_load!r}")
        if tiers not in TIER_MODES:
            raise ValueError(f"tiers must be one of {TIER_MODES}, got {tiers!r}")
        if not kv_bytes_per_token > 0:
            raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token!r}")
        gbps = {**TIER_GBPS, **(tier_gbps or {})}
        if not all(g > 0 for g in gbps.values()):
            raise ValueError(f"tier_gbps must be > 0, got {gbps!r}")
        self.tiers = tiers
        self.kv_bytes_per_token = float(kv_bytes_per_token)
        self.learn_tiers = bool(learn_tiers) and tiers == "seconds"
        # seconds per token loaded from each tier (learned, in place); or the GPU-hit share a
        # tier's block is worth
        prior_load = {t: kv_bytes_per_token / (g * 1e9) for t, g in gbps.items()}
        self._tier_rates = TierRates(prior_load, float(prior_weight), float(decay))
        self.load_s_per_token = self._tier_rates.rates
        self.tier_weights = {**TIER_WEIGHTS, **(tier_weights or {})}
        per_token = 1.0 / prefill_tokens_per_s
        self._prior_k = (float(base_s), per_token * _KTOK, per_token * _KTOK)  # per 1k tokens
        self.prior = (float(base_s), per_token, per_token)  # a [s], b [s/token], c [s/token]
        self._prior_weight = float(prior_weight)
        self._decay = float(decay)
        self._coef: dict[str, tuple[float, float, float]] = {}
        self._fits: dict[str, _Fit] = {}  # this process's own observations
        self._peer: dict[str, list[float]] = {}  # the other gateways' sums, per replica
        self._pooled = self.prior  # what a replica without observations is predicted with
        self.lora = LoraCost(lora_load_s)  # what a request's LoRA adapter adds, in seconds
        self.hold = _Hold(float(prior_weight), float(decay))  # per request in flight, seconds
        # per replica, the measured tier rates its last prediction used: observe() takes the
        # load term out of the TTFT at the same rates
        self._measured: dict[str, Mapping[str, tuple[float, float]]] = {}
        # the engine's load beyond the queued prefill the fit prices: seconds per request ahead
        # (running, decoding or waiting), learned for the pool from the fit's residuals
        self._load = _LoadFit(float(load_s), float(prior_weight), float(decay))
        self.kv_s = float(kv_s)
        self.recompute = float(recompute)
        self.recompute_load = recompute_load
        # per replica, the share of predicted hits its engine reported reusing: a prediction the
        # engine keeps missing (its LRU evicted what the index still lists) is credited less
        self.kept = _Kept(float(prior_weight), float(decay))

    def coefficients(self, replica: str) -> tuple[float, float, float]:
        """(a seconds, b seconds per uncached token, c seconds per queued token) for a replica."""
        return self._coef.get(replica, self._pooled)

    def load_s(self) -> float:
        """Seconds a request ahead on the engine adds to a TTFT now (learned, else `load_s`)."""
        return self._load.d

    def tier_gbps(self) -> dict[str, float]:
        """The bandwidth each lower tier is priced at now, GB/s: learned, else `tier_gbps`."""
        return self._tier_rates.gbps(self.kv_bytes_per_token)

    def predict(self, req: RoutedRequest, view: ReplicaView) -> float:
        """Predicted TTFT in seconds if `req` went to `view`."""
        a, b, c = self._coef.get(view.name, self._pooled)
        hit = view.hit_blocks * req.tokens_per_block * self.kept.share.get(view.name, 1.0)
        uncached = max(0.0, req.prompt_tokens - hit)
        load = 0.0
        if view.tier_hits and self.tiers != "off":
            measured = view.tier_load_rates
            if measured is not None:
                self._saw(view.name, measured)
            uncached, load = self._tiered(view.tier_hits, uncached, req.tokens_per_block, measured)
        t = a + b * uncached + c * view.inflight_prompt_tokens + load
        if self.hold.s:
            t += self.hold.s * view.kv_waits(req.prompt_tokens)
        if self._load.d or self.kv_s:
            t += self._load.d * view.load + self.kv_s * _pressure(view.kv_usage)
        if view.lora is not None:
            t += self.lora.extra_s(req.model, view.lora)
        return max(_FLOOR_S, t)

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        coef, prior, seen = self._coef, self._pooled, self._measured
        prompt, tpb, hold = req.prompt_tokens, req.tokens_per_block, self.hold.s
        pred: dict[str, float] = {}
        d, kv_s, rho = self._load.d, self.kv_s, self.recompute
        kept = self.kept.share
        # each candidate's predicted GPU hit in blocks, credited as far as its engine kept them
        hits = [v.hit_blocks * kept[v.name] if v.name in kept else v.hit_blocks for v in views]
        holds, held, fleet = hits, 0.0, 1.0
        if rho:  # the prefill the fleet would redo (recompute: 0 skips this)
            if self.tiers != "off" and any(v.tier_hits for v in views):
                holds = [h + sum(v.tier_hits.values()) if v.tier_hits else h
                         for v, h in zip(views, hits, strict=True)]  # fmt: skip
            held = max(holds, default=0.0)
            # the factor the recompute is priced at: 1 (flat), 1 + the target's load (true), or
            # ("fleet") 1 + the mean load of the candidates: a saturated fleet of n replicas is
            # one server, and the prefill it redoes delays each request it holds by 1/n of it
            if held and self.recompute_load == "fleet":
                fleet = 1 + sum(v.load for v in views) / len(views)
        by = self.recompute_load
        scale = rho * fleet if by == "fleet" else rho  # x (1 + the target's load) when by is True
        most = prompt if held * tpb > prompt else held * tpb  # the prefix tokens the best holds
        worst = None
        if kv_s:  # a replica whose KV use is unknown now (no fresh scrape) counts as the fullest
            known = [v.kv_usage for v in views if v.kv_usage is not None]
            worst = max(known) if known else None
        for v, hit, mine in zip(views, hits, holds, strict=True):
            a, b, c = coef.get(v.name, prior)
            uncached = prompt - hit * tpb
            t = a + b * (uncached if uncached > 0 else 0.0) + c * v.inflight_prompt_tokens
            if hold and v.kv_tokens is not None:
                t += hold * v.kv_waits(prompt)
            if d:
                t += d * v.load
            if worst is not None:
                t += kv_s * _pressure(worst if v.kv_usage is None else v.kv_usage)
            if held > mine:  # the fleet recomputes what another holds (held is 0 with rho 0)
                redo = b * (most - (prompt if mine * tpb > prompt else mine * tpb))
                t += redo * (scale * (1 + v.load) if by is True else scale)
            if v.tier_hits and self.tiers != "off":
                measured = v.tier_load_rates
                if measured is not None and seen.get(v.name) is not measured:
                    self._saw(v.name, measured)
                left, load = self._tiered(v.tier_hits, max(0.0, uncached), tpb, measured)
                t += b * (left - max(0.0, uncached)) + load
            if v.lora is not None:
                t += self.lora.extra_s(req.model, v.lora)
            pred[v.name] = t if t > _FLOOR_S else _FLOOR_S
        best = min(pred.values(), default=_FLOOR_S)
        return {name: best / t for name, t in pred.items()}

    def _tiered(
        self,
        hits: Mapping[str, int],
        uncached: float,
        tpb: float,
        measured: Mapping[str, tuple[float, float]] | None,
    ) -> tuple[float, float]:
        """(tokens still to recompute, seconds to load the rest) given lower-tier hits, each
        tier priced at the replica's `measured` rate when its engine reports one."""
        load = 0.0
        if self.tiers == "seconds":
            for tier, blocks in hits.items():
                tokens = min(uncached, blocks * tpb)
                load += tokens * self._s_per_token(tier, measured, math.inf)
                uncached -= tokens
            return uncached, load
        for tier, blocks in hits.items():
            uncached -= min(uncached, blocks * tpb) * self.tier_weights.get(tier, 0.0)
        return uncached, load

    def _s_per_token(
        self, tier: str, measured: Mapping[str, tuple[float, float]] | None, unknown: float
    ) -> float:
        """Seconds to load one token from `tier`: the replica's `measured` rate (per byte or
        per token), else the learned or configured one, else `unknown`."""
        m = measured.get(tier) if measured is not None else None
        if m is None:
            return self.load_s_per_token.get(tier, unknown)
        return self.kv_bytes_per_token * m[0] + m[1]

    def _saw(self, replica: str, measured: Mapping[str, tuple[float, float]]) -> None:
        if replica not in self._measured and len(self._measured) >= _MAX_REPLICAS:
            self._measured.clear()  # replica names churned: the live ones come back at once
        self._measured[replica] = measured

    def observe(self, outcome: Outcome) -> None:
        y = outcome.ttft_s
        if not outcome.ok or y is None or not 0 <= y < float("inf") or outcome.rides:
            return  # a request that rode a prefix still prefilling waited for a part of it only
        fit = self._fits.get(outcome.replica)
        if fit is None:
            if len(self._fits) >= _MAX_REPLICAS:
                oldest = next(iter(self._fits))
                del self._fits[oldest]
                self._coef.pop(oldest, None)
                self._tier_rates.forget(oldest)
            fit = self._fits[outcome.replica] = _Fit()
        reused = outcome.credited_cached_tokens()
        if reused is not None and not outcome.tier_tokens:
            # the engine said what it reused: the share of the prediction it kept, and the fit
            # learns from the prefill it did
            self.kept.learn(outcome.replica, outcome.predicted_hit_tokens, reused)
        else:
            reused = outcome.predicted_hit_tokens
        u = max(0, outcome.prompt_tokens - reused) / _KTOK
        q = max(0, outcome.queued_prompt_tokens_at_dispatch) / _KTOK
        a, b, c = self._coef.get(outcome.replica, self._pooled)
        tiers = outcome.tier_tokens if self.tiers == "seconds" else None
        if tiers:  # loaded, not recomputed: the fit learns the prefill without the load time
            u = max(0.0, u - sum(tiers.values()) / _KTOK)
            if self.learn_tiers and outcome.served_in_full():  # else it hid some recompute
                rest = y - (a + b * u * _KTOK + c * q * _KTOK)
                if outcome.adapter_load:
                    rest -= self.lora.load_s
                self._tier_rates.learn(outcome.replica, tiers, rest)
            measured = self._measured.get(outcome.replica)
            for t, n in tiers.items():
                y -= n * self._s_per_token(t, measured, 0.0)
            y = max(0.0, y)
        n = outcome.kv_waits
        if outcome.adapter_load:  # learn the load from the residual, fit the rest without it
            self.lora.learn(y - (a + b * u * _KTOK + c * q * _KTOK + self.hold.s * n))
            y = max(0.0, y - self.lora.load_s)
        if n > 0:  # the wait for requests ahead to free KV: learned apart, fit without it
            self.hold.learn(n, y - (a + b * u * _KTOK + c * q * _KTOK))
            y = max(0.0, y - self.hold.s * n)
        if self._load.d0:  # load_s > 0: learn what a request ahead costs, fit the rest without it
            r = max(0, outcome.load_at_dispatch)
            self._load.learn(r, y - (a + b * u * _KTOK + c * q * _KTOK))
            y = max(0.0, y - self._load.d * r)
        fit.add(u, q, y, self._decay)
        self._coef[outcome.replica] = self._solve(fit, self._peer.get(outcome.replica))
        self._pool()

    def share(self) -> SharedState:
        """This process's decayed sums per replica (own observations only): the prefill fit's,
        followed by the replica's tier sums when it has any (a gateway from before tier
        learning skips those entries, as it skips any width it does not know)."""
        out = {}
        for name, fit in self._fits.items():
            tiers = self._tier_rates.own(name)
            out[name] = fit.numbers() if tiers is None else fit.numbers() + tiers
        return out

    def absorb(self, peers: Sequence[Mapping[str, Sequence[float]]]) -> None:
        """Take the other gateways' sums (each peer's `share`): the coefficients are refitted
        from own + peers' sums, so every gateway of the fleet predicts alike."""
        total: dict[str, list[float]] = {}
        full = _WIDTH + TIER_WIDTH
        for peer in peers:
            for name, nums in peer.items():
                if len(nums) not in (_WIDTH, full) or not all(math.isfinite(x) for x in nums):
                    continue  # not a fit this version sends
                if name not in total and len(total) >= _MAX_REPLICAS:
                    continue
                acc = total.setdefault(name, [0.0] * full)
                for i, x in enumerate(nums):
                    acc[i] += float(x)
        self._tier_rates.absorb({n: v[_WIDTH:] for n, v in total.items() if v[-1] > 0})
        total = {name: v[:_WIDTH] for name, v in total.items()}
        if total == self._peer:
            return
        self._peer = total
        self._coef = {
            name: self._solve(self._fits.get(name), total.get(name))
            for name in {*self._fits, *total}
        }
        self._pool()

    def _pool(self) -> None:
        coef = self._coef
        n = len(coef)
        if not n:
            self._pooled = self.prior
            return
        self._pooled = (  # fsum: the same result in any order, so on every gateway
            math.fsum(x[0] for x in coef.values()) / n,
            math.fsum(x[1] for x in coef.values()) / n,
            math.fsum(x[2] for x in coef.values()) / n,
        )

    def _solve(
        self, fit: _Fit | None, peer: Sequence[float] | None = None
    ) -> tuple[float, float, float]:
        # Ridge in the basis (1, uncached + queued, queued): theta = (a, b, c - b), pulled toward
        # (base_s, 1 / prefill_tokens_per_s, 0). A queued token is prefill work on the same
        # replica, so without evidence it costs what an uncached token is learned to cost; a
        # fixed prior for c would stay put on a replica whose requests rarely met a queue (the
        # policy sends them where there is none) while b follows the replica's real speed.
        # The sums stay in the basis (1, u, q) (shared as they are); Z = M X with
        # M = [[1 0 0] [0 1 1] [0 0 1]], so Z'Z = M X'X M' and Z'y = M X'y.
        w, p = self._prior_weight, self._prior_k
        m = list(fit.xx) if fit is not None else [0.0] * 6
        xy = list(fit.xy) if fit is not None else [0.0] * 3
        if peer is not None:
            for i in range(6):
                m[i] += peer[i]
            for i in range(3):
                xy[i] += peer[6 + i]
        s00, s01, s02, s11, s12, s22 = m
        z = [s00 + w, s01 + s02, s02, s11 + 2 * s12 + s22 + w, s12 + s22, s22 + w]
        v = [xy[0] + w * p[0], xy[1] + xy[2] + w * p[1], xy[2]]
        theta = solve3(z, v) or (p[0], p[1], 0.0)
        a, b, extra = theta
        return max(0.0, a), max(0.0, b) / _KTOK, max(0.0, b + extra) / _KTOK
