"""The Redis Lua scripts of admission. Each runs atomically, so the check and the reservation of
every bucket of a request happen as one step that no other gateway can interleave with.

Clock: `now` is given in milliseconds since the epoch; a negative `now` means Redis's own clock
(`TIME`), the default, so every gateway process agrees on one clock. Tests pass their own.

Layout shared by ADMIT and SETTLE: KEYS are the buckets' keys in order (`W`: win, wtok, wsum;
`C`: conc; `B`: ledger — see gateway.quotas.buckets), then the request's release mark
(`<tenant>:released:<member>`): set by the settlement of an admission whose reply was lost, it
stops that admission's script from reserving anything should it reach Redis only after its
release did (a delayed packet, a reply the caller stopped waiting for).
"""

from __future__ import annotations

_CLOCK = """
local function clock(given)
  local t = tonumber(given)
  if t >= 0 then return t end
  local r = redis.call('TIME')
  return tonumber(r[1]) * 1000 + math.floor(tonumber(r[2]) / 1000)
end
"""

ADMIT = (
    _CLOCK
    + """
-- ARGV: now, member, tokens, window_ms, lease_ms;
--       then per bucket: kind, a, b, seed (spent tokens read from SQL for a missing ledger, or -1)
-- Returns {status, six values per bucket}, status 0 admitted, 1 refused, 3 admitted by an
-- earlier call with this member (a retry whose first reply was lost: nothing is reserved
-- twice); or {2, indexes of missing ledgers}; or {4}: this member was released already (its
-- caller gave up on this reply), so nothing is checked or reserved.
-- Per bucket, `wait` is FITS (-1), NEVER (-2: the request alone exceeds the limit), UNKNOWN (-3:
-- a running request must finish) or the milliseconds until the request would fit:
--   W: requests remaining, reset ms, requests wait, tokens remaining, reset ms, tokens wait
--   C: slots remaining, 0, wait, 0, 0, FITS
--   B: tokens remaining, ms to the period's end, wait, 0, 0, FITS
-- Remaining counts are before this request (status 0, 1) or with it (status 3).
local now = clock(ARGV[1])
local member, tokens = ARGV[2], tonumber(ARGV[3])
local window, lease = tonumber(ARGV[4]), tonumber(ARGV[5])
local HEAD, FITS, NEVER, UNKNOWN = 5, -1, -2, -3
local LEDGER_GRACE_MS = 86400000 -- a ledger outlives its period by a day, for late settlements
local n = (#ARGV - HEAD) / 4
local function arg(i, j) return ARGV[HEAD + 4 * i + j] end
if redis.call('EXISTS', KEYS[#KEYS]) == 1 then return {4} end

local first, k = {}, 1
for i = 0, n - 1 do
  first[i] = k
  if arg(i, 1) == 'W' then k = k + 3 else k = k + 1 end
end

-- A ledger without its total (a new period, a Redis that lost its data, or a budget set again:
-- gateway.quotas.limits) starts from the seed, plus the reservations it still holds: requests
-- running across a budget set again, which the usage in SQL does not count yet. Its `seeded`
-- field names the seed that set the total (member/seed), which alone may charge what was
-- recorded while it was on its way (CHARGE_LATE).
local missing = {}
for i = 0, n - 1 do
  local key = KEYS[first[i]]
  if arg(i, 1) == 'B' and redis.call('HEXISTS', key, 'spent') == 0 then
    local seed = tonumber(arg(i, 4))
    if seed < 0 then
      missing[#missing + 1] = i
    else
      local held = 0
      for _, v in ipairs(redis.call('HVALS', key)) do held = held + (tonumber(v) or 0) end
      redis.call('HSET', key, 'spent', seed + held, 'seeded', member .. '/' .. arg(i, 4))
      redis.call('PEXPIREAT', key, tonumber(arg(i, 3)) + LEDGER_GRACE_MS)
    end
  end
end
if #missing > 0 then return {2, unpack(missing)} end

-- Drop admissions that left the window, with the tokens they counted for.
local function trim(win, wtok, wsum)
  while true do
    local old = redis.call('ZRANGEBYSCORE', win, '-inf', now - window, 'LIMIT', 0, 256)
    if #old == 0 then break end
    local freed = 0
    for _, v in ipairs(redis.call('HMGET', wtok, unpack(old))) do
      freed = freed + (tonumber(v) or 0)
    end
    redis.call('HDEL', wtok, unpack(old))
    redis.call('ZREM', win, unpack(old))
    redis.call('DECRBY', wsum, freed)
  end
  if redis.call('ZCARD', win) == 0 then redis.call('DEL', wtok, wsum) end
end

-- Until the oldest admissions holding `excess` tokens have left the window.
local function token_wait(win, wtok, excess)
  local start = 0
  while true do
    local page = redis.call('ZRANGE', win, start, start + 99, 'WITHSCORES')
    if #page == 0 then return window end
    local ids = {}
    for j = 1, #page, 2 do ids[#ids + 1] = page[j] end
    local amounts = redis.call('HMGET', wtok, unpack(ids))
    for j = 1, #ids do
      excess = excess - (tonumber(amounts[j]) or 0)
      if excess <= 0 then return tonumber(page[2 * j]) + window - now end
    end
    start = start + 100
  end
end

local function check_window(win, wtok, wsum, rpm, tpm)
  trim(win, wtok, wsum)
  local count = redis.call('ZCARD', win)
  local sum = tonumber(redis.call('GET', wsum) or '0')
  local reset = 0
  local newest = redis.call('ZRANGE', win, -1, -1, 'WITHSCORES')
  if #newest > 0 then reset = tonumber(newest[2]) + window - now end
  local rw, tw = FITS, FITS
  if rpm >= 0 and count + 1 > rpm then
    if rpm == 0 then rw = NEVER else
      local e = redis.call('ZRANGE', win, count - rpm, count - rpm, 'WITHSCORES')
      rw = tonumber(e[2]) + window - now
    end
  end
  if tpm >= 0 and sum + tokens > tpm then
    if tokens > tpm then tw = NEVER else tw = token_wait(win, wtok, sum + tokens - tpm) end
  end
  return {rpm - count, reset, rw, tpm - sum, reset, tw}
end

local function check_slots(conc, limit)
  redis.call('ZREMRANGEBYSCORE', conc, '-inf', now)
  local count = redis.call('ZCARD', conc)
  local w = FITS
  if count + 1 > limit then
    if limit == 0 then w = NEVER else w = UNKNOWN end
  end
  return {limit - count, 0, w, 0, 0, FITS}
end

local function check_budget(ledger, budget, period_end)
  local spent = tonumber(redis.call('HGET', ledger, 'spent'))
  local w = FITS
  if spent + tokens > budget then
    if tokens > budget then w = NEVER else w = period_end - now end
  end
  return {budget - spent, period_end - now, w, 0, 0, FITS}
end

-- Whether this member holds a reservation already (in the first bucket: all or none have it).
local function holds(i)
  local kind, key = arg(i, 1), KEYS[first[i]]
  if kind == 'W' then return redis.call('HEXISTS', KEYS[first[i] + 1], member) == 1 end
  if kind == 'C' then return redis.call('ZSCORE', key, member) ~= false end
  return redis.call('HEXISTS', key, member) == 1
end
local again = holds(0)

local out = {0}
for i = 0, n - 1 do
  local kind, a, b, key = arg(i, 1), tonumber(arg(i, 2)), tonumber(arg(i, 3)), KEYS[first[i]]
  local r
  if kind == 'W' then r = check_window(key, KEYS[first[i] + 1], KEYS[first[i] + 2], a, b)
  elseif kind == 'C' then r = check_slots(key, a)
  else r = check_budget(key, a, b) end
  if r[3] ~= FITS or r[6] ~= FITS then out[1] = 1 end
  for j = 1, 6 do out[#out + 1] = r[j] end
end
if again then out[1] = 3 return out end
if out[1] == 1 then return out end

-- Every bucket has room: reserve in all of them.
for i = 0, n - 1 do
  local kind, key = arg(i, 1), KEYS[first[i]]
  if kind == 'W' then
    local wtok, wsum = KEYS[first[i] + 1], KEYS[first[i] + 2]
    redis.call('ZADD', key, now, member)
    redis.call('HSET', wtok, member, tokens)
    redis.call('INCRBY', wsum, tokens)
    for _, x in ipairs({key, wtok, wsum}) do redis.call('PEXPIRE', x, 2 * window) end
  elseif kind == 'C' then
    redis.call('ZADD', key, now + lease, member)
    redis.call('PEXPIRE', key, 2 * lease)
  else
    redis.call('HSET', key, member, tokens)
    redis.call('HINCRBY', key, 'spent', tokens)
  end
end
return out
"""
)

SETTLE = """
-- ARGV: member, used tokens, mark_ms; then the kind of each bucket.
-- A window entry still in its window is set to the real usage; a slot is released; a ledger
-- holding this member's reservation is charged the real usage instead. A ledger rebuilt after
-- Redis lost its data never saw the reservation and is left alone. Running it twice changes
-- nothing more. With mark_ms > 0 (the release of an admission whose reply was lost) the
-- member is also marked released for mark_ms, so its admission, should it come later,
-- reserves nothing.
local member, used, mark = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if mark > 0 then redis.call('SET', KEYS[#KEYS], '1', 'PX', mark) end
local k = 1
for i = 4, #ARGV do
  local kind = ARGV[i]
  if kind == 'W' then
    local old = redis.call('HGET', KEYS[k + 1], member)
    if old then
      redis.call('HSET', KEYS[k + 1], member, used)
      redis.call('INCRBY', KEYS[k + 2], used - tonumber(old))
    end
    k = k + 3
  elseif kind == 'C' then
    redis.call('ZREM', KEYS[k], member)
    k = k + 1
  else
    local reserved = redis.call('HGET', KEYS[k], member)
    if reserved then
      redis.call('HDEL', KEYS[k], member)
      -- A ledger waiting for its seed has no total: the seed will count this usage.
      if redis.call('HEXISTS', KEYS[k], 'spent') == 1 then
        redis.call('HINCRBY', KEYS[k], 'spent', used - tonumber(reserved))
      end
    end
    k = k + 1
  end
end
return 1
"""

CHARGE_LATE = """
-- KEYS: budget ledgers; ARGV: per ledger, the seed sent (member/seed, as ADMIT writes it in
-- `seeded`) and tokens. Adds them to each ledger whose total that very seed set (usage recorded
-- while it was on its way: gateway.quotas.ledger), once: the mark is taken away. A ledger
-- another seed set, or without a total, is left alone.
for i, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'seeded') == ARGV[2 * i - 1] then
    redis.call('HDEL', key, 'seeded')
    if redis.call('HEXISTS', key, 'spent') == 1 then
      redis.call('HINCRBY', key, 'spent', tonumber(ARGV[2 * i]))
    end
  end
end
return 1
"""

RENEW = (
    _CLOCK
    + """
-- KEYS: the concurrency sets holding one request's slots; ARGV: now, lease_ms, member.
-- Pushes the slots' expiry one lease ahead; a slot already released stays released.
local now, lease, member = clock(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
for _, key in ipairs(KEYS) do
  if redis.call('ZSCORE', key, member) then
    redis.call('ZADD', key, now + lease, member)
    redis.call('PEXPIRE', key, 2 * lease)
  end
end
return 1
"""
)
