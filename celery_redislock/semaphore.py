"""RedisSemaphore: up to ``limit`` holders of one name, each with a lock's lease, fence and watchdog.

A permit is held as a lock is (see ``lock``, whose failure timeline applies to
each permit): its own random token, its own lease renewed by the watchdog, its
own fence, owner-checked release and extend. Where the permits live is
described in ``_permit_scripts``; this module drives them through the lock
core (``primitive.LeaseLock``), with ``Permits`` as its servers.

Failure timeline, for a permit with ``ttl`` T: its holder dies, and nothing
renews the permit: it frees itself at most T after the last renewal, and a
waiter notices then at the latest (a release wakes one at once).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import redis
import redis.cluster

from ._durations import Duration, to_ms
from ._permit_scripts import ACQUIRE_PERMIT, MAX_LIMIT, RELEASE_PERMIT
from ._redis import FAILURES
from ._scripts import RENEW
from .attempt import Attempt, companion_key, owns
from .exceptions import LockConfigurationError
from .lock import OneServer
from .primitive import LeaseLock
from .protocol import parse_value, text
from .telemetry import log_fields
from .watchdog import Lease

__all__ = ["PermitBook", "Permits", "RedisSemaphore", "permit_limit", "release_permit_held_by"]

logger = logging.getLogger(__name__)


def permit_limit(limit: object) -> int:
    """``limit`` as an int in ``1..MAX_LIMIT``, or ``LockConfigurationError`` saying what is allowed."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise LockConfigurationError(f"limit must be an int from 1 to {MAX_LIMIT}, got {limit!r}")
    return limit


class PermitBook:
    """The permit keys of the semaphore ``name`` and which one each token holds (no I/O)."""

    def __init__(self, name: str, limit: int) -> None:
        self.name, self.limit = name, limit
        #: the permits' keys, permit i (1-based) at position i - 1
        self.keys = [companion_key(name, f"permit:{i}") for i in range(1, limit + 1)]
        #: token -> the key of the permit it was granted
        self.held: dict[str, str] = {}

    def granted(self, token: str, reply: Any) -> Any:
        """A script's reply or a wake message: a grant (``"<fence>:<i>"``) as its fence, permit i
        recorded as ``token``'s; any other reply unchanged."""
        if isinstance(reply, (bytes, str)):
            fence, _, permit = text(reply).partition(":")
            if permit:
                self.held[token] = self.keys[int(permit) - 1]
                return int(fence)
        return reply

    def key_of(self, token: str | None) -> str | None:
        """The key of the permit ``token`` was granted (None: none)."""
        return None if token is None else self.held.get(token)


def release_permit_held_by(client: Any, name: str, limit: int, holder: str) -> bool:
    """Release the permit of ``name`` that ``holder`` holds (two round trips); whether one was
    (also when the client's retry policy sent the release again after its first send freed it).

    For a process that cleans up after another (the worker's main process after
    a pool child died), as ``inventory.release_held_by`` for a lock: the token
    comes from the permit, and the release is still owner-checked.
    """
    for value in client.mget(PermitBook(name, limit).keys):
        found = parse_value(value)
        if found is not None and found.holder == holder:
            return RELEASE_PERMIT.freed(client, [name], [found.token, "", limit])
    return False


class RedisSemaphore(LeaseLock):
    """Up to ``limit`` holders of the name ``name`` at once, each holding a permit.

    ``RedisLock``'s arguments and members, with a permit for the lock: ``acquire(blocking,
    timeout) -> bool`` takes one (waiting, woken by a release, while all ``limit`` are
    held), ``release()`` gives it back, ``extend(ttl)`` sets its TTL, ``owned()`` says
    whether this object holds one, ``locked()`` whether all are held; ``token``,
    ``fence`` and ``lost`` describe this object's permit; the ``with`` block raises
    ``LockNotAcquired`` after ``timeout``. Re-entrant per object: share the name, not
    the object, between threads that each take a permit. Each permit's lease is renewed
    by the watchdog (``watchdog=True``) and its fence is greater than every earlier
    permit's. ``fair=True`` serves waiters in arrival order.

    All users of one name agree on ``limit`` and ``fair``; a semaphore's name is not
    also a lock's. ``limit`` is an int from 1 to ``MAX_LIMIT`` (1000).
    """

    servers: Permits

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster,
        name: str | bytes,
        limit: int,
        ttl: Duration = 30.0,
        *,
        watchdog: bool = True,
        fair: bool = False,
        timeout: Duration | None = None,
        holder: str | None = None,
    ) -> None:
        if not isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise LockConfigurationError(
                f"client must be a redis.Redis or redis.cluster.RedisCluster, got {type(client).__name__}"
            )
        super().__init__(name, ttl, watchdog=watchdog, fair=fair, timeout=timeout, holder=holder)
        self.limit = permit_limit(limit)
        self.servers = Permits(client, PermitBook(self.name, self.limit), self.ttl, self.wake_prefix)

    def __repr__(self) -> str:
        return f"<RedisSemaphore {self.name!r} limit={self.limit} ttl={self.ttl} held={self.hold_count}>"


class Permits(OneServer):
    """The servers of a ``RedisSemaphore``: its one server, where waiters queue and are woken
    as a lock's (``OneServer.sleep``), and where each holder holds a permit key."""

    def __init__(self, client: Any, book: PermitBook, ttl: float, wake_prefix: str) -> None:
        super().__init__(client, book.name, ttl, 0, 1.0, wake_prefix)
        self.book = book

    def acquire(self, attempt: Attempt, mode: str) -> Any:
        reply = ACQUIRE_PERMIT(self.client, [self.name], [attempt.member, mode, self.book.limit])
        return self.book.granted(attempt.token, reply)

    def sleep(self, attempt: Attempt) -> Any:
        return self.book.granted(attempt.token, super().sleep(attempt))

    def abandon(self, token: str, member: str) -> None:
        """``OneServer.abandon`` for a permit: a Redis failure is logged (a permit granted
        meanwhile runs out unrenewed within its lease); an interrupt propagates."""
        try:
            self.free(token, member)
        except FAILURES as exc:
            fields = log_fields(self.name, outcome="error")
            logger.warning("semaphore %r: could not leave the waiter queue: %s", self.name, exc, extra=fields)

    def free(self, token: str, member: str = "") -> bool:
        """Release ``token``'s permit (and leave the queue as ``member``), owner-checked; whether
        ``token`` held one (also when the client's retry policy sent the release again after its
        first send freed it)."""
        released = RELEASE_PERMIT.freed(self.client, [self.name], [token, member, self.book.limit])
        self.book.held.pop(token, None)
        return released

    def extend(self, token: str, ttl: float) -> bool:
        key = self.book.key_of(token)
        return key is not None and not RENEW(self.client, [key], [to_ms(ttl), token])

    def leases(self, token: str, ttl: float, owner: weakref.ref[LeaseLock]) -> list[Lease]:
        return [Lease(self.client, self.book.held[token], token, ttl, owner)]

    def confirm(self, token: str, member: str) -> None:
        """Never: replicas do not confirm permits (``replicas`` is 0 here; ``config`` refuses
        ``lock_limit`` above 1 with ``redislock_replicas``)."""
        raise LockConfigurationError(f"semaphore {self.name!r}: permits are not confirmed by replicas")

    def locked(self) -> bool:
        """Whether all ``limit`` permits are held (one round trip)."""
        return int(self.client.exists(*self.book.keys)) == self.book.limit

    def owned(self, token: str | None) -> bool:
        key = self.book.key_of(token)
        return key is not None and owns(self.client.get(key), token)
