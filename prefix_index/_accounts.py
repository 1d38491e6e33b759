"""The Redis index's bound: the namespace's scope accounts, kept from the writes' replies.

Each record's or evict's reply is the change in entries; this gateway carries the changes per
scope and sends them to the accounts when the write queue empties (or every second under
load), then trims the least recently recorded scopes past `max_blocks` and, with a TTL, sweeps
scopes idle past it (their keys deleted). All of it runs in the flusher, off the request path.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import RedisError

from prefix_index._link import SHA, RedisLink, raise_first
from prefix_index.constants import (
    SCOPE_COST_BLOCKS,
    SIZES_EVICTED,
    ScopeKeys,
    replica_scopes_key,
    replicas_key,
    scopes_key,
    sid_of_prefix,
    sizes_key,
)
from prefix_index.redis_client import OUTAGE

_SIZED = {SHA["record"], SHA["evict"]}  # writes whose reply is the change in entries
_UPKEEP_MS = 1000  # under a steady stream of writes, settle the scope accounts this often...
_UPKEEP_SCOPES = 1024  # ...or once this many scopes have changed
_SWEEP_MS = 1000  # look for scopes idle past the TTL this often (client clock)
_TRIM_SCOPES = 256  # scopes one trim or sweep round handles
_TRIM_ROUNDS = 64  # rounds one upkeep may spend trimming (the next one goes on)


class ScopeAccounts:
    """One namespace's scope accounts as this gateway keeps them (through `link`)."""

    def __init__(
        self, link: RedisLink, namespace: str, ttl_ms: int, max_blocks: int, forget_batch: int
    ) -> None:
        self._link = link
        self.namespace = namespace
        self._ttl_ms = ttl_ms
        self.max_blocks = max_blocks
        self._forget_batch = forget_batch
        # Entries this gateway's writes added per scope (sid -> [delta, last record ms or 0]),
        # not yet sent to the namespace's scope accounts.
        self._carry: dict[str, list[int]] = {}
        self._carry_entries = 0
        self._next_upkeep = 0
        self._next_sweep = 0

    def reset(self) -> None:
        """Redis lost the index: the accounts start over from the replayed writes' replies."""
        self._carry.clear()
        self._carry_entries = 0

    def carry_sizes(self, commands: list[tuple[Any, ...]], replies: list[Any]) -> None:
        """Note what each record and evict changed, then raise the first refusal, if any."""
        for command, reply in zip(commands, replies, strict=True):
            if command[0] == "EVALSHA" and command[1] in _SIZED and isinstance(reply, int):
                sid = sid_of_prefix(command[4])
                if command[1] == SHA["record"]:
                    self._carry_add(sid, reply, command[5])  # entries gained, at its time
                else:
                    self._carry_add(sid, -reply, 0)  # entries an evict took
        raise_first(replies)

    def _carry_add(self, sid: str, delta: int, at: int) -> None:
        entry = self._carry.get(sid)
        if entry is None:
            self._carry[sid] = [delta, at]
        else:
            entry[0] += delta
            entry[1] = max(entry[1], at)
        self._carry_entries += abs(delta)

    async def forget(self, replica: str) -> None:
        """Per scope the replica holds blocks in, pop its entries in bounded calls."""
        ns = self.namespace
        scopes_of = replica_scopes_key(ns, replica)
        for sid in await self._link.redis().smembers(scopes_of):
            keys = ScopeKeys.from_sid(ns, _text(sid))
            command = ("EVALSHA", SHA["forget"], 1, keys.seq, keys.prefix, replica,
                       self._forget_batch)  # fmt: skip
            more = 1
            while more:
                more, popped = (await self._link.execute([command]))[0]
                self._carry_add(keys.sid, -int(popped), 0)
        await self._link.execute([("DEL", scopes_of), ("SREM", replicas_key(ns), replica)])

    def upkeep_due(self, now: int, idle: bool) -> bool:
        if self._ttl_ms and now >= self._next_sweep:
            return True
        if not self._carry:
            return False
        return (
            idle
            or now >= self._next_upkeep
            or len(self._carry) >= _UPKEEP_SCOPES
            or self._carry_entries * 16 >= self.max_blocks
        )

    async def upkeep(self, now: int) -> None:
        """Send the carried sizes; trim past the bound; now and then sweep idle scopes."""
        try:
            self._next_upkeep = now + _UPKEEP_MS
            if self._carry:
                carry, self._carry, entries = self._carry, {}, self._carry_entries
                self._carry_entries = 0
                triples = [(sid, d, at) for sid, (d, at) in carry.items()]
                try:
                    load, emptied = await self._account(triples)
                except BaseException:
                    for sid, (d, at) in carry.items():
                        self._carry_add(sid, d, at)
                    self._carry_entries = max(self._carry_entries, entries)
                    raise
                if emptied:  # evictions or a forget emptied them: their keys go too
                    load = await self._drop_scopes([(sid, 0) for sid in emptied], evicted=False)
                if load > self.max_blocks:
                    await self._trim(load)
            if self._ttl_ms and now >= self._next_sweep:
                self._next_sweep = now + _SWEEP_MS
                await self._sweep(now - self._ttl_ms)
        except OUTAGE as exc:
            self._link.went_down(exc)
        except RedisError as exc:
            self._link.complain("write", exc)

    async def _account(
        self,
        triples: list[tuple[str, int, int]],
        evicted: int = 0,
        extra: tuple[tuple[Any, ...], ...] = (),
    ) -> tuple[int, list[str]]:
        """Apply (sid, delta, at) changes to the scope accounts (see ACCOUNT): the new load, and
        the scopes left empty."""
        ns = self.namespace
        args = [a for triple in triples for a in triple]
        command = ("EVALSHA", SHA["account"], 2, scopes_key(ns), sizes_key(ns), self._ttl_ms,
                   SCOPE_COST_BLOCKS, evicted, *args)  # fmt: skip
        load, *emptied = (await self._link.execute([command, *extra]))[0]
        return int(load), [sid.decode() for sid in emptied]

    async def _trim(self, load: int) -> None:
        """Take entries from the least recently recorded scopes of the namespace until its
        load fits: whole scopes while one's weight fits in the excess, then part of one."""
        ns = self.namespace
        oldest = ("EVALSHA", SHA["oldest"], 2, scopes_key(ns), sizes_key(ns), _TRIM_SCOPES)
        for _ in range(_TRIM_ROUNDS):
            over = load - self.max_blocks
            if over <= 0 or self._link.closed:
                return
            flat = (await self._link.execute([oldest]))[0]
            victims: list[tuple[str, int | None]] = []  # sid, entries to take (None: all)
            for sid, size in zip(flat[::2], flat[1::2], strict=True):
                if over <= 0:
                    break
                whole = int(size) + SCOPE_COST_BLOCKS <= over or int(size) <= over
                victims.append((sid.decode(), None if whole else over))
                over -= int(size) + SCOPE_COST_BLOCKS if whole else over
            if not victims:
                return
            load = await self._drop_scopes(victims, evicted=True)

    async def _sweep(self, cutoff_ms: int) -> None:
        """Drop scopes last recorded at or before `cutoff_ms`: every entry of theirs expired
        (their keys too, if Redis' clock agrees; what is left is deleted)."""
        for _ in range(_TRIM_ROUNDS):
            # the stub's answer includes (member, score) pairs, which only withscores=True gives
            sids: list[bytes | str] = await self._link.redis().zrangebyscore(  # type: ignore[assignment]
                scopes_key(self.namespace), "-inf", cutoff_ms, start=0, num=_TRIM_SCOPES
            )
            if sids:
                await self._drop_scopes([(_text(sid), None) for sid in sids], evicted=False)
            if len(sids) < _TRIM_SCOPES:
                return

    async def _drop_scopes(self, victims: list[tuple[str, int | None]], evicted: bool) -> int:
        """Pop the victims' entries (all of them, or as many as given) in bounded calls, then
        settle their accounts and their replicas' scope sets; the new load. A scope that ends
        empty loses its remaining keys and its account."""
        ns = self.namespace
        client = self._link.redis()
        replicas = sorted(_text(n) for n in await client.smembers(replicas_key(ns)))
        step = self._forget_batch
        todo = {sid: limit for sid, limit in victims}
        popped = dict.fromkeys(todo, 0)
        gone: list[str] = []
        while todo:
            rounds = list(todo.items())
            commands = []
            for sid, limit in rounds:
                keys = ScopeKeys.from_sid(ns, sid)
                take = step if limit is None else min(step, limit - popped[sid])
                commands.append(("EVALSHA", SHA["drop"], 1, keys.seq, keys.prefix, take,
                                 *replicas))  # fmt: skip
            replies = await self._link.execute(commands)
            for (sid, limit), (got, left) in zip(rounds, replies, strict=True):
                popped[sid] += int(got)
                if not int(left):
                    gone.append(sid)
                    del todo[sid]
                elif limit is not None and popped[sid] >= limit:
                    del todo[sid]
        triples = [(sid, 0, -1) if sid in gone else (sid, -popped[sid], 0) for sid in popped]
        unlisted = tuple(("SREM", replica_scopes_key(ns, r), *gone) for r in replicas if gone)
        load, _ = await self._account(
            triples, evicted=sum(popped.values()) if evicted else 0, extra=unlisted
        )
        return load

    async def counts(self) -> tuple[dict[str, int], int, int]:
        """Entries per replica across all gateways of the namespace, its scope count and the
        entries the bound evicted (three round trips)."""
        ns = self.namespace
        client = self._link.redis()
        pipe = client.pipeline(transaction=False)
        pipe.smembers(replicas_key(ns))
        pipe.zcard(scopes_key(ns))
        pipe.hget(sizes_key(ns), SIZES_EVICTED)
        members, scope_count, evicted = await pipe.execute()
        names = sorted(n.decode() for n in members)
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.smembers(replica_scopes_key(ns, name))
        sid_sets = await pipe.execute()
        pipe = client.pipeline(transaction=False)
        for name, sids in zip(names, sid_sets, strict=True):
            for sid in sids:
                pipe.zcard(ScopeKeys.from_sid(ns, sid.decode()).lru(name))
        cards = iter(await pipe.execute())
        per_replica = {
            name: sum(int(next(cards)) for _ in sids)
            for name, sids in zip(names, sid_sets, strict=True)
        }
        return per_replica, int(scope_count), int(evicted or 0)


def _text(member: bytes | str) -> str:
    """A set member as text (the client does not decode responses: members come as bytes)."""
    return member if isinstance(member, str) else member.decode()
