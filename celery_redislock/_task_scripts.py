"""Lua scripts for a task's lock passing from one owner to the next.

A beat slot's marker is claimed (``CLAIM``) by the beat that sends the slot
or by the worker that runs it, for the token the message carries.

An enqueue lock is taken by ``apply_async`` (``ACQUIRE``) with a holder
``task=<id> try=<n> state=queued ...``; the worker that runs the message
adopts it (same token, from the message header) and marks it
``state=running``. Lock values are as in ``_scripts``: ``"<token>:<fence>:<holder>"``.
"""

from __future__ import annotations

from ._scripts import Script

_HOLDER = """
local function holder_of(value) return value and string.match(value, '^%x+:%d+:(.*)$') end
local function fence_of(value) return tonumber(string.match(value, '^%x+:(%d+):')) end
local function owns(value, token) return value and string.sub(value, 1, 32) == token end
"""

_ADOPT = """
-- KEYS[1] lock; ARGV[1] token (from the message), ARGV[2] ttl in ms, ARGV[3] the new
-- holder (state=running), ARGV[4] the adopting attempt's retry count.
-- Adopts the lock when the token owns it and it is queued, or running under an
-- earlier attempt of the task (a retry whose previous attempt is finishing or
-- died); a running hold of the same attempt is a redelivered message's twin.
-- Returns the fence when adopted, else {PTTL, holder or false} (PTTL -2: gone).
local value = redis.call('GET', KEYS[1])
local holder = holder_of(value)
if owns(value, ARGV[1]) then
  local try = tonumber(string.match(holder, ' try=(%d+)') or '0')
  if string.find(holder, ' state=queued', 1, true) or try < tonumber(ARGV[4]) then
    local fence = fence_of(value)
    local adopted = ARGV[1] .. ':' .. string.format('%.0f', fence) .. ':' .. ARGV[3]
    redis.call('SET', KEYS[1], adopted, 'PX', ARGV[2])
    return fence
  end
end
return {redis.call('PTTL', KEYS[1]), holder or false}
"""

_PARK = """
-- KEYS[1] lock; ARGV[1] token, ARGV[2] the holder it must still have, ARGV[3] the new
-- holder (state=queued), ARGV[4] ttl in ms.
-- Hands a running hold back to the queue (a retry is on its way). Returns 1 if
-- parked, 0 if the token or holder no longer matches (left untouched).
local value = redis.call('GET', KEYS[1])
if not owns(value, ARGV[1]) or holder_of(value) ~= ARGV[2] then return 0 end
local fence = string.format('%.0f', fence_of(value))
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. fence .. ':' .. ARGV[3], 'PX', ARGV[4])
return 1
"""

_SETTLE = """
-- KEYS[1] lock; ARGV[1] token, ARGV[2] period in ms.
-- Keeps the hold until `period` after it was taken (its fence is the server time
-- in microseconds at the grant). Returns the ms left (the TTL now set), 0 if the
-- period is over (the caller releases), -1 if the token does not own the lock.
local value = redis.call('GET', KEYS[1])
if not owns(value, ARGV[1]) then return -1 end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = math.floor(fence_of(value) / 1000) + tonumber(ARGV[2]) - now_ms
if left <= 0 then return 0 end
redis.call('PEXPIRE', KEYS[1], left)
return left
"""

_CLAIM = """
-- KEYS[1] a beat slot's marker; ARGV[1] the token of the message sent for the slot,
-- ARGV[2] the claimer's holder description, ARGV[3] ttl in ms for a new marker.
-- The marker is a lock value (fence 0) naming the message that runs the slot.
-- Claims the slot for the token: sets the marker when there is none, and, when
-- the token already has it, renames its holder (its TTL kept). Returns 1 when
-- the token has the slot, else the holder of the marker (another message's).
local value = redis.call('GET', KEYS[1])
if not value then
  redis.call('SET', KEYS[1], ARGV[1] .. ':0:' .. ARGV[2], 'PX', ARGV[3])
  return 1
end
if owns(value, ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1] .. ':0:' .. ARGV[2], 'KEEPTTL')
  return 1
end
return holder_of(value) or ''
"""

ADOPT = Script(_HOLDER + _ADOPT)
CLAIM = Script(_HOLDER + _CLAIM)
PARK = Script(_HOLDER + _PARK)
SETTLE = Script(_HOLDER + _SETTLE)
