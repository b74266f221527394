"""RedisLock: an owner-checked Redis lease with a watchdog, fair waiting and fencing tokens.

Failure timeline, for a holder with ``ttl`` T (the lease):

* the holder process dies (SIGKILL, OOM): nothing renews the lease, the key
  expires at most T after the last renewal, and waiters notice then at the
  latest (a release wakes them at once; an expiry is seen at the holder's TTL);
* the holder is paused or cut off for longer than T: the lease expires and
  another owner may take the lock. The watchdog reports the loss within one
  renewal interval of the process running again (``lost``, the ``lock_lost``
  signal, an ERROR log), a later ``release()`` raises ``LockNotOwned`` and
  leaves the new owner alone, and the new owner's ``fence`` is greater, so a
  resource that checks fences rejects the stale holder's writes.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import threading
import time as mod_time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import redis
import redis.cluster

from ._durations import Duration, seconds, to_ms
from ._redis import call_with_timeout, node_client, pooled_connection
from ._scripts import ACQUIRE, RELEASE, RENEW, bulk
from .exceptions import LockConfigurationError, LockLost, LockNotAcquired, LockNotOwned, LockNotReplicated
from .protocol import text
from .watchdog import Lease, get_watchdog

__all__ = ["MAX_TTL", "MIN_WATCHDOG_TTL", "RedisLock", "companion_key"]

logger = logging.getLogger(__name__)

#: Shortest lease the watchdog renews (every ttl/3, so at least every 0.1 s).
MIN_WATCHDOG_TTL = 0.3
#: Longest lease accepted (Redis refuses expiry times past its range).
MAX_TTL = 365 * 24 * 3600.0


def companion_key(name: str, suffix: str) -> str:
    """A key in ``name``'s Redis Cluster hash slot, for data that belongs to the lock.

    Raises ``LockConfigurationError`` for a name whose slot no companion can
    share: one with a ``}`` but no hash tag (Redis hashes the first non-empty
    ``{...}``).
    """
    start = name.find("{")
    if start != -1:
        end = name.find("}", start + 1)
        if end > start + 1:  # ``name`` has a hash tag: the companion reuses it
            return f"{name}:{suffix}"
    if "}" in name:
        raise LockConfigurationError(
            f"name {name!r} has a '}}' but no hash tag; use a name without '}}' or with a {{tag}}"
        )
    return f"{{{name}}}:{suffix}"


@functools.cache
def _hostname() -> str:
    return socket.gethostname()


def _lease_seconds(ttl: object, watchdog: bool) -> float:
    """A lease length in seconds, or ``LockConfigurationError`` saying what is allowed."""
    value = seconds(ttl, "ttl")
    if not 0 < value <= MAX_TTL:
        raise LockConfigurationError(f"ttl must be > 0 and <= {MAX_TTL:.0f} seconds, got {ttl!r}")
    if watchdog and value < MIN_WATCHDOG_TTL:
        raise LockConfigurationError(
            f"ttl must be >= {MIN_WATCHDOG_TTL} seconds for the watchdog to renew it "
            f"(every ttl/3), got {ttl!r}; use a longer ttl or watchdog=False"
        )
    return value


def _lock_name(name: object) -> str:
    """``name`` as a non-empty str, or ``LockConfigurationError`` saying what is allowed."""
    if isinstance(name, bytes):
        try:
            name = name.decode()
        except UnicodeDecodeError:
            raise LockConfigurationError(f"name must be UTF-8, got {name!r}") from None
    if not isinstance(name, str) or not name:
        raise LockConfigurationError(f"name must be a non-empty str or bytes, got {name!r}")
    return name


def _check_holder(holder: object) -> None:
    if holder is not None and not isinstance(holder, str):
        raise LockConfigurationError(f"holder must be a str, got {holder!r}")


def _member(ttl_ms: int, token: str, fair: bool, holder: str | None) -> str:
    """The waiter member (see ``_scripts``) describing an acquisition by ``token``."""
    holder = holder if holder is not None else f"{_hostname()}:{os.getpid()}"
    return f"{ttl_ms}:{token}:{'1' if fair else '0'}:{holder}"


def _sleep_seconds(ttl: float, deadline: float | None, pttl_ms: int) -> float:
    """How long a waiter blocks: until the holder's TTL (``pttl_ms``; at most our own ``ttl``)
    runs out, or until ``deadline`` (monotonic)."""
    waits = [ttl, pttl_ms / 1000 if pttl_ms > 0 else ttl]
    if deadline is not None:
        waits.append(deadline - mod_time.monotonic())
    return max(min(waits), 0.001)


class RedisLock:
    """A lock on the Redis key ``name`` that only its owner can release or extend.

    ``ttl`` (seconds or timedelta) is the lease: an unrenewed hold expires
    after it. With ``watchdog=True`` the process's watchdog renews the lease
    every ``ttl/3`` while the lock is held. ``fair=True`` hands the lock to
    waiters in arrival order. ``timeout`` is how long ``acquire()`` and the
    ``with`` block wait by default (``None``: no limit). ``holder`` describes
    the owner to others (``LockNotAcquired.holder``); by default
    ``"<host>:<pid>"``.

    Re-entrant per object: acquiring again while this object holds the lock
    raises a hold count (no round trip) and ``release()`` lowers it; the last
    release frees the key. Share the key, not the object, between threads
    that must exclude each other. All users of one key should agree on
    ``fair``.

    ``token`` and ``fence`` describe the current hold (``None`` when not
    held); ``fence`` is greater than every earlier holder's, so a resource
    that remembers the highest fence it saw can reject a stale holder.
    ``lost`` is set when the watchdog finds the lock gone or taken over.
    """

    def __new__(cls, client: Any, *args: Any, **kwargs: Any) -> RedisLock:
        """A list or tuple of clients or URLs makes a Redlock (see ``redlock.Redlock``)."""
        if cls is RedisLock and isinstance(client, (list, tuple)):
            from .redlock import Redlock

            return super().__new__(Redlock)
        return super().__new__(cls)

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster | Sequence[redis.Redis | str],
        name: str | bytes,
        ttl: Duration = 30.0,
        *,
        watchdog: bool = True,
        fair: bool = False,
        timeout: Duration | None = None,
        holder: str | None = None,
        replicas: int = 0,
        replica_timeout: Duration = 1.0,
    ) -> None:
        if not isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise LockConfigurationError(
                f"client must be a redis.Redis or redis.cluster.RedisCluster, got {type(client).__name__}"
            )
        name = _lock_name(name)
        self.ttl = _lease_seconds(ttl, watchdog)
        self.timeout = None if timeout is None else seconds(timeout, "timeout")
        _check_holder(holder)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise LockConfigurationError(f"replicas must be an int >= 0, got {replicas!r}")
        if replicas and not isinstance(client, redis.Redis):
            raise LockConfigurationError("replicas needs a redis.Redis client (one primary, or Sentinel's)")
        self.replicas = replicas
        self.replica_timeout = seconds(replica_timeout, "replica_timeout")
        if replicas and not 0 < self.replica_timeout < self.ttl:
            raise LockConfigurationError(
                f"replica_timeout must be > 0 and < ttl ({self.ttl:g}), got {replica_timeout!r}"
            )
        self.client = client
        self.name = name
        self.watchdog = bool(watchdog)
        self.fair = bool(fair)
        self.holder = holder
        self.token: str | None = None
        self.fence: int | None = None
        self.lost = threading.Event()
        self._keys = (name,)
        self._wake_prefix = companion_key(name, "wake:")  # also checks the name can have companions
        self._ttl_ms = to_ms(self.ttl)
        self._count = 0
        self._pid = 0
        self._lease: Lease | None = None
        self._state = threading.Lock()
        #: (holder, ttl in seconds) seen by the last failed attempt
        self.busy: tuple[str | None, float | None] = (None, None)

    def __repr__(self) -> str:
        return f"<RedisLock {self.name!r} ttl={self.ttl} held={self._count}>"

    # -- acquiring -----------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: Duration | None = None) -> bool:
        """Take the lock; ``True`` once held, ``False`` if not within ``timeout``.

        ``timeout`` (seconds or timedelta; default: the constructor's, where
        ``None`` waits without limit) bounds the wait with one monotonic
        deadline. A waiter sleeps until a release wakes it, or until the
        holder's TTL runs out (a holder that died), never polling. Free lock:
        one round trip. Raises ``LockLost`` when re-entering a hold the
        watchdog found lost.
        """
        if timeout is not None and not blocking:
            raise LockConfigurationError("timeout cannot be given with blocking=False")
        wait = self.timeout if timeout is None else seconds(timeout, "timeout")
        with self._state:
            if self.held():
                if self.lost.is_set():
                    raise LockLost(self.name)
                self._count += 1
                return True
        token = secrets.token_hex(16)
        member = _member(self._ttl_ms, token, self.fair, self.holder)
        deadline = None if wait is None else mod_time.monotonic() + wait
        sent_at, fence = self._wait_for(token, member, blocking, deadline)
        if fence is None:
            return False
        self.take_hold(token, fence, sent_at)
        return True

    def wait_as(self, token: str, deadline: float) -> int | None:
        """Queue for the lock as ``token`` until it is granted or handed over to ``token`` (the
        fence), or until monotonic ``deadline`` (``None``); ``busy`` then names the holder.

        For a hold prepared for a known token (a retry adopting its attempt's parked hold):
        the caller records it with ``take_hold``.
        """
        member = _member(self._ttl_ms, token, self.fair, self.holder)
        return self._wait_for(token, member, True, deadline)[1]

    def take_hold(self, token: str, fence: int, sent_at: float) -> None:
        """Record as this object's the hold ``token`` was granted (``fence``) by a request sent at
        monotonic ``sent_at``: confirmed by ``replicas`` replicas where set (else released and
        ``LockNotReplicated``), then renewed by the watchdog."""
        if self.replicas:
            self._confirm(token, _member(self._ttl_ms, token, self.fair, self.holder))
        self._hold(token, fence, sent_at)

    def _confirm(self, token: str, member: str) -> None:
        """Wait (``WAIT``, at most ``replica_timeout``) until ``replicas`` replicas have the hold of
        ``token``; else release it, owner-checked, and raise ``LockNotReplicated``.

        The hold is written again (its TTL set, owner-checked) on the connection that
        then sends ``WAIT``, so the wait covers it however it was granted (also handed over).
        """
        try:
            with pooled_connection(self.client) as connection:
                encode = connection.encoder.encode
                key, ttl_ms = bulk(encode(self.name)), bulk(b"%d" % self._ttl_ms)
                not_owned = RENEW.run_on(connection, [key], [ttl_ms, bulk(token.encode())])
                connection.send_command("WAIT", self.replicas, to_ms(self.replica_timeout))
                acknowledged = connection.read_response()
        except BaseException:
            self._abandon(token, member)
            raise
        if not_owned or int(acknowledged) < self.replicas:
            self._abandon(token, member)
            raise LockNotReplicated(self.name, int(acknowledged), self.replicas)

    def _hold(self, token: str, fence: int, sent_at: float) -> None:
        """Record the hold granted to ``token`` (``fence``) by a request sent at monotonic ``sent_at``."""
        with self._state:
            self.token, self.fence, self._count, self._pid = token, fence, 1, os.getpid()
            if self.lost.is_set():
                self.lost.clear()
            if self.watchdog:
                self._lease = Lease(self.client, self.name, token, self.ttl, weakref.ref(self))
                get_watchdog().add(self._lease, sent_at)

    def stop_renewing(self) -> str:
        """Stop renewing the hold (before the caller frees or parks the key) and return its token;
        no renewal of it is in flight any more (see ``watchdog``)."""
        with self._state:
            if not self.held():
                raise LockNotOwned(self.name)
            token, leases = self.token or "", self._held_leases()
        for lease in leases:
            get_watchdog().discard(lease)
        return token

    def _held_leases(self) -> list[Lease]:
        """The watchdog's leases of the current hold (under ``_state``)."""
        return [] if self._lease is None else [self._lease]

    def forget(self) -> None:
        """Forget the hold, once the caller has freed or parked the key."""
        with self._state:
            self.token, self.fence, self._count, self._lease = None, None, 0, None

    def _wait_for(
        self, token: str, member: str, blocking: bool, deadline: float | None
    ) -> tuple[float, int | None]:
        """Attempts by ``member`` (see ``_scripts``) until granted or past ``deadline``.

        Returns (a monotonic time no later than the grant, the fence), or
        (_, None) when not granted. Interrupted (an exception, KeyboardInterrupt
        or a Celery time limit included) after an attempt may have reached
        Redis, it leaves the queue and releases the lock if it came.
        """
        queued = sent = False
        try:
            while True:
                sent_at = mod_time.monotonic()
                waiting = blocking and (deadline is None or sent_at < deadline)
                mode = ("again" if waiting else "last") if queued else ("wait" if waiting else "try")
                sent = True
                reply = ACQUIRE(self.client, self._keys, [member, mode])
                if isinstance(reply, int):
                    return sent_at, reply
                pttl = int(reply[0])
                self.busy = (None if reply[1] is None else text(reply[1]), max(pttl, 0) / 1000)
                if not waiting:
                    return sent_at, None
                queued = True
                message = self._sleep(token, deadline, pttl)
                if message not in (None, "retry"):  # handed over after our last attempt was sent
                    return sent_at, int(message)
        except BaseException:
            if sent:
                self._abandon(token, member)
            raise

    def _sleep(self, token: str, deadline: float | None, pttl_ms: int) -> str | None:
        """Blocks until woken by a release, the holder's TTL runs out, or ``deadline``."""
        wait = _sleep_seconds(self.ttl, deadline, pttl_ms)
        key = self._wake_prefix + token
        try:
            reply = call_with_timeout(node_client(self.client, key), wait + 1.0, "BLPOP", key, f"{wait:.3f}")
        except (redis.exceptions.MovedError, redis.exceptions.AskError):
            return None  # a Cluster moving the slot: try again through the client, which follows it
        return None if reply is None else text(reply[1])

    def _abandon(self, token: str, member: str) -> None:
        """Leave the queue, and release the lock if it was granted meanwhile."""
        try:
            RELEASE(self.client, self._keys, [token, member])
        except Exception as exc:
            logger.warning("lock %r: could not leave the waiter queue: %s", self.name, exc)

    # -- holding -------------------------------------------------------------

    def held(self) -> bool:
        """Held by this object in this process (a forked child holds nothing it inherited)."""
        return self._count > 0 and self._pid == os.getpid()

    def renewals_on_time(self) -> bool:
        """Whether the watchdog renews the hold and its last renewal is less than one interval
        late (a late one means this process was paused or cut off: ask Redis, ``extend()``)."""
        with self._state:
            leases = self._held_leases() if self.held() else []
        return bool(leases) and all(mod_time.monotonic() < lease.expires - lease.interval for lease in leases)

    def release(self) -> None:
        """Lower the hold count; at zero, free the key (one round trip, owner-checked).

        Raises ``LockNotOwned`` (changing nothing in Redis) when this object
        does not hold the lock, or no longer does (expired or taken over).
        Renewal stops before the release is sent. On a Redis error the outcome
        is unknown: the error propagates and the hold is kept, so ``release()``
        can be retried; unrenewed, the key expires within ``ttl`` anyway.
        """
        with self._state:
            if not self.held():
                raise LockNotOwned(self.name)
            if self._count > 1:
                self._count -= 1
                return
        released = self._free(self.stop_renewing())
        self.forget()
        if not released:
            raise LockNotOwned(self.name)

    def _free(self, token: str) -> bool:
        """Release ``token``'s hold in Redis, owner-checked; whether ``token`` held the lock.

        A release the client's retry policy sent again (redis-py 6+ retries by default)
        may find the key already freed by its first send, whose reply was lost: then
        ``token`` counts as having held it.
        """
        resent: list[bool] = []
        released = int(RELEASE(self.client, self._keys, [token], lambda: resent.append(True)))
        return bool(released or resent)

    def extend(self, ttl: Duration | None = None) -> None:
        """Set the remaining TTL to ``ttl`` (default: the lock's), replacing it, never adding.

        Owner-checked in one round trip; raises ``LockNotOwned`` (and sets
        ``lost``) when this object does not hold the lock. With the watchdog,
        the hold is renewed to ``ttl`` from then on (every ``ttl/3``); a
        renewal already under way lands first, so it cannot undo the extension.
        """
        new_ttl = self.ttl if ttl is None else _lease_seconds(ttl, self.watchdog)
        with self._state:
            if not self.held():
                raise LockNotOwned(self.name)
            token, leases = self.token or "", self._held_leases()
        with get_watchdog().changing(leases):  # no renewal in flight can undo it
            sent_at = mod_time.monotonic()
            if not self._extend(token, new_ttl):
                self.lost.set()
                raise LockNotOwned(self.name)
            for lease in leases:
                get_watchdog().reschedule(lease, new_ttl, sent_at)

    def _extend(self, token: str, ttl: float) -> bool:
        """Set ``token``'s hold to ``ttl`` in Redis, owner-checked; whether ``token`` held the lock."""
        return not RENEW(self.client, [self.name], [to_ms(ttl), token])

    def locked(self) -> bool:
        """Whether anyone holds the lock (one round trip)."""
        return bool(self.client.exists(self.name))

    def owned(self) -> bool:
        """Whether this object holds the lock, as Redis sees it now (one round trip)."""
        with self._state:
            if not self.held():
                return False
            token = self.token
        current = self.client.get(self.name)
        return current is not None and text(current)[:32] == token

    # -- context manager -----------------------------------------------------

    def __enter__(self) -> RedisLock:
        if not self.acquire():
            holder, ttl = self.busy
            raise LockNotAcquired(self.name, holder, ttl)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.release()
            return
        try:  # the body's exception is the one to see
            self.release()
        except LockNotOwned:
            logger.warning("lock %r was not held any more when its with-block raised", self.name)

    def lease_lost(self, lease: Lease) -> bool:
        """Called by the watchdog: set ``lost`` if ``lease`` is still this object's hold."""
        with self._state:
            if self._lease is not lease:
                return False
            self.lost.set()
            return True
