"""Session scorer: a conversation goes back to the replica that served its last turn.

    score = 1.0  for the replica this session_key last went to (from Outcomes), or, when the
                 session is unseen or that replica is not a candidate, the rendezvous-hash
                 choice of session_key among the candidates (remembered until an Outcome
                 says the session went elsewhere)
    score = 0.0  for every other replica, and for all when the request has no session_key

Assignments live in a bounded LRU (`capacity` sessions, least recently used dropped first), keyed
by a 16-byte BLAKE2b digest of session_key, never the key itself: about 200 bytes a session
whatever the key's length (a 1 MB `user` costs what "alice" does), so the default 65,536 sessions
hold about 13 MB. The value is the replica's name, a string the fleet already holds. (BLAKE2b, not
xxhash: this package imports only the standard library; a 1 MB key hashes in about a millisecond.)

    scorers:
      session: {weight: 2, capacity: 65536}
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from policies.base import Scorer
from policies.types import Outcome, ReplicaView, RoutedRequest


def _digest(key: str) -> bytes:
    """A fixed-size stand-in for a key of any length (what the LRU keeps and rendezvous hashes)."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _rendezvous(key: bytes, names: Sequence[str]) -> str:
    """Highest-random-weight hash: stable when replicas join or leave, no ring to maintain."""
    best, best_h = names[0], -1
    for name in names:
        digest = hashlib.blake2b(key + b"\x00" + name.encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "big")
        if h > best_h:
            best, best_h = name, h
    return best


class SessionScorer(Scorer):
    name = "session"
    reason = "session"

    def __init__(self, *, capacity: int = 65536) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self._last: OrderedDict[bytes, str] = OrderedDict()  # digest -> replica name

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        if req.session_key is None or not views:
            return {}
        key = _digest(req.session_key)
        last = self._last.get(key)
        if last is not None:
            for v in views:
                if v.name == last:
                    self._last.move_to_end(key)
                    return {last: 1.0}
        chosen = _rendezvous(key, [v.name for v in views])
        self._remember(key, chosen)
        return {chosen: 1.0}

    def observe(self, outcome: Outcome) -> None:
        if outcome.session_key is not None and outcome.ok:
            self._remember(_digest(outcome.session_key), outcome.replica)

    def _remember(self, key: bytes, replica: str) -> None:
        self._last[key] = replica
        self._last.move_to_end(key)
        if len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)
