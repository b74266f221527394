"""RedisLock at its edges: fair and unfair waiters of one key still exclude, a late hand-over is
still held, a stalled server or a foreign key loses only its own lease, an interrupt leaves nothing
held or queued, and a lost hold fails loudly but does not hide the error of the body."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
import redis
from celery.exceptions import Ignore

import celery_redislock.busy as busy
import celery_redislock.lock as lock_module
import celery_redislock.redelivery as redelivery
import celery_redislock.run_lock as run_lock
from celery_redislock import (
    LockConfigurationError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    RedisLock,
    RedisSemaphore,
)
from celery_redislock._permit_scripts import WATCH_PERMIT
from celery_redislock._redis import call_with_timeout
from celery_redislock._scripts import ACQUIRE, RELEASE
from celery_redislock._task_scripts import ADOPT, DECLINE, PARK, SETTLE, WATCH
from celery_redislock.attempt import waiter_member
from celery_redislock.found import Found
from celery_redislock.inventory import release_token
from celery_redislock.lock import companion_key
from celery_redislock.protocol import KEPT_TOKEN, parse_value
from celery_redislock.run_lock import KEPT, PARKED, watch
from celery_redislock.testing import RedisServer
from tests.conftest import blocked_clients, busy_for, calls_since, command_calls
from tests.interrupts import Arm, Interrupt, on_this_thread
from tests.invariants import stored
from tests.taskapp import LEASE, text
from tests.test_attempts import first_reply_lost
from tests.workers import renewed, wait_for


def wait_until_queued(client: redis.Redis, name: str, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while client.zcard(companion_key(name, "queue")) < count:
        assert time.monotonic() < deadline, "the waiter never queued"


def test_fair_and_unfair_users_of_one_key_still_exclude(client: redis.Redis, prefix: str) -> None:
    name = f"{prefix}:k"
    unfair_holder = RedisLock(client, name, ttl=5)
    fair_waiter = RedisLock(client, name, ttl=5, fair=True)
    unfair_holder.acquire()
    thread = threading.Thread(target=fair_waiter.acquire)
    thread.start()
    wait_until_queued(client, name)
    unfair_holder.release()  # the fair waiter is handed the lock, whoever releases
    thread.join()
    assert fair_waiter.owned()
    assert not RedisLock(client, name, ttl=5).acquire(blocking=False)
    fair_waiter.release()

    fair_holder, unfair_waiter = RedisLock(client, name, ttl=5, fair=True), RedisLock(client, name, ttl=5)
    fair_holder.acquire()
    thread = threading.Thread(target=unfair_waiter.acquire)
    thread.start()
    wait_until_queued(client, name)
    fair_holder.release()  # the unfair waiter is told to retry, and wins the free lock
    thread.join()
    assert unfair_waiter.owned()
    assert not RedisLock(client, name, ttl=5).acquire(blocking=False)
    unfair_waiter.release()


def test_a_handover_received_late_is_still_held(
    client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pause between the failed attempt and BLPOP must not make the watchdog miss the lease."""
    resume = threading.Event()

    def paused_call(*args: Any) -> Any:
        resume.wait(30)  # an injected pause (GC, scheduling) before the BLPOP is sent
        return call_with_timeout(*args)

    monkeypatch.setattr(lock_module, "call_with_timeout", paused_call)
    name = f"{prefix}:k"
    holder = RedisLock(client, name, ttl=LEASE, fair=True)
    waiter = RedisLock(client, name, ttl=LEASE, fair=True)
    holder.acquire()
    thread = threading.Thread(target=waiter.acquire)
    thread.start()
    wait_until_queued(client, name)
    holder.release()  # hands over, with a fresh lease, while the waiter is still paused
    resume.set()
    thread.join()
    assert not waiter.lost.wait(1.5 * LEASE)
    assert waiter.owned()
    waiter.release()


def test_a_stalled_server_is_reported_and_does_not_stall_other_leases(
    fresh_server: RedisServer, redis_server: RedisServer, prefix: str
) -> None:
    stalled = RedisLock(fresh_server.client(), f"{prefix}:stalled", ttl=0.6)
    healthy = RedisLock(redis_server.client(), f"{prefix}:healthy", ttl=LEASE)
    stalled.acquire()
    healthy.acquire()
    os.kill(fresh_server.pid, signal.SIGSTOP)
    try:
        assert stalled.lost.wait(10)  # renewals get no answer: lost once the lease ran out
        renewed(redis_server.client(), f"{prefix}:healthy")  # meanwhile the other server's lease is renewed
        assert not healthy.lost.is_set()
        assert healthy.owned()
    finally:
        os.kill(fresh_server.pid, signal.SIGCONT)
    healthy.release()
    assert fresh_server.client().exists(f"{prefix}:stalled") == 0  # expired, not renewed


def test_a_waiter_answered_late_by_a_busy_server_goes_on_waiting(
    redis_server: RedisServer, client: redis.Redis, prefix: str
) -> None:
    """A server busy with another client's long command when a waiter's BLPOP times out answers
    it late: the waiter goes on waiting, as any of its commands waits out the client's
    ``socket_timeout`` (5 s here), and is handed the lock when it is freed. Its own ``ttl``
    (1 s) bounds each BLPOP; the server stays busy 2.5 s from just after the BLPOP was sent."""
    name = f"{prefix}:k"
    holder = RedisLock(client, name, ttl=30, watchdog=False)
    waiter = RedisLock(redis_server.client(socket_timeout=5), name, ttl=1, fair=True)
    holder.acquire()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            waiter.acquire(timeout=60)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_for(lambda: blocked_clients(client), what="the waiter's BLPOP")
    busy_for(redis_server, 2.5).join()
    holder.release()  # handed to the waiter, if it still waits
    thread.join(60)
    assert [f"{type(exc).__name__}: {exc}" for exc in errors] == []
    assert waiter.owned()
    waiter.release()


@pytest.mark.parametrize("pttl_ms", [0, -2])
def test_a_waiter_whose_wait_is_at_its_floor_is_answered(
    client: redis.Redis, prefix: str, pttl_ms: int
) -> None:
    """A waiter that found the holder in its last millisecond (PTTL 0), or gone (-2: expired
    between the attempt's checks), as a copy watching a dead worker's lease does when it runs
    out, sleeps the shortest BLPOP the lock sends before it tries again. Redis 6.2 reads a
    timeout as whole milliseconds, rounded down from its floating-point value: "0.001" was 0
    there, a BLPOP that blocks until woken, and the waiter failed with its reply timed out ("no
    reply to BLPOP within 5.001s"). Nothing wakes it here: it is answered all the same. (Redis
    7.0 reads "0.001" as 1 ms: the test fails on 6.2 only, which CI runs the suite on too.)"""
    waiter = RedisLock(client, f"{prefix}:k", ttl=30)
    attempt = waiter.new_attempt(secrets.token_hex(16), True, None, waiter.servers.queues)
    attempt.mode()
    assert attempt.granted([pttl_ms, b"holder"]) is None
    assert waiter.servers.sleep(attempt) is None


def test_a_key_of_another_type_loses_only_its_own_lease(client: redis.Redis, prefix: str) -> None:
    locks = [RedisLock(client, f"{prefix}:{i}", ttl=LEASE) for i in range(3)]
    for lock in locks:
        lock.acquire()
    client.delete(f"{prefix}:0")
    client.set(f"{prefix}:0", "not a lock", px=60_000)
    assert locks[0].lost.wait(5)
    renewed(client, f"{prefix}:1")  # the other two are renewed all along
    assert not locks[1].lost.is_set() and not locks[2].lost.is_set()
    assert locks[1].owned() and locks[2].owned()
    for lock in locks[1:]:
        lock.release()
    client.delete(f"{prefix}:0")


def test_an_interrupt_after_the_attempt_leaves_nothing_held(
    client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        ACQUIRE(*args, **kwargs)  # the attempt reached Redis...
        raise KeyboardInterrupt  # ...and the caller was interrupted before it saw the reply

    monkeypatch.setattr(lock_module, "ACQUIRE", interrupted)
    lock = RedisLock(client, f"{prefix}:k", ttl=30)
    with pytest.raises(KeyboardInterrupt):
        lock.acquire()
    assert lock.token is None
    assert client.exists(f"{prefix}:k") == 0


def test_an_interrupted_waiter_leaves_the_queue(
    client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any) -> Any:
        raise KeyboardInterrupt

    name = f"{prefix}:k"
    holder = RedisLock(client, name, ttl=5)
    holder.acquire()
    monkeypatch.setattr(lock_module, "call_with_timeout", interrupted)
    with pytest.raises(KeyboardInterrupt):
        RedisLock(client, name, ttl=5, fair=True).acquire()
    assert client.exists(companion_key(name, "queue"), companion_key(name, "waiters")) == 0
    holder.release()


def test_extend_with_the_watchdog_renews_to_the_new_ttl(client: redis.Redis, prefix: str) -> None:
    lock = RedisLock(client, f"{prefix}:k", ttl=30)
    lock.acquire()
    lock.extend(0.6)  # renewed to 0.6 s every 0.2 s from now on
    assert not lock.lost.wait(2.0)
    assert 0 < client.pttl(f"{prefix}:k") <= 600
    with pytest.raises(LockConfigurationError, match=r"ttl must be >= 0\.3"):
        lock.extend(0.1)
    lock.release()


def test_with_block_error_is_not_hidden_by_a_lost_lock(client: redis.Redis, prefix: str) -> None:
    def body() -> None:
        with RedisLock(client, f"{prefix}:k", ttl=5):
            client.delete(f"{prefix}:k")
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        body()
    with pytest.raises(LockNotOwned), RedisLock(client, f"{prefix}:k", ttl=5):
        client.delete(f"{prefix}:k")


def test_waiting_with_decode_responses(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client(decode_responses=True)
    for fair in (False, True):
        holder, waiter = (
            RedisLock(client, f"{prefix}:k", ttl=5, fair=fair),
            RedisLock(client, f"{prefix}:k", ttl=5, fair=fair),
        )
        holder.acquire()
        thread = threading.Thread(target=waiter.acquire)
        thread.start()
        wait_until_queued(client, f"{prefix}:k")
        holder.release()
        thread.join()
        assert waiter.owned()
        waiter.release()


def test_reentry_after_loss_raises_only_for_the_lost_hold(client: redis.Redis, prefix: str) -> None:
    lock = RedisLock(client, f"{prefix}:k", ttl=0.6)
    lock.acquire()
    client.delete(f"{prefix}:k")
    assert lock.lost.wait(5)
    with pytest.raises(LockLost):
        lock.acquire()
    with pytest.raises(LockNotOwned):
        lock.release()
    assert lock.acquire(blocking=False)  # a new hold starts clean
    assert not lock.lost.is_set()
    lock.release()


@pytest.mark.parametrize("fair", [True, False])
def test_a_first_wait_sent_again_and_granted_leaves_the_queue(
    client: redis.Redis, prefix: str, fair: bool
) -> None:
    """``ACQUIRE`` answers a call sent again (``idempotent``, and redis-py's retries) as the
    first send would have: a first ``'wait'`` whose first run queued the caller (its reply
    lost), granted the lock when sent again (the holder's lease ran out meanwhile), leaves the
    queue. Else its own release would hand the lock (fair) to the call that is over, held by
    no one for a lease, or wake it (unfair) instead of the waiter queued behind it."""
    name = f"{prefix}:k"
    holder, waiter, other = (secrets.token_hex(16) for _ in range(3))
    member = waiter_member(5000, waiter, fair, "w")
    assert isinstance(ACQUIRE(client, [name], [waiter_member(5000, holder, fair, "h"), "try"]), int)
    assert not isinstance(ACQUIRE(client, [name], [member, "wait"]), int)  # queued; the reply lost
    other_member = waiter_member(5000, other, fair, "o")
    assert not isinstance(ACQUIRE(client, [name], [other_member, "wait"]), int)
    client.delete(name)  # the holder's lease runs out, before the other waiter calls again
    assert isinstance(ACQUIRE(client, [name], [member, "wait"]), int)  # the call sent again
    assert client.zrange(companion_key(name, "queue"), 0, -1) == [other_member.encode()]
    assert RELEASE(client, [name], [waiter]) == 1
    woken = client.lrange(companion_key(name, f"wake:{other}"), 0, -1)
    if fair:  # handed to the waiter queued behind, woken with the hold's fence
        held = client.get(name)
        assert held is not None
        value = text(held)
        assert value.startswith(other) and woken == [value.split(":")[1].encode()]
    else:
        assert client.get(name) is None and woken == [b"retry"]
    client.delete(name, companion_key(name, f"wake:{other}"))  # what the waiter behind would do


def test_a_woken_waiter_that_gives_up_passes_the_wake_on(client: redis.Redis, prefix: str) -> None:
    """Two first-come waiters queue behind a holder, which releases: the first is woken ("retry")
    and leaves the queue. Interrupted before it tries again (a soft time limit, a cancel), it
    gives up (``abandon``: ``RELEASE`` with its member): the second waiter is woken then, not
    left asleep beside the free lock until the holder's lease would have run out."""
    name = f"{prefix}:k"
    holder, first, second = (secrets.token_hex(16) for _ in range(3))
    members = {
        token: waiter_member(30_000, token, False, who) for token, who in ((first, "w1"), (second, "w2"))
    }
    assert isinstance(ACQUIRE(client, [name], [waiter_member(30_000, holder, False, "h"), "try"]), int)
    for token in (first, second):
        assert not isinstance(ACQUIRE(client, [name], [members[token], "wait"]), int)
    assert RELEASE(client, [name], [holder]) == 1
    assert client.lpop(companion_key(name, f"wake:{first}")) == b"retry"  # woken, then interrupted
    assert RELEASE(client, [name], [first, members[first]]) == 0  # gives up: it held nothing
    assert client.lrange(companion_key(name, f"wake:{second}"), 0, -1) == [b"retry"]
    assert isinstance(ACQUIRE(client, [name], [members[second], "again"]), int)
    assert RELEASE(client, [name], [second, members[second]]) == 1
    assert client.keys(f"*{prefix}*") == []


def test_an_acquire_on_another_thread_during_the_last_release_does_not_reenter_a_freed_hold(
    client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock object shared by two threads (re-entrant per object): thread A's last ``release()``
    is on its way to Redis when thread B calls ``acquire()``. Either order is fine (B re-enters
    first and the key is kept, or the key is freed first and B takes a hold of its own), but B
    must not be told it holds the lock while the key it re-entered is freed under it: then
    another owner takes the key while B works "under" the lock."""
    name = f"{prefix}:k"
    shared = RedisLock(client, name, ttl=5)
    assert shared.acquire()
    real_free = shared.servers.free
    entered: list[bool] = []
    worker = threading.Thread(target=lambda: entered.append(shared.acquire(timeout=10)))

    def free(token: str) -> bool:
        # thread B's acquire lands between A's decision to free and the RELEASE round trip:
        # it returns (re-entered), or queues for the key A is about to free
        if worker.ident is not None:
            return real_free(token)
        worker.start()
        wait_for(lambda: entered or client.zcard(companion_key(name, "queue")), 10, "B's acquire")
        return real_free(token)

    monkeypatch.setattr(shared.servers, "free", free)
    shared.release()  # thread A's last release
    worker.join(10)
    assert entered == [True]  # thread B was told it holds the lock...
    other = RedisLock(client, name, ttl=5)
    try:
        assert not other.acquire(blocking=False), "...and a second owner took the key B holds"
    finally:
        if other.held():
            other.release()
        if shared.held():
            shared.release()


# -- a run's hold watched by a copy of its message, delivered again (``run_lock.watch``) ----------

#: The holders of a run and of its message's copy: the same task and attempt, another process.
T = TypeVar("T")

RUN = "task=t1 try=0 state=running node=first@host pid=1"
COPY = "task=t1 try=0 state=running node=copy@host pid=2"


def waiting_as(lock: RedisLock | RedisSemaphore, token: str) -> tuple[threading.Thread, list[int | None]]:
    """``lock.wait_as(token)`` on a thread of its own, for up to 10 s: the thread, and the list
    that gets what it returned."""
    got: list[int | None] = []
    thread = threading.Thread(target=lambda: got.append(lock.wait_as(token, time.monotonic() + 10)))
    thread.start()
    return thread, got


def test_a_watched_hold_goes_to_its_watcher_at_release_before_any_other_waiter(
    client: redis.Redis, prefix: str
) -> None:
    """A copy watching a run's hold is handed it when the run releases it, its fence kept, even
    with another waiter queued first: the copy learns that the run let go of it. Meanwhile the
    run's hold reads, renews and is owned as before."""
    name = f"{prefix}:k"
    run, copy, other = (RedisLock(client, name, ttl=LEASE, holder=h) for h in (RUN, COPY, None))
    run.acquire()
    other_thread = threading.Thread(target=other.acquire)
    other_thread.start()
    wait_until_queued(client, name)
    token, fence = secrets.token_hex(16), run.fence
    assert watch(copy, RUN, token) == fence
    assert text(stored(client, name))[32:64] == token  # the copy's token, after the run's
    assert parse_value(stored(client, name)) == (run.token, fence, RUN)
    assert run.owned()
    run.extend(2 * LEASE)
    assert client.pttl(name) > LEASE * 1000
    thread, got = waiting_as(copy, token)
    wait_until_queued(client, name, 2)
    run.release()
    thread.join()
    assert got == [fence]
    assert parse_value(stored(client, name)) == (token, fence, COPY)
    assert other_thread.is_alive()  # still waiting: the hold went to the copy
    assert release_token(client, name, token)  # the copy lets go: the other waiter is woken
    other_thread.join()
    assert other.owned()
    other.release()


def test_a_watched_hold_whose_watcher_left_is_released_as_any_other(client: redis.Redis, prefix: str) -> None:
    """A copy that stopped waiting (its first delivery alive) leaves its token on the hold: the
    release finds it no longer queued, and wakes the next waiter as ever."""
    name = f"{prefix}:k"
    run, copy, other = (RedisLock(client, name, ttl=LEASE, holder=h) for h in (RUN, COPY, None))
    run.acquire()
    token = secrets.token_hex(16)
    assert watch(copy, RUN, token) == run.fence
    assert copy.wait_as(token, time.monotonic() + 0.1) is None  # gave up: out of the queue
    assert copy.busy[0] == RUN
    other_thread = threading.Thread(target=other.acquire)
    other_thread.start()
    wait_until_queued(client, name)
    run.release()
    other_thread.join()
    assert other.owned()
    other.release()


def test_a_watcher_whose_wait_begins_past_its_deadline_leaves_the_queue(
    client: redis.Redis, prefix: str
) -> None:
    """``WATCH`` queues the copy; a copy paused from then until past its wait's deadline (a
    stopped process, a long GIL hold) still leaves the queue, so that the run's release wakes
    no one and leaves nothing behind (a wake for the gone copy stayed, for its lease)."""
    name = f"{prefix}:k"
    run, copy = (RedisLock(client, name, ttl=LEASE, holder=h) for h in (RUN, COPY))
    run.acquire()
    token = secrets.token_hex(16)
    assert watch(copy, RUN, token) == run.fence
    assert copy.wait_as(token, time.monotonic() - 1, queued=True) is None  # deadline past at once
    assert copy.busy[0] == RUN
    run.release()
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


def test_a_hold_watched_by_a_queued_copy_is_left_to_it(client: redis.Redis, prefix: str) -> None:
    """A second copy of the message (delivered once more) does not take the watch over from a
    copy still queued; a hold its run no longer has is not watched (``busy`` names the holder)."""
    name = f"{prefix}:k"
    run, copy, again = (RedisLock(client, name, ttl=LEASE, holder=h) for h in (RUN, COPY, COPY))
    run.acquire()
    token, fence = secrets.token_hex(16), run.fence
    assert watch(copy, RUN, token) == fence
    assert watch(again, RUN, secrets.token_hex(16)) == 0
    assert text(stored(client, name))[32:64] == token
    thread, got = waiting_as(copy, token)
    run.release()
    thread.join()
    assert got == [fence]
    assert watch(again, RUN, secrets.token_hex(16)) is None  # the copy's hold now, not the run's
    assert again.busy[0] == COPY
    assert release_token(client, name, token)


def test_a_watched_permit_goes_to_its_watcher_at_release_before_any_other_waiter(
    client: redis.Redis, prefix: str
) -> None:
    """As a lock's watched hold, a semaphore's permit (``lock_limit`` above 1): with every permit
    held and another waiter queued first, the run's release hands its permit to the copy that
    watches it, its fence kept; the copy's release then wakes the other waiter. A second copy
    does not take the watch over, and a run that holds no permit is not watched."""
    name = f"{prefix}:s"
    run, filler, copy, again, other = (
        RedisSemaphore(client, name, 2, ttl=LEASE, holder=h) for h in (RUN, None, COPY, COPY, None)
    )
    run.acquire()
    filler.acquire()
    other_thread = threading.Thread(target=other.acquire)
    other_thread.start()
    wait_until_queued(client, name)
    token, fence = secrets.token_hex(16), run.fence
    permit = run.servers.book.key_of(run.token)
    assert permit is not None
    assert watch(copy, RUN, token) == fence
    assert watch(again, RUN, secrets.token_hex(16)) == 0
    assert text(stored(client, permit))[32:64] == token  # the copy's token, after the run's
    assert parse_value(stored(client, permit)) == (run.token, fence, RUN)
    assert run.owned()
    run.extend(2 * LEASE)
    assert client.pttl(permit) > LEASE * 1000
    thread, got = waiting_as(copy, token)
    wait_until_queued(client, name, 2)
    run.release()
    thread.join()
    assert got == [fence]
    assert parse_value(stored(client, permit)) == (token, fence, COPY)
    assert other_thread.is_alive()  # still waiting: the permit went to the copy
    assert watch(again, RUN, secrets.token_hex(16)) is None  # the copy's permit now, not the run's
    assert copy.servers.free(token)  # the copy lets go: the other waiter is woken
    other_thread.join()
    assert other.owned()
    other.release()
    filler.release()


def kept_for_its_period(client: redis.Redis, run: RedisLock) -> None:
    """End ``run`` as an ``until_expired`` run ends: its hold kept for ``lock_period`` (``SETTLE``)."""
    fence = run.fence
    assert SETTLE(client, [run.name], [run.stop_renewing(), 600_000, fence or 0]) > 0
    run.forget()


def test_a_hold_kept_for_its_period_is_not_watched(fresh_server: RedisServer, prefix: str) -> None:
    """A run over keeps its hold for its period, owned by no token: a copy of its message learns
    that from its ``WATCH`` alone (``KEPT``), one script call, which neither marks the hold nor
    queues the copy."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run, copy = (RedisLock(client, name, ttl=LEASE, holder=h) for h in (RUN, COPY))
    assert watch(copy, RUN, secrets.token_hex(16)) is None  # the scripts loaded: not counted below
    client.script_load(SETTLE.source)
    run.acquire()
    before = command_calls(client)
    kept_for_its_period(client, run)  # a hold no copy watches: the commands it always sent
    assert calls_since(client, before) == {"evalsha": 1, "get": 1, "time": 1, "set": 1}
    kept = stored(client, name)
    before = command_calls(client)
    assert watch(copy, RUN, secrets.token_hex(16)) == KEPT
    assert calls_since(client, before) == {"evalsha": 1, "get": 1}
    assert stored(client, name) == kept
    client.delete(name)
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


def woken_copy(client: redis.Redis, run: RedisLock, end: Callable[[], T]) -> tuple[int | None, T]:
    """A copy of ``run``'s message watches its hold (``WATCH``) and waits to be woken (at most
    30 s); ``end`` then ends the run. Returns what the copy's wait returned, and ``end``'s result."""
    copy, token = RedisLock(client, run.name, ttl=LEASE, holder=COPY), secrets.token_hex(16)
    assert watch(copy, RUN, token) == run.fence
    got: list[int | None] = []
    thread = threading.Thread(
        target=lambda: got.append(copy.wait_as(token, time.monotonic() + 30, queued=True))
    )
    thread.start()
    wait_for(lambda: client.info("clients")["blocked_clients"] == 1, what="the copy to wait for a wake")
    ended = end()
    thread.join()
    return got[0], ended


def test_a_copy_watching_a_hold_is_woken_when_its_run_keeps_it_for_its_period(
    fresh_server: RedisServer, prefix: str
) -> None:
    """The run a copy watches ends and keeps its hold for its period (``SETTLE``): the copy is
    woken at once with ``KEPT``, out of the queue (not left waiting until its deadline, a
    renewal interval, to take the kept hold for a live run's); the hold is kept unmarked."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    run.acquire()
    fence = run.fence
    assert woken_copy(client, run, lambda: kept_for_its_period(client, run)) == (KEPT, None)
    assert text(stored(client, name)) == f"{KEPT_TOKEN}:{fence}:{RUN}"
    client.delete(name)
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


#: The holder of the hold a run parks for its retry's message (``PARK``): attempt 1, queued.
RETRY = "task=t1 try=1 state=queued node=first@host pid=1"


def parked_for_its_retry(client: redis.Redis, run: RedisLock) -> str:
    """End ``run`` as a run that retried ends (``until_executed``, ``until_expired``): its hold
    parked for its retry's message (``PARK``). Returns the token that message carries."""
    token = secrets.token_hex(16)
    assert PARK(client, [run.name], [run.stop_renewing(), RUN, token, RETRY, 600_000, 0]) == 1
    run.forget()
    return token


def test_a_park_of_a_hold_no_copy_watches_sends_the_commands_it_always_sent(
    fresh_server: RedisServer, prefix: str
) -> None:
    """The common park (no copy of the run's message watches its hold) pays nothing for waking a
    watching copy: the same server commands as before copies were woken by it."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    client.script_load(PARK.source)
    run.acquire()
    before = command_calls(client)
    parked_for_its_retry(client, run)
    assert calls_since(client, before) == {"evalsha": 1, "get": 1, "exists": 1, "set": 1, "zrange": 1}
    client.delete(name)


def test_a_copy_watching_a_hold_is_woken_when_its_run_parks_it_for_its_retry(
    fresh_server: RedisServer, prefix: str
) -> None:
    """The run a copy watches retries and parks its hold for its retry's message (``PARK``): the
    copy is woken at once with ``PARKED``, out of the queue (not left waiting until its deadline,
    a renewal interval, to take the parked hold for a live run's); the hold is parked unmarked,
    and the retry adopts it, its fence above the run's."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    run.acquire()
    fence = run.fence or 0
    got, retry_token = woken_copy(client, run, lambda: parked_for_its_retry(client, run))
    assert got == PARKED
    assert text(stored(client, name)) == f"{retry_token}:{fence}:{RETRY}"
    own = secrets.token_hex(16)
    adopted = ADOPT(client, [name], [retry_token, own, 600_000, RETRY.replace("queued", "running")])
    assert isinstance(adopted, int) and adopted > fence
    assert stored(client, name)[:32].decode() == own
    client.delete(name)
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


@pytest.mark.parametrize("period_ms", [0, 600_000], ids=["freed", "kept"])
def test_a_copy_watching_a_hold_is_woken_when_its_run_lets_go_of_it_for_a_declined_retry(
    fresh_server: RedisServer, prefix: str, period_ms: int
) -> None:
    """The run a copy watches retries, and its retry declined the hold already (``DECLINE``: it
    failed before adopting it): the park lets go of the hold instead, freed or kept for what is
    left of the period. The copy is woken at once with ``PARKED`` (its run handed the hold on),
    out of the queue: not handed the freed hold as the first waiter, nor left waiting for a
    renewal of a kept one that never comes, to take the run for alive."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    run.acquire()
    fence, retry_token = run.fence or 0, secrets.token_hex(16)
    assert DECLINE(client, [name], [retry_token, 60_000, period_ms]) == 0  # marked: not parked yet

    def park() -> Any:
        let_go = PARK(client, [name], [run.stop_renewing(), RUN, retry_token, RETRY, 600_000, period_ms])
        run.forget()
        return let_go

    assert woken_copy(client, run, park) == (PARKED, 2 if period_ms == 0 else 3)
    if period_ms:
        assert text(stored(client, name)) == f"{KEPT_TOKEN}:{fence}:{RUN}"
    else:
        assert not client.exists(name)
    client.delete(name, companion_key(name, f"declined:{retry_token}"))
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


@pytest.mark.parametrize("adopted", [False, True], ids=["parked", "adopted"])
def test_a_copy_that_finds_its_runs_hold_parked_already_learns_that_it_retried(
    fresh_server: RedisServer, prefix: str, adopted: bool
) -> None:
    """The run parks its hold for its retry's message between the copy's read of the hold and
    its ``WATCH`` (or the retry has adopted it since): the watch finds the retry's holder, a
    later attempt of the run's task id. The copy learns that the run retried (``"parked"``),
    not that a live run holds on (``"alive"``), and leaves nothing behind."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run, copy = (RedisLock(client, name, ttl=LEASE, holder=h) for h in (RUN, COPY))
    run.acquire()
    retry_token = parked_for_its_retry(client, run)
    if adopted:
        assert ADOPT(client, [name], [retry_token, "c" * 32, 600_000, RETRY.replace("queued", "running")]) > 0
    now = time.monotonic()
    found = Found(None, None, copy, None, (), {}, RUN, LEASE, now, now, now)  # type: ignore[arg-type]
    assert redelivery.watch_until(found, now + LEASE, now + 30) == "parked"
    client.delete(name)
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


@pytest.mark.parametrize("ending", ["kept", "parked"])
def test_a_copy_woken_by_its_runs_end_before_its_first_attempt_leaves_the_queue(
    fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """The run keeps its hold for its period, or parks it for its retry, between the copy's
    ``WATCH`` and the copy's first attempt, which queues the copy again (the keep or the park
    took it out): the copy, woken, learns how the run ended and leaves the queue, so that
    nothing of it is left (``redelivery.watch_until``)."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run, copy = (RedisLock(client, name, ttl=LEASE, holder=h) for h in (RUN, COPY))
    run.acquire()
    fence, owner = run.fence, []

    def watch_then_end(lock: RedisLock, holder: str, token: str) -> int | None:
        watched = watch(lock, holder, token)
        if ending == "kept":
            kept_for_its_period(client, run)
            owner.append((KEPT_TOKEN, RUN))
        else:
            owner.append((parked_for_its_retry(client, run), RETRY))
        return watched

    monkeypatch.setattr(run_lock, "watch", watch_then_end)
    now = time.monotonic()
    found = Found(None, None, copy, None, (), {}, RUN, LEASE, now, now, now)  # type: ignore[arg-type]
    assert redelivery.watch_until(found, time.monotonic() + LEASE, time.monotonic() + 30) == ending
    token, holder = owner[0]
    assert text(stored(client, name)) == f"{token}:{fence}:{holder}"
    client.delete(name)
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


def test_a_watcher_gone_past_its_deadline_is_neither_handed_the_hold_nor_keeps_the_watch(
    client: redis.Redis, prefix: str
) -> None:
    """A copy (or a later attempt, ``busy``) that watches a run's hold dies while queued (its
    process SIGKILLed: nothing takes it out of the queue); its member stays queued past its
    deadline, which evicts a dead waiter everywhere else (another waiter keeps the queue
    alive). A second copy's ``WATCH`` then takes
    the watch over (before: 0, "another copy watches it", and the copy was ignored as while its
    first delivery runs), and the run's release hands the hold to the live copy, never to the
    dead one (before: handed to the dead token, which held the key, unrenewed, for its ttl)."""
    name = f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    dead, again = (RedisLock(client, name, ttl=0.1, watchdog=False, holder=COPY) for _ in range(2))
    run.acquire()
    fence, gone = run.fence, secrets.token_hex(16)
    assert watch(dead, RUN, gone) == fence  # queued, then never calls again
    deadlines = companion_key(name, "waiters")
    queued: list[Any] = client.zrange(deadlines, 0, -1, withscores=True)
    ((_, dead_by),) = queued  # the dead watcher's deadline (server ms)
    other = RedisLock(client, name, ttl=LEASE)  # a live waiter: the queue outlives the dead one
    other_thread = threading.Thread(target=lambda: other.acquire(timeout=60))
    other_thread.start()
    wait_until_queued(client, name, 2)

    def server_ms() -> float:
        seconds, micros = client.time()
        return int(seconds) * 1000 + int(micros) / 1000

    wait_for(lambda: server_ms() > dead_by, what="the dead watcher's deadline to pass")
    token = secrets.token_hex(16)
    assert watch(again, RUN, token) == fence  # the watch is the live copy's now
    assert text(stored(client, name))[32:64] == token
    thread, got = waiting_as(again, token)
    run.release()
    thread.join()
    assert got == [fence]
    assert parse_value(stored(client, name)) == (token, fence, COPY)
    assert other_thread.is_alive()  # still waiting: the hold went to the live copy
    assert again.servers.free(token)  # the copy lets go: the other waiter is woken
    other_thread.join()
    assert other.owned()
    other.release()
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


#: The holder of a later attempt of the run's task id (``busy``'s earlier-run wait).
LATER = "task=t1 try=2 state=running node=second@host pid=3"


def test_a_later_attempt_watching_a_parked_hold_is_woken_by_how_its_adopter_ends_it(
    fresh_server: RedisServer, prefix: str
) -> None:
    """A later attempt of the task id (an ``until_expired`` retry back to these arguments) waits
    for the hold its earlier attempt parked for its own retry, watching it (``WATCH``); that retry
    adopts it (``ADOPT``), runs, and keeps it for its period (``SETTLE``): the watch goes with
    the hold, so the later attempt is woken with ``KEPT`` and meets the kept hold with
    ``lock_busy``, not left waiting until ``lock_wait_timeout`` (before: the adoption dropped the
    watch, and the wait ran to its deadline)."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    run.acquire()
    retry_token = parked_for_its_retry(client, run)
    later, token = RedisLock(client, name, ttl=LEASE, holder=LATER), secrets.token_hex(16)
    fence = watch(later, RETRY, token)
    assert fence is not None and fence > 0
    thread, got = waiting_as(later, token)
    wait_for(lambda: client.info("clients")["blocked_clients"] == 1, what="the later attempt to wait")
    own = secrets.token_hex(16)
    adopted = ADOPT(client, [name], [retry_token, own, 600_000, RETRY.replace("queued", "running")])
    assert isinstance(adopted, int) and adopted > fence
    watcher = text(stored(client, name))[32:64]
    assert SETTLE(client, [name], [own, 600_000, adopted]) > 0
    thread.join()  # its wait ends by itself within 10 s
    assert (watcher, got) == (token, [KEPT]), "the adoption dropped the watch: the keep woke no one"
    assert text(stored(client, name)) == f"{KEPT_TOKEN}:{adopted}:{RETRY.replace('queued', 'running')}"
    client.delete(name)
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


@pytest.mark.parametrize("ending", ["kept", "parked"])
def test_a_later_attempt_that_meets_the_hold_again_waits_no_longer_than_lock_wait_timeout(
    fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """A later attempt of the task id (``until_expired``, ``lock_busy="wait"``) waits for its
    earlier attempt's hold (``busy``'s earlier-run wait), is woken as that run keeps the hold for
    its period, or parks it for a retry, and meets the hold again (``lock_busy``): its wait
    for that hold ends by the deadline its wait began with, ``lock_wait_timeout`` being the
    longest wait (before: a new ``lock_wait_timeout`` from then on, each hold met again
    adding one)."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    run.acquire()
    later = RedisLock(client, name, ttl=LEASE, holder=LATER)
    wait_timeout, timeouts, acquire = 600.0, list[float | None](), later.acquire

    def recorded(blocking: bool = True, timeout: float | None = None) -> bool:
        if not blocking:
            return acquire(blocking=False)
        timeouts.append(timeout)  # the wait for the hold met again: not waited here
        return False

    monkeypatch.setattr(later, "acquire", recorded)
    rules = SimpleNamespace(settles=True, adopts_ticket=False)
    options = SimpleNamespace(rules=rules, wait_timeout=wait_timeout, ttl=LEASE, busy="wait")
    now, task = time.monotonic(), type("Task", (), {"name": "t", "app": SimpleNamespace()})()
    found = Found(task, options, later, None, (), {}, RUN, LEASE, now, now, now)  # type: ignore[arg-type]

    def end_once_waited_for() -> None:
        wait_until_queued(client, name)
        kept_for_its_period(client, run) if ending == "kept" else parked_for_its_retry(client, run)

    ended = threading.Thread(target=end_once_waited_for)
    ended.start()
    with pytest.raises(LockNotAcquired):
        busy._earlier_run(found)
    ended.join()
    assert len(timeouts) == 1 and timeouts[0] is not None
    assert timeouts[0] < wait_timeout, "the wait for the hold met again began a new lock_wait_timeout"
    client.delete(name)
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


def waiting_run(own: RedisLock) -> Found:
    """What a later attempt of the run's task id (holder ``LATER``) knows of the run's hold it
    found (``busy``'s earlier-run wait, ``until_expired``: its mode keeps holds), waiting with
    the lock object ``own``; a redelivered copy's wait reads only what the two share."""
    options = SimpleNamespace(rules=SimpleNamespace(settles=True), wait_timeout=30.0, ttl=LEASE)
    now = time.monotonic()
    return Found(None, options, own, None, (), {}, RUN, LEASE, now, now, now)  # type: ignore[arg-type]


def interrupted_as_the_run_lets_go(
    client: redis.Redis, name: str, run: RedisLock, wait: Callable[[], Any]
) -> None:
    """``wait`` (a waiter's wait for ``run``'s hold of ``name``) is cut short by ``Interrupt``
    once ``run`` released, handing the hold over: nothing is left of that hold."""

    def release_once_waited_for() -> None:
        wait_until_queued(client, name)
        run.release()

    ended = threading.Thread(target=release_once_waited_for)
    ended.start()
    with pytest.raises(Interrupt):
        wait()
    ended.join()
    assert not client.exists(name), "the hold handed over stayed with a token nobody knows"


def copy_or_later(kind: str, client: redis.Redis, name: str) -> tuple[RedisLock, Callable[[Found], object]]:
    """The waiter of ``kind`` for the run's hold of ``name``, and how it waits: a redelivered copy
    (``redelivery.watch_until``) or a later attempt (``busy``'s earlier-run wait)."""
    if kind == "copy":
        until = time.monotonic() + 30
        return RedisLock(client, name, ttl=LEASE, holder=COPY), lambda f: redelivery.watch_until(
            f, until, until
        )
    return RedisLock(client, name, ttl=LEASE, holder=LATER), busy._earlier_run


@pytest.mark.parametrize("kind", ["copy", "later_attempt"])
def test_a_watcher_interrupted_as_its_watch_is_answered_leaves_no_watch_behind(
    fresh_server: RedisServer, prefix: str, interrupt_read: Arm, kind: str
) -> None:
    """An interrupt (a soft time limit) lands as the reply of the waiter's ``WATCH`` is read: the
    script ran, queueing a token nothing else knows as the hold's watcher. The waiter gives it
    up on the way out, so the run's release frees the lock at once (before: handed to that
    token, which held the key, unrenewed, for a lease)."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    waiter, wait = copy_or_later(kind, client, name)
    assert watch(waiter, RUN, secrets.token_hex(16)) is None  # the script loaded: its reply is the one read
    run.acquire()
    fired = interrupt_read(on_this_thread())
    with pytest.raises(Interrupt):
        wait(waiting_run(waiter))
    assert fired
    run.release()
    assert not client.exists(name), "the release handed the hold to the interrupted watcher"
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


@pytest.mark.parametrize("kind", ["copy", "later_attempt"])
def test_a_watcher_interrupted_before_its_wait_begins_leaves_no_watch_behind(
    fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """An interrupt (a soft time limit) lands once the waiter's ``WATCH`` is answered, before its
    wait for how the hold ends begins (the entry of ``wait_as``): the token ``WATCH`` queued as
    the hold's watcher, which nothing else knows, is given up on the way out, so the run's
    release frees the lock at once (before: handed to that token, which held the key,
    unrenewed, for a lease)."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    waiter, wait = copy_or_later(kind, client, name)
    run.acquire()

    def interrupted(*_: object, **__: object) -> None:
        raise Interrupt

    monkeypatch.setattr(waiter, "wait_as", interrupted)
    with pytest.raises(Interrupt):
        wait(waiting_run(waiter))
    run.release()
    assert not client.exists(name), "the release handed the hold to the interrupted watcher"
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


@pytest.mark.parametrize("kind", ["copy", "later_attempt"])
def test_a_watcher_interrupted_as_its_wait_returns_the_hold_handed_to_it_gives_it_back(
    fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The run's release hands its watched hold to the waiter (its token, which nothing else
    knows), and an interrupt (a soft time limit) lands right after the watch and wait return
    that (``run_lock.watch_end``): the hold is given back at once (before: kept, unrenewed, for
    a lease)."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    run.acquire()
    waiter, wait = copy_or_later(kind, client, name)
    module = redelivery if kind == "copy" else busy

    def interrupted(*args: Any) -> tuple[int | None, int | None]:
        watched, fence = run_lock.watch_end(*args)
        assert fence == watched  # handed over
        raise Interrupt

    monkeypatch.setattr(module, "watch_end", interrupted)

    interrupted_as_the_run_lets_go(client, name, run, lambda: wait(waiting_run(waiter)))
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


@pytest.mark.parametrize("limit", [1, 2], ids=["lock", "permit"])
def test_a_watch_sent_again_after_its_hold_was_handed_to_it_learns_the_run_let_go(
    fresh_server: RedisServer, prefix: str, limit: int
) -> None:
    """A redelivered copy's ``WATCH`` (with ``lock_limit`` above 1, ``WATCH_PERMIT``) runs, its
    reply is lost, and the run releases its hold before the client's retry policy sends the
    watch again: the release handed the hold to the copy's token. The second run answers as the
    first did (the fence), so the copy takes the hold handed to it as its run letting go
    (``"alive"``) and frees it (before: it found the hold no longer the run's and left it,
    unrenewed, to a token nothing knows for a lease)."""
    run_client, copy_client, name = fresh_server.client(), fresh_server.client(), f"{prefix}:k"
    run, copy = (
        RedisLock(client, name, ttl=LEASE, holder=h)
        if limit == 1
        else RedisSemaphore(client, name, limit, ttl=LEASE, holder=h)
        for client, h in ((run_client, RUN), (copy_client, COPY))
    )
    assert watch(copy, RUN, secrets.token_hex(16)) is None  # the scripts loaded: the watch's reply is lost
    run.acquire()
    fence, now = run.fence, time.monotonic()
    found = Found(None, None, copy, None, (), {}, RUN, LEASE, now, now, now)  # type: ignore[arg-type]
    with first_reply_lost(WATCH if limit == 1 else WATCH_PERMIT, then=run.release) as lost:
        assert redelivery.watch_until(found, now + LEASE, now + 30) == "alive"
    assert lost == [fence]  # the first run watched the hold
    assert sorted(copy_client.scan_iter(match=f"*{prefix}*")) == [], "the hold handed over was left"


@pytest.mark.parametrize("kind", ["copy", "later_attempt"])
def test_a_hold_handed_to_a_watcher_as_an_interrupt_lands_is_given_back(
    fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The run's release hands its watched hold to the waiter (its token, which nothing else
    knows), then an interrupt (a soft time limit) lands before the waiter frees it (a redelivered
    copy: the first delivery let go) or adopts it (a later attempt, ``ADOPT``): it is given back
    at once (before: kept, unrenewed, for a lease)."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run = RedisLock(client, name, ttl=LEASE, holder=RUN)
    run.acquire()
    waiter, wait = copy_or_later(kind, client, name)

    def interrupted(*_: object) -> None:
        raise Interrupt

    if kind == "copy":
        monkeypatch.setattr(waiter.servers, "free", interrupted)
    else:
        monkeypatch.setattr(busy, "adopt", interrupted)

    interrupted_as_the_run_lets_go(client, name, run, lambda: wait(waiting_run(waiter)))
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []


def test_a_copy_that_finds_the_hold_watched_already_says_so_as_it_is_ignored(
    fresh_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy of the message comes while another copy of it, or a later attempt of its task id,
    watches the run's hold (``WATCH`` answers 0): that one acts on how the hold ends, so this
    copy is ignored, saying so (before: "while its first delivery runs", which it cannot know:
    that delivery may have died, its watcher left to find out)."""
    client, name = fresh_server.client(), f"{prefix}:k"
    run, first_copy = (RedisLock(client, name, ttl=LEASE, holder=h) for h in (RUN, LATER))
    run.acquire()
    watcher = secrets.token_hex(16)
    assert watch(first_copy, RUN, watcher) == run.fence
    copy = RedisLock(client, name, ttl=LEASE, holder=COPY)
    task = SimpleNamespace(name="t")
    found = replace(waiting_run(copy), task=task)
    with caplog.at_level(logging.INFO, logger="celery_redislock.busy"), pytest.raises(Ignore):
        busy._redelivered(found)
    assert (
        "redelivered while another copy or a later attempt waits for its first delivery; ignored"
        in caplog.text
    )
    first_copy.servers.abandon(watcher, first_copy.member(watcher))
    run.release()
    assert sorted(client.scan_iter(match=f"*{prefix}*")) == []
