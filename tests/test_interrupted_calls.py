"""An exchange with Redis cut between its send and its read never desynchronises a connection.

An exception that lands after a command was sent and before its reply was
read (Celery's soft time limit, ``KeyboardInterrupt``, an injected
``LockLost``, an asyncio cancellation) must not put the connection back in
use with that reply still on its way: its next user would read it as the
answer to its own command (a busy lock's acquire answering "granted, fence 1").
Each test interrupts one kind of exchange at that point (a seam in
``read_response``: the send is done, the read not begun), then checks that
the same client, or the same watchdog, goes on with the right answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection
from celery.exceptions import SoftTimeLimitExceeded

from celery_redislock import AsyncRedisLock, AsyncRedisSemaphore, LockNotOwned, RedisLock, RedisSemaphore
from celery_redislock._permit_scripts import ACQUIRE_PERMIT, RELEASE_PERMIT
from celery_redislock._scripts import ACQUIRE, RELEASE, RENEW
from celery_redislock.lock import companion_key
from celery_redislock.run_lock import watch
from celery_redislock.testing import RedisServer
from celery_redislock.watchdog import get_watchdog
from tests.interrupts import Arm, Interrupt, on_this_thread
from tests.invariants import stored
from tests.workers import wait_for


def assert_right_answers(client: Any, prefix: str) -> RedisLock:
    """After an interrupted call, ``client`` (or a Redlock's clients) answers rightly: ``{prefix}:b``,
    held by another owner, is refused, and a free ``{prefix}:c`` is taken and released.
    Returns the refused probe."""
    probe = RedisLock(client, f"{prefix}:b", ttl=5)
    assert not probe.acquire(blocking=False)  # held by another: a stale "granted" reply would say True
    fresh = RedisLock(client, f"{prefix}:c", ttl=5)
    assert fresh.acquire(blocking=False)
    fresh.release()
    return probe


def held_keys(name: str) -> list[str]:
    """The keys a hold of ``name`` may leave: the lock's, or a semaphore of 2's permits."""
    return [name, companion_key(name, "permit:1"), companion_key(name, "permit:2")]


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
@pytest.mark.parametrize("step", ["release", "acquire", "extend"])
def test_an_interrupted_script_call_leaves_the_client_giving_right_answers(
    redis_server: RedisServer,
    prefix: str,
    step: str,
    kind: str,
    interrupt_read: Arm,
) -> None:
    """A call on the script fast path (a semaphore's: its permit script) is interrupted after its
    send: the client's next calls, for another lock held by someone else, still read their own
    replies (no second holder)."""
    client, other = redis_server.client(), redis_server.client()
    for script in (ACQUIRE, RELEASE, RENEW, ACQUIRE_PERMIT, RELEASE_PERMIT):  # loaded: the
        client.script_load(script.source)  # interrupted read is the call's own reply
    name = f"{prefix}:a"
    mine = RedisLock(client, name, ttl=5) if kind == "lock" else RedisSemaphore(client, name, 2, ttl=5)
    theirs = RedisLock(other, f"{prefix}:b", ttl=5)
    assert theirs.acquire(blocking=False)
    if step != "acquire":
        assert mine.acquire(blocking=False)
    calls: dict[str, Callable[[], object]] = {
        "release": mine.release,
        "acquire": lambda: mine.acquire(blocking=False),
        "extend": mine.extend,
    }
    fired = interrupt_read(on_this_thread())
    with pytest.raises(Interrupt):
        calls[step]()
    assert fired
    probe = assert_right_answers(client, prefix)
    assert probe.fence is None
    assert stored(other, f"{prefix}:b").decode().startswith(theirs.token or "-")
    assert not client.exists(f"{prefix}:c")
    theirs.release()
    client.delete(*held_keys(name))  # whatever the interrupted call left (it may have acquired)


def test_an_interrupted_replica_wait_leaves_the_client_giving_right_answers(
    redis_server: RedisServer,
    prefix: str,
    interrupt_read: Arm,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An acquire with ``replicas`` is interrupted after sending WAIT, before its reply: the hold is
    undone and the client's next calls read their own replies."""
    client, other = redis_server.client(), redis_server.client()
    theirs = RedisLock(other, f"{prefix}:b", ttl=5)
    assert theirs.acquire(blocking=False)
    waits = 0

    def at_the_wait() -> bool:  # the second read of the confirmation (its WAIT), on this thread
        nonlocal waits
        if threading.current_thread() is not thread or not waiting.is_set():
            return False
        waits += 1
        return waits == 2

    thread, waiting = threading.current_thread(), threading.Event()
    client.script_load(RENEW.source)  # the confirmation's reads: its renewal, then its WAIT
    fired = interrupt_read(at_the_wait)
    mine = RedisLock(client, f"{prefix}:a", ttl=5, replicas=1, replica_timeout=0.5)
    original_confirm = mine.servers.confirm

    def confirm(token: str, member: str) -> None:
        waiting.set()
        try:
            original_confirm(token, member)
        finally:
            waiting.clear()

    monkeypatch.setattr(mine.servers, "confirm", confirm)
    with pytest.raises(Interrupt):
        mine.acquire(blocking=False)
    assert fired
    assert not client.exists(f"{prefix}:a")  # the interrupted acquire gave its hold back
    assert_right_answers(client, prefix)
    theirs.release()


@pytest.mark.parametrize("error", [Interrupt, SoftTimeLimitExceeded])
@pytest.mark.parametrize("where", ["after a send", "before a read"])
def test_an_interrupted_redlock_call_leaves_its_servers_giving_right_answers(
    redlock_servers: list[RedisServer],
    prefix: str,
    where: str,
    error: type[BaseException],
    interrupt_read: Arm,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Redlock release is interrupted right after its first send, or before its first read
    (also by a soft time limit, an ``Exception``, never taken for that server's failure): the
    interrupt propagates, no connection is left taken, and every server still answers the next
    acquire of a lock held by someone else rightly."""
    clients = [server.client() for server in redlock_servers]
    others = [server.client() for server in redlock_servers]
    theirs = RedisLock(others, f"{prefix}:b", ttl=5)
    assert theirs.acquire(blocking=False)
    mine = RedisLock(clients, f"{prefix}:a", ttl=5)
    assert mine.acquire(blocking=False)
    if where == "before a read":
        fired = interrupt_read(on_this_thread(), error)
    else:
        fired = []
        original = redis.connection.AbstractConnection.send_packed_command

        def send_packed_command(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            if not fired:
                fired.append(1)
                raise error

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send_packed_command)
    with pytest.raises(error):
        mine.release()
    assert fired
    monkeypatch.undo()
    assert not any(client.connection_pool._in_use_connections for client in clients)
    assert_right_answers(clients, prefix)
    theirs.release()
    for client in clients:
        client.delete(f"{prefix}:a")


def test_an_interrupted_renewal_leaves_the_watchdog_reading_its_own_replies(
    redis_server: RedisServer,
    prefix: str,
    interrupt_read: Arm,
) -> None:
    """A watchdog renewal is interrupted after its send: the renewal after it reads its own reply,
    so a lock deleted in between is reported lost by that very next renewal, not one later."""
    client = redis_server.client()
    lock = RedisLock(client, f"{prefix}:a", ttl=1.5)
    ticks: list[int] = []
    original = get_watchdog()._renew_node

    def renew_node(*args: Any, **kwargs: Any) -> Any:
        ticks.append(1)
        return original(*args, **kwargs)

    interrupted_at: list[int] = []

    def delete_the_key() -> None:  # gone before the next renewal is sent
        interrupted_at.append(len(ticks))
        client.delete(f"{prefix}:a")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(get_watchdog(), "_renew_node", renew_node)
        fired = interrupt_read(
            lambda: threading.current_thread().name == "celery-redislock-watchdog",
            RuntimeError,  # anything unexpected: the thread carries on
            delete_the_key,
        )
        assert lock.acquire(blocking=False)
        wait_for(lambda: fired, 10, "an interrupted renewal")
        assert lock.lost.wait(10)
        assert len(ticks) == interrupted_at[0] + 1  # the next renewal's own reply ("not owned") told it
    with pytest.raises(LockNotOwned):
        lock.release()


@pytest.mark.parametrize(
    ("kind", "step"), [("lock", "extend"), ("semaphore", "extend"), ("semaphore", "acquire")]
)
def test_a_cancelled_async_call_while_the_server_is_slow_leaves_the_client_giving_right_answers(
    fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, kind: str, step: str
) -> None:
    """An ``AsyncRedisLock.extend()`` (an ``AsyncRedisSemaphore``'s ``extend()`` or ``acquire()``) is
    cancelled while the server is stopped (SIGSTOP), its command sent and its reply not read: the
    client's next calls read their own replies, and a cancelled acquire leaves no permit held."""
    sent = threading.Event()
    original = redis.asyncio.connection.AbstractConnection.send_packed_command

    async def send_packed_command(self: Any, *args: Any, **kwargs: Any) -> None:
        await original(self, *args, **kwargs)
        sent.set()

    monkeypatch.setattr(
        redis.asyncio.connection.AbstractConnection, "send_packed_command", send_packed_command
    )

    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=fresh_server.port)
        other = fresh_server.client()
        theirs = RedisLock(other, f"{prefix}:b", ttl=30)
        assert theirs.acquire(blocking=False)
        name = f"{prefix}:a"
        mine = (
            AsyncRedisLock(client, name, ttl=30)
            if kind == "lock"
            else AsyncRedisSemaphore(client, name, 2, ttl=30)
        )
        if step == "extend":
            assert await mine.acquire(blocking=False)
        else:
            await client.script_load(ACQUIRE_PERMIT.source)  # the acquire's first reply is its own
        sent.clear()
        os.kill(fresh_server.pid, signal.SIGSTOP)
        try:
            call = asyncio.ensure_future(mine.extend() if step == "extend" else mine.acquire(blocking=False))
            for _ in range(2000):  # poll until the command is on its way (10 s at most)
                if sent.is_set():
                    break
                await asyncio.sleep(0.005)
            assert sent.is_set()
            call.cancel()  # delivered at the call's next step, before any reply can be read
        finally:
            os.kill(fresh_server.pid, signal.SIGCONT)  # a cancelled acquire finishes its exchange
        with pytest.raises(asyncio.CancelledError):
            await call
        probe = AsyncRedisLock(client, f"{prefix}:b", ttl=30)
        assert not await probe.acquire(blocking=False)
        fresh = AsyncRedisLock(client, f"{prefix}:c", ttl=30)
        assert await fresh.acquire(blocking=False)
        await fresh.release()
        if step == "extend":
            await mine.release()
        assert not mine.held() and not await client.exists(*held_keys(name))  # a cancelled acquire: undone
        theirs.release()
        await client.aclose()

    asyncio.run(main())


def test_an_interrupted_shortening_extend_does_not_let_the_hold_expire_under_its_owner(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``extend(0.4)`` of a watchdog-renewed 3 s lock is interrupted as its reply comes back
    (Redis set the 0.4 s TTL; the caller cannot know): the watchdog renews it in time for
    either TTL, so no second holder takes the key while its owner holds it."""
    client = redis_server.client()
    lock = RedisLock(client, f"{prefix}:a", ttl=3)
    assert lock.acquire(blocking=False)
    extend = lock.servers.extend

    def interrupted(token: str, ttl: float) -> bool:
        extend(token, ttl)
        raise Interrupt  # e.g. a soft time limit, as the reply is read

    monkeypatch.setattr(lock.servers, "extend", interrupted)
    with pytest.raises(Interrupt):
        lock.extend(0.4)
    assert 0 < client.pttl(f"{prefix}:a") <= 400
    other = RedisLock(client, f"{prefix}:a", ttl=30)
    taken = other.acquire(timeout=1.5)  # the old schedule renews only ~1 s after the acquire
    if taken:
        other.release()
    assert not taken, f"a second holder took the key while the first held it (lost: {lock.lost.is_set()})"
    lock.release()


def interrupt_the_next_handshake(
    server: RedisServer, interrupt_read: Arm, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[int], list[int], Callable[[], bool]]:
    """From now on, the first connection handshake on this thread is interrupted (``Interrupt``)
    as its reply is read, and ``server``, once held up by the caller (SIGSTOP) so that the reply
    waits unread, is resumed (SIGCONT) as the next command on this thread is sent.
    (fired, resumed: each gets a 1 when it happened; whether this thread is in a handshake)."""
    thread, handshaking = threading.current_thread(), threading.local()
    on_connect = redis.connection.AbstractConnection.on_connect_check_health
    send = redis.connection.AbstractConnection.send_packed_command
    resumed: list[int] = []

    def on_connect_check_health(self: Any, *args: Any, **kwargs: Any) -> Any:
        handshaking.now = True
        try:
            return on_connect(self, *args, **kwargs)
        finally:
            handshaking.now = False

    def send_packed_command(self: Any, *args: Any, **kwargs: Any) -> None:
        send(self, *args, **kwargs)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        if fired and not resumed and threading.current_thread() is thread:
            resumed.append(1)  # the first command after the interrupted handshake is on its way
            os.kill(server.pid, signal.SIGCONT)

    def in_a_handshake() -> bool:
        return threading.current_thread() is thread and getattr(handshaking, "now", False)

    patch = redis.connection.AbstractConnection
    monkeypatch.setattr(patch, "on_connect_check_health", on_connect_check_health)
    fired = interrupt_read(in_a_handshake)
    monkeypatch.setattr(patch, "send_packed_command", send_packed_command)
    return fired, resumed, in_a_handshake


@pytest.mark.parametrize("when", ["first call", "reconnecting"])
def test_an_interrupted_connection_handshake_leaves_the_client_reading_its_own_replies(
    fresh_server: RedisServer,
    prefix: str,
    when: str,
    interrupt_read: Arm,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A semaphore's acquire is interrupted in a connection's handshake, HELLO sent and its reply
    not read (the server held up, SIGSTOP, until the next command is sent): the first call of a
    fresh client (redis-py puts the half-connected connection back in its pool, where it counts
    as connected), or the undo of an acquire interrupted after its send, which connects afresh
    (the interrupted exchange dropped its connection). The calls that follow read their own
    replies, not the handshake's. (A lock's undo, or a lock's next acquire, reads it without
    noticing, and leaves its own reply for the next call to read as its answer.)"""
    other = fresh_server.client()
    theirs = RedisLock(other, f"{prefix}:b", ttl=30)
    assert theirs.acquire(blocking=False)
    client, name = fresh_server.client(), f"{prefix}:a"
    mine = RedisSemaphore(client, name, 2, ttl=30)
    if when == "reconnecting":
        client.script_load(ACQUIRE_PERMIT.source)  # the acquire's read is its own reply's
        assert RedisLock(client, f"{prefix}:c", ttl=30).acquire(blocking=False)  # connected
        client.delete(f"{prefix}:c")
    fired, resumed, in_a_handshake = interrupt_the_next_handshake(fresh_server, interrupt_read, monkeypatch)
    stop_the_server = partial(os.kill, fresh_server.pid, signal.SIGSTOP)  # its handshake's reply held up
    if when == "first call":
        stop_the_server()
    else:
        at_its_read = on_this_thread()
        interrupt_read(lambda: at_its_read() and not in_a_handshake(), then=stop_the_server)
    try:
        with pytest.raises(Interrupt):
            mine.acquire(blocking=False)
        assert fired
        assert_right_answers(client, prefix)
    finally:
        os.kill(fresh_server.pid, signal.SIGCONT)
    assert resumed
    monkeypatch.undo()
    assert not [record.getMessage() for record in caplog.records if "could not leave" in record.getMessage()]
    assert not mine.held()
    if when == "reconnecting":  # its undo was cut short: a permit it was granted is left to expire
        client.delete(*held_keys(name))
    assert not client.exists(*held_keys(name))
    theirs.release()


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_soft_time_limit_as_a_watcher_leaves_the_queue_propagates(
    redis_server: RedisServer,
    prefix: str,
    kind: str,
    interrupt_read: Arm,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A token queued as a hold's watcher leaves the queue (``servers.abandon``, as a run's wait
    woken by the holder's keep or park does, ``busy``, ``redelivery``), and a soft time limit (an
    ``Exception``) lands as the reply is read: it propagates, not logged as a failure to leave
    the queue while the run goes on past its limit; the queue is left (the command was sent),
    and the client reads its own replies."""
    client, other = redis_server.client(), redis_server.client()
    name = f"{prefix}:a"
    theirs: RedisLock | RedisSemaphore = (
        RedisLock(other, name, ttl=5, holder="theirs")
        if kind == "lock"
        else RedisSemaphore(other, name, 1, ttl=5, holder="theirs")
    )
    assert theirs.acquire(blocking=False)
    others = RedisLock(other, f"{prefix}:b", ttl=5)
    assert others.acquire(blocking=False)
    mine = RedisLock(client, name, ttl=5) if kind == "lock" else RedisSemaphore(client, name, 1, ttl=5)
    token = "f" * 32
    assert watch(mine, "theirs", token)  # queued as the hold's watcher
    assert client.zcard(companion_key(name, "queue")) == 1
    client.script_load(RELEASE.source)  # the interrupted read is the release's own reply
    client.script_load(RELEASE_PERMIT.source)
    fired = interrupt_read(on_this_thread(), SoftTimeLimitExceeded)
    with caplog.at_level(logging.WARNING), pytest.raises(SoftTimeLimitExceeded):
        mine.servers.abandon(token, mine.member(token))
    assert fired
    assert "could not leave the waiter queue" not in caplog.text
    queue = companion_key(name, "queue")  # left once the release sent (its connection dropped) ran
    wait_for(lambda: client.zcard(queue) == 0, what="the watcher to leave the queue")
    assert_right_answers(client, prefix)
    theirs.release()
    others.release()


@pytest.mark.parametrize("when", ["as its call ends", "while its call runs"])
def test_a_soft_time_limit_landing_in_an_async_acquire_propagates_and_leaves_no_hold(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A soft time limit (an ``Exception``, raised in whatever runs on the main thread) lands in
    an ``AsyncRedisLock.acquire()`` as it awaits its shielded Redis call (``aio._to_the_end``),
    once the call ended (the lock granted) or while it runs: it is not the call's outcome.
    It propagates, once the call ended, and the hold is given back."""
    real_shield = asyncio.shield
    fired: list[int] = []

    def shield(inner: Any) -> Any:
        async def landing() -> Any:
            if when == "while its call runs" and not fired:
                fired.append(1)
                raise SoftTimeLimitExceeded()
            result = await real_shield(inner)
            if not fired:
                fired.append(1)
                raise SoftTimeLimitExceeded()
            return result

        return landing()

    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
        lock = AsyncRedisLock(client, f"{prefix}:a", ttl=30)
        monkeypatch.setattr(asyncio, "shield", shield)
        try:
            with pytest.raises(SoftTimeLimitExceeded):
                await lock.acquire(blocking=False)
        finally:
            monkeypatch.undo()
        assert fired
        assert not lock.held()
        assert not await client.exists(f"{prefix}:a")
        await client.aclose()

    asyncio.run(main())


def test_an_interrupted_redlock_handshake_leaves_its_server_reading_its_own_replies(
    redlock_servers: list[RedisServer], prefix: str, interrupt_read: Arm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Redlock's first acquire is interrupted in its first server's connection handshake, the
    handshake sent and its reply not read (the server held up, SIGSTOP, until the next command is
    sent): redis-py puts the half-connected connection back in its pool, where it counts as
    connected. The Redlock's later exchanges with that server read their own replies, not the
    handshake's (as ``_redis.PooledConnection``'s do)."""
    clients = [server.client() for server in redlock_servers]  # fresh pools: the acquire connects
    stopped = redlock_servers[0]
    fired, _, _ = interrupt_the_next_handshake(stopped, interrupt_read, monkeypatch)
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        with pytest.raises(Interrupt):
            RedisLock(clients, f"{prefix}:a", ttl=5).acquire(blocking=False)
        assert fired
        probe = RedisLock(clients, f"{prefix}:c", ttl=5)
        assert probe.acquire(blocking=False)
        servers: Any = probe.servers  # a Quorum: each server's reply, in order
        assert servers._on_all(RELEASE, [probe.token or ""]) == [1, 1, 1]  # each its own reply
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    monkeypatch.undo()
    for client in clients:
        client.delete(f"{prefix}:a", f"{prefix}:c")
