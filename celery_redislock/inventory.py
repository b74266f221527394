"""The locks in Redis as seen from outside their owner: list and read them, free a hold by its token.

Used by the CLI (``celery redislock``), ``celery_redislock.testing``
(``assert_no_locks``), and the processes that clean up after another (the
worker's main process after a pool child died or a message was revoked, a
beat whose send failed). Every release here is the owner-checked release
script run with a token read from the lock or carried by a message, so a hold
taken over meanwhile is left alone, and the next waiter is woken as by the
owner's own release.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.cluster
from redis.crc import key_slot

from ._permit_scripts import LEAVE_PERMIT_QUEUE, RELEASE_PERMIT
from ._redis import PooledConnection
from ._scripts import FORCE_RELEASE, LEAVE_QUEUE, RELEASE, Script, bulks, plain_client
from ._task_scripts import SETTLE
from .attempt import companion_key
from .connection import Client
from .exceptions import LockConfigurationError
from .modes import QUEUED_SUFFIXES
from .protocol import LockValue, parse_holder, parse_value, text
from .telemetry import log_fields

__all__ = [
    "HeldLock",
    "force_release",
    "glob_escape",
    "held_locks",
    "hold_of",
    "is_queued",
    "leave_queue_of",
    "parse_lock",
    "permit_of",
    "read_lock",
    "read_locks",
    "read_values",
    "release_held_by",
    "release_token",
    "scan_keys",
    "settle_held_by",
    "task_of",
]

logger = logging.getLogger(__name__)

#: What follows ``{prefix}:`` in a task's lock key; a queued suffix (``:queued``) marks an
#: enqueue lock that is not the execution lock (``until_and_while_executing``).
_TASK_KEY = re.compile(
    r"(.+):[0-9a-f]{64}(?:" + "|".join(map(re.escape, sorted(QUEUED_SUFFIXES))) + ")?", re.DOTALL
)
#: A semaphore's permit key: ``companion_key(name, "permit:<i>")`` (``semaphore.PermitBook``).
_PERMIT = re.compile(r"(.+):permit:([1-9][0-9]*)", re.DOTALL)
#: The default holder of a ``RedisLock``: ``"<host>:<pid>"``.
_HOST_PID = re.compile(r"(.+):(\d+)", re.DOTALL)
#: Keys read per ``READ`` call, and calls sent before the first reply is read.
_BATCH = 500
_AHEAD = 4

#: Kept here, by the one function that runs it, rather than in ``_scripts`` with the lock's
#: scripts: it reads, never writes, and no lock operation uses it.
_READ = """
-- READ. KEYS[i] a key; ARGV[i] the name whose waiters wait for it: '' for the key itself, a
-- semaphore's name for one of its permits (the waiters' deadlines are named from it by
-- `companion_prefix`, in the key's hash slot). Reads, never writes.
-- Returns one JSON array (one reply element, however many keys) holding, per key,
-- [its PTTL in ms, its live waiters, its value]: the value "" unless it is a lock value
-- (PTTL -2: no such key); a waiter is live until its deadline.
local after = '(' .. clock(redis.call('TIME'))
local read = {}
for i, key in ipairs(KEYS) do
  local value, waiting = redis.pcall('GET', key), 0  -- pcall: a key of another type is no lock
  if type(value) == 'string' and fence_of(value) then
    local waited_as = ARGV[i] ~= '' and ARGV[i] or key
    waiting = redis.call('ZCOUNT', companion_prefix(waited_as) .. 'waiters', after, '+inf')
  else
    value = ''
  end
  read[#read + 1] = {redis.call('PTTL', key), waiting, value}
end
return cjson.encode(read)
"""
READ = Script(_READ)


@dataclass(frozen=True)
class HeldLock:
    """A lock as read from Redis; ``None`` where the holder does not say."""

    key: str
    #: the task whose key this is (``None`` for a key outside the prefix or of another shape)
    task: str | None
    task_id: str | None
    #: retries of the task so far when it took the lock
    attempt: int | None
    #: ``queued`` (an enqueue lock whose message waits), ``running`` (taken by a run) or
    #: ``kept`` (an ``until_expired`` lock through its period after the run; the other fields
    #: name that run)
    state: str | None
    node: str | None
    pid: int | None
    #: seconds left (``None``: no TTL, which this package never leaves)
    ttl: float | None
    #: the fencing token: the Redis server clock in microseconds when the hold was granted
    #: (taken, adopted by its run or handed over; 0 for a beat slot marker)
    fence: int
    #: the holder description as stored
    holder: str
    #: blocking acquires queued for it (a waiter counts until its deadline: its ttl + 2 s
    #: after its last call); for a permit, those queued for any permit of its semaphore
    waiters: int
    token: str = field(repr=False)
    #: which permit of its semaphore ``key`` is (``None``: a lock; see ``permit_of``)
    permit: int | None = None

    def as_dict(self, mode: str | None) -> dict[str, Any]:
        """The fields shown by ``list --json``, with the task's ``lock_mode``."""
        return {
            "key": self.key,
            "task": self.task,
            "task_id": self.task_id,
            "attempt": self.attempt,
            "state": self.state,
            "mode": mode,
            "node": self.node,
            "pid": self.pid,
            "ttl": self.ttl,
            "fence": self.fence,
            "holder": self.holder,
            "waiters": self.waiters,
            "permit": self.permit,
        }


def permit_of(key: str) -> tuple[str, int] | None:
    """The semaphore name and the permit number of the permit key ``key`` (a task's with a
    ``lock_limit`` above 1, or a ``RedisSemaphore``'s); ``None``: ``key`` is no permit key.
    ``{x}:permit:1`` is the permit of ``x`` (a name that is a hash tag alone, ``{x}``, is
    refused: ``attempt.companion_key``)."""
    match = _PERMIT.fullmatch(key) if ":permit:" in key else None
    if match is None:
        return None
    base, number = match.group(1), int(match.group(2))
    names = (base[1:-1], base) if base.startswith("{") and base.endswith("}") else (base,)
    for name in names:
        with contextlib.suppress(LockConfigurationError):
            if name and companion_key(name, f"permit:{number}") == key:
                return name, number
    return None


def task_of(key: str, prefix: str) -> str | None:
    """The task whose lock key ``key`` is under ``prefix`` (``None``: not a task's key); a
    permit key (``permit_of``) is its semaphore's, whose name is the task's lock key."""
    permit = permit_of(key)
    if permit is not None:
        key = permit[0]
    if not key.startswith(prefix + ":"):
        return None
    task_match = _TASK_KEY.fullmatch(key, len(prefix) + 1)
    return task_match.group(1) if task_match else None


def is_queued(lock: LockValue) -> bool:
    """Whether ``lock`` is an enqueue lock whose message waits: its holder (``protocol.holder_for``'s)
    says ``state=queued``, as ``parse_holder`` would read it, without decoding the other fields
    (each field is ``name=value`` between spaces, and no value holds a space or ``=``
    unencoded), and it is not kept for its period (``LockValue.kept``: a hold a retry
    declined keeps that retry's holder)."""
    holder = lock.holder
    return not lock.kept and holder.startswith("task=") and " state=queued " in f" {holder} "


def parse_lock(key: str, pttl: int, waiters: int, value: str, prefix: str) -> HeldLock | None:
    """The lock at ``key`` from what ``READ`` read of it (``read_values``); ``None`` if the
    value is not a lock."""
    lock = parse_value(value)
    if lock is None or pttl == -2:
        return None
    token, fence, holder = lock
    task = task_of(key, prefix)
    fields = parse_holder(holder)
    node, pid = fields.get("node"), fields.get("pid")
    if not fields:
        host_pid = _HOST_PID.fullmatch(holder)
        node, pid = host_pid.groups() if host_pid else (None, None)
    permit = permit_of(key)
    return HeldLock(
        key=key,
        task=task,
        task_id=fields.get("task"),
        attempt=int(fields["try"]) if fields.get("try", "").isdigit() else None,
        state="kept" if lock.kept else fields.get("state"),
        node=node,
        pid=int(pid) if pid and pid.isdigit() else None,
        ttl=None if pttl == -1 else pttl / 1000,
        fence=fence,
        holder=holder,
        waiters=waiters,
        token=token,
        permit=None if permit is None else permit[1],
    )


def read_locks(client: Client, keys: Sequence[str], prefix: str) -> list[HeldLock]:
    """The locks among ``keys``, in their order, each with its waiters."""
    found = {}
    for read in read_values(client, keys):
        lock = parse_lock(*read, prefix)
        if lock is not None:
            found[read[0]] = lock
    return [found[key] for key in keys if key in found]


def read_values(client: Client, keys: Iterable[str]) -> Iterator[tuple[str, int, int, str]]:
    """What ``READ`` read of each of ``keys`` that can be a lock, in batches: (key, PTTL in
    ms, live waiters, value), the value ``""`` unless it is a lock value (``parse_lock``).

    ``READ`` is a read-only script, sent 500 keys a call (in a Cluster, per hash slot). The
    keys are taken as the calls go (``scan_keys``' while SCAN walks on), except in a Cluster.
    A permit's waiters are its semaphore's (``HeldLock.waiters``).
    """
    for batch, reply in _reads(client, _slot_batches(client, filter(_has_companions, keys))):
        # a holder not in UTF-8 (a value written by hand) shows U+FFFD where it is not
        reads = json.loads(reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply)
        for key, (pttl, waiters, value) in zip(batch, reads, strict=True):
            yield key, pttl, waiters, value


def _has_companions(key: str) -> bool:
    """Whether ``key`` can be a lock: its companions can share its hash slot (``companion_key``)."""
    if "}" not in key:
        return True
    try:
        companion_key(key, "waiters")
    except LockConfigurationError:
        return False
    return True


def _slot_batches(client: Client, keys: Iterable[str]) -> Iterator[list[str]]:
    """``keys`` in ``READ`` calls of up to ``_BATCH`` keys, of one hash slot in a Cluster
    (which takes them all first)."""
    if not isinstance(client, redis.cluster.RedisCluster):
        keys = iter(keys)
        while batch := list(itertools.islice(keys, _BATCH)):
            yield batch
        return
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(key_slot(key.encode()), []).append(key)
    for group in groups.values():
        yield from (group[i : i + _BATCH] for i in range(0, len(group), _BATCH))


def _waited_as(keys: list[str]) -> list[str]:
    """``READ``'s ARGV for ``keys``: for each, the name its waiters queue under, ``""`` for itself."""
    return [permit[0] if (permit := permit_of(key)) is not None else "" for key in keys]


def _reads(client: Client, batches: Iterator[list[str]]) -> Iterator[tuple[list[str], Any]]:
    """Each of ``batches`` with ``READ``'s reply to it, in order. A plain ``redis.Redis`` gets
    the script's ``SCRIPT LOAD``, then the calls on one connection, ``_AHEAD`` of them sent
    before their replies are read: the server runs those while the caller reads this one. Any
    other client (a Cluster: its nodes; an instrumented one) makes one call at a time."""
    if not plain_client(client):
        for batch in batches:
            yield batch, READ(client, batch, _waited_as(batch))
        return
    with PooledConnection(client) as connection:
        sent: collections.deque[list[str]] = collections.deque()

        def send(calls: int) -> None:
            for batch in itertools.islice(batches, calls):
                keys, names = bulks(connection.encoder, batch), bulks(connection.encoder, _waited_as(batch))
                call = READ.pack(keys, names)
                connection.send_packed_command([call])
                sent.append(batch)

        connection.send_packed_command(connection.pack_command("SCRIPT", "LOAD", READ.source))
        try:
            send(_AHEAD)
            connection.read_response()  # the script is loaded: no call can be refused with NOSCRIPT
            while sent:
                reply = connection.read_response()
                send(1)
                yield sent.popleft(), reply
        except redis.exceptions.ResponseError:
            connection.disconnect()  # the replies to the later calls are left unread
            raise


def read_lock(client: Client, key: str, prefix: str) -> HeldLock | None:
    """The lock at ``key`` (``None`` if the key is missing or holds no lock)."""
    found = read_locks(client, [key], prefix)
    return found[0] if found else None


def glob_escape(text: str) -> str:
    """``text`` as a SCAN pattern matching it alone (``*``, ``?``, ``[``, ``]``, ``\\`` escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def held_locks(client: Client, prefix: str, task: str | None = None) -> list[HeldLock]:
    """Every lock under ``{prefix}:`` (only ``task``'s, if given), sorted by key.

    Keys are found with SCAN (in a Cluster, on each primary), so a large
    keyspace is walked without blocking Redis; a lock taken or freed during the
    walk may be missed or included. Companion keys (a lock's waiter queue and
    wake lists) are not locks.
    """
    keys = sorted(scan_keys(client, prefix, task))
    found = read_locks(client, keys, prefix)
    if task is not None:
        found = [lock for lock in found if lock.task == task]
    return found


def scan_keys(client: Client, prefix: str, task: str | None = None) -> Iterator[str]:
    """The keys under ``{prefix}:`` (``{prefix}:{task}:`` if given), each once, as SCAN (in a
    Cluster, on each primary) finds them: locks and their companion keys, maybe others; and
    the permits of the semaphores named there, ``{<name>}:permit:<i>`` (``permit_of``). A key
    that is not UTF-8 is left out: the package's keys are text.

    One SCAN finds both: its pattern also matches keys with anything before the prefix,
    which are left out here (SCAN's cost is the keyspace's, whatever the pattern)."""
    under = f"{prefix}:{task}:" if task is not None else f"{prefix}:"
    seen: set[str] = set()
    for found in client.scan_iter(match="*" + glob_escape(under) + "*", count=1000):
        try:
            key = text(found)
        except UnicodeDecodeError:  # not UTF-8: no key of the package (another app's, binary)
            continue
        if key in seen:  # SCAN can return a key twice
            continue
        if key.startswith(under) or (key.startswith("{" + under) and permit_of(key) is not None):
            seen.add(key)
            yield key


def force_release(client: Client, lock: HeldLock, why: str, limit: int | None = None) -> bool:
    """Free the hold ``lock`` describes, whoever holds it; whether it was freed.

    ``False`` when that hold is gone or was taken over since it was read (another token, or
    another fence: every hold kept for its period has the same token, ``KEPT_TOKEN``):
    Redis is then unchanged. Logged at WARNING, naming ``why``. A permit is given back
    to its semaphore (``RELEASE_PERMIT``: its first waiter is woken, as by its holder),
    whose ``limit`` its users agree on, where known (else: at least the permit's number);
    a permit above that limit (lowered since it was taken) is only deleted: none of its
    users can be handed it. Sent again by the client's retry policy after a lost reply, its
    second run finds the hold gone that its first freed: freed, as a holder's release sent again
    is (``RedisLock.release``).
    """
    permit = permit_of(lock.key)
    args: list[str | int]
    if permit is None or (limit is not None and permit[1] > limit):
        script, key, args = FORCE_RELEASE, lock.key, [lock.token, "", lock.fence]
    else:  # the script reads permits 1..limit, where the token is found and a waiter handed one
        script, key, args = RELEASE_PERMIT, permit[0], [lock.token, "", permit[1] if limit is None else limit]
    released = script.freed(client, [key], args)
    if released:
        logger.warning(
            "lock %s force-released (%s); it was held by %s, fence %d",
            lock.key,
            why,
            lock.holder,
            lock.fence,
            extra=log_fields(lock.key, None, lock.holder, lock.fence, "force-released"),
        )
    return released


def release_token(client: Client, key: str, token: str) -> bool:
    """Release the hold of ``key`` whose token is ``token`` (a message's enqueue lock, a beat
    slot's marker, a forced release), owner-checked by the token; whether it was released (also
    when the client's retry policy sent it again after a lost reply, the second run finding the
    hold its first freed gone, as ``RedisLock.release`` counts it)."""
    return RELEASE.freed(client, [key], [token])


def release_held_by(client: Client, key: str, holder: str) -> bool:
    """Release ``key`` if ``holder`` holds it (two round trips); whether it was released.

    For a process that cleans up after another (the worker's main process
    after a pool child died): the token comes from the lock itself, and the
    release is still owner-checked, so a lock taken over meanwhile is left alone.
    A hold kept for the rest of its period (``LockValue.kept``) is left too: its
    run ended, and no run of its message is to follow within the period.
    """
    value = hold_of(client, key, holder)
    return value is not None and not value.kept and release_token(client, key, value.token)


def hold_of(client: Client, key: str, holder: str) -> LockValue | None:
    """The value of ``key`` if ``holder`` holds it (one round trip), else ``None``: how a process
    that cleans up after another finds the token of that one's hold."""
    value = parse_value(client.get(key))
    return value if value is not None and value.holder == holder else None


def settle_held_by(client: Client, key: str, holder: str, period_ms: int) -> str | None:
    """Keep ``key``, if ``holder`` holds it, until ``period_ms`` after its hold was taken
    (``"settled"``), or release it if that is past (``"released"``); ``None``: not ``holder``'s.

    As ``release_held_by``, for the hold of a run in a mode that keeps its lock for a period
    after the run (``until_expired``), run by a process that is gone.
    """
    value = hold_of(client, key, holder)
    if value is None:
        return None
    left = int(SETTLE(client, [key], [value.token, period_ms, value.fence]))
    if left > 0:
        return "settled"
    return "released" if left == 0 and release_token(client, key, value.token) else None


def leave_queue_of(client: Client, key: str, holder: str, limit: int = 1) -> int:
    """Take the waits ``holder`` queued for ``key`` (a lock; with ``limit`` above 1, the permits of
    the semaphore ``key``) out of its waiter queue, and wake the next waiter where the lock, or a
    permit, is free (``LEAVE_QUEUE``, ``LEAVE_PERMIT_QUEUE``: one round trip, never touching a
    hold); how many were taken out.

    For a process that cleans up after another that died waiting (the worker's main process
    after a pool child died): else the next release wakes the dead waiter, and a live one
    queued behind it sleeps on until its own timer (the holder's TTL, or its deadline) while the
    lock is free, until the dead waiter is dropped (its ``ttl`` plus 2 s after its last try).
    """
    if limit == 1:
        return int(LEAVE_QUEUE(client, [key], [holder]))
    return int(LEAVE_PERMIT_QUEUE(client, [key], [holder, limit]))
