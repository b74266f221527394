"""Keys in the producer and in the worker, on a real Redis and a real worker: the key
``apply_async`` locks is the key the worker's run computes from what it receives, whatever
``lock_on`` is; and a run whose key cannot be computed leaves nothing in Redis."""

from __future__ import annotations

import json
import threading
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import LockedTask, LockKeyError, task_lock_key
from celery_redislock.protocol import HEADER
from celery_redislock.testing import RedisServer
from tests.test_cli import run as run_cli
from tests.test_task_config import new_app
from tests.workers import threads_worker, wait_for

RESULT_TIMEOUT = 30

try:  # the pydantic=True test's (skipped when missing)
    import pydantic  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover
    pydantic = None  # type: ignore[assignment,unused-ignore]

if pydantic is not None:

    class Order(pydantic.BaseModel):  # type: ignore[misc,unused-ignore]
        id: int
        account: int


@pytest.fixture
def app(redis_server: RedisServer, prefix: str) -> Iterator[Celery]:
    app = new_app(redis_server.url, prefix)
    yield app
    app.close()


def under(client: redis.Redis, prefix: str) -> list[bytes]:
    return [*client.scan_iter(match=f"{prefix}*"), *client.scan_iter(match=f"{{{prefix}*")]


def enqueue_key(app: Celery, prefix: str) -> str:
    """The key of the one message queued: the enqueue lock its header carries."""
    client = redis.Redis.from_url(app.conf.redislock_url)
    try:
        raw = client.lindex(f"q-{prefix}", 0)
    finally:
        client.close()
    assert raw is not None, "no message queued"
    return str(json.loads(raw)["headers"][HEADER]["key"])


@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_a_lock_on_callable_keys_what_the_worker_receives(
    app: Celery, client: redis.Redis, prefix: str, mode: str
) -> None:
    """A lock_on callable was called with the caller's values at apply_async and with the
    delivered ones in the worker: an int-keyed dict arrives string-keyed, so
    ``min(totals)`` was 9 at apply_async and "10" in the worker, two keys. The worker did not
    adopt the enqueue lock apply_async took, which then refused every later call for
    lock_queue_ttl (an hour), as a duplicate of a message long run."""

    def lowest_account(totals: dict[Any, int]) -> Any:
        return min(totals)  # the account with the lowest id, say

    def keyed(self: Any, totals: dict[Any, int]) -> str:
        return self.request.lock_key  # type: ignore[no-any-return]

    task = app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="keys.totals",
        lock_mode=mode,
        lock_period=0.5 if mode == "until_expired" else None,  # the only mode with one
        lock_on=lowest_account,
    )(keyed)
    totals = {10: 100, 9: 90}
    first = task.delay(totals)
    locked_at_enqueue = enqueue_key(app, prefix)
    with threads_worker(app, concurrency=2):
        assert first.get(timeout=RESULT_TIMEOUT) == locked_at_enqueue  # the run's lock is the enqueued one
        if mode == "until_executed":
            assert not client.exists(locked_at_enqueue)  # adopted, then released
            second = task.delay(totals)
            assert second.id != first.id  # not refused as a duplicate of the run that ended
            assert second.get(timeout=RESULT_TIMEOUT) == locked_at_enqueue
    wait_for(lambda: not under(client, prefix), timeout=10, what="no key left")


def test_a_lock_on_callable_that_cannot_take_the_delivered_values_fails_at_apply_async(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    """Celery's JSON delivers a tuple (a namedtuple too) as a list: a callable reading an
    attribute of it raised in the worker only, after apply_async had sent the message and
    taken its enqueue lock. It now fails at apply_async, naming lock_on, and sends nothing."""
    Order = namedtuple("Order", "account id")  # as a caller's code may have it

    def ship(order: Any) -> Any:
        return order

    task = app.task(
        base=LockedTask,
        shared=False,
        name="keys.order",
        lock_mode="until_executed",
        lock_on=lambda order: order.account,
    )(ship)
    with pytest.raises(LockKeyError, match=r"'keys\.order'.*'lock_on'.*AttributeError"):
        task.delay(Order(7, 1))
    assert client.llen(f"q-{prefix}") == 0
    assert not under(client, prefix)


@pytest.mark.parametrize("mode", ["until_executed", "until_executing", "until_and_while_executing"])
def test_a_run_whose_key_cannot_be_computed_frees_its_enqueue_lock(
    app: Celery, client: redis.Redis, prefix: str, mode: str
) -> None:
    """A lock_on callable that looks something up (the account of an order) and fails in the
    worker (the order was deleted since apply_async): the run fails with LockKeyError, naming
    the task, and frees the enqueue lock its message carries. It stayed for lock_queue_ttl
    (an hour), refusing every later call as a duplicate of a message that never ran."""
    accounts = {"o-1": 7}

    def ship(order: str) -> str:
        return order

    task = app.task(
        base=LockedTask,
        shared=False,
        name="keys.lookup",
        lock_mode=mode,
        lock_on=lambda order: accounts[order],
    )(ship)
    first = task.delay("o-1")
    assert under(client, prefix)  # the enqueue lock
    del accounts["o-1"]
    with threads_worker(app, concurrency=2):
        with pytest.raises(LockKeyError, match=r"'keys\.lookup'.*'lock_on'"):
            first.get(timeout=RESULT_TIMEOUT)
        wait_for(lambda: not under(client, prefix), timeout=10, what="the enqueue lock freed")
        accounts["o-1"] = 7
        second = task.delay("o-1")
        assert second.id != first.id
        assert second.get(timeout=RESULT_TIMEOUT) == "o-1"
    wait_for(lambda: not under(client, prefix), timeout=10, what="no key left")


@pytest.mark.skipif(pydantic is None, reason="pydantic is not installed")
@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_pydantic_task_keys_its_models_as_celery_sends_them(
    redis_server: RedisServer, client: redis.Redis, prefix: str, serializer: str
) -> None:
    """``@app.task(pydantic=True)``: Celery sends a model argument as its dict (JSON), which the
    task's wrapper validates back into the model. A LockedTask keyed the caller's model, which
    Celery's JSON cannot encode: every call raised LockKeyError, where plain Celery sends it. The
    key is the dumped model's, at apply_async and in the worker, under either serializer."""
    app = new_app(redis_server.url, prefix, task_serializer=serializer, accept_content=["json", "pickle"])
    try:

        def ship(self: Any, order: Order) -> list[Any]:
            return [order.id, self.request.lock_key]

        task = app.task(
            base=LockedTask,
            bind=True,
            pydantic=True,
            shared=False,
            name="keys.ship",
            lock_mode="until_executed",
        )(ship)
        order = Order(id=1, account=2)
        key = task_lock_key(task, (order,))
        assert key == task_lock_key(task, ({"id": 1, "account": 2},))
        first = task.delay(order)
        assert client.exists(key)  # the enqueue lock
        assert task.delay(order=order).id == first.id  # a duplicate, however spelled
        with threads_worker(app, concurrency=2):
            assert first.get(timeout=RESULT_TIMEOUT) == [1, key]
        wait_for(lambda: not under(client, prefix), timeout=10, what="no key left")
    finally:
        app.close()


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_task_lock_key_and_release_by_task_name_the_key_the_run_locks(
    redis_server: RedisServer, client: redis.Redis, prefix: str, serializer: str
) -> None:
    """``task_lock_key`` called a lock_on callable with the caller's values, the run with the
    delivered ones: under Celery's JSON an int-keyed dict arrives string-keyed, and
    ``min(totals)`` was 9 for task_lock_key, "10" in the run: it named a key nobody locks.
    It now keys as the run does, through the task's serializer (under pickle the ints stay).
    ``celery redislock release --task`` (which reads its JSON as a worker reads a message's)
    frees the run's lock."""
    app = new_app(redis_server.url, prefix, task_serializer=serializer, accept_content=["json", "pickle"])
    started, gate = threading.Event(), threading.Event()

    def lowest_account(totals: dict[Any, int]) -> Any:
        return min(totals)

    def settle(self: Any, totals: dict[Any, int]) -> str:
        started.set()
        gate.wait(RESULT_TIMEOUT)
        return self.request.lock_key  # type: ignore[no-any-return]

    task = app.task(base=LockedTask, bind=True, shared=False, name="keys.settle", lock_on=lowest_account)(
        settle
    )
    try:
        totals = {10: 100, 9: 90}
        key = task_lock_key(task, (totals,))
        with threads_worker(app, concurrency=2):
            result = task.delay(totals)
            assert started.wait(RESULT_TIMEOUT), "the run did not start"
            assert client.exists(key), f"{key} is not the key the run locks: {under(client, prefix)}"
            if serializer == "json":  # a message's JSON: what the CLI reads, as the run received it
                released = run_cli(app, "release", "--task", task.name, "--args", '[{"10": 100, "9": 90}]')
                assert released.exit_code == 0, released.output
                assert released.stdout.startswith(f"released {key} ")
            gate.set()
            assert result.get(timeout=RESULT_TIMEOUT) == key
        wait_for(lambda: not under(client, prefix), timeout=10, what="no key left")
    finally:
        gate.set()
        app.close()
