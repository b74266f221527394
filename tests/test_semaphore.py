"""RedisSemaphore on a real redis-server: permits, owner checks, expiry, wake-ups, fairness, a stress test."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from celery_redislock import LockConfigurationError, LockNotAcquired, LockNotOwned, RedisLock, RedisSemaphore
from celery_redislock.lock import companion_key
from celery_redislock.semaphore import release_permit_held_by
from celery_redislock.signals import lock_lost
from celery_redislock.testing import RedisClusterServers, RedisServer
from tests import invariants
from tests.conftest import calls_since, command_calls
from tests.taskapp import LEASE, text
from tests.workers import wait_for

ROOT = Path(__file__).resolve().parent.parent


def permit(name: str, i: int) -> str:
    return companion_key(name, f"permit:{i}")


def queued(client: redis.Redis, name: str) -> int:
    return int(client.zcard(companion_key(name, "queue")))


def has_queued(client: redis.Redis, name: str, count: int) -> bool:
    return queued(client, name) == count


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    connection = redis_server.client()
    yield connection
    connection.close()


def test_up_to_limit_holders_each_with_its_own_token_fence_and_lease(
    client: redis.Redis, prefix: str
) -> None:
    name = f"{prefix}:s"
    first, second, third = (RedisSemaphore(client, name, 2, ttl=10, holder=f"h{i}") for i in range(3))
    assert not first.locked() and not first.owned()
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    assert first.token != second.token
    assert isinstance(first.fence, int) and isinstance(second.fence, int) and second.fence > first.fence
    assert first.locked() and first.owned() and second.owned()
    assert not third.acquire(blocking=False)
    holder, ttl = third.busy
    assert holder in ("h0", "h1") and ttl is not None and 0 < ttl <= 10
    assert not third.owned()
    assert {client.get(permit(name, 1)), client.get(permit(name, 2))} == {
        f"{first.token}:{first.fence}:h0".encode(),
        f"{second.token}:{second.fence}:h1".encode(),
    }
    assert 0 < client.pttl(permit(name, 1)) <= 10_000 and 0 < client.pttl(permit(name, 2)) <= 10_000
    assert not client.exists(name)  # the name itself is never written
    first.release()
    assert not first.owned() and first.token is None and first.fence is None
    assert third.acquire(blocking=False)
    assert third.fence is not None and third.fence > second.fence
    second.release()
    third.release()
    assert invariants.keys_of(client, prefix) == []


def test_reentrant_per_object_and_the_with_block(client: redis.Redis, prefix: str) -> None:
    name = f"{prefix}:s"
    semaphore = RedisSemaphore(client, name, 1, ttl=10)
    with semaphore:
        fence = semaphore.fence
        assert semaphore.acquire() and semaphore.hold_count == 2 and semaphore.fence == fence
        semaphore.release()
        assert semaphore.owned()
        other = RedisSemaphore(client, name, 1, ttl=10, holder="other")
        with pytest.raises(LockNotAcquired) as caught, RedisSemaphore(client, name, 1, ttl=10, timeout=0.05):
            pass
        assert caught.value.key == name
        assert not other.acquire(blocking=False)
    assert not semaphore.owned() and not semaphore.locked()
    with pytest.raises(LockNotOwned):
        semaphore.release()


def test_extend_sets_the_permits_ttl_owner_checked(client: redis.Redis, prefix: str) -> None:
    name = f"{prefix}:s"
    semaphore = RedisSemaphore(client, name, 3, ttl=10, watchdog=False)
    assert semaphore.acquire()
    semaphore.extend(60)
    assert 10_000 < client.pttl(permit(name, 1)) <= 60_000
    semaphore.extend(5)  # replaces the TTL, never adds
    assert 0 < client.pttl(permit(name, 1)) <= 5_000
    semaphore.release()
    with pytest.raises(LockNotOwned):
        semaphore.extend()


def test_a_permit_taken_over_is_not_released_or_extended_by_its_old_holder(
    client: redis.Redis, prefix: str
) -> None:
    name = f"{prefix}:s"
    old = RedisSemaphore(client, name, 1, ttl=10, watchdog=False)
    assert old.acquire()
    client.delete(permit(name, 1))  # as if its lease ran out unrenewed
    new = RedisSemaphore(client, name, 1, ttl=10)
    assert new.acquire(blocking=False)
    assert new.fence is not None and old.fence is not None and new.fence > old.fence
    assert not old.owned()
    with pytest.raises(LockNotOwned):
        old.extend()
    assert old.lost.is_set()
    with pytest.raises(LockNotOwned):
        old.release()
    assert new.owned()
    new.release()


def test_the_watchdog_renews_each_permit_past_its_lease(client: redis.Redis, prefix: str) -> None:
    name = f"{prefix}:s"
    holders = [RedisSemaphore(client, name, 2, ttl=LEASE) for _ in range(2)]
    for holder in holders:
        assert holder.acquire()
    waiter = RedisSemaphore(client, name, 2, ttl=LEASE)
    assert not waiter.acquire(timeout=1.5 * LEASE)  # still held past the lease: renewed
    assert all(holder.owned() for holder in holders)
    for holder in holders:
        holder.release()


def test_a_locks_hold_of_the_name_takes_one_of_the_places(client: redis.Redis, prefix: str) -> None:
    """A task's ``lock_limit`` raised from 1 while a run holds the lock (the name's own key)."""
    name = f"{prefix}:s"
    lock = RedisLock(client, name, ttl=10, holder="the lock's run")
    assert lock.acquire()
    first, second = (RedisSemaphore(client, name, 2, ttl=10, holder=f"h{i}") for i in range(2))
    assert first.acquire(blocking=False)
    assert not second.acquire(blocking=False)
    assert second.busy[0] in ("the lock's run", "h0")
    lock.release()
    assert second.acquire(blocking=False)
    first.release()
    second.release()


@pytest.mark.parametrize("fair", [False, True])
def test_a_permits_fence_is_above_a_live_lock_hold_of_the_name_after_the_clock_went_back(
    client: redis.Redis, prefix: str, fair: bool
) -> None:
    """A lock's hold of the name (a run from before ``lock_limit`` was raised from 1) is a live
    holder of the name: a permit granted beside it gets a greater fence, as it does beside a
    live permit, also when the server clock has gone back since that hold was granted (its fence
    ahead of TIME, written here as such a clock leaves it). Before, only the permits' fences were
    looked at: the permit got TIME, below the live lock's fence."""
    name = f"{prefix}:s"
    lock = RedisLock(client, name, ttl=10, holder="the lock's run", watchdog=False)
    assert lock.acquire() and lock.fence is not None
    ahead = lock.fence + 3_600_000_000  # granted an hour "later" than TIME now reads
    client.set(name, f"{lock.token}:{ahead}:the lock's run", keepttl=True)
    semaphore = RedisSemaphore(client, name, 2, ttl=10, fair=fair)
    assert semaphore.acquire(blocking=False)
    assert semaphore.fence is not None and semaphore.fence > ahead
    semaphore.release()
    client.delete(name)


def test_permits_refuse_a_replica_confirmation(client: redis.Redis, prefix: str) -> None:
    """``Permits`` is a lock's server by inheritance; the lock's confirmation, which acts on the
    never-written name, is not one of its members."""
    semaphore = RedisSemaphore(client, f"{prefix}:s", 2, ttl=10)
    assert semaphore.acquire()
    with pytest.raises(LockConfigurationError, match="permits are not confirmed by replicas"):
        semaphore.servers.confirm(semaphore.token or "", "")
    assert semaphore.owned()
    semaphore.release()


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2", None, 1001])
def test_a_bad_limit_is_refused_naming_it_and_writes_nothing(
    client: redis.Redis, prefix: str, limit: object
) -> None:
    with pytest.raises(LockConfigurationError, match="limit must be an int from 1 to 1000"):
        RedisSemaphore(client, f"{prefix}:s", limit)  # type: ignore[arg-type]
    assert invariants.keys_of(client, prefix) == []


def test_bad_arguments_are_refused_as_a_locks_are(client: redis.Redis, prefix: str) -> None:
    with pytest.raises(LockConfigurationError, match="client must be"):
        RedisSemaphore("redis://127.0.0.1", f"{prefix}:s", 2)  # type: ignore[arg-type]
    with pytest.raises(LockConfigurationError, match="ttl must be"):
        RedisSemaphore(client, f"{prefix}:s", 2, ttl=0)
    with pytest.raises(LockConfigurationError, match="name must be"):
        RedisSemaphore(client, "", 2)
    with pytest.raises(LockConfigurationError, match="is a hash tag alone"):
        RedisSemaphore(client, "{" + prefix + "}", 2)  # its permits would be the semaphore prefix's
    assert invariants.keys_of(client, prefix) == []


@contextlib.contextmanager
def holder_processes(
    server: RedisServer,
    name: str,
    limit: int,
    lease: float,
    rounds: int,
    count: int,
    log: str = "",
    pauses: tuple[int, ...] = (),
) -> Iterator[list[subprocess.Popen[str]]]:
    """``count`` processes of ``tests.semaphore_holder`` (see there), process i stopping itself in
    round ``pauses[i]`` (if any); each stopped by its pid at the end."""
    arguments = [server.url, name, str(limit), str(lease), str(rounds), log]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.semaphore_holder",
                *arguments,
                *[str(pause) for pause in pauses[i : i + 1]],
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    try:
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)  # a frozen one, too, is killed
                os.kill(process.pid, signal.SIGKILL)
                process.wait()


def test_a_killed_holders_permit_frees_within_its_lease(
    redis_server: RedisServer, client: redis.Redis, prefix: str
) -> None:
    name = f"{prefix}:s"
    with holder_processes(redis_server, name, 2, LEASE, 0, 1) as [holder]:
        assert holder.stdout is not None and holder.stdout.readline().startswith("acquired")
        mine = RedisSemaphore(client, name, 2, ttl=LEASE)
        assert mine.acquire(blocking=False)
        waiter = RedisSemaphore(client, name, 2, ttl=LEASE)
        assert not waiter.acquire(timeout=1.5 * LEASE)  # renewed by the holder's watchdog
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        theirs = next(key for key in mine.servers.book.keys if key != mine.servers.book.key_of(mine.token))
        assert 0 < client.pttl(theirs) <= LEASE * 1000  # nobody renews it now: gone within one lease
        assert waiter.acquire(timeout=10 * LEASE)
        assert waiter.servers.book.key_of(waiter.token) == theirs
        waiter.release()
        mine.release()


def _wait_in_thread(semaphore: RedisSemaphore, results: list[bool]) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(semaphore.acquire(timeout=30)))
    thread.start()
    return thread


@pytest.mark.parametrize("fair", [False, True], ids=["first-come", "fair"])
def test_a_waiter_is_woken_by_a_release_not_by_polling(client: redis.Redis, prefix: str, fair: bool) -> None:
    name = f"{prefix}:s"
    warm = RedisSemaphore(client, f"{name}-warm", 1, ttl=60, fair=fair)
    assert warm.acquire()  # its scripts loaded: a fresh server's NOSCRIPT resend is not counted
    warm.release()
    holder = RedisSemaphore(client, name, 1, ttl=60, fair=fair)  # its lease: the waiter's longest sleep
    assert holder.acquire()
    before = command_calls(client)
    waiter = RedisSemaphore(client, name, 1, ttl=60, fair=fair)
    results: list[bool] = []
    thread = _wait_in_thread(waiter, results)
    wait_for(lambda: queued(client, name) == 1, 10, "the waiter queued")
    holder.release()
    thread.join(30)
    assert results == [True] and waiter.owned()
    calls = calls_since(client, before)
    # The waiter: one attempt (queued), one BLPOP ended by the release, and (first-come
    # only) one attempt to take the permit the release left free; the holder: the release.
    assert calls["blpop"] == 1
    assert calls["evalsha"] == (2 if fair else 3)
    waiter.release()


def test_a_fair_waiter_is_served_when_a_permit_runs_out_unreleased(client: redis.Redis, prefix: str) -> None:
    """No release wakes the waiters: the first wakes when the permit's TTL runs out and is served
    first; the second, woken as well, stays queued behind it."""
    name = f"{prefix}:s"
    holder = RedisSemaphore(client, name, 1, ttl=0.5, watchdog=False, fair=True)  # it never renews
    assert holder.acquire()
    first, second = (RedisSemaphore(client, name, 1, ttl=30, fair=True) for _ in range(2))
    first_results: list[bool] = []
    second_results: list[bool] = []
    first_thread = _wait_in_thread(first, first_results)
    wait_for(lambda: queued(client, name) == 1, 10, "the first waiter queued")
    second_thread = _wait_in_thread(second, second_results)
    wait_for(lambda: queued(client, name) == 2, 10, "the second waiter queued")
    first_thread.join(30)
    assert first_results == [True] and first.owned() and not holder.owned()
    assert first.fence is not None and holder.fence is not None and first.fence > holder.fence
    assert not second.owned() and queued(client, name) == 1  # still waiting, its place kept
    first.release()
    second_thread.join(30)
    assert second_results == [True] and second.owned()
    second.release()
    with pytest.raises(LockNotOwned):
        holder.release()


def test_the_crash_release_frees_only_the_dead_holders_permit(client: redis.Redis, prefix: str) -> None:
    """``release_permit_held_by`` (the worker's main process, after a pool child died) frees the
    permit its holder holds, and leaves alone one taken over by someone else after it ran out."""
    name = f"{prefix}:s"
    dead, alive = (RedisSemaphore(client, name, 2, ttl=10, holder=f"task=t{i} try=0") for i in range(2))
    assert dead.acquire() and alive.acquire()
    dead_key = dead.servers.book.key_of(dead.token)
    assert dead_key is not None
    client.delete(dead_key)  # its lease ran out
    taker = RedisSemaphore(client, name, 2, ttl=10, holder="task=t2 try=0")
    assert taker.acquire(blocking=False) and taker.servers.book.key_of(taker.token) == dead_key
    assert not release_permit_held_by(client, name, 2, "task=t0 try=0")  # its permit is the taker's now
    assert taker.owned() and alive.owned()
    assert release_permit_held_by(client, name, 2, "task=t1 try=0")
    assert not alive.owned() and taker.owned()
    taker.release()
    for gone in (dead, alive):
        with pytest.raises(LockNotOwned):
            gone.release()


def test_fair_waiters_are_served_in_arrival_order(client: redis.Redis, prefix: str) -> None:
    name = f"{prefix}:s"
    holders = [RedisSemaphore(client, name, 2, ttl=30, fair=True) for _ in range(2)]
    for holder in holders:
        assert holder.acquire()
    grants: list[tuple[int, int]] = []
    lock = threading.Lock()

    def wait(index: int) -> None:
        semaphore = RedisSemaphore(client, name, 2, ttl=30, fair=True)
        assert semaphore.acquire(timeout=30)
        with lock:
            grants.append((semaphore.fence or 0, index))
        semaphore.release()

    threads = []
    for index in range(5):
        threads.append(threading.Thread(target=wait, args=(index,)))
        threads[-1].start()
        wait_for(functools.partial(has_queued, client, name, index + 1), 10, f"waiter {index} queued")
    first_come = RedisSemaphore(client, name, 2, ttl=30, fair=True)
    assert not first_come.acquire(blocking=False)  # a fair newcomer does not pass the queue
    for holder in holders:
        holder.release()
    for thread in threads:
        thread.join(30)
    assert [index for _, index in sorted(grants)] == [0, 1, 2, 3, 4]


def _most_at_once(holds: list[tuple[int, int]]) -> int:
    """The most holds (start, end) that overlap in time."""
    events = sorted([(start, 1) for start, _ in holds] + [(end, -1) for _, end in holds])
    most = inside = 0
    for _, step in events:  # at equal times an exit (-1) sorts before an entry
        inside += step
        most = max(most, inside)
    return most


def _stopped(pid: int) -> bool:
    """Whether the process ``pid`` is stopped (by a signal)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


def test_stress_never_more_than_limit_owning_holders(
    redis_server: RedisServer, client: redis.Redis, prefix: str
) -> None:
    """Seven processes take and give back permits of a semaphore of 3, 25 times each; four of
    them freeze (SIGSTOP) once while holding a permit and are resumed past their lease. Every
    hold counts, from its grant to the end of its body (or to when its holder learnt of its loss):
    holds overlap more than 3 at once only with a lost one among them, and a hold is lost only
    where it outlived its lease (only a pause explains that): a permit is never taken from a
    holder that renews it."""
    name, log, limit, lease = f"{prefix}:s", f"{prefix}:log", 3, 0.6
    pauses = (2, 5, 8, 11)
    with (
        holder_processes(redis_server, name, limit, lease, 25, 7, log, pauses) as processes,
        invariants.Sampler(client, prefix),
    ):
        for frozen in processes[: len(pauses)]:
            # the first wait includes the seven processes' start-up: slow on a loaded machine
            wait_for(functools.partial(_stopped, frozen.pid), what="a holder frozen holding its permit")
            time.sleep(2 * lease)  # the pause injected, not a synchronisation
            os.kill(frozen.pid, signal.SIGCONT)
        for process in processes:
            assert process.wait(60) == 0
    records = [[int(field) for field in text(entry).split()] for entry in client.lrange(log, 0, -1)]
    client.delete(log)
    assert len(records) == 7 * 25
    assert len({fence for fence, _, _ in records}) == len(records)  # every permit had a fence of its own
    lost = [(fence, end) for fence, end, released in records if not released]
    kept = [(fence, end) for fence, end, released in records if released]
    assert len(lost) >= len(pauses)  # each frozen holder's permit ran out under it
    assert all(end - fence > lease * 1_000_000 for fence, end in lost)  # lost only past its lease
    assert _most_at_once(kept + lost) > limit  # the pauses crowded the semaphore, by lost holds only:
    assert _most_at_once(kept) <= limit  # the holds that kept their permit: never more than allowed


def test_on_a_cluster_every_key_of_a_semaphore_is_in_its_names_slot(
    cluster: RedisClusterServers, prefix: str
) -> None:
    name = f"{prefix}:s"
    client = cluster.client()
    try:
        holders = [RedisSemaphore(client, name, 2, ttl=30, fair=True) for _ in range(2)]
        for holder in holders:
            assert holder.acquire()
        waiter = RedisSemaphore(client, name, 2, ttl=30, fair=True)
        results: list[bool] = []
        thread = _wait_in_thread(waiter, results)
        wait_for(lambda: client.zcard(companion_key(name, "queue")) == 1, 10, "the waiter queued")
        node = client.get_node_from_key(name)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        keys = list(node.redis_connection.scan_iter(match=f"{{{prefix}*"))
        assert len(keys) == 4  # two permits, the queue and the deadlines
        assert {key_slot(key) for key in keys} == {key_slot(name.encode())}
        assert all(node.redis_connection.pttl(key) > 0 for key in keys)
        holders[0].release()
        thread.join(30)
        assert results == [True] and waiter.owned() and not waiter.lost.is_set()
        waiter.release()
        holders[1].release()
        assert not any(node.redis_connection.exists(key) for key in keys)
    finally:
        client.close()


@pytest.mark.parametrize("fair", [True, False])
def test_a_first_wait_sent_again_and_granted_leaves_the_queue(
    client: redis.Redis, prefix: str, fair: bool
) -> None:
    """``ACQUIRE_PERMIT`` answers a call sent again as the first send would have: a first
    ``'wait'`` whose first run queued the caller (its reply lost), granted a permit when sent
    again (the holder's lease ran out meanwhile), leaves the queue, so that its release does
    not grant the permit back to the call that is over, nor wake it in another's stead."""
    from celery_redislock._permit_scripts import ACQUIRE_PERMIT, RELEASE_PERMIT
    from celery_redislock.attempt import waiter_member

    name = f"{prefix}:s"
    holder, waiter = secrets.token_hex(16), secrets.token_hex(16)
    member = waiter_member(5000, waiter, fair, "w")
    first = waiter_member(5000, holder, fair, "h")
    assert isinstance(ACQUIRE_PERMIT(client, [name], [first, "try", 1]), bytes)
    assert isinstance(ACQUIRE_PERMIT(client, [name], [member, "wait", 1]), list)  # queued; the reply lost
    client.delete(companion_key(name, "permit:1"))  # the holder's lease runs out
    assert isinstance(ACQUIRE_PERMIT(client, [name], [member, "wait", 1]), bytes)  # the call sent again
    assert client.zcard(companion_key(name, "queue")) == 0
    assert RELEASE_PERMIT(client, [name], [waiter, "", 1]) == 1
    assert invariants.keys_of(client, prefix) == []  # not granted again, nobody woken


def _run_holder(task: str, attempt: int) -> str:
    """A task run's holder (``protocol.holder_for``), as the permit scripts read it."""
    return f"task={task} try={attempt} state=running node=n pid=1"


def test_a_release_wakes_a_waiter_that_can_take_the_permit(client: redis.Redis, prefix: str) -> None:
    """Limit 2, held by runs X (attempt 0) and Y; X's next attempt waits for X's own permit (a
    run never holds two places), then Z waits for any. Y's release must wake Z: woken first,
    X's attempt 1 is refused again and queues anew, and Z would sleep until its pause ran out
    (up to its lease) beside a free permit."""
    from celery_redislock._permit_scripts import ACQUIRE_PERMIT, RELEASE_PERMIT
    from celery_redislock.attempt import waiter_member

    name, limit = f"{prefix}:s", 2
    x0, y0, x1, z0 = (secrets.token_hex(16) for _ in range(4))

    def member(token: str, task: str, attempt: int) -> str:
        return waiter_member(30_000, token, False, _run_holder(task, attempt))

    assert isinstance(ACQUIRE_PERMIT(client, [name], [member(x0, "X", 0), "try", limit]), bytes)
    assert isinstance(ACQUIRE_PERMIT(client, [name], [member(y0, "Y", 0), "try", limit]), bytes)
    assert isinstance(ACQUIRE_PERMIT(client, [name], [member(x1, "X", 1), "wait", limit]), list)
    assert isinstance(ACQUIRE_PERMIT(client, [name], [member(z0, "Z", 0), "wait", limit]), list)
    assert RELEASE_PERMIT(client, [name], [y0, "", limit]) == 1  # permit 2 is free
    assert client.lrange(companion_key(name, f"wake:{z0}"), 0, -1) == [b"retry"]
    assert not client.exists(companion_key(name, f"wake:{x1}"))  # X's attempt 1 still waits, unwoken
    assert isinstance(ACQUIRE_PERMIT(client, [name], [member(z0, "Z", 0), "again", limit]), bytes)
    for token in (x0, z0):
        assert RELEASE_PERMIT(client, [name], [token, "", limit]) == 1
    assert client.lrange(companion_key(name, f"wake:{x1}"), 0, -1) == [b"retry"]  # X's own freed
    assert isinstance(ACQUIRE_PERMIT(client, [name], [member(x1, "X", 1), "again", limit]), bytes)
    assert RELEASE_PERMIT(client, [name], [x1, "", limit]) == 1
    assert invariants.keys_of(client, prefix) == []


def test_a_waiter_behind_a_runs_next_attempt_takes_a_freed_permit_at_once(
    client: redis.Redis, prefix: str
) -> None:
    """The same through ``RedisSemaphore`` (leases of 30 s): Z, queued behind the next attempt
    of run X, takes the permit Y frees as soon as Y frees it."""
    name = f"{prefix}:s"
    x0, y0 = (RedisSemaphore(client, name, 2, ttl=30, holder=_run_holder(task, 0)) for task in "XY")
    assert x0.acquire(blocking=False) and y0.acquire(blocking=False)
    x1 = RedisSemaphore(client, name, 2, ttl=30, holder=_run_holder("X", 1))
    z0 = RedisSemaphore(client, name, 2, ttl=30, holder=_run_holder("Z", 0))
    took: dict[str, bool] = {}

    def take(semaphore: RedisSemaphore, who: str) -> None:
        took[who] = semaphore.acquire(timeout=20)

    threads = [threading.Thread(target=take, args=(x1, "x1")), threading.Thread(target=take, args=(z0, "z0"))]
    threads[0].start()
    wait_for(lambda: has_queued(client, name, 1), 10, "X's attempt 1 queued")
    threads[1].start()
    wait_for(lambda: has_queued(client, name, 2), 10, "Z queued")
    released = time.monotonic()
    y0.release()
    threads[1].join(30)
    assert took.get("z0") and time.monotonic() - released < 10, "Z slept beside a free permit"
    x0.release()
    threads[0].join(30)
    assert took.get("x1")
    x1.release()
    z0.release()


def test_a_woken_waiter_that_gives_up_passes_the_wake_on(client: redis.Redis, prefix: str) -> None:
    """As a lock's (``test_lock_edges``): a first-come waiter woken by a permit's release and
    interrupted before it tries again gives up (``RELEASE_PERMIT`` with its member); the next
    waiter is woken then, not left asleep beside the free permit."""
    from celery_redislock._permit_scripts import ACQUIRE_PERMIT, RELEASE_PERMIT
    from celery_redislock.attempt import waiter_member

    name = f"{prefix}:s"
    holder, first, second = (secrets.token_hex(16) for _ in range(3))
    members = {
        token: waiter_member(30_000, token, False, who) for token, who in ((first, "w1"), (second, "w2"))
    }
    assert isinstance(
        ACQUIRE_PERMIT(client, [name], [waiter_member(30_000, holder, False, "h"), "try", 1]), bytes
    )
    for token in (first, second):
        assert isinstance(ACQUIRE_PERMIT(client, [name], [members[token], "wait", 1]), list)
    assert RELEASE_PERMIT(client, [name], [holder, "", 1]) == 1
    assert client.lpop(companion_key(name, f"wake:{first}")) == b"retry"  # woken, then interrupted
    assert RELEASE_PERMIT(client, [name], [first, members[first], 1]) == 0  # gives up: it held none
    assert client.lrange(companion_key(name, f"wake:{second}"), 0, -1) == [b"retry"]
    assert isinstance(ACQUIRE_PERMIT(client, [name], [members[second], "again", 1]), bytes)
    assert RELEASE_PERMIT(client, [name], [second, "", 1]) == 1
    assert invariants.keys_of(client, prefix) == []


def test_a_lost_permit_is_signalled_under_the_semaphores_name(client: redis.Redis, prefix: str) -> None:
    """``lock_lost``'s ``key`` is the semaphore's name (the ``key`` its holders know it by), not
    the key of the permit it held, which is the package's own layout."""
    name = f"{prefix}:s"
    reports: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        if sender is semaphore:
            reports.append(kwargs)

    semaphore = RedisSemaphore(client, name, 2, ttl=0.6)
    lock_lost.connect(receiver, weak=False)
    try:
        assert semaphore.acquire()
        client.delete(permit(name, 1))  # as if its lease ran out unrenewed
        wait_for(lambda: reports, 10, "the loss to be reported")
    finally:
        lock_lost.disconnect(receiver)
    assert [(report["key"], report["reason"]) for report in reports] == [(name, "not owned")]
