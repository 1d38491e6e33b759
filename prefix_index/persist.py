"""A memory index written to a file on shutdown and read back at start (a warm restart).

The file: an 8-byte magic with the format version, one JSON header line (`written_at`, unix
seconds), then one record per (scope, replica): the lengths (struct `<IIII`: scope bytes, replica
bytes, blocks, holes), the two names in UTF-8, then the block hashes (u64), the milliseconds each
has left (i64, -1: no TTL), and the same two arrays for the replica's live holes. Little-endian.
It is written beside its final path and renamed over it, so a crash leaves the old file or none.
Only routed blocks are kept (engine-reported ones come back from the engine's KV events), and the
time the gateway was down counts against every block's TTL.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from array import array
from pathlib import Path
from typing import BinaryIO

from prefix_index.memory import MemoryIndex, RoutedEntries

MAGIC = b"KVGWIX\x00\x01"  # the last byte is the format version
_LENGTHS = struct.Struct("<IIII")


def write_snapshot(index: MemoryIndex, path: str | os.PathLike[str]) -> int:
    """Write `index` to `path` atomically; returns the blocks written."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    blocks = 0
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(json.dumps({"written_at": time.time()}).encode() + b"\n")
            for e in index.routed_entries():
                blocks += _write_one(f, e)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return blocks


def _write_one(f: BinaryIO, e: RoutedEntries) -> int:
    scope, replica = e.scope.encode(), e.replica.encode()
    try:
        arrays = [array("Q", e.hashes), array("q", e.left_ms), array("Q", e.holes),
                  array("q", e.holes_left_ms)]  # fmt: skip
    except OverflowError:
        return 0  # not a 64-bit chain hash: not this index's own
    f.write(_LENGTHS.pack(len(scope), len(replica), len(e.hashes), len(e.holes)))
    f.write(scope + replica)
    for a in arrays:
        if sys.byteorder != "little":
            a.byteswap()
        f.write(a.tobytes())
    return len(e.hashes)


def read_snapshot(
    index: MemoryIndex, path: str | os.PathLike[str], max_age_s: float
) -> tuple[int, float] | None:
    """Load the snapshot at `path` into `index` when it is there, of this format and younger
    than `max_age_s`: (blocks restored, its age in seconds); None when it is not used. A file
    that is cut short or not a snapshot raises ValueError (nothing is loaded from it)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a prefix index snapshot of this version")
    try:
        end = data.index(b"\n", len(MAGIC))
        age = max(0.0, time.time() - float(json.loads(data[len(MAGIC) : end])["written_at"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: the snapshot's header is damaged ({exc})") from None
    if age > max_age_s:
        return None
    records = list(_records(memoryview(data)[end + 1 :], int(age * 1000)))
    return sum(index.restore(e) for e in records), age


def _records(buf: memoryview, aged_ms: int) -> list[RoutedEntries]:
    out, pos = [], 0
    try:
        while pos < len(buf):
            ls, lr, nb, nh = _LENGTHS.unpack_from(buf, pos)
            pos += _LENGTHS.size
            scope = bytes(buf[pos : pos + ls]).decode()
            replica = bytes(buf[pos + ls : pos + ls + lr]).decode()
            pos += ls + lr
            arrays = []
            for code, n in (("Q", nb), ("q", nb), ("Q", nh), ("q", nh)):
                a = array(code)
                a.frombytes(buf[pos : pos + 8 * n])
                if len(a) != n:
                    raise ValueError("cut short")
                if sys.byteorder != "little":
                    a.byteswap()
                arrays.append(a.tolist())
                pos += 8 * n
            hashes, left, holes, holes_left = arrays
            out.append(RoutedEntries(scope, replica, hashes, _aged(left, aged_ms), holes,
                                     _aged(holes_left, aged_ms)))  # fmt: skip
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"prefix index snapshot is damaged ({exc})") from None
    return out


def _aged(left: list[int], aged_ms: int) -> list[int]:
    """Take the time the file sat on disk off each TTL (0: expired; -1 stays: no TTL)."""
    return [x if x < 0 else max(0, x - aged_ms) for x in left]
