"""``redislock_enabled = False``: every lock off, and nothing connects to Redis.

The locks' URL points at a port where nothing answers: a listening socket that
never accepts. A connection attempt would queue on it, so a non-blocking
``accept`` at the end tells whether anything tried; a closed port would refuse
it without a trace. The broker and the results stay on the test's real Redis.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery import signals as celery_signals

from celery_redislock import LockConfigurationError, LockedTask, task_lock_key
from celery_redislock.modes import UNLOCKED
from celery_redislock.state import app_state
from celery_redislock.testing import RedisServer
from tests.taskapp import Recorder, make_app
from tests.workers import BeatProcess, WorkerProcess, wait_for

RESULT_TIMEOUT = 30
WARNING = "redislock_enabled=False for app"


@pytest.fixture
def silent() -> Iterator[socket.socket]:
    """A listening socket on 127.0.0.1 that never accepts (see the module docstring)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener


def attempts(listener: socket.socket) -> int:
    """How many connections reached ``listener`` so far."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            return count
        connection.close()
        count += 1


def switched_off(silent: socket.socket) -> dict[str, Any]:
    """The settings that turn the locks off, with their URL on ``silent``."""
    return {"redislock_enabled": False, "redislock_url": f"redis://127.0.0.1:{silent.getsockname()[1]}/0"}


@pytest.fixture
def off_app(redis_server: RedisServer, prefix: str, silent: socket.socket) -> Iterator[Celery]:
    app = make_app(redis_server.url, prefix, f"q-{prefix}", **switched_off(silent))
    yield app
    app.recorder.client.delete(app.conf.task_default_queue)  # type: ignore[attr-defined]
    app.close()


def test_enqueue_modes_send_duplicates_and_a_prefork_worker_runs_them_at_once_unlocked(
    off_app: Celery, prefix: str, redis_server: RedisServer, silent: socket.socket
) -> None:
    recorder: Recorder = off_app.recorder  # type: ignore[attr-defined]
    task: Any = off_app.tasks["taskapp.until_executed"]
    assert task.lock_options.mode == "until_executed" and task.lock_options.rules == UNLOCKED
    first, second = task.delay("x", True), task.delay("x", True)  # same signature, both sent
    assert first.id != second.id
    assert recorder.client.llen(off_app.conf.task_default_queue) == 2
    conf = json.dumps(switched_off(silent))
    worker = WorkerProcess(redis_server.url, prefix, f"q-{prefix}", "prefork", 2, "off", conf)
    worker.start()
    try:
        started = wait_for(
            lambda: runs if len(runs := recorder.events()) == 2 else [],
            what="both runs of the same signature under way at once",
        )
        recorder.open_gate("x", 2)
        assert first.get(timeout=RESULT_TIMEOUT) == second.get(timeout=RESULT_TIMEOUT) == "x"
    finally:
        worker.stop()
    assert [event[0] for event in started] == ["start", "start"]
    assert len({event[4] for event in started}) == 2  # in two pool children
    assert [event[5] for event in started] == ["None", "None"]  # lock_fence: no lock
    assert not [event for event in recorder.events() if event[0] == "released"]
    assert worker.output().count(WARNING) == 1  # once: the pool children inherit the main process's
    assert attempts(silent) == 0


def test_a_run_sees_the_lock_fields_of_an_unlocked_run(off_app: Celery, silent: socket.socket) -> None:
    @off_app.task(base=LockedTask, bind=True, shared=False, name="test.fields", lock_mode="until_executed")
    def fields(self: Any, x: int, y: int = 2) -> dict[str, Any]:
        request = self.request
        keys = ("lock_key", "lock_fence", "lock_lost", "lock_slot")
        return {name: getattr(request, name) for name in keys}

    key = task_lock_key(fields, (1,))
    expected = {"lock_key": key, "lock_fence": None, "lock_lost": False, "lock_slot": None}
    assert fields(1) == expected  # a direct call
    assert fields.apply((1,)).get() == expected  # apply(): a worker's path, in this process
    assert app_state(off_app).client is None
    assert attempts(silent) == 0


def nothing() -> None:
    """A task body."""


def test_the_switch_is_logged_once_per_process_as_a_warning(
    off_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="celery_redislock"):
        for name in ("a", "b"):
            off_app.task(base=LockedTask, shared=False, name=f"test.{name}")(nothing)
        off_app.tasks["test.a"]()
        off_app.tasks["test.b"].delay()
    logged = [record for record in caplog.records if WARNING in record.getMessage()]
    assert [record.levelname for record in logged] == ["WARNING"]


def test_a_beat_sends_every_entry_unguarded(
    redis_server: RedisServer, prefix: str, silent: socket.socket
) -> None:
    """No slot claim, no slot header: the runs name no slot and no sending beat."""
    settings = switched_off(silent)
    entry = {"task": "taskapp.beat_job", "schedule": 1.0, "args": ["b"]}
    conf = json.dumps({**settings, "beat_schedule": {"job": entry}})
    queue = f"q-{prefix}"
    recorder = Recorder(redis_server.url, prefix)
    beat = BeatProcess(redis_server.url, prefix, queue, "off", conf)
    worker = WorkerProcess(redis_server.url, prefix, queue, "threads", 2, "off", conf)
    beat.start()
    worker.start()
    try:
        runs = wait_for(lambda: recorder.runs() if len(recorder.runs()) >= 2 else [], what="2 runs")
    finally:
        beat.stop()
        worker.stop()
        recorder.client.delete(queue)
    assert {(run[2], run[3]) for run in runs} == {("None", "None")}  # lock_slot, sending beat
    assert beat.output().count(WARNING) == 1
    assert "slot" not in beat.output()
    assert attempts(silent) == 0


def test_a_setting_that_is_not_a_bool_is_refused(redis_server: RedisServer, prefix: str) -> None:
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_enabled="no")
    with pytest.raises(LockConfigurationError, match=r"redislock_enabled='no' is not valid; allowed: True"):
        app.tasks["taskapp.hold_skip"]
    app.close()


def test_a_switched_off_app_frees_no_enqueue_lock_when_another_apps_receivers_fire(
    off_app: Celery, redis_server: RedisServer, prefix: str, silent: socket.socket
) -> None:
    """Two apps in one process, one with its locks on (its receivers connected, for every app):
    a message of the switched-off app that will never run connects nothing to free its lock."""
    on_app = make_app(redis_server.url, prefix, f"q-{prefix}")
    recorder: Recorder = on_app.recorder  # type: ignore[attr-defined]
    on_app.tasks["taskapp.until_executed"].delay("m")  # a message carrying its enqueue lock
    (key,) = recorder.client.keys(f"{prefix}:*")
    with on_app.connection_for_read() as connection:
        message = connection.SimpleQueue(f"q-{prefix}").get(timeout=RESULT_TIMEOUT)
    # the sender stands for each app's consumer: the receiver reads its ``app``
    off_sender, on_sender = off_app.tasks["taskapp.until_executed"], on_app.tasks["taskapp.until_executed"]
    celery_signals.task_rejected.send(sender=off_sender, message=message, exc=None)
    assert recorder.client.exists(key) and attempts(silent) == 0
    celery_signals.task_rejected.send(sender=on_sender, message=message, exc=None)
    assert not recorder.client.exists(key)  # freed by the app whose locks are on
    on_app.close()
