"""Session scorer: back to where the session last went, else a stable hash; bounded memory."""

from __future__ import annotations

import pytest

from policies import Outcome, ReplicaView, RoutedRequest
from policies.scorers.session import SessionScorer

VIEWS = [ReplicaView(f"r{i}") for i in range(6)]


def _req(session: str | None) -> RoutedRequest:
    return RoutedRequest("r", "m", "m", "p", 64, (1, 2, 3, 4), 16.0, session_key=session)


def _went(session: str, replica: str, ok: bool = True) -> Outcome:
    return Outcome(replica, 64, 0, 0, 0, 0.1, ok=ok, session_key=session)


def _winner(scores: dict[str, float]) -> str:
    assert sorted(scores.values()) == [1.0], scores  # exactly one replica scores, and it scores 1
    return next(iter(scores))


def test_no_session_key_scores_nothing() -> None:
    assert SessionScorer().score(_req(None), VIEWS) == {}


def test_unseen_session_hashes_stably() -> None:
    first = _winner(SessionScorer().score(_req("alice"), VIEWS))
    assert _winner(SessionScorer().score(_req("alice"), list(reversed(VIEWS)))) == first
    # rendezvous hashing: removing another replica does not move the session
    others = [v for v in VIEWS if v.name != first][1:]
    assert (
        _winner(
            SessionScorer().score(_req("alice"), [*others, *[v for v in VIEWS if v.name == first]])
        )
        == first
    )
    # and sessions spread over replicas
    spread = {_winner(SessionScorer().score(_req(f"s{i}"), VIEWS)) for i in range(200)}
    assert spread == {v.name for v in VIEWS}


@pytest.mark.parametrize(
    ("outcomes", "candidates", "expected"),
    [
        ([("alice", "r3")], VIEWS, "r3"),
        ([("alice", "r3"), ("alice", "r5")], VIEWS, "r5"),  # the last turn wins
        ([("bob", "r3")], VIEWS, None),  # another session's history is irrelevant
    ],
)
def test_session_follows_outcomes(
    outcomes: list[tuple[str, str]], candidates: list[ReplicaView], expected: str | None
) -> None:
    scorer = SessionScorer()
    for session, replica in outcomes:
        scorer.observe(_went(session, replica))
    got = _winner(scorer.score(_req("alice"), candidates))
    hashed = _winner(SessionScorer().score(_req("alice"), candidates))
    assert got == (expected or hashed)


def test_remembered_replica_gone_falls_back_to_a_candidate() -> None:
    scorer = SessionScorer()
    scorer.observe(_went("alice", "gone"))
    assert _winner(scorer.score(_req("alice"), VIEWS)) in {v.name for v in VIEWS}


def test_failed_outcome_is_not_remembered() -> None:
    scorer = SessionScorer()
    hashed = _winner(scorer.score(_req("alice"), VIEWS))
    other = next(v.name for v in VIEWS if v.name != hashed)
    scorer.observe(_went("alice", other, ok=False))
    assert _winner(scorer.score(_req("alice"), VIEWS)) == hashed


def test_memory_is_bounded_lru() -> None:
    scorer = SessionScorer(capacity=2)
    scorer.observe(_went("a", "r1"))
    scorer.observe(_went("b", "r2"))
    scorer.score(_req("a"), VIEWS)  # touch a: b is now least recently used
    scorer.observe(_went("c", "r3"))
    assert len(scorer) == 2
    assert _winner(scorer.score(_req("a"), VIEWS)) == "r1"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_session_rejects_bad_capacity(bad: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        SessionScorer(capacity=bad)  # type: ignore[arg-type]


def test_memory_is_bounded_by_bytes_whatever_the_key_length() -> None:
    """Issue 22: 1 MB `user` values used to be kept whole (65,536 of them: gigabytes)."""
    import tracemalloc

    scorer = SessionScorer(capacity=64)

    def key(i: int) -> str:  # a fresh string per request, as the gateway makes them
        return f"{i:04d}" + "u" * 256_000  # 256 KB

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            scorer.observe(_went(key(i), f"r{i % 6}"))
            scorer.score(_req(key(i)), VIEWS)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(scorer) == 64
    assert kept < 64 * 1024, kept  # a fixed-size digest per session, not the key
    # a long key still finds its way back; one a byte longer is another session
    assert _winner(scorer.score(_req(key(199)), VIEWS)) == f"r{199 % 6}"
    assert scorer.score(_req(key(199) + "!"), VIEWS) == SessionScorer().score(
        _req(key(199) + "!"), VIEWS
    )
