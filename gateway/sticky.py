"""Where each `/v1/responses` answer was made: response id -> (pool, replica), bounded (least
recently used out) and forgotten after a while, so a request naming `previous_response_id` goes
to the replica that stores that response.

Per gateway process: a follow-up that reaches another gateway process is routed as usual (and the
engine answers 404 for a response it does not hold).
"""

from __future__ import annotations

import time
from collections import OrderedDict

MAX_RESPONSES = 100_000  # ~200 B each: ~20 MB at most
TTL_S = 3600.0


class ResponseHomes:
    def __init__(self, max_entries: int = MAX_RESPONSES, ttl_s: float = TTL_S) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._homes: OrderedDict[str, tuple[str, str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def learn(self, response_id: str, pool: str, replica: str, now: float | None = None) -> None:
        if not response_id or len(response_id) > 256:
            return
        now = time.monotonic() if now is None else now
        homes = self._homes
        homes[response_id] = (pool, replica, now + self.ttl_s)
        homes.move_to_end(response_id)
        while len(homes) > self.max_entries:
            homes.popitem(last=False)

    def home(self, response_id: object, pool: str, now: float | None = None) -> str | None:
        """The replica that made `response_id` in `pool`, if known and not expired."""
        if not isinstance(response_id, str):
            return None
        entry = self._homes.get(response_id)
        if entry is None:
            return None
        now = time.monotonic() if now is None else now
        if entry[2] < now:
            del self._homes[response_id]
            return None
        self._homes.move_to_end(response_id)
        return entry[1] if entry[0] == pool else None
