"""The watchdog in each Celery pool, in a real ``celery worker -P <pool>`` subprocess:
prefork, threads, solo, gevent and eventlet.

Under gevent and eventlet the worker monkey-patches ``threading``, so the
watchdog's thread is a green thread: it renews only while the running task
yields to the hub (cooperative I/O, ``gevent.sleep``). A task that holds the hub
without yielding (a CPU loop, a C call) starves it: its lease expires
meanwhile, another worker may take the lock, and the loss is reported once the
task yields again (docs/tasks.md, "gevent and eventlet").
"""

from __future__ import annotations

import importlib.util

import pytest

from celery_redislock import task_lock_key
from tests.faults.conftest import RESULT_TIMEOUT, Stage, fresh, stage  # noqa: F401  (the fixture)
from tests.taskapp import LEASE
from tests.workers import wait_for

GREEN = ["gevent", "eventlet"]


def pool(name: str) -> object:
    """``name`` as a parameter, skipped with the way to get it if it is a green pool not installed."""
    missing = name in GREEN and importlib.util.find_spec(name) is None
    reason = f"{name} is not installed: pip install {name} (celery-redislock[test] has it)"
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=reason))


@pytest.mark.compat
@pytest.mark.parametrize("name", [pool(name) for name in ["prefork", "threads", "solo", *GREEN]])
def test_the_watchdog_keeps_the_lock_of_a_task_that_outlasts_its_lease(stage: Stage, name: str) -> None:  # noqa: F811
    """A body lasting three leases, spent in cooperative I/O, keeps its lock to the end: the
    watchdog renews it every lease/3 in whatever the pool makes of a thread (a green one under
    gevent and eventlet), and nothing reports it lost."""
    stage.worker("w", name, 2)
    x, task = fresh(), stage.task("long")
    assert task.delay(x, leases=3).get(timeout=RESULT_TIMEOUT) is True
    assert stage.events("lost", x) == []
    assert not stage.client.exists(task_lock_key(task, (x, 3)))


@pytest.mark.compat
@pytest.mark.locks_may_remain("a starved lease expires; nothing else is left, but the check allows it")
@pytest.mark.parametrize("name", [pool(name) for name in GREEN])
def test_a_task_that_never_yields_starves_the_watchdog_of_a_green_pool(stage: Stage, name: str) -> None:  # noqa: F811
    """The documented limit of green pools: a body that spins on the CPU for four leases
    without yielding stops the hub, and the watchdog with it. The lease expires while the
    body still runs (the key is gone before the body's "spun" event), and the body sees
    ``request.lock_lost`` once it yields again, with a ``lock_lost`` report."""
    stage.worker("w", name, 2)
    x, task = fresh(), stage.task("hog")
    key = task_lock_key(task, (x, 4))
    result = task.delay(x, leases=4)
    stage.wait_events("start", x)
    wait_for(lambda: not stage.client.exists(key), timeout=4 * LEASE, what="the starved lease to expire")
    assert stage.events("spun", x) == [], "the key expired only after the body yielded"
    assert result.get(timeout=RESULT_TIMEOUT) is True
    assert [event[-1] for event in stage.events("lost", x)] in (["not_owned"], ["expired"])
