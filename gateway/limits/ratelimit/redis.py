"""The Redis backend: buckets shared by every gateway process, one script call per decision.

Any URL prefix_index/redis_client.py opens: one node, Sentinel (the master is found again after a
failover, and followed within `check_s` of a graceful switch: prefix_index/redis_follow.py),
Cluster (every rule of one key shares the key's hash tag, so one script call stays in one slot;
the scripts are loaded on whichever master answers NOSCRIPT).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from redis.exceptions import RedisError

from gateway.limits.ratelimit.base import Clock, Rule, RuleState, Verdict, check_costs, rule_state
from prefix_index.redis_client import (
    OUTAGE,
    Client,
    RedisHealth,
    cancel,
    open_redis,
    parse_redis_url,
)
from prefix_index.redis_follow import MasterFollower

log = logging.getLogger("gateway.ratelimit")

# What both scripts share. Each bucket is a hash {v: level, t: seconds}; Redis TIME is the clock,
# so every gateway process agrees. Numbers go out as strings (Lua numbers would be truncated to
# integers on the way out). A bucket's key lives as long as the bucket takes to fill again (+1 s).
_BUCKETS = """
local function s(x) return string.format('%.17g', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, rate, burst)
  local b = redis.call('HMGET', key, 'v', 't')
  local v = tonumber(b[1])
  if v == nil then return burst end
  return math.min(burst, v + math.max(0, now - tonumber(b[2])) * rate)
end
local function store(key, v, rate, burst)
  redis.call('HSET', key, 'v', s(v), 't', s(now))
  redis.call('PEXPIRE', key, math.ceil((burst - v) / rate * 1000) + 1000)
end
"""

# KEYS: one bucket per rule; ARGV: rate, burst, cost per key. Returns {allowed, wait, flags per
# rule ("0" fits, "1" short now, "2" deeper than the bucket: never fits), level after, ...}. A cost
# is taken whole or not at all.
_ACQUIRE = (
    _BUCKETS
    + """
local n = #KEYS
local levels, needs = {}, {}
local wait = 0
local short = ''
for i = 1, n do
  local rate, burst = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1])
  local cost = math.max(0, tonumber(ARGV[3*i]))
  local v = level(KEYS[i], rate, burst)
  if cost > burst + 1e-9 then
    short = short .. '2'
  elseif v + 1e-9 < cost then
    wait = math.max(wait, (cost - v) / rate)
    short = short .. '1'
  else
    short = short .. '0'
  end
  levels[i], needs[i] = v, cost
end
local allowed = not string.find(short, '[12]')
local out = {allowed and '1' or '0', s(wait), short}
for i = 1, n do
  if allowed then
    levels[i] = levels[i] - needs[i]
    store(KEYS[i], levels[i], tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]))
  end
  out[#out+1] = s(levels[i])
end
return out
"""
)

# KEYS[1]: one bucket; ARGV: rate, burst, delta (taken; negative gives back).
_ADJUST = (
    _BUCKETS
    + """
local rate, burst, delta = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local v = math.min(burst, level(KEYS[1], rate, burst) - delta)
store(KEYS[1], v, rate, burst)
return s(v)
"""
)


class RedisRateLimiter:
    """Buckets in Redis, shared by every gateway process; one script call (one round trip) each.

    Keys are `<namespace>:{<key>}:<rule>` hashes with a TTL of their refill time, so idle buckets
    vanish. When Redis is unreachable the limiter fails open: it allows, warns once per outage,
    skips Redis for `probe_s`, then probes again and recovers by itself. At most
    `max_connections` calls are in flight; the rest wait their turn in a gate (a queue, not an
    outage) and skip Redis at once if it went down meanwhile. `health` counts the outages and
    recoveries (and the time spent failing open). On Sentinel a background task asks the
    sentinels every `check_s` where the master is and moves there (`health.switches`), so the
    buckets keep living on the master after a graceful switch, not on a master about to be
    demoted (whose writes the demotion discards).
    """

    def __init__(
        self,
        url: str,
        namespace: str = "kvgw:rl",
        *,
        timeout_s: float = 0.25,
        probe_s: float = 1.0,
        max_connections: int = 32,
        check_s: float = 1.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self._target = target = parse_redis_url(url)
        self._where = target.where
        self._timeout_s = timeout_s
        self._probe_s = probe_s
        self._max_connections = max_connections
        self._check_s = check_s
        self._clock = clock
        self.health = RedisHealth()
        # a call is bounded by timeout_s * 4: a retired client has no call left after that
        self._follower = MasterFollower(
            target=target, health=self.health, timeout_s=timeout_s * 4, grace_s=timeout_s * 4,
            log=log, who="rate limit",
        )  # fmt: skip
        self._watcher: asyncio.Task[None] | None = None
        self._gate = asyncio.Semaphore(max_connections)
        self._next_probe = 0.0
        self._open()

    def _open(self) -> None:
        """A client (it connects on first use) and the scripts registered on it."""
        self._redis: Client = open_redis(
            self._target,
            socket_timeout=self._timeout_s,
            connect_timeout=self._timeout_s,
            max_connections=self._max_connections,
        )
        self._scripts = {
            "acquire": self._redis.register_script(_ACQUIRE),
            "adjust": self._redis.register_script(_ADJUST),
        }

    def bucket_key(self, key: str, rule: Rule) -> str:
        return f"{self.namespace}:{{{key}}}:{rule.name}"

    async def acquire(self, key: str, rules: Sequence[Rule], costs: Sequence[float]) -> Verdict:
        check_costs(rules, costs)
        if not rules:
            return Verdict(True, 0.0)
        args: list[float] = []
        for r, c in zip(rules, costs, strict=True):
            args += [r.rate_per_s, r.burst, c]
        keys = [self.bucket_key(key, r) for r in rules]
        reply = await self._call("acquire", keys, args)
        if reply is None:
            states = tuple(RuleState(r, r.burst, r.burst, 0.0) for r in rules)
            return Verdict(True, 0.0, states, degraded=True)
        levels = [float(x) for x in reply[3:]]
        states = tuple(rule_state(r, lv) for r, lv in zip(rules, levels, strict=True))
        flags = reply[2].decode()
        blocked = tuple(r.name for r, flag in zip(rules, flags, strict=True) if flag != "0")
        oversized = tuple(
            (r.name, max(0.0, float(c)))
            for r, c, flag in zip(rules, costs, flags, strict=True)
            if flag == "2"
        )
        return Verdict(reply[0] == b"1", float(reply[1]), states, blocked, oversized=oversized)

    async def adjust(self, key: str, rule: Rule, delta: float) -> None:
        await self._call(
            "adjust", [self.bucket_key(key, rule)], [rule.rate_per_s, rule.burst, delta]
        )

    async def _call(self, script: str, keys: list[str], args: list[float]) -> list[bytes] | None:
        """The script's reply, or None when Redis is down (or was, and the probe is not due)."""
        if self._watcher is None and self._follower.sentinel and self._check_s > 0:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        async with self._gate:
            probing = not self.health.up
            if probing:
                now = self._clock()
                if now < self._next_probe:
                    return None
                self._next_probe = now + self._probe_s  # one probe per interval, not per request
            try:
                async with asyncio.timeout(self._timeout_s * 4):  # connect + one retry, bounded
                    reply = await self._scripts[script](keys=keys, args=args)
            except (*OUTAGE, RedisError) as exc:  # redis_client.OUTAGE says what counts
                if self.health.up:
                    self.health.went_down(exc)
                    self._next_probe = self._clock() + self._probe_s
                    log.warning(
                        "rate limit Redis at %s unreachable (%s: %s); allowing requests "
                        "unlimited until it answers again",
                        self._where,
                        type(exc).__name__,
                        exc,
                    )
                return None
            if probing and not self.health.up:
                self._follower.forget()
                down_s = self.health.came_back()
                log.info(
                    "rate limit Redis at %s answers again after %.1f s; limits apply",
                    self._where,
                    down_s,
                )
            return reply  # type: ignore[no-any-return]

    async def _watch(self) -> None:
        """Every `check_s` while Redis answers: has the Sentinel master moved? (During an outage
        the probe's new connection asks the sentinels itself.) Sentinels that do not answer are
        no outage of the limiter: its calls tell."""
        while True:
            await asyncio.sleep(self._check_s)
            if not self.health.up:
                continue
            try:
                if await self._follower.moved(self._redis):
                    self._open()
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug(
                    "rate limit: could not ask the sentinels (%s: %s)", type(exc).__name__, exc
                )

    async def aclose(self) -> None:
        await cancel(self._watcher)
        await self._redis.aclose()
        await self._follower.aclose()
