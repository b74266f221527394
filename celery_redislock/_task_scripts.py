"""Lua scripts for a task's lock passing from one owner to the next.

A beat slot's marker is claimed (``CLAIM``) by the beat that sends the slot
or by the worker that runs it, for the token the message carries.

An enqueue lock is taken by ``apply_async`` (``ACQUIRE``) with a holder
``task=<id> try=<n> state=queued ...`` and the token that the message carries
(header ``redislock``). The worker that runs the message adopts it (``ADOPT``),
giving it a token of its own and a greater fence. A run that retries, or replaces
itself with a call of the same key, parks its hold (``PARK``) for the token its
retry's or replacement's message carries; that message adopts it. One that will
never adopt its hold (it failed before adopting, was revoked, its pool child died)
lets go of it (``DECLINE``), or, when the run has not parked it yet, marks its
token declined, so that the park lets go of the hold instead (kept for what is
left of ``lock_period``, else freed). A run over keeps its hold for the rest of
``lock_period`` (``SETTLE``) under no token (all zeros: ``keep_for``), as a let-go
does, so that a copy of its message, delivered again, reads from the hold that the
run ended. A message's token therefore owns a hold only while it is queued: a copy
of the message (a redelivery, a stale attempt) can neither adopt a running hold nor
release it. With ``lock_duplicate="replace"``, ``apply_async`` takes the enqueue
lock over from the queued message (``REPLACE``), marking it superseded, and gives it
back if its own message could not be sent (``UNREPLACE``); the worker that meets a
superseded message drops it (``DROP``, which also frees a message's lock where the
mode frees it, in the same step). Lock values are as in ``_scripts``:
``"<token>:<fence>:<holder>"``, read and written by the shared pieces of
``_scripts`` (``owns``, ``fence_of``, ``holder_of``, ``hold``).
"""

from __future__ import annotations

from types import MappingProxyType

from ._scripts import Script

_ADOPT = """
-- ADOPT. KEYS[1] lock; ARGV[1] the token the message carries, ARGV[2] the run's own new token,
-- ARGV[3] ttl in ms, ARGV[4] the run's holder (state=running).
-- Adopts the hold queued for the message (its enqueue lock, or the hold its previous
-- attempt parked for it): re-tokened to ARGV[2], with a fence above its own. A hold
-- ARGV[2] already owns is this call's own, sent again by a client that lost the reply:
-- its fence is returned again. A watch on the parked hold (WATCH by a later attempt of the
-- task id, waiting for it) goes with it: how the adopting run ends its hold wakes the watcher.
-- A hold kept for its period by an earlier attempt of the run's task id is taken over (below).
-- Returns the fence when adopted, else {PTTL, holder or false} (PTTL -2: gone).
local value = redis.call('GET', lock)
if owns(value, ARGV[2]) then return fence_of(value) end
-- Re-tokens the hold to ARGV[2] (`watcher` after it, if any), running as ARGV[4] for ARGV[3] ms,
-- with a fence above its own; returns the fence.
local function take_over(watcher)
  local _, now_us = clock(redis.call('TIME'))
  local fence = math.max(now_us, fence_of(value) + 1)
  redis.call('SET', lock, hold(ARGV[2] .. watcher, fence, ARGV[4]), 'PX', ARGV[3])
  return fence
end
if owns(value, ARGV[1]) then
  return take_over(string.byte(value, 33) ~= 58 and string.sub(value, 33, 64) or '')
end
-- The common refusal (a hold no run keeps: running, queued, or none) ends here, before what only
-- a kept hold needs is set up: a kept hold's token is all zeros (`kept_token`), one whose first
-- digit is not '0' is not kept.
if not value or string.byte(value, 1) ~= 48 then
  return {redis.call('PTTL', lock), holder_of(value) or false}
end
"""

_ADOPT_KEPT = """
-- The hold is kept for its period (`kept_token`), its run over, by an earlier attempt of the run's
-- own task id (the holders' task fields equal, its (rep, try) below the run's): that attempt sent
-- the retry or replacement carrying ARGV[1] and did not park its hold for it (an interrupt, such
-- as a soft time limit, landed between the send and the run's record of it). The run takes it
-- over, as it would have adopted it parked: re-tokened to ARGV[2], with a fence above the kept
-- one, ARGV[4], for ARGV[3] ms. Not a hold kept by the same attempt (a copy of a message whose
-- first delivery ran and kept it), by a later one (a stale copy) or by another task id's run, nor
-- one the message declined (DECLINE: it failed before adopting, and the park let go of the hold).
-- The task field and attempt of a holder written by ``protocol.holder_for`` (nil for another kind).
local function attempt_of(holder)
  local task, try = string.match(holder, '^task=(%S+) try=(%d+) ')
  return task, tonumber(string.match(holder, ' rep=(%d+)') or '0'), tonumber(try)
end
local kept_task, kept_rep, kept_try = attempt_of(holder_of(value) or '')
local task, rep, try = attempt_of(ARGV[4])
local earlier = kept_task and kept_task == task and (kept_rep < rep or (kept_rep == rep and kept_try < try))
if owns(value, kept_token) and earlier
    and redis.call('EXISTS', prefix .. 'declined:' .. ARGV[1]) == 0 then
  return take_over('')
end
return {redis.call('PTTL', lock), holder_of(value) or false}
"""

_PARK = """
-- PARK. KEYS[1] lock; ARGV[1] the running hold's token, ARGV[2] the holder it must still have,
-- ARGV[3] the token the retry's message carries, ARGV[4] the retry's holder (state=queued),
-- ARGV[5] ttl in ms, ARGV[6] the mode's period in ms ('0': none).
-- Hands a running hold to the retry on its way: re-tokened to ARGV[3] (its fence kept),
-- so that only that retry can adopt it and the parking attempt can neither release nor
-- renew it. A retry already waiting for it (queued under ARGV[3]) is woken with the fence; a
-- copy of the run's message that watches the hold (WATCH) with '-2' (below).
-- If the retry declined it already (DECLINE: it failed before adopting), lets go of the hold
-- instead (`let_go`: kept for what is left of the period, else freed), the watching copy woken
-- with '-2' all the same.
-- Returns 1 if parked (also when this call, sent again after a lost reply, finds it parked
-- already), 2 if freed or 3 if kept for its period (declined; also when this call, sent again,
-- finds it kept), 0 if the token or holder no longer matches (left untouched).
local value = redis.call('GET', lock)
if owns(value, ARGV[3]) and holder_of(value) == ARGV[4] then return 1 end
local resent = owns(value, kept_token)  -- kept by this call's let-go below, if declined still
if not (owns(value, ARGV[1]) or resent) or holder_of(value) ~= ARGV[2] then return 0 end
local declined = prefix .. 'declined:' .. ARGV[3]
-- Lets go of the hold its retry declined; returns the reply.
local function give_up()
  local kept = let_go(value, tonumber(ARGV[6]))
  if kept == 0 then
    redis.call('DEL', declined)
    return 2
  end
  redis.call('PEXPIRE', declined, kept)  -- as long as the hold: a resent PARK keeps it again
  return 3
end
-- The common case is a hold no copy watches (no token after the owner's): it ends in this
-- stage, before the helper only a watched hold needs is set up.
local watched, refused = string.byte(value, 33) ~= 58, redis.call('EXISTS', declined) == 1
if refused and not watched then return give_up() end
if not refused then
  if resent then return 0 end  -- kept, not by a park for ARGV[3]: left untouched
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
  if not watched then return 1 end
end
"""

_PARK_WATCHED = """
-- The copy watching the hold learns at once that the run handed it on to the message that
-- continues it (its WATCH would now find the retry's holder), rather than wait for a renewal
-- that never comes, or for the retry's release, to take the run for alive; also when that
-- message declined it: woken before the let-go, which then wakes the next waiter, not the copy.
wake_watcher(value, '-2')
if refused then return give_up() end
return 1
"""

_DECLINE = """
-- DECLINE. KEYS[1] lock; ARGV[1] the token a retry's message carries, ARGV[2] ttl in ms,
-- ARGV[3] the mode's period in ms ('0': none).
-- The retry will never adopt the hold its previous attempt parks for it (it failed before
-- adopting, was revoked, its pool child died). If ARGV[1] owns it (parked already), lets go
-- of it (`let_go`: kept for what is left of the period, else freed), with the period its
-- holder names (' period=<ms>': the parking run's, which a worker that does not know the task
-- cannot tell), else ARGV[3] (a hold parked by a version that named none); else marks ARGV[1]
-- declined for ARGV[2] ms, so that the PARK for it lets go of the hold rather than park it
-- for no one. The retry waits no more: its places in the queue and its wake list go. A hold
-- kept for its period is owned by no token from then on (`keep_for`), so that no copy of the
-- retry's message (delivered again) can adopt or release it.
-- Returns 2 if freed, 3 if kept for its period (as PARK's let-go replies), 0 if marked.
for _, member in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
  local _, token = member_fields(member)
  if token == ARGV[1] then leave(member, wake_prefix .. token) end
end
redis.call('DEL', wake_prefix .. ARGV[1])
local value = redis.call('GET', lock)
if not owns(value, ARGV[1]) then
  redis.call('SET', prefix .. 'declined:' .. ARGV[1], '1', 'PX', ARGV[2])
  return 0
end
local period = string.match(holder_of(value) or '', ' period=(%d+)') or ARGV[3]
return let_go(value, tonumber(period)) == 0 and 2 or 3
"""

_WATCH = """
-- WATCH. KEYS[1] lock; ARGV[1] the holder its hold must have (a run's), ARGV[2] the waiter
-- member (see ``_scripts``) of a copy of that run's message, delivered again (or of a later
-- attempt of its task id, waiting for it).
-- The copy watches how the run's hold ends (`watch_hold`): the release of the hold hands it to
-- the copy, its fence kept (RELEASE); a hold kept for its period wakes it (SETTLE), as does
-- one parked for the run's retry or replacement (PARK); a hold running out is never handed over.
-- Returns the hold's fence once marked, 0 if another copy watches it, -1 if the run is over and
-- its hold kept for its period (not watched), else {PTTL, holder or false} (the run no longer
-- holds it). A hold the copy's token owns was handed to it by the release, after this call's
-- first run (its reply lost, the call sent again): its fence is returned again, as then.
local value = redis.call('GET', lock)
local _, token = member_fields(ARGV[2])
if owns(value, token) then return fence_of(value) end
if not value or holder_of(value) ~= ARGV[1] then
  return {redis.call('PTTL', lock), holder_of(value) or false}
end
return watch_hold(lock, value, ARGV[2])
"""

_SETTLE = """
-- SETTLE. KEYS[1] lock; ARGV[1] token, ARGV[2] period in ms, ARGV[3] the hold's fence.
-- Keeps the hold, its run over, until `period` after it was taken (its fence is the server
-- time in microseconds at the grant): owned by no token from then on (`keep_for`). A hold so kept
-- with the fence ARGV[3] is this call's own, sent again by a client that lost the reply: kept
-- again. A copy of the run's message that watches the hold (WATCH) is woken with '-1' (below).
-- Returns the ms left (the TTL now set), 0 if the period is over (the caller
-- releases), -1 if the token does not own the lock.
local value = redis.call('GET', lock)
if not (owns(value, ARGV[1]) or (owns(value, kept_token) and fence_of(value) == tonumber(ARGV[3]))) then
  return -1
end
local now_ms = clock(redis.call('TIME'))
local left = math.floor(fence_of(value) / 1000) + tonumber(ARGV[2]) - now_ms
if left <= 0 then return 0 end
keep_for(value, left)
-- The common case (a hold no copy watches: no token after the owner's) ends here, before the
-- helpers and companion names only a watched hold needs are set up.
if string.byte(value, 33) == 58 then return left end
"""

_SETTLE_WATCHED = """
-- The copy watching the hold learns at once that the run is over and keeps it (its WATCH would
-- now answer -1), rather than wait for a renewal that never comes to take the run for alive.
wake_watcher(value, '-1')
return left
"""

_CLAIM = """
-- CLAIM. KEYS[1] a beat slot's marker; ARGV[1] the token of the message sent for the slot,
-- ARGV[2] the claimer's holder description (a run's names its claim: field claim),
-- ARGV[3] ttl in ms for a new marker, ARGV[4] '1' when the claimer's message was
-- redelivered.
-- The marker is a lock value (fence 0) naming the message that runs the slot.
-- Claims the slot for the token: sets the marker when there is none, and, when
-- the token already has it, renames its holder (its TTL kept): from the beat that
-- sent it to the run of its message, or from a run to a later attempt of its task
-- id (a retry, a replacement, the message queued again by a busy lock's retry:
-- holder fields rep, try and again, compared in that order), or to a redelivery of
-- its message (its execution lock then tells whether the first delivery died, or
-- runs still). A run of the same or an earlier attempt of that task id, not
-- redelivered (a copy of the message: kombu's publish retry sent it twice, a stale
-- attempt), is refused: the slot went to the run the marker names. The same claim
-- sent again after a lost reply finds the slot its own. Returns 1 when the token
-- has the slot, else the holder of the marker.
local value = redis.call('GET', lock)
if not value then
  redis.call('SET', lock, hold(ARGV[1], 0, ARGV[2]), 'PX', ARGV[3])
  return 1
end
local current = holder_of(value) or ''
local function attempt(holder)
  local function field(name) return tonumber(string.match(holder, ' ' .. name .. '=(%d+)') or 0) end
  return {field('rep'), field('try'), field('again')}
end
local function later(claimer, run)
  local task = string.match(run, '^task=(%S+)')
  if claimer == run or not task or task ~= string.match(claimer, '^task=(%S+)') then return true end
  local this, that = attempt(claimer), attempt(run)
  for i = 1, 3 do
    if this[i] ~= that[i] then return this[i] > that[i] end
  end
  return ARGV[4] == '1'
end
if owns(value, ARGV[1]) and later(ARGV[2], current) then
  redis.call('SET', lock, hold(ARGV[1], 0, ARGV[2]), 'KEEPTTL')
  return 1
end
return current
"""

_REPLACE = """
-- REPLACE. KEYS[1] an enqueue lock; ARGV[1] the new message's token, ARGV[2] its holder
-- (state=queued), ARGV[3] ttl in ms, ARGV[4] its task id.
-- Last one wins: takes the lock for the new message, free or held by another queued
-- message's first attempt (holder fields state=queued and try=0). That message is
-- superseded: its mark 'superseded:<its token>' reads 's:<ARGV[1]>:<ARGV[4]>' until a
-- worker drops it (DROP), and 'replaced:<ARGV[1]>' keeps '<its expiry, server ms>:<its
-- value>' for UNREPLACE; both live as long as either message's lock could. A run's hold,
-- or one queued for a retry or a replacement (try above 0, or a rep field), is left
-- untouched. Scripts run one at a time, so the lock always names exactly one message, the
-- last to take it. A hold ARGV[1] owns already is this call's own, sent again: the same
-- answer is returned.
-- Returns {'taken'}, {'replaced', the old value} or {'busy', PTTL, holder or false}.
local record = prefix .. 'replaced:' .. ARGV[1]
local value = redis.call('GET', lock)
if owns(value, ARGV[1]) then
  local replaced = redis.call('GET', record)
  if not replaced then return {'taken'} end
  return {'replaced', string.match(replaced, '^%d+:(.*)$')}
end
local now_ms, now_us = clock(redis.call('TIME'))
if not value then
  redis.call('SET', lock, hold(ARGV[1], now_us, ARGV[2]), 'PX', ARGV[3])
  return {'taken'}
end
local fields = ' ' .. (holder_of(value) or '') .. ' '
local ttl = redis.call('PTTL', lock)
local first = string.find(fields, ' try=0 ', 1, true) and not string.find(fields, ' rep=', 1, true)
if not (string.find(fields, ' state=queued ', 1, true) and first) then
  return {'busy', ttl, holder_of(value) or false}
end
local keep = math.max(ttl, tonumber(ARGV[3]))
local mark = prefix .. 'superseded:' .. string.sub(value, 1, 32)
redis.call('SET', mark, 's:' .. ARGV[1] .. ':' .. ARGV[4], 'PX', keep)
redis.call('SET', record, string.format('%.0f', now_ms + ttl) .. ':' .. value, 'PX', keep)
redis.call('SET', lock, hold(ARGV[1], math.max(now_us, fence_of(value) + 1), ARGV[2]), 'PX', ARGV[3])
return {'replaced', value}
"""

_UNREPLACE = """
-- UNREPLACE. KEYS[1] an enqueue lock; ARGV[1] the token of a message REPLACE took it for
-- (or tried to: owner-checked) and that was not sent.
-- If ARGV[1] owns the lock: gives it back to the message it replaced (no longer
-- superseded) if that message's mark is still 's:' (not dropped by a worker) and its
-- lock would still live; else frees it (that message, if its mark is 's:', no longer
-- superseded all the same: never dropped for an unsent message). If a later message took it
-- over from ARGV[1] meanwhile, that message's undo is pointed at what ARGV[1] replaced (or at
-- nothing), and that message's mark names it: an unsent message is never given the lock back.
-- Returns 1 if ARGV[1] owned the lock, else 0.
local record, mark = prefix .. 'replaced:' .. ARGV[1], prefix .. 'superseded:' .. ARGV[1]
local replaced = redis.call('GET', record)
redis.call('DEL', record)
local value = redis.call('GET', lock)
if not owns(value, ARGV[1]) then
  local by = redis.call('GET', mark)
  redis.call('DEL', mark)
  local later = by and string.match(by, '^s:(%x+):')
  if not later then return 0 end
  local later_record = prefix .. 'replaced:' .. later
  local points_here = redis.call('GET', later_record)
  if not (points_here and string.match(points_here, '^%d+:(%x+):') == ARGV[1]) then return 0 end
  if not replaced then
    redis.call('DEL', later_record)
    return 0
  end
  redis.call('SET', later_record, replaced, 'KEEPTTL')
  local old_mark = prefix .. 'superseded:' .. string.match(replaced, '^%d+:(%x+):')
  if string.sub(redis.call('GET', old_mark) or '', 1, 2) == 's:' then
    redis.call('SET', old_mark, by, 'KEEPTTL')
  end
  return 0
end
local now_ms, now_us = clock(redis.call('TIME'))
if replaced then
  local expiry, old = string.match(replaced, '^(%d+):(.*)$')
  local old_mark = prefix .. 'superseded:' .. string.sub(old, 1, 32)
  local left = tonumber(expiry) - now_ms
  if string.sub(redis.call('GET', old_mark) or '', 1, 2) == 's:' then
    -- No longer superseded, whether its lock would still live (given back) or not (it runs
    -- when delivered, as any message past its queue ttl): never dropped for an unsent message.
    redis.call('DEL', old_mark)
    if left > 0 then
      redis.call('SET', lock, old, 'PX', left)
      return 1
    end
  end
end
redis.call('DEL', lock)
wake_next(fence_of(value), now_ms, now_us)
return 1
"""

_DROP = """
-- DROP. KEYS[1] a message's enqueue lock; ARGV[1] the token the message carries, ARGV[2]
-- '1' to free the lock (owner-checked) in the same step if the message is not superseded.
-- A worker met the message: if REPLACE marked it superseded, the mark becomes
-- 'd:...' (dropped, its TTL kept), so that UNREPLACE no longer gives it the lock back
-- and a copy delivered again is dropped too. The message was sent: the record of what
-- its own REPLACE took over ('replaced:<ARGV[1]>', for an undo) goes.
-- Returns {'superseded', the superseding task id}, or {'freed'}, {'gone'} (not owned:
-- nothing freed), {'kept'} (ARGV[2] not '1').
redis.call('DEL', prefix .. 'replaced:' .. ARGV[1])
local mark = prefix .. 'superseded:' .. ARGV[1]
local state = redis.call('GET', mark)
if state then
  redis.call('SET', mark, 'd' .. string.sub(state, 2), 'KEEPTTL')
  return {'superseded', string.match(state, '^[sd]:%x+:(.*)$')}
end
if ARGV[2] ~= '1' then return {'kept'} end
local value = redis.call('GET', lock)
if not owns(value, ARGV[1]) then return {'gone'} end
redis.call('DEL', lock)
local now_ms, now_us = clock(redis.call('TIME'))
wake_next(fence_of(value), now_ms, now_us)
return {'freed'}
"""

#: What ``PARK`` and ``DECLINE`` reply when they let go of a hold no retry will adopt.
LET_GO = MappingProxyType({2: "released", 3: "settled"})

ADOPT = Script(_ADOPT, _ADOPT_KEPT)
CLAIM = Script(_CLAIM)
DECLINE = Script(_DECLINE)
DROP = Script(_DROP)
PARK = Script(_PARK, _PARK_WATCHED)
REPLACE = Script(_REPLACE)
SETTLE = Script(_SETTLE, _SETTLE_WATCHED)
UNREPLACE = Script(_UNREPLACE)
WATCH = Script(_WATCH)
