"""Every Lua script the package runs, each with its KEYS/ARGV/return contract.

A lock is one string at ``KEYS[1]``: ``"<token>:<fence>:<holder>"``, where the
token is the owner's 128-bit random token (32 hex digits), the fence is the
fencing token of this hold (decimal) and the holder a free-form description of
the owner. Ownership is the token prefix. A second token may follow the owner's:
a waiter watching how the hold ends, which its release hands the hold to (``WATCH``,
in ``_task_scripts``).

Waiters of a blocking acquire use companion keys, named in the scripts from
the lock's name as ``attempt.companion_key`` names them, so that they share its
cluster hash slot: a queue (sorted set, member -> arrival time in
microseconds), the waiters' deadlines (sorted set, member -> server time in ms
after which the waiter counts as gone), and one wake list per waiter
(``wake:<token>``). A waiter member is ``"<ttl ms>:<token>:<fair 1|0>:<holder>"``,
which is also how an acquire describes its caller.
A woken waiter finds one message in its wake list: ``"retry"`` (the lock is
free: try again) or, for a fair waiter, the fence of the hold just handed to
it. Whether a waiter is handed the lock depends on its own ``fair`` flag,
whoever releases. A copy watching a run's hold (``WATCH``) is handed it at its
release, or woken with ``"-1"`` when the run keeps it for its period (``SETTLE``),
``"-2"`` when the run parks it for its retry or replacement (``PARK``).

Every key written gets a TTL in the same command or script; nothing outlives
its use. Times come from the Redis server clock (``TIME``), never a client's.
"""

from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
import redis.cluster
from redis.exceptions import NoScriptError

from ._redis import PooledConnection, node_client

#: What a script may call or read without defining it, one Lua piece each (its first ``local``
#: statement at a line's start names what it defines), in an order where each uses only those
#: before it: the lock's companion keys, in its cluster hash slot (named as
#: ``attempt.companion_key`` names them), the lock value format (``protocol.LockValue``), the
#: server clock and the waiter queue. A script's source holds only the pieces its text uses
#: (``_pieces_for``): Redis runs the whole text on every call, and each ``local function`` is a
#: closure made anew, about 1,200 server instructions, each companion name a string made anew,
#: about 3,000 (callgrind).
_PIECES = (
    """
-- The prefix of lock `name`'s companion keys: its own hash tag if it has one, else the whole
-- name as the tag.
local function companion_prefix(name)
  local open = string.find(name, '{', 1, true)
  local close = open and string.find(name, '}', open + 1, true)
  return (close and close > open + 1) and name .. ':' or '{' .. name .. '}:'
end
""",
    "local prefix = companion_prefix(lock)\n",
    "local queue = prefix .. 'queue'\n",
    "local deadlines = prefix .. 'waiters'\n",
    "local wake_prefix = prefix .. 'wake:'\n",
    """
-- The server clock as (ms, us), from a TIME reply.
local function clock(t)
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us
end
""",
    """
-- A lock value "<token>:<fence>:<holder>": who owns it, its fence, its holder.
local function owns(value, token) return type(value) == 'string' and string.sub(value, 1, 32) == token end
""",
    "local function fence_of(value) return tonumber(string.match(value, '^%x+:(%d+):')) end\n",
    "local function holder_of(value) return value and string.match(value, '^%x+:%d+:(.*)$') end\n",
    """
-- The lock value of a hold by `token` with fence `fence`.
local function hold(token, fence, holder)
  return token .. ':' .. string.format('%.0f', fence) .. ':' .. holder
end
""",
    """
-- The token of a hold kept for its period, its run over (`keep_for`): all zeros, which no random
-- token is (``protocol.KEPT_TOKEN``).
local kept_token = string.rep('0', 32)
""",
    """
-- A waiter member "<ttl ms>:<token>:<fair 1|0>:<holder>" as its four fields.
local function member_fields(member) return string.match(member, '^(%d+):(%x+):([01]):(.*)$') end
""",
    """
-- Drops the waiters whose deadline has passed (they died or gave up unseen).
local function evict(now_ms)
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', deadlines, '-inf', now_ms)) do
    redis.call('ZREM', queue, member)
    redis.call('ZREM', deadlines, member)
  end
end
""",
    """
-- Takes the waiter `member` (and its wake list) out of the queue.
local function leave(member, wake_list)
  redis.call('ZREM', queue, member)
  redis.call('ZREM', deadlines, member)
  redis.call('DEL', wake_list)
end
""",
    """
-- Takes every waiter whose member names `holder` out of the queue (with its wake list).
local function leave_all_of(holder)
  local left = 0
  for _, member in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
    local _, token, _, named = member_fields(member)
    if named == holder then
      leave(member, wake_prefix .. token)
      left = left + 1
    end
  end
  return left
end
""",
    """
-- Leaves `message` (one only) in `token`'s wake list, for its ttl.
local function wake(token, message, ttl_ms)
  local list = wake_prefix .. token
  redis.call('DEL', list)
  redis.call('RPUSH', list, message)
  redis.call('PEXPIRE', list, ttl_ms)
end
""",
    """
-- Wakes the first live waiter; a fair one is handed the (free) lock, with a
-- fence above `floor` (the previous holder's).
local function wake_next(floor, now_ms, now_us)
  evict(now_ms)
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if not head then return end
  redis.call('ZREM', queue, head)
  redis.call('ZREM', deadlines, head)
  local ttl_ms, token, fair, holder = member_fields(head)
  local message = 'retry'
  if fair == '1' then
    local fence = math.max(now_us, floor + 1)
    redis.call('SET', lock, hold(token, fence, holder), 'PX', ttl_ms)
    message = string.format('%.0f', fence)
  end
  wake(token, message, ttl_ms)
end
""",
    """
-- Marks `value`, a run's hold of `key`, as watched by a copy of the run's message, delivered
-- again, whose waiter member is `member`: the copy's token after the owner's ("<owner's
-- token><copy's token>:<fence>:<holder>": ownership, fence and holder read as before), and
-- queues the copy, as ACQUIRE 'wait' queues a waiter, so that the release of the hold, which
-- then finds a waiter, hands it to the copy (`hand_to_watcher`); a hold running out is never
-- handed over. A hold marked for a copy still queued (not past its deadline: one gone
-- unseen is evicted) is left to that one; a hold kept for its period (`kept_token`), its run
-- over, is not watched.
-- Returns the hold's fence once marked, 0 if another copy watches it, -1 if it is kept.
local function watch_hold(key, value, member)
  if owns(value, kept_token) then return -1 end
  local ttl_ms, token = member_fields(member)
  local watched = string.byte(value, 33) ~= 58
  local now_ms, now_us = clock(redis.call('TIME'))
  if watched and string.sub(value, 33, 64) ~= token then
    evict(now_ms)
    for _, queued in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
      local _, other = member_fields(queued)
      if other == string.sub(value, 33, 64) then return 0 end
    end
  end
  local rest = string.sub(value, watched and 65 or 33)
  redis.call('SET', key, string.sub(value, 1, 32) .. token .. rest, 'KEEPTTL')
  redis.call('ZADD', queue, 'NX', now_us, member)
  redis.call('ZADD', deadlines, now_ms + tonumber(ttl_ms) + 2000, member)
  local last = tonumber(redis.call('ZRANGE', deadlines, -1, -1, 'WITHSCORES')[2])
  redis.call('PEXPIRE', queue, math.max(1, last - now_ms))
  redis.call('PEXPIRE', deadlines, math.max(1, last - now_ms))
  return fence_of(value)
end
""",
    """
-- Wakes the copy that watches the hold `value` (WATCH) with `message`, while that copy is
-- queued (not past its deadline: one gone unseen is evicted, never handed a hold), taking it
-- out of the queue. Returns the copy's waiter ttl (ms) and holder, or nil when no queued copy
-- watches the hold.
local function wake_watcher(value, message)
  if string.byte(value, 33) == 58 then return nil end
  evict(clock(redis.call('TIME')))
  local watcher = string.sub(value, 33, 64)
  for _, member in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
    local ttl_ms, copy, _, holder = member_fields(member)
    if copy == watcher then
      redis.call('ZREM', queue, member)
      redis.call('ZREM', deadlines, member)
      wake(copy, message, ttl_ms)
      return ttl_ms, holder
    end
  end
  return nil
end
""",
    """
-- Hands `value`, the hold of `key` its owner just released, to the copy that watches it
-- (WATCH) while that copy is queued, its fence kept, waking it with the fence followed by
-- `suffix`: the copy learns that the run let go of it. Returns whether it was handed over.
local function hand_to_watcher(key, value, suffix)
  local fence = fence_of(value)
  local ttl_ms, holder = wake_watcher(value, string.format('%.0f', fence) .. suffix)
  if not ttl_ms then return false end
  redis.call('SET', key, hold(string.sub(value, 33, 64), fence, holder), 'PX', ttl_ms)
  return true
end
""",
    """
-- Keeps lock's hold `value`, its run over, for `ms` more (the rest of its period): owned by no
-- token from then on (`kept_token`), its fence and holder kept, so that nothing can take it for
-- its own, and a copy of the run's message, delivered again, reads from it that the run ended.
local function keep_for(value, ms)
  redis.call('SET', lock, hold(kept_token, fence_of(value), holder_of(value)), 'PX', ms)
end
""",
    """
-- Lets go of lock's hold `value`, which no run will take on: kept (`keep_for`) to expire `period_ms`
-- after its grant (its fence) while that is ahead (as SETTLE keeps it), else freed and the first
-- waiter woken. Returns the ms it is kept, or 0 when freed.
local function let_go(value, period_ms)
  local fence = fence_of(value)
  local now_ms, now_us = clock(redis.call('TIME'))
  local left = math.floor(fence / 1000) + period_ms - now_ms
  if period_ms > 0 and left > 0 then
    keep_for(value, left)
    return left
  end
  redis.call('DEL', lock)
  wake_next(fence, now_ms, now_us)
  return 0
end
""",
)


def _defined_by(piece: str) -> frozenset[str]:
    """The names ``piece`` defines: those of its first ``local`` statement at a line's start."""
    statement = re.search(r"^local (function )?([\w, ]+)", piece, re.M)
    assert statement is not None, piece
    return frozenset(name.strip() for name in statement.group(2).split(","))


#: Each piece, and the names it defines.
_PIECE_NAMES = {piece: _defined_by(piece) for piece in _PIECES}


def lua_code(text: str) -> str:
    """Lua ``text`` without its comments and its quoted strings (escapes within them read as
    Lua reads them): the names it uses, as code. (The scripts write no long brackets.)"""
    return re.sub(r"--[^\n]*|'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"", "", text)


def _pieces_for(text: str, defined: frozenset[str] = frozenset()) -> tuple[str, frozenset[str]]:
    """The pieces (``_PIECES``) that ``text`` uses (in its code), with those they use in turn, in
    their order, less those ``defined`` already; and every name defined then."""
    text = lua_code(text)
    chosen: list[str] = []
    for piece, names in reversed(_PIECE_NAMES.items()):
        if defined.isdisjoint(names) and any(re.search(rf"\b{name}\b", text) for name in names):
            chosen.insert(0, piece)
            text += lua_code(piece)
    return "".join(chosen), defined.union(*(_PIECE_NAMES[piece] for piece in chosen))


_ACQUIRE_FAST = """
-- ACQUIRE. KEYS[1] lock (the queue, deadlines and wake lists are its companions).
-- ARGV[1] the caller's waiter member: its ttl in ms, token, fairness ('1': a
-- free lock goes to the first waiter) and holder description. ARGV[2] what to
-- do when the lock is busy: 'try' (nothing), 'wait' (join the queue), 'again'
-- (stay queued), 'last' (leave the queue). A queued waiter counts as gone when
-- it has not called again within its ttl + 2 s.
-- Returns the fence (an integer) when the caller owns the lock now (its TTL
-- set to the member's ttl), {the lock's PTTL in ms, its holder description or
-- nil} when not. A failed attempt never touches the holder's TTL.
local member, mode = ARGV[1], ARGV[2]
local ttl_ms, token, fair, holder = string.match(member, '^(%d+):(%x+):([01]):(.*)$')
local queued = mode == 'again' or mode == 'last'
local time = redis.call('TIME')
-- An unqueued first-come attempt: the fence is TIME's seconds and zero-padded
-- microseconds, written out.
local granted = nil
if fair == '0' and not queued then
  local fence = time[1] .. string.rep('0', 6 - #time[2]) .. time[2]
  if redis.call('SET', lock, token .. ':' .. fence .. ':' .. holder, 'NX', 'PX', ttl_ms) then
    if mode == 'try' then return tonumber(fence) end
    granted = fence
  end
end
"""

_ACQUIRE_GRANTED = """
-- A first 'wait' granted at once. If this is its call sent again after a lost reply, its
-- first run may have queued the caller: it leaves the queue (else a release would wake, or
-- hand the lock to, the call that is over).
if granted then
  if redis.call('ZREM', queue, member) == 1 then
    redis.call('ZREM', deadlines, member)
    redis.call('DEL', wake_prefix .. token)
  end
  return tonumber(granted)
end
"""

_ACQUIRE = """
local wake_list = wake_prefix .. token
local now_ms, now_us = clock(time)
local head = nil
if fair == '1' then
  evict(now_ms)
  head = redis.call('ZRANGE', queue, 0, 0)[1]
end
if (fair == '1' or queued) and (not head or head == member)
    and redis.call('SET', lock, hold(token, now_us, holder), 'NX', 'PX', ttl_ms) then
  if mode ~= 'try' then leave(member, wake_list) end  -- also a first 'wait' sent again (above)
  return now_us
end
local current = redis.call('GET', lock)
if owns(current, token) then  -- handed over while we were away from the wake list
  leave(member, wake_list)
  redis.call('PEXPIRE', lock, ttl_ms)
  return fence_of(current)
end
if not current then  -- free, but the first fair waiter comes before us
  wake_next(0, now_ms, now_us)
  current = redis.call('GET', lock)
end
if mode == 'wait' or mode == 'again' then
  redis.call('ZADD', queue, 'NX', now_us, member)
  redis.call('ZADD', deadlines, now_ms + tonumber(ttl_ms) + 2000, member)
  local last = redis.call('ZRANGE', deadlines, -1, -1, 'WITHSCORES')[2]
  local keep = math.max(1, tonumber(last) - now_ms)
  redis.call('PEXPIRE', queue, keep)
  redis.call('PEXPIRE', deadlines, keep)
elseif mode == 'last' then
  leave(member, wake_list)
end
return {redis.call('PTTL', lock), holder_of(current) or false}
"""

_RELEASE_FAST = """
-- RELEASE. KEYS[1] lock (the queue, deadlines and wake lists are its companions).
-- ARGV[1] token, ARGV[2] the caller's waiter member (absent or '' when it
-- never waited).
-- Returns 1 when the caller owned the lock and it is released (the first
-- waiter woken, or if fair handed the lock; a watched hold is handed to the
-- copy watching it, see below), 0 when the caller did not own it:
-- then the lock is untouched and the caller, if it was queued, leaves the queue
-- (waking the first waiter if the lock is free: the caller may have taken a wake).
local token, member = ARGV[1], ARGV[2]
local waited = member and member ~= ''
local current = redis.call('GET', lock)
local owned = current and string.sub(current, 1, 32) == token
-- The common cases (a caller that never waited) end here, before the helpers and the
-- companion names only the others use are set up.
if owned then
  redis.call('DEL', lock)
  if not waited and redis.call('EXISTS', queue) == 0 then return 1 end
elseif not waited then
  return 0
end
"""

_RELEASE = """
if not owned then
  leave(member, wake_prefix .. token)
  -- A free lock: the caller, giving up, may have taken the wake of a release; it goes on.
  if not current and redis.call('EXISTS', queue) == 1 then
    local now_ms, now_us = clock(redis.call('TIME'))
    wake_next(0, now_ms, now_us)
  end
  return 0
end
if waited then redis.call('DEL', wake_prefix .. token) end  -- a hand-over unread
-- A hold watched by a copy of its run's message (WATCH) goes to that copy while it is queued,
-- rather than to the first waiter. Only a release that finds waiters comes here.
if hand_to_watcher(lock, current, '') then return 1 end
local now_ms, now_us = clock(redis.call('TIME'))
wake_next(fence_of(current), now_ms, now_us)
return 1
"""

_FORCE_RELEASE = """
-- FORCE_RELEASE. KEYS[1] lock. ARGV[1] the token of a hold read from the lock by another than
-- its owner (`celery redislock release`), ARGV[2] '', ARGV[3] the hold's fence.
-- RELEASE (what follows) of that hold alone: the token and the fence both, as one token is not
-- one hold when the hold is kept for its period (`kept_token`, that of every kept hold).
-- Returns 1 when it is released, 0 when the lock holds another hold, or none: untouched.
if fence_of(redis.call('GET', lock) or '') ~= tonumber(ARGV[3]) then return 0 end
"""

_LEAVE_QUEUE = """
-- LEAVE_QUEUE. KEYS[1] lock (the queue, deadlines and wake lists are its companions).
-- ARGV[1] a holder description.
-- For a waiter that died waiting: takes every waiter whose member names the holder ARGV[1]
-- out of the queue, never touching a hold (one parked for a token of theirs included); then,
-- the lock free, wakes the first waiter left (a dead waiter may have taken a release's wake).
-- Returns how many waiters were taken out.
local left = leave_all_of(ARGV[1])
if redis.call('EXISTS', lock) == 0 and redis.call('EXISTS', queue) == 1 then
  local now_ms, now_us = clock(redis.call('TIME'))
  wake_next(0, now_ms, now_us)
end
return left
"""

_RENEW = """
-- RENEW. KEYS[i] lock i; ARGV[1] the new TTL in ms; ARGV[i + 1] the token owning lock i.
-- Sets each lock's TTL to ARGV[1] (replacing, never adding) where its token
-- still owns it. Returns the positions (1-based) of the keys not owned: gone,
-- held by another token, or not a lock at all (those are left untouched).
local lost = {}
for i, key in ipairs(KEYS) do
  local value = redis.pcall('GET', key)  -- pcall: a key of another type is "not owned"
  if owns(value, ARGV[i + 1]) then
    redis.call('PEXPIRE', key, ARGV[1])
  else
    lost[#lost + 1] = i
  end
end
return lost
"""


class Script:
    """A Lua script run by EVALSHA, loaded again after NOSCRIPT (a restarted or new server).

    Its source names the lock (``lock``), then holds each of ``stages`` in turn, each after the
    shared pieces (``_PIECES``) it uses that no stage before it did: a stage that ends a common
    case ends it before the pieces only the later stages use are set up. The script's
    KEYS/ARGV/return contract opens its first stage.
    """

    __slots__ = ("idempotent", "packed_sha", "sha", "source")

    def __init__(self, *stages: str, idempotent: bool = False) -> None:
        self.source, defined = "local lock = KEYS[1]\n", frozenset[str]()
        for stage in stages:
            pieces, defined = _pieces_for(stage, defined)
            self.source += pieces + stage
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        #: a second run of a call answers as the first did (``ACQUIRE``: the caller's own hold is
        #: found and granted again): sent on a fresh connection unpolled (``_call_pooled``)
        self.idempotent = idempotent
        #: the SHA as a RESP bulk string, as every ``pack`` sends it
        self.packed_sha = bulk(self.sha.encode())

    def __call__(
        self,
        client: Any,
        keys: Sequence[str],
        args: Sequence[str | int],
        resending: Callable[[], None] | None = None,
    ) -> Any:
        """Run on ``client``, honouring its retry policy.

        ``resending`` is called when the retry policy is about to send the script
        again after an error that may have come after the script ran (a reply
        lost with its connection), on the paths that send it here (not through
        ``execute_command``), so that a caller can read the second reply knowing that.

        A plain ``redis.Redis`` gets the command on the calling thread's
        connection of its pool (``_redis.PooledConnection``), packed here and
        sent in one write: redis-py's per-command layers
        (observability hooks, argument packing, callbacks) cost several times
        the CPU of the exchange itself, and these scripts run once or twice per
        task. A ``RedisCluster`` sends it the same way to the node serving the
        keys' slot, and goes through its ``execute_command`` (which follows
        MOVED/ASK and learns the new layout) when that node redirects it or is
        gone. Any other client (single-connection, a subclass), and any client
        whose ``execute_command`` an instrumentation library wraps (see
        ``own_execute_command``), goes through ``execute_command``, so that
        APM tools see every lock command.

        An exception that ends the exchange early (``KeyboardInterrupt``, a
        Celery time limit, even between the send and the read) drops the
        connection, so that its reply is never read by the next user.
        """
        if plain_client(client):
            return self._call_pooled(client, keys, args, resending)
        if type(client) is redis.cluster.RedisCluster and keys and own_execute_command(client):
            try:  # straight to the node that serves the keys' slot, on that node's own fast path
                return self(node_client(client, keys[0]), keys, args, resending)
            except _REDIRECTED:
                pass  # the slot moved, or the node is gone: the Cluster client follows and learns
        try:
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def freed(self, client: Any, keys: Sequence[str], args: Sequence[str | int]) -> bool:
        """Run a release (a script whose reply is 1 when it freed the token's hold, 0 when it found
        none); whether the hold was freed: also when the client's retry policy sent it again
        after a lost reply (``resending``), whose second run finds gone what its first freed."""
        resent: list[bool] = []
        return bool(int(self(client, keys, args, lambda: resent.append(True))) or resent)

    def _call_pooled(
        self,
        client: Any,
        keys: Sequence[str],
        args: Sequence[str | int],
        resending: Callable[[], None] | None,
    ) -> Any:
        """``__call__`` on this thread's connection of the pool of ``client`` (a plain ``redis.Redis``).

        An ``idempotent`` script goes on a fresh connection unpolled (``PooledConnection``,
        ``resends``); one the first send finds broken, and the retry policy did not send it
        again on, is sent on again once, on a new connection: the script may run twice, and
        answers the second run as it would have answered the first.
        """
        pooled = PooledConnection(client, resends=self.idempotent)
        with pooled as connection:
            packed_keys, packed_args = bulks(connection.encoder, keys), bulks(connection.encoder, args)
            sends = failures = 0

            def failed(_: Exception) -> None:
                nonlocal failures
                failures += 1
                connection.disconnect()
                if resending is not None:
                    resending()

            def send() -> Any:
                nonlocal sends
                sends += 1
                return self.run_on(connection, packed_keys, packed_args)

            try:
                return connection.retry.call_with_retry(send, failed)
            except redis.exceptions.ConnectionError as exc:
                if sends > 1 or not pooled.unpolled:
                    raise
                if not failures:  # a policy that does not retry this error did not drop the connection
                    failed(exc)
                return send()

    async def call_async(self, client: Any, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """Run on the asyncio client ``client`` (``redis.asyncio.Redis``), honouring its retry policy."""
        try:
            return await client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def run_on(self, connection: Any, keys: Sequence[bytes], args: Sequence[bytes]) -> Any:
        """Run on one ``redis.connection.Connection``, bounded by its own socket timeouts.

        ``keys`` and ``args`` are already RESP bulk strings (``bulk()``), so a
        caller sending many can pack each once; the command is sent in one write.
        An error reply is raised.
        """
        command = self.pack(keys, args)
        connection.send_packed_command([command])
        return self.read_reply(connection, command)

    def read_reply(self, connection: Any, command: bytes) -> Any:
        """The reply to ``command`` (a call of this script, from ``pack()``) sent on ``connection``,
        the next to read there; an error reply is raised. After NOSCRIPT (rare), the call is sent
        again once the script is loaded, by ``read_replies``' rule."""
        try:
            return connection.read_response()
        except NoScriptError as exc:
            reply = _send_refused_again(connection, self, [command], [exc])[0]
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
        return reply

    def pack(self, keys: Sequence[bytes], args: Sequence[bytes]) -> bytes:
        """The EVALSHA command as RESP, ``keys`` and ``args`` being bulk strings already (``bulk()``)."""
        return b"".join(
            (
                b"*%d\r\n$7\r\nEVALSHA\r\n" % (3 + len(keys) + len(args)),
                self.packed_sha,
                bulk(b"%d" % len(keys)),
                *keys,
                *args,
            )
        )


def read_replies(connection: Any, script: Script, commands: Sequence[bytes]) -> list[Any]:
    """The replies to ``commands`` (calls of ``script``, from ``pack()``) sent on ``connection``, in
    order; a call's own error reply (e.g. MOVED) is its reply, the others stand.

    After NOSCRIPT (a restarted or new server), the script (and ``RELEASE``) is
    loaded and the calls it refused are sent again in one write: the one NOSCRIPT
    recovery of every exchange on a connection (a single call, the watchdog's
    batches, a Redlock's servers).
    """
    return _send_refused_again(connection, script, commands, [_reply(connection) for _ in commands])


def _send_refused_again(
    connection: Any, script: Script, commands: Sequence[bytes], replies: list[Any]
) -> list[Any]:
    """``replies`` (to ``commands``), those that were NOSCRIPT replaced by the replies to the
    same calls sent again, in one write, once ``script`` is loaded."""
    again = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if again:
        # The server lost its scripts (restarted, flushed): RELEASE is loaded too, since a run
        # sends it without waiting for its reply (``run_lock.release_later``), and it must run
        # when it arrives, not when its NOSCRIPT is read.
        # Every reply sent for is read before a refused load raises (ACL, BUSY): none is left
        # on a connection its exchange ends cleanly on, for the next exchange to read as its own.
        sources = (script.source,) if script is RELEASE else (script.source, RELEASE.source)
        for source in sources:
            connection.send_command("SCRIPT", "LOAD", source)
        for refused in [_reply(connection) for _ in sources]:
            if isinstance(refused, redis.exceptions.ResponseError):
                raise refused
        connection.send_packed_command([commands[index] for index in again])
        for index in again:
            replies[index] = _reply(connection)
    return replies


def _reply(connection: Any) -> Any:
    """The next reply on ``connection``, or the error it is (a complete error reply)."""
    try:
        return connection.read_response()
    except redis.exceptions.ResponseError as exc:
        return exc


def _redis_py_execute_command(cls: type) -> Any:
    """``cls.execute_command`` as redis-py defines it, unwrapped (``__wrapped__``) if an
    instrumentation library wrapped it before this module was imported; ``None`` if it was
    replaced by a function that does not lead back to redis-py's (no client is then taken for
    uninstrumented: every command goes through ``execute_command``)."""
    function = inspect.unwrap(cls.__dict__["execute_command"])
    if function.__module__ != cls.__module__ or function.__qualname__ != f"{cls.__name__}.execute_command":
        return None
    return function


#: class -> its ``execute_command`` as redis-py defines it (or ``None``), captured at import.
_OWN_EXECUTE_COMMAND = {
    cls: _redis_py_execute_command(cls) for cls in (redis.Redis, redis.cluster.RedisCluster)
}


def own_execute_command(client: Any) -> bool:
    """Whether ``client`` (a ``redis.Redis`` or ``RedisCluster``) sends commands with redis-py's
    own ``execute_command``: not wrapped by an instrumentation library (OpenTelemetry, Sentry,
    ddtrace wrap it on the class, ``instrument_client`` on the client). Checked on every call,
    since an app may instrument redis-py, or stop, at any time after this module is imported."""
    cls = type(client)
    return cls.execute_command is _OWN_EXECUTE_COMMAND.get(cls) and "execute_command" not in vars(client)


def plain_client(client: Any) -> bool:
    """Whether ``client`` is a plain, uninstrumented ``redis.Redis`` on a connection pool (not a
    single-connection client), whose scripts may go straight to a pooled connection."""
    return type(client) is redis.Redis and client.connection is None and own_execute_command(client)


#: Errors after which a Cluster's direct node call is sent again through the Cluster client.
_REDIRECTED = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.ConnectionError,
    redis.exceptions.RedisClusterException,
)


def bulk(value: bytes) -> bytes:
    """``value`` as a RESP bulk string, the form of every argument of a command."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def bulks(encoder: Any, values: Iterable[str | int]) -> list[bytes]:
    """``values`` as RESP bulk strings, encoded as ``encoder`` (a connection's) encodes them: a
    ``str`` straight with its encoding, which is what the encoder's type checks come to for one,
    at a third of their cost (these run for every script call)."""
    encoding, errors = encoder.encoding, encoder.encoding_errors
    return [
        bulk(value.encode(encoding, errors) if type(value) is str else encoder.encode(value))
        for value in values
    ]


ACQUIRE = Script(_ACQUIRE_FAST, _ACQUIRE_GRANTED, _ACQUIRE, idempotent=True)
RELEASE = Script(_RELEASE_FAST, _RELEASE)
FORCE_RELEASE = Script(_FORCE_RELEASE, _RELEASE_FAST, _RELEASE)
LEAVE_QUEUE = Script(_LEAVE_QUEUE)
RENEW = Script(_RENEW)
