"""Lua scripts of a semaphore (``semaphore.RedisSemaphore``): up to ``limit`` permits of one name.

KEYS[1] is the semaphore's name; the key of that name is never written, but
a lock's hold of it (a task's run while its ``lock_limit`` was 1, the limit
raised since) takes one of the ``limit`` places until it ends. Its
permits are the keys ``<prefix>permit:<i>`` for ``i`` in ``1..limit``, where
``<prefix>`` is the name's companion prefix (``attempt.companion_key``), so
that every key of one semaphore is in one Redis Cluster hash slot. A permit
is a lock value (``_scripts``: ``"<token>:<fence>:<holder>"``) with the TTL of
its holder's lease: the watchdog renews it with ``RENEW`` like any lock, and
a permit nobody renews (its holder died) frees itself when its TTL runs out,
within its lease. Waiters queue and are woken as a lock's (the shared
pieces' queue, deadlines and wake lists): a release wakes the first waiter; a fair
one is granted the freed permit and woken with ``"<fence>:<i>"``.

A permit's fence is the server clock in microseconds, raised above every
live permit's fence and a lock's hold of the name (and, when handed on, the
releaser's): greater than every earlier permit's, as a lock's fence is.

All users of one name agree on ``limit`` (and ``fair``): the scripts look at
permits ``1..limit`` of the caller's ``limit`` only (a limit lowered from N to
M leaves the holders of permits M+1..N unseen until they end). A script reads every
permit, so ``limit`` is at most ``MAX_LIMIT``.
"""

from __future__ import annotations

from ._scripts import Script

__all__ = ["ACQUIRE_PERMIT", "LEAVE_PERMIT_QUEUE", "MAX_LIMIT", "RELEASE_PERMIT", "WATCH_PERMIT"]

#: The highest ``limit`` (every script reads all the permits, in one MGET).
MAX_LIMIT = 1000

_PERMITS = """
local permit_prefix = prefix .. 'permit:'

-- The values of permits 1..limit (false: free).
local function permits(limit)
  local keys = {}
  for i = 1, limit do keys[i] = permit_prefix .. i end
  return redis.call('MGET', unpack(keys))
end

-- Grants permit `i` to `token` with a fence above every live permit's, a lock's hold of the
-- name's (see first_free) and `floor`: also when the server clock went back since they were
-- granted. Returns the grant as "<fence>:<i>".
local function grant(i, values, floor, token, holder, ttl_ms, now_us)
  local top = math.max(floor, fence_of(redis.call('GET', lock) or '') or 0)
  for _, value in ipairs(values) do
    if value then top = math.max(top, fence_of(value)) end
  end
  local fence = math.max(now_us, top + 1)
  values[i] = hold(token, fence, holder)
  redis.call('SET', permit_prefix .. i, values[i], 'PX', ttl_ms)
  return string.format('%.0f', fence) .. ':' .. i
end

-- The run a task's holder names ("task=<id> ", see protocol.holder_for); nil for another holder.
local function run_of(holder) return holder and string.match(holder, '^task=%S+ ') end

-- Whether `holder` is a task's run that holds one of `values` or the name's lock: it waits for
-- that hold, and is not granted (nor woken for) another place.
local function run_holds(holder, values)
  local run = run_of(holder)
  if not run then return false end
  for _, value in ipairs(values) do
    if value and run_of(holder_of(value)) == run then return true end
  end
  local named = redis.call('GET', lock)
  return (named and run_of(holder_of(named)) == run) or false
end

-- Wakes the first live waiter (before `stop`, if given) that can take the free permit `i`; a
-- fair one is granted it. Returns whether one was woken.
local function pass_on(i, values, floor, now_ms, now_us, stop)
  evict(now_ms)
  for _, head in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
    if head == stop then return false end
    local ttl_ms, token, fair, holder = member_fields(head)
    if not run_holds(holder, values) then
      leave(head, wake_prefix .. token)
      wake(token, fair == '1' and grant(i, values, floor, token, holder, ttl_ms, now_us) or 'retry', ttl_ms)
      return true
    end
  end
  return false
end

-- The first free permit (nil: none). A hold of the name's own key, a lock (a task's run of
-- lock_limit 1, the limit raised under it), takes one of the `limit` places too.
local function first_free(values)
  local taken = redis.call('EXISTS', lock)
  for _, value in ipairs(values) do
    if value then taken = taken + 1 end
  end
  if taken >= #values then return end
  for i, value in ipairs(values) do
    if not value then return i end
  end
end
"""

_ACQUIRE_PERMIT = """
-- ACQUIRE_PERMIT. KEYS[1] the semaphore's name. ARGV[1] the caller's waiter member,
-- ARGV[2] what to do when no permit is free ('try', 'wait', 'again', 'last': as ACQUIRE's),
-- ARGV[3] limit.
-- Returns "<fence>:<i>" when the caller holds permit i now (its TTL set to the member's
-- ttl), else {the PTTL in ms of the permit that runs out first, its holder} ({-2, false}
-- when the free permits just went to fair waiters before the caller). A task's run whose
-- task id holds a permit already (its own message delivered again, or its previous attempt
-- letting go) is not granted one: it gets {that permit's PTTL, its holder}, and waits for it.
local member, mode = ARGV[1], ARGV[2]
local ttl_ms, token, fair, holder = member_fields(member)
local now_ms, now_us = clock(redis.call('TIME'))
local values = permits(tonumber(ARGV[3]))
local run, soonest, soonest_holder, same_run = run_of(holder), nil, false, nil
-- Notes the hold `value` of `key`: the soonest to run out, and the caller's run's own.
local function note(key, value)
  local pttl = redis.call('PTTL', key)
  if not soonest or pttl < soonest then soonest, soonest_holder = pttl, holder_of(value) end
  if run and run_of(holder_of(value)) == run then same_run = {pttl, holder_of(value)} end
end
for i, value in ipairs(values) do
  if owns(value, token) then  -- handed over while we were away from the wake list
    leave(member, wake_prefix .. token)
    redis.call('PEXPIRE', permit_prefix .. i, ttl_ms)
    return string.format('%.0f', fence_of(value)) .. ':' .. i
  elseif value then
    note(permit_prefix .. i, value)
  end
end
local named = redis.call('GET', lock)
if named then note(lock, named) end  -- a lock's hold of the name (see first_free)
local free, head = not same_run and first_free(values) or nil, nil
if fair == '1' then
  evict(now_ms)
  head = redis.call('ZRANGE', queue, 0, 0)[1]
  while free and head and head ~= member do  -- fair waiters before the caller are served first
    if not pass_on(free, values, 0, now_ms, now_us, member) then break end
    free, head = first_free(values), redis.call('ZRANGE', queue, 0, 0)[1]
  end
end
if free then
  -- a waiter leaves the queue; so does a first 'wait' sent again after a lost reply, which its
  -- first run may have queued
  if mode ~= 'try' then leave(member, wake_prefix .. token) end
  return grant(free, values, 0, token, holder, ttl_ms, now_us)
end
if mode == 'wait' or mode == 'again' then
  redis.call('ZADD', queue, 'NX', now_us, member)
  redis.call('ZADD', deadlines, now_ms + tonumber(ttl_ms) + 2000, member)
  local keep = math.max(1, tonumber(redis.call('ZRANGE', deadlines, -1, -1, 'WITHSCORES')[2]) - now_ms)
  redis.call('PEXPIRE', queue, keep)
  redis.call('PEXPIRE', deadlines, keep)
elseif mode == 'last' then
  leave(member, wake_prefix .. token)
end
return same_run or {soonest or -2, soonest_holder}
"""

_RELEASE_PERMIT = """
-- RELEASE_PERMIT. KEYS[1] the semaphore's name. ARGV[1] token, ARGV[2] the caller's waiter
-- member ('' when it never waited), ARGV[3] limit.
-- Returns 1 when the caller held a permit and it is freed (the first waiter woken, a fair one
-- granted it; a watched permit is handed to the copy watching it), 0 when it held none: then
-- no permit is touched, and the caller leaves the queue (waking the first waiter that can take
-- a free permit: the caller may have taken a wake).
local token, member = ARGV[1], ARGV[2]
local values = permits(tonumber(ARGV[3]))
for i, value in ipairs(values) do
  if owns(value, token) then
    redis.call('DEL', permit_prefix .. i, wake_prefix .. token)  -- with a hand-over unread
    -- A permit watched by a copy of its run's message (WATCH_PERMIT) goes to that copy while
    -- it is queued, rather than to the first waiter.
    if hand_to_watcher(permit_prefix .. i, value, ':' .. i) then return 1 end
    values[i] = false
    local now_ms, now_us = clock(redis.call('TIME'))
    pass_on(i, values, fence_of(value), now_ms, now_us)
    return 1
  end
end
if member ~= '' then
  leave(member, wake_prefix .. token)
  -- A free permit: the caller, giving up, may have taken the wake of a release; it goes on.
  local free = first_free(values)
  if free and redis.call('EXISTS', queue) == 1 then
    local now_ms, now_us = clock(redis.call('TIME'))
    pass_on(free, values, 0, now_ms, now_us)
  end
end
return 0
"""

_LEAVE_PERMIT_QUEUE = """
-- LEAVE_PERMIT_QUEUE. KEYS[1] the semaphore's name. ARGV[1] a holder description, ARGV[2] limit.
-- For a waiter that died waiting: takes every waiter whose member names the holder ARGV[1]
-- out of the queue, never touching a permit; then a free permit wakes the first waiter left
-- that can take it (a dead waiter may have taken a release's wake). Returns how many waiters
-- were taken out.
local left = leave_all_of(ARGV[1])
local values = permits(tonumber(ARGV[2]))
local free = first_free(values)
if free and redis.call('EXISTS', queue) == 1 then
  local now_ms, now_us = clock(redis.call('TIME'))
  pass_on(free, values, 0, now_ms, now_us)
end
return left
"""

_WATCH_PERMIT = """
-- WATCH_PERMIT. KEYS[1] the semaphore's name. ARGV[1] the holder its permit must have (a run's),
-- ARGV[2] the waiter member of a copy of that run's message, delivered again, ARGV[3] limit.
-- As WATCH, for the permit the run holds (`watch_hold`): its release (RELEASE_PERMIT) hands it
-- to the copy, its fence kept, waking it with "<fence>:<i>"; a permit running out is not.
-- Returns the permit's fence once marked, 0 if another copy watches it, {-2, false} if the run
-- holds no permit; -1, as WATCH, for a hold kept for its period (`watch_hold`), which no permit is.
-- A permit the copy's token owns was handed to it, as WATCH says: its fence is returned again.
local _, token = member_fields(ARGV[2])
for i, value in ipairs(permits(tonumber(ARGV[3]))) do
  if owns(value, token) then return fence_of(value) end
  if value and holder_of(value) == ARGV[1] then return watch_hold(permit_prefix .. i, value, ARGV[2]) end
end
return {-2, false}
"""

ACQUIRE_PERMIT = Script(_PERMITS + _ACQUIRE_PERMIT)
RELEASE_PERMIT = Script(_PERMITS + _RELEASE_PERMIT)
LEAVE_PERMIT_QUEUE = Script(_PERMITS + _LEAVE_PERMIT_QUEUE)
WATCH_PERMIT = Script(_PERMITS + _WATCH_PERMIT)
