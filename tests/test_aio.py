"""AsyncRedisLock on a real redis-server: the sync lock's semantics, its watchdog task, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.connection
from celery.exceptions import SoftTimeLimitExceeded

import celery_redislock.aio as aio_module
import celery_redislock.watchdog as watchdog_module
from celery_redislock import (
    AsyncRedisLock,
    LockConfigurationError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    RedisLock,
)
from celery_redislock._scripts import ACQUIRE, RELEASE, RENEW
from celery_redislock.lock import companion_key
from celery_redislock.testing import RedisServer
from celery_redislock.watchdog import Lease
from tests.conftest import blocked_clients, busy_for
from tests.taskapp import LEASE


def run(redis_server: RedisServer, body: Callable[[redis.asyncio.Redis], Awaitable[None]]) -> None:
    """Run ``body(client)`` on a fresh event loop with an asyncio client of ``redis_server``."""

    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
        try:
            await body(client)
        finally:
            await client.aclose()

    asyncio.run(main())


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 10
    while not await condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)  # poll the condition against the deadline


def test_a_waiter_answered_late_by_a_busy_server_goes_on_waiting(
    redis_server: RedisServer, prefix: str
) -> None:
    """``test_lock_edges``' test of the same name, for ``AsyncRedisLock``: the BLPOP's reply,
    late behind another client's long command, is waited for (the client has no
    ``socket_timeout``: ``REPLY_GRACE``, 5 s), and the waiter is handed the lock."""
    name = f"{prefix}:k"

    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisLock(client, name, ttl=30, watchdog=False)
        waiter = AsyncRedisLock(client, name, ttl=1, fair=True)
        await holder.acquire()
        waiting = asyncio.ensure_future(waiter.acquire(timeout=60))
        sync_client = redis_server.client()
        await until(lambda: asyncio.to_thread(lambda: blocked_clients(sync_client) > 0), "the waiter's BLPOP")
        await asyncio.to_thread(busy_for(redis_server, 2.5).join)
        await holder.release()  # handed to the waiter, if it still waits
        assert await waiting
        assert await waiter.owned()
        await waiter.release()
        sync_client.close()

    run(redis_server, body)


def test_acquire_release_and_the_sync_lock_share_the_key(redis_server: RedisServer, prefix: str) -> None:
    name = f"{prefix}:k"
    sync_client = redis_server.client()

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, name, ttl=10)
        assert not await lock.locked() and not await lock.owned()
        assert await lock.acquire(blocking=False)
        assert lock.token is not None and isinstance(lock.fence, int)
        assert await lock.locked() and await lock.owned()
        assert 0 < sync_client.pttl(name) <= 10_000
        assert not RedisLock(sync_client, name).acquire(blocking=False)  # one key, sync or async
        assert not await AsyncRedisLock(client, name).acquire(blocking=False)
        assert await lock.acquire()  # re-entrant: no round trip, a hold count
        await lock.release()
        assert await lock.owned()
        await lock.release()
        assert lock.token is None and sync_client.exists(name) == 0
        with pytest.raises(LockNotOwned):
            await lock.release()
        with pytest.raises(LockNotOwned):
            await lock.extend()
        sync_lock = RedisLock(sync_client, name, ttl=10)
        sync_lock.acquire()
        other = AsyncRedisLock(client, name, ttl=10)
        assert await other.acquire(timeout=0.05) is False
        assert other.busy[0] is not None  # the holder, for LockNotAcquired
        sync_lock.release()
        fences = []
        for _ in range(3):
            async with AsyncRedisLock(client, name, ttl=10) as held:
                fences.append(held.fence)
        assert fences == sorted(set(fences))

    run(redis_server, body)


def test_bad_input_names_the_argument(redis_server: RedisServer, prefix: str) -> None:
    with pytest.raises(LockConfigurationError, match=r"client must be a redis\.asyncio\.Redis"):
        AsyncRedisLock(redis_server.client(), f"{prefix}:k")  # type: ignore[arg-type]

    async def body(client: redis.asyncio.Redis) -> None:
        with pytest.raises(LockConfigurationError, match="name"):
            AsyncRedisLock(client, "")
        with pytest.raises(LockConfigurationError, match="ttl"):
            AsyncRedisLock(client, f"{prefix}:k", ttl=0.1)
        with pytest.raises(LockConfigurationError, match="timeout"):
            await AsyncRedisLock(client, f"{prefix}:k").acquire(blocking=False, timeout=1)

    run(redis_server, body)


@pytest.mark.parametrize("fair", [False, True], ids=["unfair", "fair"])
def test_a_waiter_is_woken_by_the_release(redis_server: RedisServer, prefix: str, fair: bool) -> None:
    name = f"{prefix}:k"

    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisLock(client, name, ttl=30, fair=fair)
        waiter = AsyncRedisLock(client, name, ttl=30, fair=fair)
        await holder.acquire()
        waiting = asyncio.ensure_future(waiter.acquire(timeout=20))
        await until(lambda: _queued(client, name), "the waiter queued")
        released_at = time.monotonic()
        await holder.release()
        assert await waiting
        assert time.monotonic() - released_at < 5  # woken, not timed out at the holder's 30 s TTL
        assert waiter.fence is not None and holder.fence is None
        await waiter.release()
        assert not await waiter.locked()

    run(redis_server, body)


async def _queued(client: redis.asyncio.Redis, name: str) -> bool:
    return bool(await client.zcard(companion_key(name, "queue")))


def test_the_watchdog_task_renews_and_reports_a_loss(redis_server: RedisServer, prefix: str) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        kept, deleted = (
            AsyncRedisLock(client, f"{prefix}:kept", ttl=LEASE),
            AsyncRedisLock(client, f"{prefix}:deleted", ttl=0.6),
        )
        await kept.acquire()
        await deleted.acquire()
        assert any(task.get_name() == "celery-redislock-watchdog" for task in asyncio.all_tasks())
        await client.delete(f"{prefix}:deleted")
        await asyncio.wait_for(deleted.lost.wait(), 5)  # reported within one renewal interval
        with pytest.raises(LockLost):
            await deleted.acquire()
        with pytest.raises(LockNotOwned):
            await deleted.release()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(kept.lost.wait(), 1.5 * LEASE)  # four intervals: renewed all along
        assert await kept.owned() and 0 < await client.pttl(f"{prefix}:kept") <= LEASE * 1000
        await kept.extend(2 * LEASE)
        assert LEASE * 1000 < await client.pttl(f"{prefix}:kept") <= 2 * LEASE * 1000
        await kept.release()
        assert len(aio_module._watchdog()) == 0
        await until(lambda: _watchdog_gone(), "the watchdog task ended with the last hold")

    run(redis_server, body)


async def _watchdog_gone() -> bool:
    return all(task.get_name() != "celery-redislock-watchdog" for task in asyncio.all_tasks())


async def renewed_async(client: redis.asyncio.Redis, key: str, lock: AsyncRedisLock) -> None:
    """Wait until the watchdog task renews ``key`` (its PTTL, which otherwise only falls, goes up);
    fails at once if it ran out under ``lock``, its owner."""
    lowest = await client.pttl(key)

    async def went_up() -> bool:
        nonlocal lowest
        now = await client.pttl(key)
        assert now > 0, f"the hold ran out under its owner, unrenewed (lost set: {lock.lost.is_set()})"
        lowest, rose = min(lowest, now), now > lowest
        return rose

    await until(went_up, f"a renewal of {key}")


@pytest.mark.parametrize("when", ["before its first step", "while it waits"])
def test_a_cancelled_watchdog_task_is_replaced_while_holds_are_left(
    redis_server: RedisServer, prefix: str, when: str
) -> None:
    """Code that cancels tasks it does not own (a shutdown handler cancelling "every other task")
    cancels the watchdog task while a lock is held: another task takes over, and the hold is
    still renewed, as the watchdog thread is when an interrupt ends it. Else the hold runs out
    under its owner, ``lost`` never set; cancelled before its first step, the task never ran
    the code that forgets it, and no lock of that event loop was renewed again."""
    name = f"{prefix}:k"

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, name, ttl=LEASE)
        assert await lock.acquire()
        if when == "while it waits":
            await asyncio.sleep(0)  # the task, scheduled first, takes its first step: it waits
        (task,) = [task for task in asyncio.all_tasks() if task.get_name() == "celery-redislock-watchdog"]
        task.cancel()
        await renewed_async(client, name, lock)
        later = AsyncRedisLock(client, f"{name}:later", ttl=LEASE)
        assert await later.acquire()
        await renewed_async(client, f"{name}:later", later)
        assert not lock.lost.is_set() and not later.lost.is_set()
        await lock.release()
        await later.release()
        await until(_watchdog_gone, "the watchdog task ended with the last hold")

    run(redis_server, body)


@pytest.mark.parametrize("where", ["as it picks the leases due", "as a renewal's reply is read"])
def test_a_soft_time_limit_landing_in_the_watchdog_task_reaches_the_holder(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Every task of an event loop runs on the main thread, where Celery's soft time limit is
    raised (by a signal handler, in whatever runs then). One that lands in the watchdog task's
    own step is neither swallowed as the watchdog's error nor taken for a failed renewal: the
    task holding the lock is cancelled, and its ``async with`` block ends with the soft time
    limit once it released the lock; the watchdog task goes on renewing. Swallowed, the limit
    never reached the body, which ran on, its lock renewed, until the hard time limit."""
    name = f"{prefix}:k"
    fired: list[int] = []
    real_renew = type(RENEW).call_async

    async def renew_lost(self: Any, client: Any, keys: Any, args: Any) -> Any:
        reply = await real_renew(self, client, keys, args)
        if self is RENEW and name in keys and not fired:
            fired.append(1)
            raise SoftTimeLimitExceeded()  # landed as the reply was read: the renewal applied
        return reply

    async def body(client: redis.asyncio.Redis) -> None:
        watchdog = aio_module._watchdog()
        real_pick = watchdog.pick

        def pick(now: float) -> list[Lease]:
            if not fired:
                fired.append(1)
                raise SoftTimeLimitExceeded()
            return real_pick(now)

        if where == "as it picks the leases due":
            monkeypatch.setattr(watchdog, "pick", pick)
        else:
            monkeypatch.setattr(type(RENEW), "call_async", renew_lost)
        lock = AsyncRedisLock(client, name, ttl=LEASE)
        entered, forever = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with lock:
                entered.set()
                await forever.wait()

        holder = asyncio.ensure_future(hold())
        await asyncio.wait_for(entered.wait(), 30)
        with pytest.raises(SoftTimeLimitExceeded):
            await asyncio.wait_for(holder, 30)
        assert fired and not lock.held() and await client.exists(name) == 0

        async def hold_later() -> None:
            later = AsyncRedisLock(client, f"{name}:later", ttl=LEASE)
            assert await later.acquire()
            await renewed_async(client, f"{name}:later", later)
            await later.release()

        await asyncio.wait_for(asyncio.ensure_future(hold_later()), 30)
        await until(_watchdog_gone, "the watchdog task ended with the last hold")

    run(redis_server, body)


def test_a_renewal_that_raises_what_is_not_a_redis_failure_is_still_a_failed_renewal(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal that raises something other than a Redis failure (a bug, or an interrupt that
    landed in it), tick after tick: passed on to the holders (none here: the task that took the
    lock has ended), and a failed renewal all the same, so the lock is found lost once its lease
    runs out, not renewed by no one while its owner believes it held."""
    name = f"{prefix}:k"
    real_renew = type(RENEW).call_async

    async def broken(self: Any, client: Any, keys: Any, args: Any) -> Any:
        if self is RENEW and name in keys:
            raise ValueError("a renewal's bug")
        return await real_renew(self, client, keys, args)

    async def body(client: redis.asyncio.Redis) -> None:
        monkeypatch.setattr(type(RENEW), "call_async", broken)
        lock = AsyncRedisLock(client, name, ttl=1.5)
        assert await asyncio.ensure_future(lock.acquire())
        await asyncio.wait_for(lock.lost.wait(), 30)
        with pytest.raises(LockNotOwned):
            await lock.release()
        await until(_watchdog_gone, "the watchdog task ended with the last hold")

    run(redis_server, body)


def test_an_extend_is_not_undone_by_a_renewal_in_flight(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog task has picked a lease for renewal (6 s) and not sent it yet when its owner
    extends the lock to 60 s: the renewal, sent afterwards, must not bring the TTL back to 6 s.
    (extend() waits for the renewal in flight to land, and keeps the lease from being picked.)"""
    key = f"{prefix}:k"

    async def body(client: redis.asyncio.Redis) -> None:
        picked, go, landed, owner_waits = (asyncio.Event() for _ in range(4))
        watchdog = aio_module._watchdog()
        renew_batch, await_landing = watchdog._renew_batch, getattr(watchdog, "_await_landing", None)

        async def held_renew_batch(batch: list[Lease], ttl_ms: int) -> Any:
            if picked.is_set() or all(lease.key != key for lease in batch):
                return await renew_batch(batch, ttl_ms)
            picked.set()
            await go.wait()
            try:
                return await renew_batch(batch, ttl_ms)
            finally:
                landed.set()

        async def waits(*args: Any) -> Any:
            owner_waits.set()
            assert await_landing is not None
            return await await_landing(*args)

        monkeypatch.setattr(watchdog, "_renew_batch", held_renew_batch)
        monkeypatch.setattr(watchdog, "_await_landing", waits, raising=False)
        lock = AsyncRedisLock(client, key, ttl=6)
        assert await lock.acquire()
        await asyncio.wait_for(picked.wait(), 30)
        extend = asyncio.ensure_future(lock.extend(60))
        await until(lambda: _either(owner_waits.is_set(), extend.done()), "the extend")
        go.set()
        await asyncio.wait_for(extend, 30)
        await asyncio.wait_for(landed.wait(), 30)
        assert await client.pttl(key) > 50_000
        await lock.release()

    run(redis_server, body)


async def _either(*conditions: bool) -> bool:
    return any(conditions)


def test_the_watchdog_task_renews_at_most_batch_leases_per_call(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the thread's, the task's script calls carry at most ``BATCH`` leases each."""
    monkeypatch.setattr(watchdog_module, "BATCH", 2)
    sizes: list[int] = []

    async def body(client: redis.asyncio.Redis) -> None:
        watchdog = aio_module._watchdog()
        renew_batch = watchdog._renew_batch

        async def counted(batch: list[Lease], ttl_ms: int) -> Any:
            sizes.append(len(batch))
            return await renew_batch(batch, ttl_ms)

        monkeypatch.setattr(watchdog, "_renew_batch", counted)
        locks = [AsyncRedisLock(client, f"{prefix}:{i}", ttl=LEASE) for i in range(5)]
        for lock in locks:
            assert await lock.acquire()
        await until(lambda: _either(sum(sizes) >= 10), "two rounds of renewals")
        for lock in locks:
            await lock.release()

    run(redis_server, body)
    assert max(sizes) == 2


def test_without_watchdog_the_lease_expires(redis_server: RedisServer, prefix: str) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, f"{prefix}:k", ttl=0.2, watchdog=False)
        await lock.acquire()
        waiter = AsyncRedisLock(client, f"{prefix}:k", ttl=5)
        assert await waiter.acquire(timeout=5)  # woken at the holder's TTL, not by a release
        with pytest.raises(LockNotOwned):
            await lock.release()
        await waiter.release()

    run(redis_server, body)


def test_context_manager_raises_lock_not_acquired(redis_server: RedisServer, prefix: str) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisLock(client, f"{prefix}:k", holder="the holder")
        await holder.acquire()
        with pytest.raises(LockNotAcquired) as busy:
            async with AsyncRedisLock(client, f"{prefix}:k", timeout=0.1):
                pass
        assert busy.value.holder == "the holder" and busy.value.ttl is not None
        await holder.release()

    run(redis_server, body)


# -- cancellation ---------------------------------------------------------------


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> dict[str, asyncio.Event]:
    """Scripts named in the dict, once their reply is in, wait for the event before returning it."""
    gates: dict[str, asyncio.Event] = {}
    real, real_noting = type(ACQUIRE).call_async, aio_module.call_noting_resend

    async def hold(script: Any, reply: Any) -> Any:
        which = "acquire" if script is ACQUIRE else "release" if script is RELEASE else "other"
        if which in gates:
            gates[which + " reached"].set()
            await gates[which].wait()  # the caller is cancelled here, after Redis acted
        return reply

    async def gated(self: Any, client: Any, keys: Any, args: Any) -> Any:
        return await hold(self, await real(self, client, keys, args))

    async def gated_noting(client: Any, script: Any, keys: Any, args: Any) -> Any:
        return await hold(script, await real_noting(client, script, keys, args))

    monkeypatch.setattr(type(ACQUIRE), "call_async", gated)
    monkeypatch.setattr(aio_module, "call_noting_resend", gated_noting)  # the release's way
    return gates


def test_cancelled_after_the_grant_releases_the_lock(
    redis_server: RedisServer, prefix: str, gate: dict[str, asyncio.Event]
) -> None:
    name = f"{prefix}:k"

    async def body(client: redis.asyncio.Redis) -> None:
        gate["acquire"], gate["acquire reached"] = asyncio.Event(), asyncio.Event()
        lock = AsyncRedisLock(client, name, ttl=30)
        attempt = asyncio.ensure_future(lock.acquire())
        await gate["acquire reached"].wait()
        assert await client.exists(name) == 1  # granted in Redis...
        attempt.cancel()  # ...and cancelled before the caller saw it
        await asyncio.sleep(0)
        gate["acquire"].set()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        assert lock.token is None and await client.exists(name) == 0

    run(redis_server, body)


def test_cancelled_by_a_timeout_while_waiting_leaves_nothing(redis_server: RedisServer, prefix: str) -> None:
    name = f"{prefix}:k"

    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisLock(client, name, ttl=30)
        await holder.acquire()
        waiter = AsyncRedisLock(client, name, ttl=30, fair=True)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(waiter.acquire(), 0.3)  # cancelled while blocked on its wake list
        assert not await _queued(client, name)
        assert await client.exists(companion_key(name, "waiters")) == 0
        await holder.release()
        assert await client.exists(name) == 0  # nothing handed to the gone waiter

    run(redis_server, body)


def test_cancelled_after_a_fair_hand_over_releases_it(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"{prefix}:k"

    async def deaf(*args: Any) -> None:
        await asyncio.Event().wait()  # never reads its wake list: the hand-over goes unseen

    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisLock(client, name, ttl=30, fair=True)
        await holder.acquire()
        waiter = AsyncRedisLock(client, name, ttl=30, fair=True, holder="the waiter")
        monkeypatch.setattr(waiter.key, "sleep", deaf)
        attempt = asyncio.ensure_future(waiter.acquire())
        await until(lambda: _queued(client, name), "the waiter queued")
        await holder.release()  # hands the lock to the waiter
        value = await client.get(name)
        assert isinstance(value, bytes) and value.endswith(b":the waiter")
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        assert await client.exists(name) == 0 and not await _queued(client, name)

    run(redis_server, body)


def test_cancelled_during_release_still_releases(
    redis_server: RedisServer, prefix: str, gate: dict[str, asyncio.Event]
) -> None:
    name = f"{prefix}:k"

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, name, ttl=30)
        await lock.acquire()
        gate["release"], gate["release reached"] = asyncio.Event(), asyncio.Event()
        releasing = asyncio.ensure_future(lock.release())
        await gate["release reached"].wait()
        releasing.cancel()
        await asyncio.sleep(0)
        gate["release"].set()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        assert lock.token is None and not lock.held()  # the object knows it is released
        assert await client.exists(name) == 0
        assert await lock.acquire(blocking=False)  # and can take it again
        await lock.release()

    run(redis_server, body)


@pytest.mark.parametrize("fair", [False, True], ids=["woken", "handed-over"])
def test_a_cancel_landing_as_the_wake_reply_is_read_still_cancels_the_acquire(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, fair: bool
) -> None:
    """The waiter's task is cancelled while its BLPOP reply (a "retry" wake, or a fair
    hand-over's fence) is being read. The module contract: a cancelled acquire raises
    CancelledError and leaves no lock held (a cancel refused, the acquire having returned,
    leaves it held). ``call_with_timeout_async`` reads the reply under
    ``asyncio.wait_for``, which on Python < 3.12 returns the inner result and drops the
    cancellation when the inner read is already done: the acquire goes on and takes the lock."""
    name = f"{prefix}:k"
    wake_prefix = companion_key(name, "wake:").encode()
    armed: dict[str, asyncio.Task[Any]] = {}
    accepted: list[bool] = []  # what task.cancel() answered: True, the task was still running
    real = redis.asyncio.connection.AbstractConnection.read_response

    async def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        reply = await real(self, *args, **kwargs)
        is_wake = isinstance(reply, list) and len(reply) == 2 and bytes(reply[0]).startswith(wake_prefix)
        if is_wake and "task" in armed:
            # the cancel (any callback's: a timeout, another task) lands before the reader resumes
            task = armed.pop("task")
            asyncio.get_running_loop().call_soon(lambda: accepted.append(task.cancel()))
        return reply

    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisLock(client, name, ttl=30, fair=fair)
        await holder.acquire()
        waiter = AsyncRedisLock(client, name, ttl=30, fair=fair, holder="the waiter")
        monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "read_response", read_response)
        attempt = asyncio.ensure_future(waiter.acquire())
        await until(lambda: _queued(client, name), "the waiter queued")
        armed["task"] = attempt
        await holder.release()  # wakes the waiter (fair: hands the lock over to it)
        outcome: bool | str
        try:
            outcome = await attempt
        except asyncio.CancelledError:
            outcome = "cancelled"
        held_by_waiter = waiter.held()
        if held_by_waiter:
            await waiter.release()  # clean up for the next tests
        assert accepted, "the wake reply was never read"
        if accepted == [True]:  # cancel() accepted while acquire() was running: it must be cancelled
            assert outcome == "cancelled", f"acquire() returned {outcome!r} after task.cancel() returned True"
            assert not held_by_waiter
        else:  # refused: acquire() had returned already, holding the lock
            assert outcome is True and held_by_waiter

    run(redis_server, body)


def test_a_cancelled_shortening_extend_does_not_let_the_hold_expire_under_its_owner(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extend(0.4) on a watchdog-renewed 3 s lock is cancelled as its reply is read (Redis
    applied it). The watchdog keeps its old schedule (next renewal up to 1 s later), so the key
    expires after 0.4 s while its owner holds it and ``lost`` is not set: a second holder."""
    name = f"{prefix}:k"
    real = type(RENEW).call_async
    armed = {"extend": True}

    async def cancelled_as_read(self: Any, client: Any, keys: Any, args: Any) -> Any:
        reply = await real(self, client, keys, args)
        if self is RENEW and list(keys) == [name] and args[0] == 400 and armed.pop("extend", False):
            raise asyncio.CancelledError  # cancelled while its reply is read: Redis applied it
        return reply

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, name, ttl=3)
        assert await lock.acquire()
        monkeypatch.setattr(type(RENEW), "call_async", cancelled_as_read)
        with pytest.raises(asyncio.CancelledError):
            await lock.extend(0.4)
        other = AsyncRedisLock(client, name, ttl=30)
        got = await other.acquire(timeout=1.5)
        lost_then = lock.lost.is_set()
        if got:
            await other.release()
        with pytest.raises(LockNotOwned) if got else contextlib.nullcontext():
            await lock.release()
        assert not got, f"a second holder took the key while the first held it (its lost set: {lost_then})"

    run(redis_server, body)


def test_a_release_retried_after_a_lost_reply_counts_as_released_as_the_sync_lock_does(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release ran in Redis but its reply was lost (ConnectionError once the client's
    retries are spent): ``release()`` raises and keeps the hold so it can be retried. The sync
    lock's retry counts the key found gone as released (``_released_maybe``); the async one
    raises LockNotOwned, as if the lock had been lost, though its own release freed it."""
    name = f"{prefix}:k"

    # the sync lock, for reference: the retry is a release
    sync_client = redis_server.client()
    sync_lock = RedisLock(sync_client, f"{name}:sync", ttl=30)
    assert sync_lock.acquire()
    real_free = sync_lock.servers.free

    def sync_lost_reply(token: str) -> bool:
        real_free(token)
        raise redis.exceptions.ConnectionError("reply lost")

    monkeypatch.setattr(sync_lock.servers, "free", sync_lost_reply)
    with pytest.raises(redis.exceptions.ConnectionError):
        sync_lock.release()
    monkeypatch.setattr(sync_lock.servers, "free", real_free)
    sync_lock.release()  # no LockNotOwned
    sync_client.close()

    real = aio_module.call_noting_resend
    armed = {"release": True}

    async def lost_reply(client: Any, script: Any, keys: Any, args: Any) -> Any:
        reply = await real(client, script, keys, args)
        if script is RELEASE and armed.pop("release", False):
            raise redis.exceptions.ConnectionError("reply lost")  # it ran; its reply did not come
        return reply

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, name, ttl=30)
        assert await lock.acquire()
        monkeypatch.setattr(aio_module, "call_noting_resend", lost_reply)
        with pytest.raises(redis.exceptions.ConnectionError):
            await lock.release()
        assert await client.exists(name) == 0  # the first release freed it
        assert lock.held()  # kept, so that release() can be tried again
        await lock.release()  # LockNotOwned here: the retry finds the key its first try freed
        assert not lock.held()

    run(redis_server, body)


def test_an_acquire_by_another_task_during_the_last_release_does_not_reenter_a_freed_hold(
    redis_server: RedisServer, prefix: str
) -> None:
    """As ``test_lock_edges``' threads, for asyncio tasks sharing one lock object: task B's
    ``acquire()`` while task A's last ``release()`` is on its way to Redis takes a hold of its
    own (after the release), never re-enters the one being freed."""
    name = f"{prefix}:k"

    async def body(client: redis.asyncio.Redis) -> None:
        shared = AsyncRedisLock(client, name, ttl=5)
        assert await shared.acquire()
        real_free = shared.key.free
        entered: list[asyncio.Task[bool]] = []

        async def free(token: str, member: str = "") -> bool:
            if not entered:  # B's acquire lands between A's decision to free and the RELEASE
                entered.append(asyncio.ensure_future(shared.acquire(timeout=10)))

                async def landed() -> bool:  # returned (re-entered), or queued for the key
                    return entered[0].done() or await _queued(client, name)

                await until(landed, "B's acquire")
            return await real_free(token, member)

        shared.key.free = free  # type: ignore[method-assign]
        await shared.release()  # task A's last release
        assert await entered[0]  # B holds the lock...
        other = AsyncRedisLock(client, name, ttl=5)
        assert not await other.acquire(blocking=False), "...and a second owner took the key B holds"
        await shared.release()

    run(redis_server, body)
