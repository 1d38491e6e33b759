"""One request inside the engine (a Sequence) and the queue of those waiting to run.

Plain slotted objects: the engine touches them every step, so they stay cheap.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from enum import IntEnum
from typing import Any


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    ABORTED = 3


class Sequence:
    """A request's tokens, KV blocks and timestamps (simulated seconds)."""

    __slots__ = (
        "id", "order", "prompt", "prompt_len", "target_out", "stop_at_length", "priority",
        "arrival_s", "salt", "out_base", "output", "num_computed", "blocks", "hashes",
        "n_registered", "admitted", "cached_tokens", "preemptions", "status", "scheduled_s",
        "first_token_s", "last_token_s", "last_itl", "finish_s", "sink", "tag", "user",
    )

    def __init__(self, request_id: str, order: int, prompt: Seq[int], *, target_out: int,
                 stop_at_length: bool, arrival_s: float, priority: int = 0, salt: int = 0,
                 out_base: int = 0) -> None:
        self.id = request_id
        self.order = order
        self.prompt = prompt
        self.prompt_len = len(prompt)
        self.target_out = target_out
        self.stop_at_length = stop_at_length  # True: max_tokens was set, finish_reason "length"
        self.priority = priority
        self.arrival_s = arrival_s
        self.salt = salt  # parent hash of the first block (cache_salt)
        self.out_base = out_base
        self.output: list[int] = []
        self.num_computed = 0  # tokens whose KV is computed
        self.blocks: list[int] = []
        self.hashes: list[int] = []  # chained hashes of full blocks, prompt then output
        self.n_registered = 0  # leading blocks already offered to the prefix cache
        self.admitted = False
        self.cached_tokens = 0  # prefix hit at first admission
        self.preemptions = 0
        self.status = Status.WAITING
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.last_itl: float | None = None
        self.finish_s: float | None = None
        self.sink: Callable[[Sequence], None] | None = None  # the HTTP layer's delivery hook
        self.tag = 0  # choice index, for prompts sent as a batch
        self.user: Any = None  # whatever the caller wants to find again (DES: its SimRequest)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output)

    @property
    def finished(self) -> bool:
        return self.status >= Status.FINISHED

    @property
    def finish_reason(self) -> str | None:
        if self.status is Status.ABORTED:
            return "abort"
        if self.status is not Status.FINISHED:
            return None
        return "length" if self.stop_at_length else "stop"

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) across the prompt/output boundary."""
        p = self.prompt_len
        if end <= p:
            return list(self.prompt[start:end])
        head = list(self.prompt[start:p]) if start < p else []
        return head + self.output[max(0, start - p):end - p]


class WaitingQueue:
    """Requests waiting to run: FCFS (preempted ones go back to the front) or by priority.

    Priority order is vLLM's: lower value first, then earlier arrival. Aborted entries are
    dropped lazily when they reach the head.
    """

    def __init__(self, policy: str) -> None:
        self.by_priority = policy == "priority"
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, seq: Sequence, *, front: bool = False) -> None:
        self._live += 1
        if self.by_priority:
            heapq.heappush(self._heap, (seq.priority, seq.arrival_s, seq.order, seq))
        elif front:
            self._fifo.appendleft(seq)
        else:
            self._fifo.append(seq)

    def peek(self) -> Sequence | None:
        if self.by_priority:
            heap = self._heap
            while heap and heap[0][3].status is not Status.WAITING:
                heapq.heappop(heap)
            return heap[0][3] if heap else None
        fifo = self._fifo
        while fifo and fifo[0].status is not Status.WAITING:
            fifo.popleft()
        return fifo[0] if fifo else None

    def pop(self) -> Sequence:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty waiting queue")
        if self.by_priority:
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        self._live -= 1
        return seq

    def discard(self, seq: Sequence) -> None:
        """Forget a waiting sequence whose status the caller just moved off WAITING."""
        self._live -= 1
