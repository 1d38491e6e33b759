"""The Redis backend's write queue: writes wait here, leave in batches, stay through outages.

Bounded: when full, the oldest write goes (and is counted), never the caller's time.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Write:
    """The commands of one record or evict, or a forget of one replica (several steps)."""

    commands: list[tuple[Any, ...]]
    forget: str | None = None
    blocks: int = 0
    done: asyncio.Future[None] | None = field(default=None)

    def resolve(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


class WriteQueue:
    """FIFO of writes; `take` cuts a batch (a forget always travels alone)."""

    def __init__(self, max_pending: int, batch_writes: int, batch_blocks: int) -> None:
        self._pending: deque[Write] = deque()
        self._max = max_pending
        self._batch_writes = batch_writes
        self._batch_blocks = batch_blocks
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, write: Write) -> None:
        self._pending.append(write)
        self._trim()

    def take(self) -> list[Write]:
        first = self._pending.popleft()
        batch = [first]
        if first.forget is not None:
            return batch
        blocks = first.blocks
        while self._pending and len(batch) < self._batch_writes:
            head = self._pending[0]
            if head.forget is not None or blocks + head.blocks > self._batch_blocks:
                break
            blocks += head.blocks
            batch.append(self._pending.popleft())
        return batch

    def put_back(self, batch: Iterable[Write]) -> None:
        """A batch that did not reach Redis goes back to the front, in order."""
        self._pending.extendleft(reversed(list(batch)))
        self._trim()

    def resolve_all(self) -> None:
        """Release every caller waiting on a queued write (the writes stay queued)."""
        for write in self._pending:
            write.resolve()

    def _trim(self) -> None:
        while len(self._pending) > self._max:
            self._pending.popleft().resolve()
            self.dropped += 1
