"""AsyncRedisSemaphore on a real redis-server: the sync semaphore's semantics and permits, on asyncio."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.asyncio.connection import AbstractConnection

from celery_redislock import (
    AsyncRedisLock,
    AsyncRedisSemaphore,
    LockConfigurationError,
    LockNotAcquired,
    LockNotOwned,
    RedisSemaphore,
)
from celery_redislock._permit_scripts import RELEASE_PERMIT
from celery_redislock._scripts import RELEASE, Script
from celery_redislock.lock import companion_key
from celery_redislock.signals import lock_lost
from celery_redislock.testing import RedisServer
from tests import invariants
from tests.conftest import calls_since, command_calls
from tests.taskapp import LEASE
from tests.test_aio import run, until


def test_permits_owner_checks_and_the_sync_semaphore_count_together(
    redis_server: RedisServer, prefix: str
) -> None:
    name = f"{prefix}:s"
    sync_client = redis_server.client()

    async def body(client: redis.asyncio.Redis) -> None:
        first = AsyncRedisSemaphore(client, name, 2, ttl=10)
        assert not await first.locked() and not await first.owned()
        assert await first.acquire(blocking=False)
        other = RedisSemaphore(sync_client, name, 2, ttl=10)  # a sync holder takes the second
        assert other.acquire(blocking=False)
        assert other.fence is not None and first.fence is not None and other.fence > first.fence
        assert await first.locked() and await first.owned()
        third = AsyncRedisSemaphore(client, name, 2, ttl=10)
        assert not await third.acquire(blocking=False)
        async with first:  # re-entrant
            assert first.hold_count == 2
        with pytest.raises(LockNotAcquired):
            async with AsyncRedisSemaphore(client, name, 2, ttl=10, timeout=0.05):
                pass
        await first.extend(60)
        key = first.key.book.key_of(first.token)
        assert key is not None and 10_000 < await client.pttl(key) <= 60_000
        await client.delete(key)  # as if its lease ran out unrenewed
        assert await third.acquire(blocking=False)
        with pytest.raises(LockNotOwned):
            await first.extend()
        assert first.lost.is_set()
        with pytest.raises(LockNotOwned):
            await first.release()
        assert await third.owned()
        await third.release()
        other.release()

    try:
        run(redis_server, body)
    finally:
        sync_client.close()


def test_the_watchdog_task_renews_a_permit_past_its_lease(redis_server: RedisServer, prefix: str) -> None:
    name = f"{prefix}:s"

    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisSemaphore(client, name, 1, ttl=LEASE)
        assert await holder.acquire()
        waiter = AsyncRedisSemaphore(client, name, 1, ttl=LEASE)
        assert not await waiter.acquire(timeout=1.5 * LEASE)
        assert await holder.owned()
        await holder.release()

    run(redis_server, body)
    with redis_server.client() as client:
        assert invariants.keys_of(client, prefix) == []


@pytest.mark.parametrize("fair", [False, True], ids=["first-come", "fair"])
def test_a_waiter_is_woken_by_a_release_not_by_polling(
    redis_server: RedisServer, prefix: str, fair: bool
) -> None:
    name = f"{prefix}:s"
    counter = redis_server.client()

    async def queued() -> bool:
        return bool(counter.zcard(companion_key(name, "queue")) == 1)

    async def body(client: redis.asyncio.Redis) -> None:
        warm = AsyncRedisSemaphore(client, f"{name}-warm", 1, ttl=60, fair=fair)
        assert await warm.acquire()  # its scripts loaded: a fresh server's NOSCRIPT resend is not counted
        await warm.release()
        holder = AsyncRedisSemaphore(client, name, 1, ttl=60, fair=fair)
        assert await holder.acquire()
        before = command_calls(counter)
        waiter = AsyncRedisSemaphore(client, name, 1, ttl=60, fair=fair)
        acquiring = asyncio.ensure_future(waiter.acquire(timeout=30))
        await until(queued, "the waiter queued")
        await holder.release()
        assert await acquiring
        calls = calls_since(counter, before)
        assert calls["blpop"] == 1 and calls["evalsha"] == (2 if fair else 3)
        await waiter.release()

    try:
        run(redis_server, body)
    finally:
        counter.close()


def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing(
    redis_server: RedisServer, prefix: str
) -> None:
    name = f"{prefix}:s"

    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisSemaphore(client, name, 1, ttl=30, fair=True)
        assert await holder.acquire()
        waiter = AsyncRedisSemaphore(client, name, 1, ttl=30, fair=True)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(waiter.acquire(), 0.3)  # cancelled while blocked on its wake list
        assert await client.zcard(companion_key(name, "queue")) == 0
        await holder.release()
        assert await client.exists(companion_key(name, "permit:1")) == 0  # nothing handed to the gone waiter

    run(redis_server, body)
    with redis_server.client() as client:
        assert invariants.keys_of(client, prefix) == []


def test_a_bad_limit_is_refused_and_writes_nothing(redis_server: RedisServer, prefix: str) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        with pytest.raises(LockConfigurationError, match="limit must be an int from 1 to 1000, got 0"):
            AsyncRedisSemaphore(client, f"{prefix}:s", 0)
        with pytest.raises(LockConfigurationError, match=r"client must be a redis\.asyncio\.Redis"):
            AsyncRedisSemaphore(redis.Redis(host="127.0.0.1", port=redis_server.port), f"{prefix}:s", 2)  # type: ignore[arg-type]

    run(redis_server, body)
    with redis_server.client() as client:
        assert invariants.keys_of(client, prefix) == []
    with redis_server.client() as checker:
        assert invariants.keys_of(checker, prefix) == []


def lose_first_async_reply(monkeypatch: pytest.MonkeyPatch, script: Script) -> list[Any]:
    """``tests.test_attempts.first_reply_lost`` for asyncio connections, until the test ends: the
    first reply to ``script`` is read, then lost as with a dropped connection, so the retry policy
    sends it again. Returns the lost replies."""
    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response
    doomed: list[AbstractConnection] = []  # the connection that sends the script first
    lost: list[Any] = []

    async def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        parts = command if isinstance(command, list) else [command]
        if not doomed and script.sha.encode() in b"".join(parts):
            doomed.append(self)
        await send(self, command, check_health)

    async def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        reply = await read(self, *args, **kwargs)
        if lost or doomed != [self]:  # one reply lost, that of the script's first send
            return reply
        lost.append(reply)
        raise redis.ConnectionError("the reply was lost (test seam)")

    monkeypatch.setattr(AbstractConnection, "read_response", read_response)
    monkeypatch.setattr(AbstractConnection, "send_packed_command", send_packed_command)
    return lost


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_resent_release_does_not_raise_lock_not_owned(
    redis_server: RedisServer, prefix: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release runs, its reply is lost, and the client sends it again: the second run finds
    nothing held. The release succeeded, so ``release()`` must not raise ``LockNotOwned``."""
    name = f"{prefix}:resent"

    async def body(client: redis.asyncio.Redis) -> None:
        assert client.get_retry() is not None and client.get_retry().get_retries() > 0  # type: ignore[union-attr]
        lock = (
            AsyncRedisLock(client, name, ttl=5)
            if kind == "lock"
            else AsyncRedisSemaphore(client, name, 2, ttl=5)
        )
        assert await lock.acquire()
        script = RELEASE if kind == "lock" else RELEASE_PERMIT
        await client.script_load(script.source)  # no NOSCRIPT round before the lost reply
        lost = lose_first_async_reply(monkeypatch, script)
        await lock.release()
        assert lost == [1]
        assert not await lock.locked()

    run(redis_server, body)
    with redis_server.client() as client:
        assert invariants.keys_of(client, prefix) == []


def test_a_lost_permit_is_signalled_under_the_semaphores_name(redis_server: RedisServer, prefix: str) -> None:
    """As the sync semaphore's: ``lock_lost``'s ``key`` is the semaphore's name, not its permit's."""
    name = f"{prefix}:s"
    reports: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        if isinstance(sender, AsyncRedisSemaphore) and sender.name == name:
            reports.append(kwargs)

    async def body(client: redis.asyncio.Redis) -> None:
        semaphore = AsyncRedisSemaphore(client, name, 2, ttl=0.6)
        assert await semaphore.acquire()
        await client.delete(companion_key(name, "permit:1"))  # as if its lease ran out unrenewed

        async def reported() -> bool:
            return bool(reports)

        await until(reported, "the loss to be reported")

    lock_lost.connect(receiver, weak=False)
    try:
        run(redis_server, body)
    finally:
        lock_lost.disconnect(receiver)
    assert [(report["key"], report["reason"]) for report in reports] == [(name, "not owned")]
