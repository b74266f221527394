"""Every Lua script the package runs, each with its KEYS/ARGV/return contract.

A lock is one hash at ``KEYS[1]`` with the fields ``token`` (the owner's
128-bit random token), ``fence`` (the fencing token of this hold) and
``holder`` (a free-form description of the owner). Waiters of a blocking
acquire add two companion keys, which share the lock's cluster hash slot:
a queue (sorted set, member -> arrival time in microseconds) and their
deadlines (sorted set, member -> server time in ms after which the waiter
counts as gone). A waiter member is ``"<ttl ms>:<token>:<fair 1|0>:<holder>"``.
A woken waiter finds one message in its own list ``<wake prefix><token>``:
``"retry"`` (the lock is free: try again) or, for a fair waiter, the fence of
the hold just handed to it. Whether a waiter is handed the lock depends on
its own ``fair`` flag, whoever releases.

Every key written gets a TTL in the same script; nothing outlives its use.
Times come from the Redis server clock (``TIME``), never from a client clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError

from ._redis import call_with_timeout, node_client

_HELPERS = """
local lock, queue, deadlines = KEYS[1], KEYS[2], KEYS[3]

-- The server clock as (ms, us).
local function server_time()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us
end

-- Makes `token` the owner for `ttl_ms`; returns its fence: the server clock in
-- microseconds, and at least `floor` + 1 (the previous holder's fence, when known).
local function take(token, ttl_ms, holder, floor)
  local _, fence = server_time()
  if fence <= floor then fence = floor + 1 end
  redis.call('HSET', lock, 'token', token, 'fence', string.format('%.0f', fence), 'holder', holder)
  redis.call('PEXPIRE', lock, ttl_ms)
  return fence
end

-- Drops the waiters whose deadline has passed (they died or gave up unseen).
local function evict(now_ms)
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', deadlines, '-inf', now_ms)) do
    redis.call('ZREM', queue, member)
    redis.call('ZREM', deadlines, member)
  end
end

-- Wakes the first live waiter; a fair one is handed the lock (which must be free).
local function wake_next(wake_prefix, floor, now_ms)
  evict(now_ms)
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if not head then return end
  redis.call('ZREM', queue, head)
  redis.call('ZREM', deadlines, head)
  local ttl_ms, token, fair, holder = string.match(head, '^(%d+):(%x+):([01]):(.*)$')
  local message = 'retry'
  if fair == '1' then message = string.format('%.0f', take(token, tonumber(ttl_ms), holder, floor)) end
  local wake = wake_prefix .. token
  redis.call('DEL', wake)
  redis.call('RPUSH', wake, message)
  redis.call('PEXPIRE', wake, ttl_ms)
end

-- Takes the waiter `member` (and its wake list) out of the queue.
local function leave(member, wake)
  redis.call('ZREM', queue, member)
  redis.call('ZREM', deadlines, member)
  redis.call('DEL', wake)
end
"""

_ACQUIRE = """
-- KEYS[1] lock, KEYS[2] waiter queue, KEYS[3] waiter deadlines.
-- ARGV[1] token (hex), ARGV[2] ttl in ms, ARGV[3] holder description,
-- ARGV[4] '1' fair (a free lock goes to the first waiter) or '0' (first come),
-- ARGV[5] 'wait' (when busy, join or stay in the queue) or 'try' (when busy, leave it),
-- ARGV[6] waiter lease in ms (a queued waiter that does not call again within it is dropped),
-- ARGV[7] wake list prefix, ARGV[8] '1' when the caller may be queued already.
-- Returns {1, fence} when the caller owns the lock now (its TTL set to ARGV[2]),
--         {0, the lock's PTTL in ms, its holder description} when not. A failed
-- attempt never touches the holder's TTL.
local token, ttl_ms, holder, fair, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local lease_ms, wake_prefix, queued = tonumber(ARGV[6]), ARGV[7], ARGV[8] == '1'
local wake = wake_prefix .. token
local member = ARGV[2] .. ':' .. token .. ':' .. fair .. ':' .. holder
local current = redis.call('HGET', lock, 'token')
if current == token then  -- handed over while we were away from the wake list
  leave(member, wake)
  redis.call('PEXPIRE', lock, ttl_ms)
  return {1, tonumber(redis.call('HGET', lock, 'fence'))}
end
local now_ms, now_us = server_time()
if not current then
  local head = nil
  if fair == '1' then
    evict(now_ms)
    head = redis.call('ZRANGE', queue, 0, 0)[1]
  end
  if not head or head == member then
    if queued then leave(member, wake) end
    return {1, take(token, ttl_ms, holder, 0)}
  end
  wake_next(wake_prefix, 0, now_ms)
end
if mode == 'wait' then
  redis.call('ZADD', queue, 'NX', now_us, member)
  redis.call('ZADD', deadlines, now_ms + lease_ms, member)
  local last = redis.call('ZRANGE', deadlines, -1, -1, 'WITHSCORES')[2]
  local keep = math.max(1, tonumber(last) - now_ms)
  redis.call('PEXPIRE', queue, keep)
  redis.call('PEXPIRE', deadlines, keep)
elseif queued then
  leave(member, wake)
end
return {0, redis.call('PTTL', lock), redis.call('HGET', lock, 'holder')}
"""

_RELEASE = """
-- KEYS[1] lock, KEYS[2] waiter queue, KEYS[3] waiter deadlines.
-- ARGV[1] token, ARGV[2] wake list prefix, ARGV[3] the caller's waiter member
-- ('' when it never waited).
-- Returns 1 when the caller owned the lock and it is released (the first
-- waiter woken, or if fair handed the lock), 0 when the caller did not own it:
-- then the lock is untouched and the caller, if it was queued, leaves the queue.
local token, wake_prefix, member = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', lock, 'token') ~= token then
  if member ~= '' then leave(member, wake_prefix .. token) end
  return 0
end
local floor = tonumber(redis.call('HGET', lock, 'fence'))
redis.call('DEL', lock)
if redis.call('EXISTS', queue) == 1 then
  local now_ms = server_time()
  wake_next(wake_prefix, floor, now_ms)
end
return 1
"""

_RENEW = """
-- KEYS[i] lock i; ARGV[2i-1] its owner's token, ARGV[2i] its new TTL in ms.
-- Sets each lock's TTL to the given value (replacing, never adding) where the
-- token still owns it. Returns a list with 1 (renewed) or 0 (not owned: gone
-- or held by another token, left untouched) per key.
local renewed = {}
for i, key in ipairs(KEYS) do
  if redis.pcall('HGET', key, 'token') == ARGV[2 * i - 1] then  -- pcall: a foreign key type is "not owned"
    redis.call('PEXPIRE', key, ARGV[2 * i])
    renewed[i] = 1
  else
    renewed[i] = 0
  end
end
return renewed
"""


@dataclass(frozen=True)
class Script:
    """A Lua script run by EVALSHA, loaded again after NOSCRIPT (a restarted or new server)."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())

    def __call__(
        self, client: Any, keys: Sequence[str], args: Sequence[str | int], timeout: float | None = None
    ) -> Any:
        """Run on ``client``; with ``timeout``, wait at most that long for the reply (else TimeoutError)."""
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        try:
            return self._send(client, keys, command, timeout)
        except NoScriptError:
            client.script_load(self.source)
            return self._send(client, keys, command, timeout)

    @staticmethod
    def _send(client: Any, keys: Sequence[str], command: tuple[str | int, ...], timeout: float | None) -> Any:
        if timeout is None:
            return client.execute_command(*command)
        return call_with_timeout(node_client(client, keys[0]), timeout, *command)


ACQUIRE = Script(_HELPERS + _ACQUIRE)
RELEASE = Script(_HELPERS + _RELEASE)
RENEW = Script(_RENEW)
