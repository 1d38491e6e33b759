"""The Redis index's writes on their way: queued, sent in batches by one task, kept through an
outage and sent after it, and the journal of recent records that refills a Redis that lost the
index. The queue is prefix_index/_writes.py, the journal prefix_index/_rebuild.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.exceptions import RedisError

from prefix_index._accounts import ScopeAccounts
from prefix_index._link import RedisLink, RedisTuning
from prefix_index._rebuild import Journal
from prefix_index._writes import Write, WriteQueue
from prefix_index.redis_client import OUTAGE, cancel


class Flusher:
    """One task at a time sends `queue` to Redis through `link` while it is up, and settles
    the scope accounts after the writes (`accounts`); `now_ms` is the index's clock."""

    def __init__(
        self,
        link: RedisLink,
        accounts: ScopeAccounts,
        tuning: RedisTuning,
        now_ms: Callable[[], int],
    ) -> None:
        self._link = link
        self._accounts = accounts
        self._now_ms = now_ms
        self.queue = WriteQueue(tuning.max_pending, tuning.write_batch, tuning.write_batch_blocks)
        self.journal = Journal(tuning.journal_writes, tuning.journal_blocks)
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> bool:
        """Writes are queued or on their way (not yet answered by Redis)."""
        return bool(self.queue) or (self._task is not None and not self._task.done())

    def kick(self) -> None:
        if self._link.down or self._link.closed:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def flush(self) -> bool:
        """Wait until queued writes reached Redis; False if some stay buffered (Redis out)."""
        while True:
            task = self._task
            if task is not None and not task.done():
                await asyncio.shield(task)
            elif self.queue and not self._link.down and not self._link.closed:
                self.kick()
            else:
                return not self.queue

    async def stop(self) -> None:
        await cancel(self._task)

    def replay(self) -> list[Write]:
        """Queue the journal again (Redis lost the index); the writes queued."""
        writes = self.journal.replay(self._now_ms())
        for write in writes:
            self.queue.push(write)
        return writes

    async def _loop(self) -> None:
        link, accounts, queue = self._link, self._accounts, self.queue
        while not link.down and not link.closed:
            if not queue:
                if accounts.upkeep_due(self._now_ms(), idle=True):
                    await accounts.upkeep(self._now_ms())
                if not queue:
                    return
                continue
            batch = queue.take()
            try:
                if batch[0].forget is not None:
                    await accounts.forget(batch[0].forget)
                else:
                    commands = [c for w in batch for c in w.commands]
                    accounts.carry_sizes(commands, await link.execute(commands, checked=False))
            except OUTAGE as exc:
                queue.put_back(batch)
                link.went_down(exc)
            except RedisError as exc:  # e.g. OOM: these writes would fail again; drop them
                link.complain("write", exc)
            finally:  # a waiting record() returns whatever happened (also on cancellation)
                for write in batch:
                    write.resolve()
            if accounts.upkeep_due(self._now_ms(), idle=False):
                await accounts.upkeep(self._now_ms())
