"""The three plugin interfaces (Filter, Scorer, Picker) and the engine that composes them (Policy).

Besides its one method each plugin has a `name` and two optional capabilities with defaults
(`needs_prefix`, `observe`; a Scorer also a `reason`), declared on the Protocols below.

The score contract, stated once: a Scorer returns a number in [0, 1] per replica name, higher is
better, and never sees its weight. The engine clamps every score to [0, 1] (NaN and missing names
count 0), multiplies by the scorer's weight, sums, and hands the totals to the Picker.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from policies.types import Decision, Outcome, ReplicaView, RoutedRequest

# Reasons a Decision can carry. A Picker that ranks by the weighted totals answers BY_SCORE and
# the engine replaces it with the `reason` of the scorer that contributed most to the winner's
# lead over the runner-up ("prefix", "load", "ttft", "session", "cost").
BY_SCORE = "score"
TIE = "tie"
GUARD = "guard"
COLD = "cold"  # no candidate holds any of the prompt's blocks: placed by load and cache balance
ONLY_CANDIDATE = "only_candidate"
NO_CANDIDATES = "no_candidates"
# the request continues state one replica holds (`RoutedRequest.home`: a /v1/responses follow-up
# of a response it made), and that replica survived the filters: it goes first
HOME = "previous_response"


class Plugin(Protocol):
    """What every plugin has besides its one method: a name and two optional capabilities.

    Subclass Filter, Scorer or Picker explicitly to inherit the defaults below; a plugin that
    only matches structurally gets them filled in by `build_policy`, which logs what it assumed.
    """

    name: str

    # Whether the plugin needs `ReplicaView.hit_blocks` and `RoutedRequest.block_hashes`. When no
    # plugin a policy asks needs them, the gateway neither hashes the prompt nor queries the
    # index: block_hashes is empty and every hit_blocks 0. Default False (the cheap one); declare
    # True if the plugin cannot do its job without them.
    needs_prefix: bool = False

    def observe(self, outcome: Outcome) -> None:
        """Learn from what happened to a routed request. Default: nothing (not a learner)."""
        return None


@runtime_checkable
class Filter(Plugin, Protocol):
    """Removes replicas that must not get this request."""

    def keep(self, req: RoutedRequest, view: ReplicaView) -> str | None:
        """None to keep the replica, else a short reason it is removed."""
        ...


@runtime_checkable
class Scorer(Plugin, Protocol):
    """Judges each candidate in [0, 1], higher is better. May omit names (they score 0)."""

    @property
    def reason(self) -> str:
        """What a Decision says when this scorer put the winner ahead. Default: its name."""
        return self.name

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]: ...


@runtime_checkable
class Picker(Plugin, Protocol):
    """Orders the candidates, best first, and says why the first one won."""

    def pick(
        self, req: RoutedRequest, views: Sequence[ReplicaView], totals: dict[str, float]
    ) -> tuple[list[str], str]: ...


class SeededPicker(Picker):
    """A picker that draws (ties, or its whole pick) from the policy's seeded `rng`."""

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()


@runtime_checkable
class Learner(Protocol):
    """Any plugin that learns from what happened to routed requests (overrides `observe`)."""

    def observe(self, outcome: Outcome) -> None: ...


SharedState = dict[str, list[float]]  # replica name -> the numbers a plugin learned about it


@runtime_checkable
class Shares(Protocol):
    """A learner whose state the other gateways of a fleet fold into theirs, so that every
    gateway decides from the same learned figures (the gateway carries them, policies/ does no
    I/O). `share` gives what this process learned from its own outcomes only; `absorb` takes
    what each peer shared (the latest of every live peer, the whole set each time)."""

    def share(self) -> SharedState: ...

    def absorb(self, peers: Sequence[Mapping[str, Sequence[float]]]) -> None: ...


def learns(plugin: Plugin) -> bool:
    """Whether `plugin` has an `observe` of its own, not the default that does nothing."""
    method = plugin.observe
    return getattr(method, "__func__", method) is not Plugin.observe


class Policy:
    """Filters, then weighted scorers, then a picker: one routing decision per `choose` call.

    `scorers` pairs each scorer with its weight (finite, >= 0). A zero-weight scorer is not asked
    to score (it costs nothing) but still observes outcomes, so a learner can warm up in shadow.
    Every plugin has its Protocol's capabilities (subclass it, or build through `build_policy`,
    which fills them in); `needs_prefix` is True when any plugin asked (filters, scorers with a
    weight, the picker) needs the prefix.
    """

    __slots__ = (
        "name",
        "filters",
        "scorers",
        "picker",
        "needs_prefix",
        "_keeps",
        "_active",
        "_learners",
        "_sharers",
    )

    def __init__(
        self,
        name: str,
        *,
        picker: Picker,
        filters: Sequence[Filter] = (),
        scorers: Sequence[tuple[Scorer, float]] = (),
    ) -> None:
        seen: set[str] = set()
        for scorer, weight in scorers:
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise TypeError(f"weight of scorer {scorer.name!r} must be a number")
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"weight of scorer {scorer.name!r} must be finite and >= 0")
            if scorer.name in seen:
                raise ValueError(f"two scorers are named {scorer.name!r}")
            seen.add(scorer.name)
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple((s, float(w)) for s, w in scorers)
        self.picker = picker
        self._keeps = tuple(f.keep for f in self.filters)
        self._active = tuple((s.name, s, w, s.reason) for s, w in self.scorers if w > 0)
        # a zero-weight scorer is never asked, so what it would read costs nothing
        asked: tuple[Plugin, ...] = (*self.filters, *(s for _, s, _, _ in self._active), picker)
        self.needs_prefix = any(p.needs_prefix for p in asked)
        plugins: tuple[Plugin, ...] = (*self.filters, *(s for s, _ in self.scorers), picker)
        self._learners = tuple(p for p in plugins if learns(p))
        self._sharers = {p.name: p for p in plugins if isinstance(p, Shares)}

    def __repr__(self) -> str:
        weights = ", ".join(f"{s.name}={w:g}" for s, w in self.scorers)
        return f"Policy({self.name!r}, scorers=[{weights}], picker={self.picker.name!r})"

    def choose(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> Decision:
        """Rank every replica that survives the filters; explain the rest."""
        filtered: dict[str, str] = {}
        if self._keeps:
            survivors: list[ReplicaView] = []
            for view in views:
                for keep in self._keeps:
                    why = keep(req, view)
                    if why is not None:
                        filtered[view.name] = why
                        break
                else:
                    survivors.append(view)
        else:
            survivors = list(views)

        if len(survivors) <= 1:
            if not survivors:
                return Decision([], NO_CANDIDATES, self.name, filtered=filtered)
            only = survivors[0]
            return Decision(
                [only.name],
                HOME if only.name == req.home else ONLY_CANDIDATE,
                self.name,
                filtered=filtered,
                predicted_hit_blocks=only.hit_blocks,
            )

        gets = [
            (sname, w, scorer.score(req, survivors).get) for sname, scorer, w, _ in self._active
        ]
        totals: dict[str, float] = {} if gets else {v.name: 0.0 for v in survivors}
        scores: dict[str, dict[str, float]] = {}
        for view in survivors if gets else ():
            name = view.name
            row: dict[str, float] = {}
            total = 0.0
            for sname, weight, get in gets:
                s = get(name, 0.0)
                if not 0.0 <= s <= 1.0:  # also catches NaN
                    s = 1.0 if s > 1.0 else 0.0  # NaN and negatives count 0
                row[sname] = s
                total += weight * s
            scores[name] = row
            totals[name] = total

        ranked, reason = self.picker.pick(req, survivors, totals)
        if reason == BY_SCORE:
            reason = self._deciding_scorer(ranked, totals, scores)
        home = req.home
        if home is not None and home in ranked:  # the replica holding the request's state
            ranked.remove(home)
            ranked.insert(0, home)
            reason = HOME
        winner = ranked[0] if ranked else None
        hit = 0
        for v in survivors:
            if v.name == winner:
                hit = v.hit_blocks
                break
        return Decision(
            ranked,
            reason,
            self.name,
            scores=scores,
            totals=totals if gets else {},
            filtered=filtered,
            predicted_hit_blocks=hit,
        )

    def _deciding_scorer(
        self, ranked: list[str], totals: dict[str, float], scores: dict[str, dict[str, float]]
    ) -> str:
        """The reason of the scorer whose weighted score put the winner ahead of the runner-up."""
        if len(ranked) < 2 or totals[ranked[0]] <= totals[ranked[1]]:
            return TIE
        win, second = scores[ranked[0]], scores[ranked[1]]
        best_reason, best_gap = TIE, 0.0
        for sname, _, weight, reason in self._active:
            gap = weight * (win[sname] - second[sname])
            if gap > best_gap:
                best_reason, best_gap = reason, gap
        return best_reason

    def observe(self, outcome: Outcome) -> None:
        """Feed what happened to a routed request to every plugin that learns."""
        for plugin in self._learners:
            plugin.observe(outcome)

    def share(self) -> dict[str, SharedState]:
        """What the plugins that share learned from this process's outcomes, by plugin name
        (empty when none shares)."""
        return {name: p.share() for name, p in self._sharers.items()}

    def absorb(self, peers: Sequence[Mapping[str, Mapping[str, Sequence[float]]]]) -> None:
        """Fold the other gateways' `share()` in (one mapping per live peer)."""
        for name, p in self._sharers.items():
            p.absorb([got for peer in peers if (got := peer.get(name)) is not None])
