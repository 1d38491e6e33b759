"""Lua scripts of the Redis backend: match (binary search, one call), record, evict, forget,
drop; and the namespace's scope bookkeeping: account, oldest.

Each scope script touches the keys of one scope only (one hash tag, one Cluster slot); key
names are built from ARGV[1], the scope's key prefix, which shares the hash tag of KEYS[1].
The bookkeeping scripts touch only the namespace's two bookkeeping keys (their own hash tag).
"""

from __future__ import annotations

# Chains arrive as one string of 8-byte big-endian hashes; block i is sub(blob, 8i+1, 8i+8).
# A field's value is its expiry in ms (client clock); "0" means no TTL.

# ARGV: prefix, now_ms, blob, hints, replica... -> "d1,d2,...": per replica, the leading
# blocks it holds (one bulk string: cheaper to send and to parse than an array of integers).
# What a replica holds is prefix-closed (records write whole chains from block 0, LRU and TTL
# take leaves first), so a binary search finds each depth, and replicas that share a depth
# share its probes. `hints` ("d,d,...", may be empty) are depths the client saw lately (a
# system prompt's length, say): a group tries them before halving, two probes for a right
# guess; answers are exact whatever the hints. Where `evict` cut a chain, the cut is kept as
# a "hole", and a replica listed in `holey` gets its depth clipped at its first live hole.
MATCH = r"""#!lua flags=no-writes
local pre = ARGV[1]
local now = tonumber(ARGV[2])
local blob = ARGV[3]
local n = math.floor(#blob / 8)
local names = {}
for i = 5, #ARGV do names[#names + 1] = ARGV[i] end
local nrep = #names
local out = {}
for i = 1, nrep do out[i] = 0 end
if n == 0 or nrep == 0 then return table.concat(out, ',') end
local hints = {n}  -- a full hit is a guess worth two probes too
for d in string.gmatch(ARGV[4], '%d+') do hints[#hints + 1] = tonumber(d) end
table.sort(hints)

-- Splits a group (replica indexes) by whether each holds a live entry of block `pos`.
-- HMGET scans a small hash once per name, so a large group reads the whole hash instead.
-- A group that does not split comes back as it is (groups are never modified).
local NONE = {}
local function live(v)
  return v and (v == '0' or tonumber(v) > now)
end
local function split(pos, group)
  local key = pre .. 'b' .. string.sub(blob, pos * 8 + 1, pos * 8 + 8)
  local size = #group
  if size == 1 then
    if live(redis.call('HGET', key, names[group[1]])) then return group, NONE end
    return NONE, group
  end
  local yes, no = {}, {}
  if size <= 8 then
    local asked = {}
    for k = 1, size do asked[k] = names[group[k]] end
    local vals = redis.call('HMGET', key, unpack(asked))
    for k = 1, size do
      if live(vals[k]) then yes[#yes + 1] = group[k] else no[#no + 1] = group[k] end
    end
  else
    local flat = redis.call('HGETALL', key)
    local holders = {}
    for k = 1, #flat, 2 do
      if live(flat[k + 1]) then holders[flat[k]] = true end
    end
    for k = 1, size do
      if holders[names[group[k]]] then yes[#yes + 1] = group[k] else no[#no + 1] = group[k] end
    end
  end
  if #yes == size then return group, NONE end
  if #no == size then return NONE, group end
  return yes, no
end

local function settle(group, depth)
  for k = 1, #group do out[group[k]] = depth end
end

local all = {}
for i = 1, nrep do all[i] = i end
local stack = {}
local held = split(0, all)
if #held > 0 then stack[1] = {1, n, held} end  -- block n does not exist: nobody holds it
-- Each entry: its group holds block lo-1 and lacks block hi, so its depth is in [lo, hi].
while #stack > 0 do
  local t = table.remove(stack)
  local lo, hi, group = t[1], t[2], t[3]
  if lo >= hi then
    settle(group, lo)
  else
    local guess
    for k = 1, #hints do
      if hints[k] > lo and hints[k] <= hi then guess = hints[k]; break end
    end
    if guess then
      local yes, no = split(guess - 1, group)
      if #no > 0 then stack[#stack + 1] = {lo, guess - 1, no} end
      if #yes > 0 then
        if guess == hi then
          settle(yes, hi)
        else
          local deeper, exact = split(guess, yes)
          settle(exact, guess)
          if #deeper > 0 then stack[#stack + 1] = {guess + 1, hi, deeper} end
        end
      end
    else
      local mid = math.floor((lo + hi) / 2)
      local yes, no = split(mid, group)
      if #yes > 0 then stack[#stack + 1] = {mid + 1, hi, yes} end
      if #no > 0 then stack[#stack + 1] = {lo, mid, no} end
    end
  end
end

if redis.call('EXISTS', pre .. 'holey') == 1 then
  local flags = redis.call('SMISMEMBER', pre .. 'holey', unpack(names))
  for i = 1, nrep do
    if flags[i] == 1 and out[i] > 0 then
      local hk = pre .. 'h:' .. names[i]
      local b, j = out[i], 0
      while j < b do
        local m = math.min(b - j, 1000)
        local members = {}
        for k = 1, m do members[k] = string.sub(blob, (j + k - 1) * 8 + 1, (j + k) * 8) end
        local scores = redis.call('ZMSCORE', hk, unpack(members))
        for k = 1, m do
          local s = scores[k]
          if s then
            local e = tonumber(s)
            if e == 0 or e > now then out[i] = j + k - 1; b = -1; break end
          end
        end
        j = j + m
      end
    end
  end
end
return table.concat(out, ',')
"""

# ARGV: prefix, now_ms, ttl_ms (0: none), capacity, replica, blob, expiry_ms -> how many entries
# the replica's LRU gained (new blocks less what the capacity pushed out; may be negative).
# Block i gets recency seq-i: the root is the most recent, so ZPOPMIN takes leaves first.
RECORD = r"""
local pre, rep, blob, expiry = ARGV[1], ARGV[5], ARGV[6], ARGV[7]
local now, ttl, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local n = math.floor(#blob / 8)
if n == 0 then return 0 end
local seq = redis.call('INCRBY', pre .. 'seq', n)
local lru = pre .. 'l:' .. rep
local before = redis.call('ZCARD', lru)
local z = {}
for i = 0, n - 1 do
  local h = string.sub(blob, i * 8 + 1, i * 8 + 8)
  local key = pre .. 'b' .. h
  redis.call('HSET', key, rep, expiry)
  if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
  z[#z + 1] = seq - i
  z[#z + 1] = h
  if #z >= 1000 then redis.call('ZADD', lru, unpack(z)); z = {} end
end
if #z > 0 then redis.call('ZADD', lru, unpack(z)) end
if ttl > 0 then
  redis.call('PEXPIRE', lru, ttl)
  redis.call('PEXPIRE', pre .. 'seq', ttl)
end
if redis.call('SISMEMBER', pre .. 'holey', rep) == 1 then
  local hk = pre .. 'h:' .. rep
  local m = {}
  for i = 0, n - 1 do
    m[#m + 1] = string.sub(blob, i * 8 + 1, i * 8 + 8)
    if #m >= 1000 then redis.call('ZREM', hk, unpack(m)); m = {} end
  end
  if #m > 0 then redis.call('ZREM', hk, unpack(m)) end
  redis.call('ZREMRANGEBYSCORE', hk, '(0', now)
  if redis.call('EXISTS', hk) == 0 then redis.call('SREM', pre .. 'holey', rep) end
end
local card = redis.call('ZCARD', lru)
if card > cap then
  local popped = redis.call('ZPOPMIN', lru, card - cap)
  for i = 1, #popped, 2 do redis.call('HDEL', pre .. 'b' .. popped[i], rep) end
  card = cap
end
return card - before
"""

# ARGV: prefix, now_ms, ttl_ms, replica, blob -> entries the replica's LRU lost.
# A live evicted block may have blocks below it that the replica still holds; it is kept as a
# hole until it would have expired anyway (or is recorded again) so match stops there.
EVICT = r"""
local pre, rep, blob = ARGV[1], ARGV[4], ARGV[5]
local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local n = math.floor(#blob / 8)
local lru = pre .. 'l:' .. rep
local hk = pre .. 'h:' .. rep
local holes = {}
local count = 0
for i = 0, n - 1 do
  local h = string.sub(blob, i * 8 + 1, i * 8 + 8)
  local key = pre .. 'b' .. h
  local v = redis.call('HGET', key, rep)
  if v then
    redis.call('HDEL', key, rep)
    count = count + redis.call('ZREM', lru, h)
    local e = tonumber(v)
    if e == 0 or e > now then
      holes[#holes + 1] = v
      holes[#holes + 1] = h
      if #holes >= 1000 then redis.call('ZADD', hk, unpack(holes)); holes = {} end
    end
  end
end
if #holes > 0 then redis.call('ZADD', hk, unpack(holes)) end
if redis.call('EXISTS', lru) == 0 then  -- it holds nothing here: no hole can matter
  redis.call('DEL', hk)
  redis.call('SREM', pre .. 'holey', rep)
elseif redis.call('EXISTS', hk) == 1 then
  redis.call('ZREMRANGEBYSCORE', hk, '(0', now)
  if redis.call('EXISTS', hk) == 1 then
    redis.call('SADD', pre .. 'holey', rep)
    if ttl > 0 then
      redis.call('PEXPIRE', hk, ttl)
      redis.call('PEXPIRE', pre .. 'holey', ttl)
    end
  else
    redis.call('SREM', pre .. 'holey', rep)
  end
end
return count
"""

# ARGV: prefix, replica, limit -> {more, popped}: more is 1 while the replica still holds
# blocks in this scope, else 0. Pops the oldest (leaves) first, so a match running between two
# calls sees a shorter prefix.
FORGET = r"""
local pre, rep, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local lru = pre .. 'l:' .. rep
local popped = redis.call('ZPOPMIN', lru, limit)
for i = 1, #popped, 2 do redis.call('HDEL', pre .. 'b' .. popped[i], rep) end
if redis.call('EXISTS', lru) == 1 then return {1, #popped / 2} end
redis.call('DEL', pre .. 'h:' .. rep)
redis.call('SREM', pre .. 'holey', rep)
return {0, #popped / 2}
"""

# ARGV: prefix, limit, replica... -> {popped, left}: pops up to `limit` entries of the scope,
# each replica's oldest in proportion to what it holds (the memory backend's rule), and when
# none is left deletes the scope's remaining keys. The global bound and the sweep of idle
# scopes call it; `replica...` are the namespace's replicas (a scope's LRUs are among them).
DROP = r"""
local pre, limit = ARGV[1], tonumber(ARGV[2])
local lrus, total = {}, 0
for i = 3, #ARGV do
  local lru = pre .. 'l:' .. ARGV[i]
  local card = redis.call('ZCARD', lru)
  if card > 0 then
    lrus[#lrus + 1] = {ARGV[i], lru, card}
    total = total + card
  end
end
local want = math.min(limit, total)
local popped = 0
for _, t in ipairs(lrus) do
  local take = math.min(t[3], math.ceil(want * t[3] / total), want - popped)
  if take > 0 then
    local got = redis.call('ZPOPMIN', t[2], take)
    for j = 1, #got, 2 do redis.call('HDEL', pre .. 'b' .. got[j], t[1]) end
    popped = popped + #got / 2
  end
end
local left = total - popped
if left == 0 then
  redis.call('DEL', pre .. 'seq', pre .. 'holey')
  for i = 3, #ARGV do redis.call('DEL', pre .. 'h:' .. ARGV[i]) end
end
return {popped, left}
"""

# KEYS: scopes (ZSET sid -> last record ms), sizes (HASH sid -> entries, '#' -> load,
# '#evicted'). ARGV: ttl_ms (0: none), scope_cost, evicted, then (sid, delta, at) triples:
# at > 0: the scope was recorded at `at` ms (it joins the LRU or moves up, never down); 0: only
# its size changed; -1: its keys are gone. -> {load, sid...}: the load (entries plus scope_cost
# per scope) and the scopes a change left empty (for the caller to drop). A delta for a scope
# no longer listed (trimmed or swept meanwhile) starts it again only if it was a record; a
# size never goes below 0.
ACCOUNT = r"""
local scopes, sizes = KEYS[1], KEYS[2]
local ttl, cost = tonumber(ARGV[1]), tonumber(ARGV[2])
local load = tonumber(redis.call('HGET', sizes, '#') or '0')
local out = {0}
for i = 4, #ARGV, 3 do
  local sid, delta, at = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local old = redis.call('HGET', sizes, sid)
  if at < 0 then
    if old then
      load = load - tonumber(old) - cost
      redis.call('HDEL', sizes, sid)
      redis.call('ZREM', scopes, sid)
    end
  elseif old or at > 0 then
    local was = tonumber(old or '0')
    local size = math.max(0, was + delta)
    load = load + size - was
    if not old then load = load + cost end
    redis.call('HSET', sizes, sid, size)
    if at > 0 then redis.call('ZADD', scopes, 'GT', at, sid) end
    if size == 0 then out[#out + 1] = sid end
  end
end
load = math.max(0, load)
out[1] = load
redis.call('HSET', sizes, '#', load)
if tonumber(ARGV[3]) > 0 then redis.call('HINCRBY', sizes, '#evicted', ARGV[3]) end
if ttl > 0 then
  redis.call('PEXPIRE', scopes, ttl)
  redis.call('PEXPIRE', sizes, ttl)
end
return out
"""

# KEYS: scopes, sizes. ARGV: count -> {sid, entries, sid, entries...}: the least recently
# recorded scopes, oldest first.
OLDEST = r"""#!lua flags=no-writes
local sids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
local out = {}
for i = 1, #sids do
  out[#out + 1] = sids[i]
  out[#out + 1] = tonumber(redis.call('HGET', KEYS[2], sids[i]) or '0')
end
return out
"""
