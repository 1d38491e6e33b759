"""The memory index's snapshot: a round trip keeps what matches, TTLs count the time on disk,
the write is atomic, and a file that is not one loads nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from prefix_index.memory import MemoryIndex
from prefix_index.persist import MAGIC, read_snapshot, write_snapshot


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def filled(ttl_s: float | None = 600.0) -> MemoryIndex:
    idx = MemoryIndex(1000, ttl_s)
    idx.record_now("s1", "r0", [1, 2, 3, 4])
    idx.record_now("s1", "r1", [1, 2])
    idx.record_now("s2", "r1", [(1 << 64) - 1, 7])
    idx.evict_now("s1", "r0", [3])  # a hole: r0's chain now stops at block 2
    return idx


def test_round_trip_answers_alike(tmp_path: Path) -> None:
    path = tmp_path / "index.snap"
    old = filled()
    assert write_snapshot(old, path) == 7
    assert not [p for p in tmp_path.iterdir() if p.name != "index.snap"]  # no temporary left
    new = MemoryIndex(1000, 600.0)
    got = read_snapshot(new, path, max_age_s=60)
    assert got is not None and got[0] == 7
    for scope, chain in (("s1", [1, 2, 3, 4]), ("s2", [(1 << 64) - 1, 7])):
        assert new.match_now(scope, chain, ["r0", "r1"]) == old.match_now(scope, chain, ["r0", "r1"])
    assert new.match_now("s1", [1, 2, 3, 4], ["r0"]) == {"r0": 2}


def test_time_on_disk_counts_against_ttls(tmp_path: Path) -> None:
    clock = Clock()
    old = MemoryIndex(1000, 10.0, clock=clock)
    old.record_now("s", "r0", [1, 2])
    clock.t += 6
    old.record_now("s", "r1", [1, 2])  # 10 s left, against r0's 4 s
    path = tmp_path / "snap"
    write_snapshot(old, path)
    header = {"written_at": time.time() - 5}  # as if the gateway was down for 5 s
    data = path.read_bytes()
    end = data.index(b"\n", len(MAGIC))
    path.write_bytes(MAGIC + json.dumps(header).encode() + data[end:])
    new = MemoryIndex(1000, 10.0)
    read_snapshot(new, path, max_age_s=60)
    assert new.match_now("s", [1, 2], ["r0", "r1"]) == {"r0": 0, "r1": 2}


def test_too_old_is_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "snap"
    write_snapshot(filled(), path)
    past = time.time() - 120
    data = path.read_bytes()
    end = data.index(b"\n", len(MAGIC))
    path.write_bytes(MAGIC + json.dumps({"written_at": past}).encode() + data[end:])
    new = MemoryIndex(1000, 600.0)
    assert read_snapshot(new, path, max_age_s=60) is None
    assert new.stats_now().entries == 0
    assert read_snapshot(new, tmp_path / "missing", max_age_s=60) is None


@pytest.mark.parametrize("cut", [b"not a snapshot", None])
def test_a_damaged_file_loads_nothing(tmp_path: Path, cut: bytes | None) -> None:
    path = tmp_path / "snap"
    write_snapshot(filled(), path)
    path.write_bytes(cut if cut is not None else path.read_bytes()[:-5])
    new = MemoryIndex(1000, 600.0)
    with pytest.raises(ValueError):
        read_snapshot(new, path, max_age_s=60)
    assert new.stats_now().entries == 0


class Failing(MemoryIndex):
    """An index whose export breaks after its first record (a crash mid-write)."""

    def routed_entries(self):  # type: ignore[no-untyped-def]
        it = super().routed_entries()
        yield next(it)
        raise OSError("disk full")


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "snap"
    write_snapshot(filled(), path)
    before = path.read_bytes()
    broken = Failing(1000, 600.0)
    broken.record_now("s", "r0", [9, 8])
    broken.record_now("s", "r1", [9])
    with pytest.raises(OSError):
        write_snapshot(broken, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["snap"]  # the temporary went too
