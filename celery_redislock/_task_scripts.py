"""Lua scripts for a task's lock passing from one owner to the next.

A beat slot's marker is claimed (``CLAIM``) by the beat that sends the slot
or by the worker that runs it, for the token the message carries.

An enqueue lock is taken by ``apply_async`` (``ACQUIRE``) with a holder
``task=<id> try=<n> state=queued ...`` and the token that the message carries
(header ``redislock``). The worker that runs the message adopts it (``ADOPT``),
giving it a token of its own and a greater fence. An attempt that retries parks
its hold (``PARK``) for the token its retry's message carries; the retry adopts
that. A message's token therefore owns a hold only while it is queued: a copy of
the message (a redelivery, a stale attempt) can neither adopt a running hold nor
release it. Lock values are as in ``_scripts``: ``"<token>:<fence>:<holder>"``, read and
written by the prelude every script opens with (``owns``, ``fence_of``, ``holder_of``, ``hold``).
"""

from __future__ import annotations

from ._scripts import Script

_ADOPT = """
-- ADOPT. KEYS[1] lock; ARGV[1] the token the message carries, ARGV[2] the run's own new token,
-- ARGV[3] ttl in ms, ARGV[4] the run's holder (state=running).
-- Adopts the hold queued for the message (its enqueue lock, or the hold its previous
-- attempt parked for it): re-tokened to ARGV[2], with a fence above its own. A hold
-- ARGV[2] already owns is this call's own, sent again by a client that lost the reply:
-- its fence is returned again.
-- Returns the fence when adopted, else {PTTL, holder or false} (PTTL -2: gone).
local value = redis.call('GET', lock)
if owns(value, ARGV[2]) then return fence_of(value) end
if owns(value, ARGV[1]) then
  local _, now_us = clock(redis.call('TIME'))
  local fence = math.max(now_us, fence_of(value) + 1)
  redis.call('SET', lock, hold(ARGV[2], fence, ARGV[4]), 'PX', ARGV[3])
  return fence
end
return {redis.call('PTTL', lock), holder_of(value) or false}
"""

_PARK = """
-- PARK. KEYS[1] lock; ARGV[1] the running hold's token, ARGV[2] the holder it must still have,
-- ARGV[3] the token the retry's message carries, ARGV[4] the retry's holder (state=queued),
-- ARGV[5] ttl in ms.
-- Hands a running hold to the retry on its way: re-tokened to ARGV[3] (its fence kept),
-- so that only that retry can adopt it and the parking attempt can neither release nor
-- renew it. A retry already waiting for it (queued under ARGV[3]) is woken with the fence.
-- Returns 1 if parked (also when this call, sent again after a lost reply, finds it parked
-- already), 0 if the token or holder no longer matches (left untouched).
local value = redis.call('GET', lock)
if owns(value, ARGV[3]) and holder_of(value) == ARGV[4] then return 1 end
if not owns(value, ARGV[1]) or holder_of(value) ~= ARGV[2] then return 0 end
local fence = fence_of(value)
redis.call('SET', lock, hold(ARGV[3], fence, ARGV[4]), 'PX', ARGV[5])
for _, member in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
  local ttl_ms, token = member_fields(member)
  if token == ARGV[3] then
    redis.call('ZREM', queue, member)
    redis.call('ZREM', deadlines, member)
    wake(token, string.format('%.0f', fence), ttl_ms)
  end
end
return 1
"""

_SETTLE = """
-- SETTLE. KEYS[1] lock; ARGV[1] token, ARGV[2] period in ms.
-- Keeps the hold until `period` after it was taken (its fence is the server time
-- in microseconds at the grant). Returns the ms left (the TTL now set), 0 if the
-- period is over (the caller releases), -1 if the token does not own the lock.
local value = redis.call('GET', lock)
if not owns(value, ARGV[1]) then return -1 end
local now_ms = clock(redis.call('TIME'))
local left = math.floor(fence_of(value) / 1000) + tonumber(ARGV[2]) - now_ms
if left <= 0 then return 0 end
redis.call('PEXPIRE', lock, left)
return left
"""

_CLAIM = """
-- CLAIM. KEYS[1] a beat slot's marker; ARGV[1] the token of the message sent for the slot,
-- ARGV[2] the claimer's holder description, ARGV[3] ttl in ms for a new marker.
-- The marker is a lock value (fence 0) naming the message that runs the slot.
-- Claims the slot for the token: sets the marker when there is none, and, when
-- the token already has it, renames its holder (its TTL kept). Returns 1 when
-- the token has the slot, else the holder of the marker (another message's).
local value = redis.call('GET', lock)
if not value then
  redis.call('SET', lock, hold(ARGV[1], 0, ARGV[2]), 'PX', ARGV[3])
  return 1
end
if owns(value, ARGV[1]) then
  redis.call('SET', lock, hold(ARGV[1], 0, ARGV[2]), 'KEEPTTL')
  return 1
end
return holder_of(value) or ''
"""

ADOPT = Script(_ADOPT)
CLAIM = Script(_CLAIM)
PARK = Script(_PARK)
SETTLE = Script(_SETTLE)
