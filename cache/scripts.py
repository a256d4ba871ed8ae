"""Lua scripts of the response cache: each runs atomically on the server.

Every script that writes what a request's answer left (STORE, REMEMBER, ADD, VADD) first checks
its fence (`FENCE`, see `cache.types.Fence`), so a purge that ran since the request's lookup, or
its tenant's deletion, refuses the write in the same step; PURGE_EPOCH is what a purge sets.

ADD (the core-Redis semantic index) takes a bucket's keys in `BucketKeys.all()` order: KEYS[1]
info, [2] vectors, [3] meta, [4] lru, [5] expiry, [6] free, [7] log, [8] by_response, then the
fence's key (the incarnation hash) when fenced; SYNC and LOAD take info, vectors, meta and log.
The bucket's version is head + LLEN(log): every change of a slot appends the slot to the log,
and a process that has applied the log up to version v asks only for what came after v.
"""

FENCE = """
-- Whether a write may go ahead, for the fence at KEYS[k] (the incarnation hash: its 'id' and
-- every purge epoch, evicted or lost together) and ARGV[a..a+5] (the tenant's and the adapter's
-- epoch fields, their values and the id seen, a new id): its tenant is not deleted (a 'gone:'
-- tombstone) and, unless it read nothing ('*'), the server is the incarnation it read and
-- neither its tenant's nor its adapter's scope was purged since ('' for a field not set). A
-- server without an incarnation (fresh: restarted, flushed, the hash evicted) gets one here, so
-- a write that read none is refused: epochs equal to those read then prove nothing.
local function fence_holds(k, a)
  local now = redis.call('HMGET', KEYS[k], 'id', ARGV[a], ARGV[a + 1])
  local boot = now[1]
  if not boot then
    boot = ARGV[a + 5]
    redis.call('HSET', KEYS[k], 'id', boot)
  end
  local tenant = now[2] or ''
  if string.sub(tenant, 1, 5) == 'gone:' then return false end
  if ARGV[a + 2] == '*' then return true end
  return boot == ARGV[a + 4] and tenant == ARGV[a + 2] and (now[3] or '') == ARGV[a + 3]
end
"""

STORE = (
    FENCE
    + """
-- KEYS: incarnation, entry[, request record]
-- ARGV: the fence's six (`Fence.args`), response, ttl_s -> 1 stored, 0 refused
-- The entry first: a record never points at an entry Redis refused (out of memory).
if not fence_holds(1, 1) then return 0 end
redis.call('SET', KEYS[2], ARGV[7], 'EX', ARGV[8])
if KEYS[3] then redis.call('SET', KEYS[3], KEYS[2], 'EX', ARGV[8]) end
return 1
"""
)

REMEMBER = (
    FENCE
    + """
-- KEYS: incarnation, request record, entry; ARGV: the fence's six (`Fence.args`)
-- -> 1 recorded, 0 refused, -1 the entry is gone (nothing left to report)
-- The record lives as long as the entry it names, whatever the hit's own policy TTL.
if not fence_holds(1, 1) then return 0 end
local ttl = redis.call('PTTL', KEYS[3])
if ttl <= 0 then return -1 end
redis.call('SET', KEYS[2], KEYS[3], 'PX', ttl)
return 1
"""
)

PURGE_EPOCH = """
-- KEYS: the incarnation hash; ARGV: an epoch's field, its new value, ttl_s.
-- The epoch is written '<value>@<expiry ms>' (hash fields have no TTL of their own, so each
-- purge also drops the epochs past their expiry). A tombstone stays one, its expiry renewed
-- (a deleted tenant's purge).
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local expiry = tonumber(string.match(fields[i + 1], '@(%d+)$'))
  if expiry and expiry <= now then redis.call('HDEL', KEYS[1], fields[i]) end
end
local value = ARGV[2]
local was = redis.call('HGET', KEYS[1], ARGV[1])
if was and string.sub(was, 1, 5) == 'gone:' then value = string.match(was, '^[^@]*') end
redis.call('HSET', KEYS[1], ARGV[1], value .. '@' .. (now + tonumber(ARGV[3]) * 1000))
return 1
"""

VADD = (
    FENCE
    + """
-- KEYS: vector set[, incarnation: when fenced]
-- ARGV: the fence's six (`Fence.args`), fp32 vector, element, attributes, ttl_s
-- -> the set's size after the add, or -1 when refused
if #KEYS == 2 and not fence_holds(2, 1) then return -1 end
redis.call('VADD', KEYS[1], 'FP32', ARGV[7], ARGV[8], 'Q8', 'SETATTR', ARGV[9])
redis.call('EXPIRE', KEYS[1], ARGV[10], 'NX')
redis.call('EXPIRE', KEYS[1], ARGV[10], 'GT')
return redis.call('VCARD', KEYS[1])
"""
)

ADD = (
    FENCE
    + """
-- ARGV: now_ms, ttl_ms, record, meta_json, response_key, max_entries, record_size, log_cap, epoch
--       [, the fence's six (`Fence.args`): with the incarnation, KEYS[9]]
-- -> the slot, or false when refused
if #KEYS == 9 and not fence_holds(9, 10) then return false end
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local size = tonumber(ARGV[7])
if redis.call('EXISTS', KEYS[1]) == 0 then
  -- a new incarnation: drop whatever an older one left behind
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
  redis.call('HSET', KEYS[1], 'epoch', ARGV[9], 'head', 0, 'next', 0)
end
local function release(slot)
  local meta = redis.call('HGET', KEYS[3], slot)
  if meta then redis.call('HDEL', KEYS[8], cjson.decode(meta)['k']) end
  redis.call('HDEL', KEYS[3], slot)
  redis.call('ZREM', KEYS[4], slot)
  redis.call('ZREM', KEYS[5], slot)
  redis.call('RPUSH', KEYS[6], slot)
  redis.call('RPUSH', KEYS[7], slot)
end
for _, slot in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, 64)) do
  release(slot)
end
local slot = redis.call('HGET', KEYS[8], ARGV[5])
if not slot then
  local max = tonumber(ARGV[6])
  while redis.call('ZCARD', KEYS[4]) >= max do
    release(redis.call('ZRANGE', KEYS[4], 0, 0)[1])
  end
  slot = redis.call('LPOP', KEYS[6])
  if not slot then slot = tostring(redis.call('HINCRBY', KEYS[1], 'next', 1) - 1) end
end
redis.call('SETRANGE', KEYS[2], tonumber(slot) * size, ARGV[3])
redis.call('HSET', KEYS[3], slot, ARGV[4])
redis.call('HSET', KEYS[8], ARGV[5], slot)
redis.call('ZADD', KEYS[4], now, slot)
redis.call('ZADD', KEYS[5], now + ttl, slot)
redis.call('RPUSH', KEYS[7], slot)
local cap = tonumber(ARGV[8])
local len = redis.call('LLEN', KEYS[7])
if len > cap then
  local cut = len - math.floor(cap / 2)
  redis.call('LTRIM', KEYS[7], cut, -1)
  redis.call('HINCRBY', KEYS[1], 'head', cut)
end
-- the bucket lives as long as its longest-lived entry; all its keys expire together
local keep = math.max(redis.call('PTTL', KEYS[1]), ttl)
for i = 1, 8 do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('PEXPIRE', KEYS[i], keep) end
end
return slot
"""
)

SYNC = """
-- ARGV: epoch, applied, max_changes, record_size
-- -> {epoch, version, 'reload'}
--  | {epoch, version, 'delta', slot, record, meta, slot, record, meta, ...}
--    where record and meta are '' for a slot no longer live; {''} when there is no bucket
local info = redis.call('HMGET', KEYS[1], 'epoch', 'head')
if not info[1] then return {''} end
local head = tonumber(info[2])
local version = head + redis.call('LLEN', KEYS[4])
local applied = tonumber(ARGV[2])
if info[1] ~= ARGV[1] or applied < head or version - applied > tonumber(ARGV[3]) then
  return {info[1], version, 'reload'}
end
local out = {info[1], version, 'delta'}
if applied == version then return out end
local size = tonumber(ARGV[4])
local changed = redis.call('LRANGE', KEYS[4], applied - head, -1)
local seen = {}
for i = #changed, 1, -1 do
  local slot = changed[i]
  if not seen[slot] then
    seen[slot] = true
    local meta = redis.call('HGET', KEYS[3], slot)
    out[#out + 1] = slot
    if meta then
      local start = tonumber(slot) * size
      out[#out + 1] = redis.call('GETRANGE', KEYS[2], start, start + size - 1)
      out[#out + 1] = meta
    else
      out[#out + 1] = ''
      out[#out + 1] = ''
    end
  end
end
return out
"""

LOAD = """
-- -> {epoch, version, records, slot, meta, slot, meta, ...}; {''} when there is no bucket
local info = redis.call('HMGET', KEYS[1], 'epoch', 'head')
if not info[1] then return {''} end
local version = tonumber(info[2]) + redis.call('LLEN', KEYS[4])
local out = {info[1], version, redis.call('GET', KEYS[2]) or ''}
for _, item in ipairs(redis.call('HGETALL', KEYS[3])) do out[#out + 1] = item end
return out
"""
