"""A beat leader stopped by SIGTERM or SIGINT exits, and gives up its leadership, wherever its
main thread was.

Celery's handler of both (``celery.apps.beat.Beat.install_sync_handler``) runs on the main
thread, inside whatever that thread was doing: it closes the scheduler (``service.sync()``),
whose guard resigns the leadership, then raises ``SystemExit``, after which ``Service.start``
closes the scheduler once more. Here a real ``celery.beat.Service`` runs on a thread of its
own, standing for beat's main thread, and Celery's own handler is run on it at a point where
its leader lock holds a ``threading.Lock`` of its own (``tests.interrupts.HandlerWhileHeld``);
the test waits, with a deadline, for the thread to end.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis
from celery import Celery, platforms
from celery.apps.beat import Beat
from celery.beat import Scheduler, Service

from celery_redislock import RedisLock, primitive
from celery_redislock.keys import leader_key
from celery_redislock.testing import RedisServer
from examples._support import ROOT
from tests import beat_sigterm
from tests.interrupts import HandlerWhileHeld
from tests.workers import wait_for


@pytest.fixture
def leader_app(redis_server: RedisServer, prefix: str) -> Iterator[Celery]:
    """``beat_sigterm.leader_app``: its beat leads (a lease longer than the test)."""
    app = beat_sigterm.leader_app(redis_server.url, prefix)
    app.finalize()  # as ``celery beat`` does before it starts: binding its LockedTasks installs the guard
    yield app
    app.recorder.client.delete(app.conf.task_default_queue)  # type: ignore[attr-defined]
    app.close()


def celery_sigterm_handler(service: Service, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """What ``celery beat`` runs on SIGTERM for ``service`` (its handler, not installed)."""
    handlers: dict[str, Any] = {}
    monkeypatch.setattr(platforms.signals, "update", lambda **installed: handlers.update(installed))
    Beat.install_sync_handler(cast(Any, None), service)
    return lambda: handlers["SIGTERM"](signal.SIGTERM, sys._getframe())


def in_call(name: str, thread: threading.Thread) -> Callable[[], bool]:
    """Whether ``thread`` (this one) is in ``LeaseLock.{name}`` of the beat leader's lock."""

    def check() -> bool:
        frame: Any = sys._getframe()
        while frame is not None and not (
            frame.f_code.co_name == name
            and frame.f_globals["__name__"] == "celery_redislock.primitive"
            and isinstance(frame.f_locals.get("self"), RedisLock)
            and frame.f_locals["self"].name.endswith(":beat-leader")
        ):
            frame = frame.f_back
        return frame is not None and threading.current_thread() is thread

    return check


@pytest.mark.parametrize("held", ["its state", "the making of its lost event"])
def test_a_leader_stopped_by_sigterm_inside_its_lock_call_exits_and_releases_the_lock(
    leader_app: Celery,
    client: redis.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    held: str,
) -> None:
    """The handler lands as the leader checks, before a send, that it still leads: in its lock's
    ``renewals_on_time`` holding the lock's state, or in the lock's ``lost`` as it makes the event
    (a ``threading.Lock`` of the module's). Beat exits, and the leader lock is released: by the
    handler, or, where the interrupted call holds what a release needs, by the close that follows
    once it unwound."""
    service = Service(leader_app, max_interval=1, scheduler_cls=Scheduler)
    sigterm = celery_sigterm_handler(service, monkeypatch)
    main = threading.Thread(target=service.start, name="beat-main", daemon=True)
    stand_ins: list[HandlerWhileHeld] = []
    if held == "its state":

        def leader_lock(*args: Any, **kwargs: Any) -> RedisLock:
            lock = RedisLock(*args, **kwargs)
            stand_ins.append(HandlerWhileHeld(lock._state, in_call("renewals_on_time", main), sigterm))
            cast(Any, lock)._state = stand_ins[-1]
            return lock

        monkeypatch.setattr("celery_redislock.beat.RedisLock", leader_lock)
    else:
        stand_ins.append(HandlerWhileHeld(threading.Lock(), in_call("lost", main), sigterm))
        monkeypatch.setattr(primitive, "_MAKING_LOST", stand_ins[-1])
    caplog.set_level(logging.INFO, logger="celery_redislock.beat")
    main.start()

    def where_main_is() -> str:
        frame = sys._current_frames().get(main.ident or 0)
        stack = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(ended)"
        return (
            f"beat to exit after its SIGTERM handler ran ({[s.fired for s in stand_ins]}); it is at:\n{stack}"
        )

    wait_for(lambda: not main.is_alive(), timeout=30, what=where_main_is)
    assert [stand_in.fired for stand_in in stand_ins] == [[1]]
    assert not client.exists(leader_key(prefix)), "the leader lock was not released"
    messages = [record.getMessage() for record in caplog.records]
    resigned = [message for message in messages if "resigned as" in message or "in use by" in message]
    # in its state: the handler's close leaves the release to the close that follows
    assert len(resigned) == (2 if held == "its state" else 1), resigned
    assert "resigned as beat leader" in resigned[-1], resigned


def test_a_celery_beat_leader_signalled_inside_its_lock_call_exits_and_releases_the_lock(
    redis_server: RedisServer, client: redis.Redis, prefix: str
) -> None:
    """The same with a real ``celery beat`` process (``tests.beat_sigterm``) and a real SIGTERM,
    sent to itself from inside the ``with`` block of its leader lock's ``renewals_on_time``."""
    beat = subprocess.Popen(
        [sys.executable, "-m", "tests.beat_sigterm", redis_server.url, prefix],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = beat.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(beat.pid, signal.SIGKILL)
        output, _ = beat.communicate()
        pytest.fail(f"beat hung after its SIGTERM; its output ends with:\n{output[-3000:]}")
    finally:
        client.delete(f"q-{prefix}")
    assert "SIGTERM sent" in output and "beat exited" in output and beat.returncode == 0, output[-3000:]
    assert "resigned as beat leader" in output, output[-3000:]
    assert not client.exists(leader_key(prefix)), "the leader lock was not released"
