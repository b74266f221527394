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

import abc
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, overload

import redis
import redis.cluster

from ._durations import Duration, seconds, to_ms
from ._redis import FAILURES, PooledConnection, call_with_timeout, node_client, reply_grace, send_later
from ._scripts import ACQUIRE, RELEASE, RENEW, bulk, plain_client
from .attempt import MAX_REPLICAS, MAX_TTL, MIN_WATCHDOG_TTL, Attempt, companion_key, is_replica_count, owns
from .exceptions import LockConfigurationError, LockNotReplicated
from .primitive import LeaseLock
from .redlock import Redlock
from .telemetry import log_fields
from .watchdog import Lease

__all__ = ["MAX_TTL", "MIN_WATCHDOG_TTL", "OneServer", "RedisLock", "companion_key"]

logger = logging.getLogger(__name__)


class RedisLock(LeaseLock, metaclass=abc.ABCMeta):
    """A lock on the Redis key ``name`` that only its owner can release or extend.

    ``ttl`` (seconds or timedelta) is the lease: an unrenewed hold expires
    after it. With ``watchdog=True`` the process's watchdog renews the lease
    every ``ttl/3`` while the lock is held. ``fair=True`` hands the lock to
    waiters in arrival order. ``timeout`` is how long ``acquire()`` and the
    ``with`` block wait by default (``None``: no limit). ``holder`` describes
    the owner to others (``LockNotAcquired.holder``); by default
    ``"<host>:<pid>"``. ``replicas`` replicas must acknowledge each hold
    within ``replica_timeout`` (``WAIT``), else it is given back and
    ``LockNotReplicated`` raised.

    Re-entrant per object: acquiring again while this object holds the lock
    raises a hold count (no round trip) and ``release()`` lowers it; the last
    release frees the key. Share the key, not the object, between threads
    that must exclude each other. All users of one key should agree on
    ``fair``.

    ``token`` and ``fence`` describe the current hold (``None`` when not
    held); ``fence`` is greater than every earlier holder's, so a resource
    that remembers the highest fence it saw can reject a stale holder.
    ``lost`` is set when the watchdog finds the lock gone or taken over.

    A list or tuple of clients or URLs makes a ``Redlock`` instead (see ``redlock``), which
    counts as a ``RedisLock`` (``isinstance``) while built over other servers.
    """

    @overload  # a Redlock: a LeaseLock of its own (registered as a RedisLock, see below)
    def __new__(  # type: ignore[misc]
        cls, client: Sequence[redis.Redis | str], *args: Any, **kwargs: Any
    ) -> Redlock: ...

    @overload
    def __new__(
        cls, client: redis.Redis | redis.cluster.RedisCluster, *args: Any, **kwargs: Any
    ) -> RedisLock: ...

    def __new__(cls, client: Any, *args: Any, **kwargs: Any) -> Any:
        if cls is RedisLock and isinstance(client, (list, tuple)):
            kwargs.pop("replica_timeout", None)
            if kwargs.pop("replicas", 0) != 0:  # each server of a Redlock is a primary of its own
                raise LockConfigurationError("replicas needs a redis.Redis client, not a list of servers")
            return Redlock(client, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster | Sequence[redis.Redis | str],  # a list: see __new__
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
        super().__init__(name, ttl, watchdog=watchdog, fair=fair, timeout=timeout, holder=holder)
        if not is_replica_count(replicas):
            raise LockConfigurationError(
                f"replicas must be an int from 0 to {MAX_REPLICAS}, got {replicas!r}"
            )
        if replicas and not isinstance(client, redis.Redis):
            raise LockConfigurationError("replicas needs a redis.Redis client (one primary, or Sentinel's)")
        self.replicas = replicas
        self.replica_timeout = seconds(replica_timeout, "replica_timeout")
        if replicas and not 0 < self.replica_timeout < self.ttl:
            raise LockConfigurationError(
                f"replica_timeout must be > 0 and < ttl ({self.ttl:g}), got {replica_timeout!r}"
            )
        self.servers = OneServer(
            client, self.name, self.ttl, replicas, self.replica_timeout, self.wake_prefix
        )


RedisLock.register(Redlock)


class OneServer:
    """The servers of a ``RedisLock``: one (a primary, a Sentinel's, or a Cluster's node for the
    key), where waiters queue and are woken (see ``_scripts``)."""

    needed = 1
    queues = True

    def __init__(
        self, client: Any, name: str, ttl: float, replicas: int, replica_timeout: float, wake_prefix: str
    ) -> None:
        self.client, self.name, self.ttl, self.replicas = client, name, ttl, replicas
        self.replica_timeout = replica_timeout
        self._keys = (name,)
        self._wake_prefix = wake_prefix

    def __len__(self) -> int:
        return 1

    def acquire(self, attempt: Attempt, mode: str) -> Any:
        return ACQUIRE(self.client, self._keys, [attempt.member, mode])

    def sleep(self, attempt: Attempt) -> Any:
        """Blocks until woken by a release, the holder's TTL runs out, or the deadline."""
        wait = attempt.pause()
        key = self._wake_prefix + attempt.token
        try:
            node = node_client(self.client, key)
            reply = call_with_timeout(node, wait + reply_grace(node), "BLPOP", key, f"{wait:.3f}")
        except (redis.exceptions.MovedError, redis.exceptions.AskError):
            return None  # a Cluster moving the slot: try again through the client, which follows it
        return None if reply is None else reply[1]

    def abandon(self, token: str, member: str) -> None:
        """Leave the waiter queue as ``member``, releasing ``token``'s hold if it was granted
        meanwhile; a Redis failure is logged (the waiter is dropped after its deadline, a hold
        runs out unrenewed). Anything else (an interrupt: a soft time limit is an ``Exception``
        too) propagates: the run must not go on past it."""
        try:
            RELEASE(self.client, self._keys, [token, member])
        except FAILURES as exc:
            logger.warning(
                "lock %r: could not leave the waiter queue: %s",
                self.name,
                exc,
                extra=log_fields(self.name, outcome="error"),
            )

    def waits_for_reply(self) -> bool:
        """Whether a release can leave its reply to be read later (``run_lock.release_later``)."""
        return not self.replicas and plain_client(self.client)

    def free(self, token: str) -> bool:
        """Release ``token``'s hold, owner-checked; whether ``token`` held the lock.

        A release the client's retry policy sent again (redis-py 6+ retries by default)
        may find the key already freed by its first send, whose reply was lost: then
        ``token`` counts as having held it. Seen only where the script is sent here
        (``Script.__call__``'s ``resending``), not through a wrapped ``execute_command``
        (docs/operations.md, "Tracing").
        """
        return RELEASE.freed(self.client, self._keys, [token])

    def free_later(self, token: str, then: Callable[[Any], None]) -> bool:
        """``free`` without waiting for the reply (``_redis.send_later``, whose contract holds):
        ``then`` gets the reply (1: ``token`` held the lock) or the exception that left the outcome
        unknown; ``False``: nothing sent. Only where ``waits_for_reply()``."""
        command = RELEASE.pack(*self._release_operands(token))

        def read(connection: Any) -> Any:
            return RELEASE.read_reply(connection, command)

        return send_later(self.client, command, read, then)

    def free_once(self, token: str) -> bool:
        """``free`` in one exchange, outside the client's retry policy (its error propagates): for a
        release sent again because its first send's reply was lost, which must not hold its run
        up for the policy's backoffs. Only where ``waits_for_reply()``."""
        with PooledConnection(self.client) as connection:
            return bool(int(RELEASE.run_on(connection, *self._release_operands(token))))

    def _release_operands(self, token: str) -> tuple[list[bytes], list[bytes]]:
        """``RELEASE``'s keys and args for ``token``, as RESP bulk strings (``free_later``, ``free_once``)."""
        return [bulk(self.client.get_encoder().encode(self.name))], [bulk(token.encode())]

    def extend(self, token: str, ttl: float) -> bool:
        return not RENEW(self.client, self._keys, [to_ms(ttl), token])

    def confirm(self, token: str, member: str) -> None:
        """Wait (``WAIT``, at most ``replica_timeout``) until ``replicas`` replicas have the hold of
        ``token``; else release it, owner-checked, and raise ``LockNotReplicated``.

        The hold is written again (its TTL set, owner-checked) on the connection that
        then sends ``WAIT``, so the wait covers it however it was granted (also handed over).
        """
        try:
            with PooledConnection(self.client) as connection:
                encode = connection.encoder.encode
                key, ttl_ms = bulk(encode(self.name)), bulk(b"%d" % to_ms(self.ttl))
                not_owned = RENEW.run_on(connection, [key], [ttl_ms, bulk(token.encode())])
                connection.send_command("WAIT", self.replicas, to_ms(self.replica_timeout))
                acknowledged = connection.read_response()
        except BaseException:
            self.abandon(token, member)
            raise
        if not_owned or int(acknowledged) < self.replicas:
            self.abandon(token, member)
            raise LockNotReplicated(self.name, int(acknowledged), self.replicas)

    def leases(self, token: str, ttl: float, owner: weakref.ref[LeaseLock]) -> list[Lease]:
        return [Lease(self.client, self.name, token, ttl, owner)]

    def locked(self) -> bool:
        return bool(self.client.exists(self.name))

    def owned(self, token: str | None) -> bool:
        return owns(self.client.get(self.name), token)
