"""django-celery-beat: slots of its schedules, and two of its ``DatabaseScheduler``s on one
database (in this process, guarded as ``celery beat`` guards them) sending each slot once,
opted in through the header field its entries keep."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery

from celery_redislock.beat import guard, slot_of
from celery_redislock.protocol import BEAT_HEADER
from celery_redislock.testing import RedisServer
from tests.taskapp import make_app
from tests.workers import wait_for

django = pytest.importorskip("django", reason="django-celery-beat is not installed")
pytest.importorskip("django_celery_beat", reason="django-celery-beat is not installed")


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from django.conf import settings
    from django.core.management import call_command

    path = tmp_path_factory.mktemp("django") / "beat.sqlite3"
    settings.configure(
        INSTALLED_APPS=["django_celery_beat"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}},
        USE_TZ=True,
        TIME_ZONE="UTC",
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()
    call_command("migrate", verbosity=0)
    return path


@pytest.fixture
def app(redis_server: RedisServer, prefix: str, database: Path) -> Iterator[Celery]:
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    yield app
    app.recorder.client.delete(app.conf.task_default_queue)  # type: ignore[attr-defined]
    app.close()


def test_slots_of_django_celery_beat_schedules(app: Celery) -> None:
    from django_celery_beat.clockedschedule import clocked
    from django_celery_beat.tzcrontab import TzAwareCrontab

    paris = TzAwareCrontab(minute=0, hour=9, tz=ZoneInfo("Europe/Paris"), app=app)
    now = datetime(2026, 6, 1, 12, 0, tzinfo=timezone.utc)
    assert slot_of(paris, now).id == "2026-06-01T07:00:00Z"
    one_off = clocked(datetime(2026, 6, 1, 11, 30, tzinfo=timezone.utc), app=app)
    assert slot_of(one_off, now).id == "2026-06-01T11:30:00Z"


def test_two_database_schedulers_send_each_slot_once(app: Celery) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    every_second = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(  # a task without lock_beat, opted in by its entry's headers
        name="by-header",
        task="taskapp.beat_off",
        interval=every_second,
        args='["h"]',
        headers='{"lock_beat": true}',
    )
    PeriodicTask.objects.create(name="by-task", task="taskapp.beat_job", interval=every_second, args='["t"]')
    PeriodicTask.objects.create(name="plain", task="taskapp.beat_off", interval=every_second, args='["p"]')
    beats = [DatabaseScheduler(app=app) for _ in range(2)]
    for beat in beats:
        guard(beat)
    recorder: Any = app.recorder  # type: ignore[attr-defined]

    def sent() -> list[dict[str, Any]]:
        queued = recorder.client.lrange(app.conf.task_default_queue, 0, -1)
        return [json.loads(raw)["headers"] for raw in queued]

    def sends_of(args: str) -> int:
        return sum(headers["argsrepr"] == args for headers in messages)

    wake_at, messages = [0.0, 0.0], list[dict[str, Any]]()
    deadline = time.monotonic() + 60  # until 3 slots at least, whatever the load
    try:
        # ... and the unguarded entry sent more often than once a slot: by both beats
        while not (3 <= min(sends_of("['h']"), sends_of("['t']")) < sends_of("['p']") - 1):
            assert time.monotonic() < deadline, f"too few sends: {[h['argsrepr'] for h in messages]}"
            for index, beat in enumerate(beats):  # each beat ticks as celery beat does: again after the delay
                if time.monotonic() >= wake_at[index]:
                    wake_at[index] = time.monotonic() + beat.tick()
            time.sleep(max(min(min(wake_at) - time.monotonic(), 0.05), 0))  # the beats' own idling
            messages = sent()
    finally:
        for beat in beats:
            beat.close()
    for args in ("['h']", "['t']"):
        slots = [headers[BEAT_HEADER]["slot"] for headers in messages if headers["argsrepr"] == args]
        assert len(slots) == len(set(slots)) >= 3
        assert all(headers[BEAT_HEADER]["claimed"] for headers in messages if headers["argsrepr"] == args)
    plain = [headers for headers in messages if headers["argsrepr"] == "['p']"]
    assert not any(BEAT_HEADER in headers for headers in plain)


def test_a_one_off_is_not_run_again_by_a_beat_that_lost_the_state_of_its_send(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """A clocked one-off is due from its time on until a beat that sent it disables it, once it
    reads back the run count it saves with its schedule state (every 3 minutes). A beat killed
    before saving it (SIGKILL, an OOM kill) and started again, or another beat coming up
    meanwhile, finds the one-off never run and sends it again, minutes later: its slot's
    marker is still there, and the send is dropped."""
    from django.utils import timezone as django_timezone
    from django_celery_beat.models import ClockedSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    when = ClockedSchedule.objects.create(clocked_time=django_timezone.now() - timedelta(seconds=1))
    PeriodicTask.objects.create(  # a task without lock_beat, opted in by its entry's headers
        name="once",
        task="taskapp.beat_off",
        clocked=when,
        one_off=True,
        args='["o"]',
        headers='{"lock_beat": true}',
    )
    try:
        recorder: Any = app.recorder  # type: ignore[attr-defined]

        def sent() -> list[dict[str, Any]]:  # the one-off's slots, from the queue (other tests' entries too)
            queued = [
                json.loads(raw)["headers"]
                for raw in recorder.client.lrange(app.conf.task_default_queue, 0, -1)
            ]
            return [headers[BEAT_HEADER] for headers in queued if headers.get("periodic_task_name") == "once"]

        def dropped() -> bool:  # the one-off's send, dropped by a beat
            return any(
                "entry 'once' slot" in r.getMessage() and "not sent" in r.getMessage() for r in caplog.records
            )

        first = DatabaseScheduler(app=app)
        guard(first)
        try:
            wait_for(lambda: first.tick() is not None and sent(), timeout=30, what="the one-off sent")
        finally:
            first.close()
        (slot,) = sent()
        PeriodicTask.objects.filter(name="once").update(total_run_count=0)  # its beat died before saving it
        marker = recorder.client.pttl(slot["key"])
        recorder.client.pexpire(slot["key"], marker - 120_000)  # two minutes on: gone if it lived less
        restarted = DatabaseScheduler(app=app)
        guard(restarted)
        try:
            with caplog.at_level(logging.INFO, logger="celery_redislock.beat"):
                wait_for(
                    lambda: restarted.tick() is not None and (len(sent()) > 1 or dropped()),
                    timeout=30,
                    what="the restarted beat sending the one-off",
                )
        finally:
            restarted.close()
        assert len(sent()) == 1, f"sent again: the marker lived {marker} ms"
    finally:  # the database is the module's
        PeriodicTask.objects.filter(name="once").delete()
        when.delete()
