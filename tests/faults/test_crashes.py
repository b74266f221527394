"""A crash mid-task frees the lock, at once or within ``lock_ttl``: a pool child killed, the whole
worker killed, ``revoke(terminate=True)``, hard and soft time limits.

What frees the lock, and when:

* a pool child dies (SIGKILL, a hard time limit, ``revoke(terminate=True)``): the
  worker's main process, at once. The tasks here hold a 300 s lease, so only
  that release explains the duplicate running within seconds;
* the whole worker dies: nobody; the lease expires within ``lock_ttl`` and a
  duplicate on another worker runs then;
* a soft time limit: the task's own release, on the way out of the body.

``tests/test_task.py::test_sigkill_of_the_pool_child_frees_the_lock_at_once``
covers a child kill with ``lock_busy="skip"``; these add a duplicate that is
already waiting (woken by the release), the enqueue modes, and timings.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import urllib.request
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from celery_redislock import task_lock_key
from celery_redislock.protocol import parse_value
from tests.faults.conftest import RESULT_TIMEOUT, Stage, fresh
from tests.taskapp import running
from tests.workers import wait_for

#: The lease of the tasks whose lock only the main process can free in time.
LONG_TTL = 300
#: How soon after a child's death its duplicate must run: a small fraction of LONG_TTL. The main
#: process learns of the death at its next pool maintenance (Celery runs it every 5 s).
PROMPT = 10.0


def test_sigkill_of_a_pool_child_wakes_the_waiting_duplicate_at_once(stage: Stage) -> None:
    worker = stage.worker("prefork", "prefork", 2, redislock_ttl=LONG_TTL)
    x, task = fresh(), stage.task("hold_wait")
    key = task_lock_key(task, (x,), {"gate": True})
    first = task.delay(x, gate=True)
    child = int(stage.wait_events("start", x)[0][4])
    second = task.delay(x, gate=True)
    stage.wait_events("busy", x)  # the duplicate waits in the other child
    assert stage.client.pttl(key) > (LONG_TTL - 10) * 1000
    killed_at = time.monotonic()
    os.kill(child, signal.SIGKILL)
    starts = stage.wait_events("start", x, 2)
    assert starts[1][3] == second.id
    assert float(starts[1][7]) - killed_at < PROMPT
    assert int(starts[1][5]) > int(starts[0][5])  # the new holder's fence is greater
    with pytest.raises(WorkerLostError):
        first.get(timeout=RESULT_TIMEOUT)
    stage.recorder.open_gate(x)
    assert second.get(timeout=RESULT_TIMEOUT) == x
    # logged once the main process is done with the dead run's locks: maybe after the duplicate ran
    worker.wait_for_line("released its lock", what="the release logged")
    assert not stage.client.exists(key)


def test_sigkill_of_a_pool_child_frees_an_adopted_enqueue_lock(stage: Stage) -> None:
    """``until_executed``: the running task holds the enqueue lock it adopted; once its child
    is killed, the next ``delay()`` is accepted and runs."""
    stage.worker("prefork", "prefork", 2, redislock_ttl=LONG_TTL)
    x, task = fresh(), stage.task("until_executed")
    key = task_lock_key(task, (x,))
    first = task.delay(x, gate=True)
    child = int(stage.wait_events("start", x)[0][4])
    assert task.delay(x, gate=True).id == first.id  # running: a duplicate is refused
    killed_at = time.monotonic()
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: not stage.client.exists(key), what="the main process to free the lock")
    assert time.monotonic() - killed_at < PROMPT
    again = task.delay(x, gate=False)
    assert again.id != first.id
    assert again.get(timeout=RESULT_TIMEOUT) == x
    with pytest.raises(WorkerLostError):
        first.get(timeout=RESULT_TIMEOUT)


def test_a_runs_signals_come_from_its_pool_child_and_a_crash_release_sends_none(stage: Stage) -> None:
    """The package's signals are sent in the process that takes the step (docs/operations.md,
    "Signals"): a run's ``lock_busy`` and ``lock_released`` in the prefork pool child running
    it (``tests/taskapp.py`` records them with that process's pid); the release by the worker's
    main process of a killed child's lock sends no ``lock_released`` (its WARNING and
    ``redislock.lock.crash_releases`` report it)."""
    worker = stage.worker("prefork", "prefork", 2, redislock_ttl=LONG_TTL)
    x, task = fresh(), stage.task("hold_wait")
    first = task.delay(x, gate=True)
    [start] = stage.wait_events("start", x)
    second = task.delay(x, gate=True)
    [busy] = stage.wait_events("busy", x)  # the duplicate waits in the other child
    assert busy[3] == second.id and busy[4] not in (start[4], str(worker.pid))
    os.kill(int(start[4]), signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        first.get(timeout=RESULT_TIMEOUT)
    worker.wait_for_line("released its lock", what="the main process's release logged")
    stage.recorder.open_gate(x)
    assert second.get(timeout=RESULT_TIMEOUT) == x
    [released] = stage.wait_events("released", x)
    assert (released[3], released[4]) == (second.id, busy[4])  # none for the killed child's lock


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_sigkill_of_the_whole_worker_frees_the_lock_within_lock_ttl(stage: Stage, pool: str) -> None:
    """Nobody frees a dead worker's lock and nothing renews it: its lease (``lock_ttl``) runs out,
    and the duplicate waiting on another worker takes it then. The key's events say so however
    slow each process is: taken, renewed, never deleted, expired, then taken by the duplicate."""
    ttl = 2.0
    doomed = stage.worker("doomed", pool, 2 if pool == "prefork" else 1, queue="doomed", redislock_ttl=ttl)
    stage.worker("survivor", queue="survivor", redislock_ttl=ttl)
    x, task = fresh(), stage.task("hold_wait")
    key = task_lock_key(task, (x,), {"gate": True})
    events = stage.key_events(key)
    task.apply_async((x,), {"gate": True}, queue="doomed")
    stage.wait_events("start", x)
    doomed.kill()
    second = task.apply_async((x,), {"gate": True}, queue="survivor")  # waits for the lease to run out
    starts = stage.wait_events("start", x, 2)
    assert starts[1][3] == second.id and int(starts[1][5]) > int(starts[0][5])
    seen = events.until(lambda seen: seen.count("set") == 2, "the duplicate to take the lock")
    assert [event for event in seen if event != "expire"] == ["set", "expired", "set"], seen
    stage.recorder.open_gate(x)
    assert second.get(timeout=RESULT_TIMEOUT) == x


@pytest.mark.parametrize("how", ["revoke_terminate", "hard_time_limit", "soft_time_limit"])
def test_a_terminated_or_timed_out_task_frees_its_lock_at_once(stage: Stage, how: str) -> None:
    stage.worker("prefork", "prefork", 2, redislock_ttl=LONG_TTL)
    x, task = fresh(), stage.task("hold_wait")
    limits = {"hard_time_limit": {"time_limit": 1}, "soft_time_limit": {"soft_time_limit": 1}}
    first = task.apply_async((x,), {"gate": True}, **limits.get(how, {}))
    started_at = float(stage.wait_events("start", x)[0][7])
    second = task.delay(x, gate=True)
    stage.wait_events("busy", x)
    if how == "revoke_terminate":
        ended_at = time.monotonic()
        first.revoke(terminate=True)
    else:
        ended_at = started_at + 1
    starts = stage.wait_events("start", x, 2)
    assert starts[1][3] == second.id
    assert float(starts[1][7]) - ended_at < PROMPT
    if how == "revoke_terminate":
        wait_for(lambda: first.state == "REVOKED", what="the revoked state")
    else:
        expected = TimeLimitExceeded if how == "hard_time_limit" else SoftTimeLimitExceeded
        with pytest.raises(expected):
            first.get(timeout=RESULT_TIMEOUT)
    stage.recorder.open_gate(x)
    assert second.get(timeout=RESULT_TIMEOUT) == x


@pytest.mark.parametrize("how", ["sigkill", "hard_time_limit"])
def test_a_pool_child_gone_before_its_run_freed_an_until_executing_enqueue_lock_frees_it(
    stage: Stage, how: str
) -> None:
    """``until_executing`` has no execution lock: the run frees its message's enqueue lock as it
    starts. A child that dies before (killed, or stopped at its hard time limit, in a
    ``before_start`` here) leaves it to the main process, as in the modes with an execution
    lock; else every ``delay()`` was refused as a duplicate of the dead task for
    ``lock_queue_ttl``."""
    stage.worker("prefork", "prefork", 2)
    x, task = fresh(), stage.task("slow_start")
    key = task_lock_key(task, (x,))
    first = task.apply_async((x,), time_limit=2) if how == "hard_time_limit" else task.delay(x)
    child = int(stage.wait_events("before", x)[0][4])
    assert stage.client.exists(key)
    if how == "sigkill":
        os.kill(child, signal.SIGKILL)
    wait_for(lambda: not stage.client.exists(key), what="the main process to free the enqueue lock")
    with pytest.raises(WorkerLostError if how == "sigkill" else TimeLimitExceeded):
        first.get(timeout=RESULT_TIMEOUT)
    again = task.delay(x)
    assert again.id != first.id
    stage.recorder.open_gate(x)
    assert again.get(timeout=RESULT_TIMEOUT) == x


def test_a_hard_time_limit_frees_the_lock_only_once_the_child_is_gone(stage: Stage) -> None:
    """A hard time limit: the pool sends SIGTERM to the child, waits 0.1 s, then sends SIGKILL.
    The body ignores SIGTERM, so its child runs on until the SIGKILL. The duplicate waiting for
    the lock starts only once that child is gone: it never sees the old child alive."""
    worker = stage.worker("prefork", "prefork", 2, redislock_ttl=LONG_TTL)
    x, task = fresh(), stage.task("outlives_sigterm")
    key = task_lock_key(task, (x,))
    first = task.apply_async((x,), time_limit=3)
    child = int(stage.wait_events("start", x)[0][4])
    second = task.delay(x)
    stage.wait_events("busy", x)  # the duplicate waits in the other child
    starts = stage.wait_events("start", x, 2)
    assert starts[1][3] == second.id and int(starts[1][5]) > int(starts[0][5])
    assert stage.events("overlap", x) == [], "the duplicate started while the old child still ran"
    assert not running(child)
    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=RESULT_TIMEOUT)
    # logged once the main process is done with the dead run's locks: maybe after Celery stored the failure
    worker.wait_for_line("released its lock", what="the release logged")
    stage.recorder.open_gate(x)
    assert second.get(timeout=RESULT_TIMEOUT) == x
    assert not stage.client.exists(key)


def crash_releases(port: int, task: str) -> float:
    """``redislock_lock_crash_releases_total`` of ``task`` as the worker's main process serves it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(
        rf'^redislock_lock_crash_releases_total{{[^}}]*task="{re.escape(task)}"[^}}]*}} (\S+)$', text, re.M
    )
    return 0.0 if found is None else float(found.group(1))


def test_a_crash_release_is_counted_by_the_main_process(
    stage: Stage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``redislock.lock.crash_releases``: the main process counts the lock it released for its
    killed pool child, served by the exporter of ``examples/prometheus_worker.py``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    crash_release_counted(stage, monkeypatch, port)


def crash_release_counted(stage: Stage, monkeypatch: pytest.MonkeyPatch, port: int) -> Any:
    """A prefork worker of one pool child serving its metrics from ``port`` on
    (``METRICS_PORT``); the child killed as it runs ``hold_wait``: the main process released
    its lock and counted it, none counted before. The task."""
    monkeypatch.setenv("METRICS_PORT", str(port))  # the worker's tests.taskapp loads the example
    worker = stage.worker("prefork", "prefork", 1, redislock_ttl=LONG_TTL)
    x, task = fresh(), stage.task("hold_wait")
    assert crash_releases(port, task.name) == 0
    first = task.delay(x, gate=True)
    os.kill(int(stage.wait_events("start", x)[0][4]), signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        first.get(timeout=RESULT_TIMEOUT)
    wait_for(lambda: crash_releases(port, task.name) == 1, what="the crash release to be counted")
    # logged once the main process is done with the dead run's locks: maybe after it counted the release
    worker.wait_for_line("released its lock", what="the release logged")
    return task


def two_free_ports() -> int:
    """A port P such that P and P + 1 are free on 127.0.0.1 now (not ``examples.prometheus_worker``'s
    ``free_ports``: importing the example here would connect its ``worker_init`` receiver, which
    sets the global MeterProvider, in the test process)."""
    while True:
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port: int = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:  # taken: try another pair
                continue
            return port


def test_a_pool_child_forked_after_a_crash_release_does_not_report_it_as_its_own(
    stage: Stage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each process reports what it counted itself: a pool child the main process forks once it
    counted a crash release (here, the replacement of a child killed after that) serves none of
    it; else each child forked since counted it again, as a scrape of all the worker's ports
    (``examples/prometheus_worker.py``) sums them."""
    port = two_free_ports()  # the main process's, and its one pool child's (index 0)
    task = crash_release_counted(stage, monkeypatch, port)
    # The child that replaced the killed one may have been forked before the count: kill it, idle.
    y = fresh()
    assert task.delay(y).get(timeout=RESULT_TIMEOUT) == y
    replaced = int(stage.wait_events("start", y)[0][4])
    os.kill(replaced, signal.SIGKILL)
    z = fresh()
    assert task.delay(z).get(timeout=RESULT_TIMEOUT) == z
    assert int(stage.wait_events("start", z)[0][4]) != replaced  # run by a child forked since
    assert crash_releases(port + 1, task.name) == 0
    assert crash_releases(port, task.name) == 1


def test_until_expired_keeps_the_hold_of_a_run_that_ended_before_its_child_died_and_its_message_came_back(
    stage: Stage,
) -> None:
    """The pool child dies once its ``until_expired`` run is over (an OOM kill as the run's outcome
    goes to the worker), its result not stored: the run kept its lock for ``lock_period``, and
    Celery requeues the message (``task_acks_late`` with ``task_reject_on_worker_lost``). The
    main process freed that hold as a dead run's, and the message ran the body again within
    the period. The hold, its run over, stays; the message, delivered again, is ignored."""
    conf: dict[str, Any] = {"task_acks_late": True, "task_reject_on_worker_lost": True}
    worker = stage.worker("prefork", "prefork", 1, **conf)
    x, task = fresh(), stage.task("until_expired_dies")
    key = task_lock_key(task, (x,))
    first = task.delay(x)
    worker.wait_for_line(
        "redelivered once its first delivery ran",
        timeout=30,
        what=lambda: f"the requeued message to be ignored; events {stage.events(x=x)}",
    )
    assert [event[3] for event in stage.events("start", x)] == [first.id]  # one run
    kept = parse_value(stage.client.get(key))
    assert kept is not None and kept.kept and kept.fence == int(stage.events("start", x)[0][5])
    assert stage.client.pttl(key) > 60_000
    stage.client.delete(key)


@pytest.mark.parametrize(
    ("requeued", "acks_late"),
    [(False, False), (False, True), (True, True)],
    ids=["acknowledged_at_receipt", "acknowledged_after_the_failure", "requeued"],
)
def test_until_expired_keeps_a_dead_childs_hold_for_its_period_unless_the_message_comes_back(
    stage: Stage, requeued: bool, acks_late: bool
) -> None:
    """``until_expired`` keeps its lock ``lock_period`` (600 s) after the run took it, whatever
    the run's outcome; a run whose pool child was SIGKILLed (an OOM kill after the body's
    work) had its hold freed at once by the main process, and the next ``delay()`` ran the
    body again within the period. The hold is now kept for what is left of the period, the
    next call refused as its duplicate. Unless the message comes back (``task_acks_late`` with
    ``task_reject_on_worker_lost``: Celery requeues it), as a retry would: the hold is freed and
    the redelivered message runs the body. With ``task_acks_late`` alone, Celery acknowledges
    the message after recording the failure; the main process, reading kombu's message state,
    which the worker's event loop updates only later, took it for one coming back and freed
    the hold."""
    conf: dict[str, Any] = {"task_acks_late": acks_late, "task_reject_on_worker_lost": requeued}
    worker = stage.worker("prefork", "prefork", 2, **conf)
    x, task = fresh(), stage.task("until_expired")
    key = task_lock_key(task, (x,), {"gate": True})
    first = task.delay(x, gate=True)
    os.kill(int(stage.wait_events("start", x)[0][4]), signal.SIGKILL)
    if requeued:
        starts = stage.wait_events("start", x, 2)  # the requeued message, run again
        assert starts[1][3] == first.id
        stage.recorder.open_gate(x)
        assert first.get(timeout=RESULT_TIMEOUT) == x
    else:
        with pytest.raises(WorkerLostError):
            first.get(timeout=RESULT_TIMEOUT)
        wait_for(  # kept (a TTL past the 30 s lease), or freed
            lambda: stage.client.pttl(key) > 60_000 or not stage.client.exists(key),
            what=lambda: f"the main process to deal with the hold:\n{worker.output()}",
        )
        assert stage.client.exists(key), f"freed within its period:\n{worker.output()}"
        # logged once the main process is done with the dead run's locks: after the hold is kept
        worker.wait_for_line("kept for what is left of lock_period", what="the kept hold logged")
        assert task.delay(x, gate=True).id == first.id  # a duplicate of the dead run, within the period
    wait_for(lambda: stage.client.pttl(key) > 60_000, what="the hold kept for its period")
    stage.client.delete(key)
    assert len(stage.events("start", x)) == (2 if requeued else 1)
