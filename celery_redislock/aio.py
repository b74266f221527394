"""AsyncRedisLock: ``RedisLock`` for asyncio, on a ``redis.asyncio.Redis``.

Same keys, values, Lua scripts (the very ``Script`` objects of ``_scripts``)
and guarantees as ``RedisLock``, so sync and async users of one key exclude
each other. The watchdog is one asyncio task per event loop renewing every
held lease of that loop in batches (one round trip per client and lease
length per tick), started with the first hold and ending with the last;
cancelled while holds are left (by code cancelling tasks it does not own),
it is replaced by another.

Cancellation (``asyncio.timeout``, ``task.cancel()``) timeline:

* during ``acquire()``: the Redis call in flight is finished, not cut, then
  the attempt is undone owner-checked (leave the waiter queue; release the
  lock if it was granted, also by a fair hand-over that arrived while
  waiting), then ``CancelledError`` propagates: a cancelled acquire never
  leaves a lock held. Each of the two calls runs under the client's retry
  policy, each try bounded by its ``socket_timeout`` (and connect timeout):
  against a server that does not answer, a cancellation waits for every try
  and backoff of both (redis-py 8.1's default: 11 tries, backoff up to 1 s),
  many times ``socket_timeout``; a client's ``retry`` bounds it;
* during ``release()``: the release is finished and the object forgets the
  hold before ``CancelledError`` propagates: a cancelled release is a release.

Every task of a loop runs on the main thread, where a signal handler raises (Celery's soft
time limit) in whatever runs then, the watchdog task's own step included. What is raised
there that is not a Redis failure is not swallowed (a renewal it cut short is retried, as a
failed one, until its lease runs out): the tasks holding the loop's watched locks are cancelled,
and an ``async with`` block of such a lock ends with that exception (not ``CancelledError``)
once it released the lock; the watchdog task goes on renewing what is still held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time as mod_time
import weakref
from collections.abc import AsyncIterator, Awaitable
from math import inf
from typing import Any, TypeVar

import redis.asyncio
from redis.exceptions import NoScriptError

from . import telemetry
from ._durations import Duration, to_ms
from ._redis import FAILURES, call_with_timeout_async, deadline, reply_grace
from ._scripts import ACQUIRE, RELEASE, RENEW, Script
from .attempt import Attempt, LockCore, ending_block, lease_seconds, owns
from .exceptions import LockConfigurationError, LockNotAcquired, LockNotOwned
from .watchdog import (
    Lease,
    LeaseSet,
    announce_loss,
    failed_renewal,
    landing_late,
    mark_lost,
    renewal_answered,
)

__all__ = ["AsyncOneKey", "AsyncRedisLock", "call_noting_resend"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def _to_the_end(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end even if the caller is cancelled meanwhile.

    A cancellation that arrives meanwhile is raised (``CancelledError``) once
    ``awaitable`` has ended, whatever its outcome; so is an exception that lands here,
    not ``awaitable``'s own (a soft time limit, raised in whatever runs on the main thread).
    """
    task = asyncio.ensure_future(awaitable)
    cancelled, landed = False, None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the inner work itself was cancelled (event loop shutting down)
                raise
            cancelled = True
        except Exception as exc:  # the task's outcome (read below), or one that landed here
            if not task.done() or task.cancelled() or task.exception() is not exc:
                landed = exc
    if landed is not None:
        raise landed
    if cancelled:
        if not task.cancelled() and task.exception() is not None:
            logger.warning(
                "interrupted Redis call failed: %r",
                task.exception(),
                extra=telemetry.log_fields(outcome="error"),
            )
        raise asyncio.CancelledError
    return task.result()


class AsyncRedisLock(LockCore):
    """``RedisLock`` for asyncio: the same arguments, semantics and keys; methods are coroutines.

    ``client`` is a ``redis.asyncio.Redis`` (a Sentinel ``master_for`` one
    included; any ``decode_responses``). ``await acquire(blocking=True,
    timeout=None) -> bool``, ``await release()``, ``await extend(ttl=None)``,
    ``await locked()``, ``await owned()``, ``async with`` (raising
    ``LockNotAcquired`` after ``timeout``); ``token``, ``fence``, and ``lost``,
    an ``asyncio.Event`` the watchdog sets when it finds the lock gone.
    Re-entrant per object; share the key, not the object, between tasks that
    must exclude each other. Use the object on one event loop.
    """

    lost: asyncio.Event

    def __init__(
        self,
        client: redis.asyncio.Redis,
        name: str | bytes,
        ttl: Duration = 30.0,
        *,
        watchdog: bool = True,
        fair: bool = False,
        timeout: Duration | None = None,
        holder: str | None = None,
    ) -> None:
        if not isinstance(client, redis.asyncio.Redis):
            raise LockConfigurationError(f"client must be a redis.asyncio.Redis, got {type(client).__name__}")
        super().__init__(name, ttl, watchdog=watchdog, fair=fair, timeout=timeout, holder=holder)
        self.client = client
        self.lost = asyncio.Event()
        #: where the hold lives, and how its scripts run there
        self.key: AsyncOneKey = AsyncOneKey(client, self.name, self.wake_prefix)
        self._lease: Lease | None = None
        #: the token of the hold whose release raised (maybe after Redis freed the key), if any
        self._released_maybe: str | None = None
        #: the task that took the hold, and what landed in the watchdog task since (the
        #: exception its ``async with`` block raises in place of the task's cancellation)
        self._task: asyncio.Task[Any] | None = None
        self._landed: BaseException | None = None

    async def acquire(self, blocking: bool = True, timeout: Duration | None = None) -> bool:
        """Take the lock; ``True`` once held, ``False`` if not within ``timeout`` (see ``RedisLock``)."""
        deadline = self.deadline(blocking, timeout)
        if self.reenter():
            return True
        token = secrets.token_hex(16)
        attempt = self.new_attempt(token, blocking, deadline, True)
        fence = await self._attempts(attempt)
        if fence is None:
            return False
        self.record_hold(token, fence)
        self.lost.clear()
        self._task, self._landed = asyncio.current_task(), None
        if self.watchdog:
            self._lease = Lease(self.client, self.key.lease_key(token), token, self.ttl, weakref.ref(self))
            _watchdog().add(self._lease, attempt.sent_at)
        return True

    async def _attempts(self, attempt: Attempt) -> int | None:
        """``LeaseLock._attempts`` on this event loop; cancelled or failing after an attempt was
        sent, it undoes it (see the module docstring)."""
        try:
            while True:
                fence = attempt.granted(await _to_the_end(self.key.acquire(attempt, attempt.mode())))
                if fence is not None:
                    return fence
                self.busy = attempt.busy
                if not attempt.waiting:
                    return None
                fence = attempt.handed(await self.key.sleep(attempt))
                if fence is not None:  # handed over after our last attempt was sent
                    return fence
        except BaseException:
            if attempt.sent:
                await _to_the_end(self.key.abandon(attempt.token, attempt.member))
            raise

    async def release(self) -> None:
        """Lower the hold count; at zero, free the key, owner-checked (see ``RedisLock.release``)."""
        if not self.drop_hold():
            return
        self.freeing()  # an acquire meanwhile (another task) takes a hold of its own
        if not await _to_the_end(self._free(self.token or "", self._lease)):
            raise LockNotOwned(self.name)

    async def _free(self, token: str, lease: Lease | None) -> bool:
        if lease is not None:  # no renewal in flight once discarded
            await _watchdog().discard(lease)
        try:
            released = await self.key.free(token)
        except BaseException:  # maybe sent: a retry finding the key gone counts it as released
            self._released_maybe = token
            self.kept_after_freeing(token)  # so that release() can be tried again
            raise
        released = released or self._released_maybe == token
        if self.freed(token):
            self._lease = self._released_maybe = self._task = None
        return released

    async def extend(self, ttl: Duration | None = None) -> None:
        """Set the remaining TTL to ``ttl`` (default: the lock's), replacing it (see ``RedisLock.extend``)."""
        new_ttl = self.ttl if ttl is None else lease_seconds(ttl, self.watchdog)
        if not self.held():
            raise LockNotOwned(self.name)
        token, lease = self.token or "", self._lease
        async with _watchdog().changing([] if lease is None else [lease]):  # no renewal in flight undoes it
            sent_at = mod_time.monotonic()
            try:
                owned = await self.key.extend(token, new_ttl)
            except BaseException:  # cancelled or failed after the send: Redis may have set new_ttl
                if lease is not None and lease is self._lease:
                    _watchdog().reschedule(lease, new_ttl, sent_at, known=False)
                raise
            if not owned:
                self.lost.set()
                raise LockNotOwned(self.name)
            if lease is not None and lease is self._lease:
                _watchdog().reschedule(lease, new_ttl, sent_at)

    async def locked(self) -> bool:
        """Whether anyone holds the lock (one round trip)."""
        return await self.key.locked()

    async def owned(self) -> bool:
        """Whether this object holds the lock, as Redis sees it now (one round trip)."""
        if not self.held():
            return False
        return await self.key.owned(self.token)

    async def __aenter__(self) -> AsyncRedisLock:
        if not await self.acquire():
            holder, ttl = self.busy
            raise LockNotAcquired(self.name, holder, ttl)
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        with ending_block(self.name, exc):
            await self.release()
        landed, self._landed = self._landed, None
        if landed is not None and isinstance(exc, asyncio.CancelledError):
            raise landed from exc

    def lease_lost(self, lease: Lease) -> bool:
        """Called by the watchdog: set ``lost`` if ``lease`` is still this object's hold."""
        if self._lease is not lease:
            return False
        self.lost.set()
        return True

    def interrupted(self, landed: Exception) -> asyncio.Task[Any] | None:
        """Called by the watchdog: ``landed`` was raised in its task's own step (see the module
        docstring); this object's ``async with`` block raises it in place of the cancellation of
        the task that took the hold, returned for the watchdog to cancel (None: it has ended)."""
        self._landed = landed
        return self._task if self._task is not None and not self._task.done() else None


async def call_noting_resend(
    client: redis.asyncio.Redis, script: Script, keys: list[str], args: list[str | int]
) -> tuple[Any, bool]:
    """``script.call_async`` on one connection of ``client``'s pool, under that connection's retry
    policy; with whether the policy sent it again after an error that may have come after it ran
    (a reply lost with its connection), as ``Script``'s ``resending`` for a sync client. An
    exception that ends the exchange early drops the connection: its reply is never read by the
    next user."""
    if client.connection is not None:  # a single-connection client: its own lock and retries
        return await script.call_async(client, keys, args), False
    resent = False
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    async def run() -> Any:
        await connection.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return await connection.read_response()

    async def failed(_: Exception) -> None:
        nonlocal resent
        resent = True
        await connection.disconnect()

    try:
        try:
            return await connection.retry.call_with_retry(run, failed), resent
        except NoScriptError:
            await client.script_load(script.source)
            return await connection.retry.call_with_retry(run, failed), resent
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)


class AsyncOneKey:
    """Where an ``AsyncRedisLock``'s hold lives: the key ``name`` on ``client``, where waiters
    queue and are woken (see ``_scripts``); the asyncio twin of ``lock.OneServer``."""

    def __init__(self, client: redis.asyncio.Redis, name: str, wake_prefix: str) -> None:
        self.client, self.name, self.wake_prefix = client, name, wake_prefix

    def lease_key(self, token: str) -> str:
        """The key the watchdog renews for the hold just granted to ``token``."""
        return self.name

    async def acquire(self, attempt: Attempt, mode: str) -> Any:
        """Send ``attempt`` in ``mode``: the fence if granted, else [PTTL in ms, holder]."""
        return await ACQUIRE.call_async(self.client, [self.name], [attempt.member, mode])

    async def sleep(self, attempt: Attempt) -> Any:
        """Blocks until woken by a release, the holder's TTL runs out, or the deadline."""
        wait = attempt.pause()
        key = self.wake_prefix + attempt.token
        grace = reply_grace(self.client)
        reply = await call_with_timeout_async(self.client, wait + grace, "BLPOP", key, f"{wait:.3f}")
        return None if reply is None else reply[1]

    async def abandon(self, token: str, member: str) -> None:
        """Leave the queue, and release the hold if it was granted meanwhile; logs a failure."""
        try:
            await self.free(token, member)
        except Exception as exc:
            logger.warning(
                "lock %r: could not leave the waiter queue: %s",
                self.name,
                exc,
                extra=telemetry.log_fields(self.name, outcome="error"),
            )

    async def free(self, token: str, member: str = "") -> bool:
        """Release ``token``'s hold (and leave the queue as ``member``), owner-checked; whether
        ``token`` held it (also when the client's retry policy sent the release again after its
        first send freed it)."""
        released, resent = await call_noting_resend(self.client, RELEASE, [self.name], [token, member])
        return bool(int(released) or resent)

    async def extend(self, token: str, ttl: float) -> bool:
        """Set ``token``'s hold to ``ttl``, owner-checked; whether ``token`` held it."""
        return not await RENEW.call_async(self.client, [self.name], [to_ms(ttl), token])

    async def locked(self) -> bool:
        """Whether anyone holds the lock."""
        return bool(await self.client.exists(self.name))

    async def owned(self, token: str | None) -> bool:
        """Whether ``token`` holds the lock, now."""
        return owns(await self.client.get(self.name), token)


class _AsyncWatchdog(LeaseSet):
    """Renews one event loop's leases on one task; the contract of ``watchdog.Watchdog``.

    A renewal is bounded by half the lease's interval (``_redis.deadline``),
    so a stalled server cannot stop the task from reporting a loss in time.
    """

    def __init__(self) -> None:
        super().__init__()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        #: notified when renewals land
        self._landed = asyncio.Condition()

    def add(self, lease: Lease, sent_at: float) -> None:
        late = self.track(lease, sent_at)
        if self._task is None:
            self._start()
        elif late:
            self._wake.set()

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="celery-redislock-watchdog")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The task ended: when leases are left (it was cancelled by code cancelling tasks it does
        not own), another one takes over, so that no hold goes unrenewed and unreported, as
        another thread takes over from the watchdog thread; not when every task is being
        cancelled (``asyncio.run`` ending: an unreleased hold is left to expire)."""
        if self._task is task:
            self._task = None
            if self.leases and not all(_being_cancelled(other) for other in asyncio.all_tasks()):
                self._start()

    async def discard(self, lease: Lease) -> None:
        self.drop(lease)
        if not self.leases:
            self._wake.set()  # the task ends now, not when its next renewal would have been due
        await self._await_landing(lease)

    @contextlib.asynccontextmanager
    async def changing(self, leases: list[Lease]) -> AsyncIterator[None]:
        for lease in leases:
            lease.changing = True
        try:
            for lease in leases:
                await self._await_landing(lease)
            yield
        finally:
            for lease in leases:
                lease.changing = False
            self._wake.set()  # one may be due: the task did not count it

    async def _await_landing(self, lease: Lease) -> None:
        if not lease.in_flight:
            return
        async with self._landed:
            try:
                async with deadline(lease.interval):
                    await self._landed.wait_for(lambda: not lease.in_flight)
            except asyncio.TimeoutError:
                landing_late(lease)

    def reschedule(self, lease: Lease, ttl: float, sent_at: float, known: bool = True) -> None:
        if self.retime(lease, ttl, sent_at, known):
            self._wake.set()

    async def _run(self) -> None:
        while self.leases:
            try:
                now = mod_time.monotonic()
                earliest = self.next_due()
                if earliest > now:
                    self._wake.clear()
                    self.wake_at = earliest
                    with contextlib.suppress(asyncio.TimeoutError):
                        async with deadline(None if earliest == inf else earliest - now):
                            await self._wake.wait()
                    continue
                self.wake_at = inf
                due = self.pick(now)
                try:
                    await self._renew(due)
                finally:
                    await self._land(due)  # also when renewing failed unexpectedly
            except Exception as exc:  # the task must survive anything; see the module docstring
                self._pass_on(exc)
                await asyncio.sleep(0.1)

    def _pass_on(self, landed: Exception) -> None:
        """``landed`` was raised in the task's own step, not by Redis: an interrupt (a soft time
        limit) or a bug. The tasks holding the leases are cancelled (each once), and their locks'
        ``async with`` blocks raise it (``AsyncRedisLock.interrupted``)."""
        holders = {
            task
            for lease in self.leases
            if isinstance(lock := lease.owner(), AsyncRedisLock) and (task := lock.interrupted(landed))
        }
        logger.error(
            "celery-redislock async watchdog: %r raised in its task; passed on to %d task(s) holding locks",
            landed,
            len(holders),
            exc_info=landed,
            extra=telemetry.log_fields(outcome="error"),
        )
        for task in holders:
            task.cancel(f"celery-redislock: {landed!r} raised in the watchdog task")

    async def _renew(self, leases: list[Lease]) -> None:
        renewals = [
            self._renew_batch(batch, ttl_ms)
            for (_, _, ttl_ms), batches in self.batches(leases).items()
            for batch in batches
        ]
        # each to its end, also when another raised: none is left in flight when they land
        results = await asyncio.gather(*renewals, return_exceptions=True)
        await self._land(leases)  # all answered: the losses are reported with no renewal in flight
        for lost in results:
            for lease, reason in [] if isinstance(lost, BaseException) else lost:
                self._report(lease, reason)
        for raised in results:
            if isinstance(raised, BaseException):
                raise raised

    async def _renew_batch(self, batch: list[Lease], ttl_ms: int) -> list[tuple[Lease, str]]:
        sent_at = mod_time.monotonic()
        keys, tokens = [lease.key for lease in batch], [lease.token for lease in batch]
        try:
            async with deadline(batch[0].interval / 2):
                not_owned = await RENEW.call_async(batch[0].client, keys, [ttl_ms, *tokens])
        except Exception as exc:  # unreachable, stalled, refusing: retried until the leases run out
            found = failed_renewal(batch, exc, "celery-redislock async watchdog")
            if not isinstance(exc, (*FAILURES, asyncio.TimeoutError)):  # maybe one that landed here
                self._pass_on(exc)
            return found
        return renewal_answered(batch, ttl_ms, sent_at, not_owned)

    async def _land(self, leases: list[Lease]) -> None:
        for lease in leases:
            lease.in_flight = False
        async with self._landed:
            self._landed.notify_all()

    def _report(self, lease: Lease, reason: str) -> None:
        if lease.cancelled:  # released meanwhile: nothing was lost
            return
        self.drop(lease)
        lock = mark_lost(lease)
        if lock is not None:
            announce_loss(lock, reason)


def _being_cancelled(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` is being cancelled (``Task.cancelling``, Python 3.11+; before: say no)."""
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() > 0


#: The watchdog of each running event loop (by contract, one per loop).
_watchdogs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncWatchdog] = weakref.WeakKeyDictionary()


def _watchdog() -> _AsyncWatchdog:
    """The running event loop's watchdog, created on first use."""
    loop = asyncio.get_running_loop()
    watchdog = _watchdogs.get(loop)
    if watchdog is None:
        watchdog = _watchdogs[loop] = _AsyncWatchdog()
    return watchdog
