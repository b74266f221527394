"""Beat slots through an injected clock: slot boundaries of each kind of schedule, and
in-process beats (Celery's own Scheduler, guarded) whose clocks are apart, that start
at different times, or all come back after being down; no waiting for real minutes.

The simulated beats publish to the test's Redis broker; the tests read what they sent
from the queue, and a real worker runs it where a test needs the worker's side.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, Literal
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import Celery
from celery.beat import Scheduler
from celery.schedules import BaseSchedule, crontab, schedule, solar
from celery.signals import task_postrun
from kombu import Producer
from kombu.exceptions import OperationalError

from celery_redislock import LockConfigurationError, LockedTask, signals
from celery_redislock.beat import CLOCK_TOLERANCE, ONE_OFF_TTL, guard, slot_of
from celery_redislock.protocol import BEAT_HEADER, text
from celery_redislock.testing import RedisServer
from examples._support import ROOT
from tests.interrupts import Arm
from tests.taskapp import Recorder, make_app
from tests.workers import threads_worker, wait_for

UTC = timezone.utc


def at(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, micro: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=UTC)


@pytest.fixture
def bare_app() -> Iterator[Celery]:
    app = Celery("slots", set_as_current=False)
    yield app
    app.close()


# -- slot boundaries -------------------------------------------------------------------


def test_an_interval_slot_is_the_epoch_aligned_bucket_of_run_every(bare_app: Celery) -> None:
    every_10s = schedule(timedelta(seconds=10), app=bare_app)
    assert slot_of(every_10s, at(2026, 1, 1, 10, 0, 9, 999999)).id == "2026-01-01T10:00:00Z"
    assert slot_of(every_10s, at(2026, 1, 1, 10, 0, 10)).id == "2026-01-01T10:00:10Z"
    naive = datetime(2026, 1, 1, 10, 0, 15)  # naive times are UTC, as in Celery
    assert slot_of(every_10s, naive).id == "2026-01-01T10:00:10Z"
    paris = timezone(timedelta(hours=1))
    assert slot_of(every_10s, datetime(2026, 1, 1, 11, 0, 15, tzinfo=paris)).id == "2026-01-01T10:00:10Z"
    slot = slot_of(every_10s, at(2026, 1, 1, 10, 0, 15))
    assert slot.end - slot.start == timedelta(seconds=10)
    assert slot.marker_ttl() == 10 + CLOCK_TOLERANCE
    quarter = schedule(timedelta(seconds=0.25), app=bare_app)
    assert slot_of(quarter, at(2026, 1, 1, 10, 0, 0, 600000)).id == "2026-01-01T10:00:00.500000Z"


def test_interval_slots_are_named_alike_by_clocks_2s_apart_started_at_any_time(bare_app: Celery) -> None:
    """A beat sends once a second of its own clock: every beat names the same slots."""
    every_1s = schedule(timedelta(seconds=1), app=bare_app)
    real = at(2026, 1, 1, 10, 0, 0)
    named = []
    for skew in (-1.0, 0.0, 1.0):
        for phase in (0.0, 0.37, 0.99):  # when in the second the beat started
            moments = [real + timedelta(seconds=skew + phase + n) for n in range(30)]
            named.append([slot_of(every_1s, moment).id for moment in moments])
    for slots in named:
        assert len(slots) == len(set(slots))  # never one slot twice by one beat
    assert len(set.intersection(*(set(slots) for slots in named))) == 28  # the same ids, 2 s apart


@pytest.mark.parametrize(
    ("cron", "now", "slot", "next_slot"),
    [
        pytest.param(
            crontab(minute=0),
            at(2026, 1, 1, 10, 0, 0),
            "2026-01-01T10:00:00Z",
            at(2026, 1, 1, 11),
            id="on-the-fire",
        ),
        pytest.param(
            crontab(minute=0),
            at(2026, 1, 1, 10, 59, 59, 999999),
            "2026-01-01T10:00:00Z",
            at(2026, 1, 1, 11),
            id="just-before-next",
        ),
        pytest.param(
            crontab(minute=0),
            at(2026, 1, 1, 9, 59, 59, 999999),
            "2026-01-01T09:00:00Z",
            at(2026, 1, 1, 10),
            id="just-before",
        ),
        pytest.param(
            crontab(minute="*/15"),
            at(2026, 1, 1, 10, 44, 59),
            "2026-01-01T10:30:00Z",
            at(2026, 1, 1, 10, 45),
            id="quarters",
        ),
        pytest.param(
            crontab(minute=0, hour=9, day_of_week="mon-fri"),
            at(2026, 11, 22, 12, 0),  # a Sunday
            "2026-11-20T09:00:00Z",
            at(2026, 11, 23, 9),
            id="weekdays-over-a-weekend",
        ),
        pytest.param(
            crontab(minute=0, hour=0, day_of_month=29, month_of_year=2),
            at(2026, 11, 22),
            "2024-02-29T00:00:00Z",
            at(2028, 2, 29),
            id="leap-day",
        ),
    ],
)
def test_a_crontab_slot_is_its_latest_fire(
    bare_app: Celery, cron: crontab, now: datetime, slot: str, next_slot: datetime
) -> None:
    cron.app = bare_app
    found = slot_of(cron, now)
    assert found.id == slot
    assert found.end == next_slot
    assert found.marker_ttl() == (next_slot - found.start).total_seconds() + CLOCK_TOLERANCE


def test_a_crontab_slot_follows_the_app_timezone(bare_app: Celery) -> None:
    bare_app.conf.update(timezone="Europe/Paris")
    nine = crontab(minute=0, hour=9, app=bare_app)  # 09:00 in Paris, 07:00 UTC in summer
    assert slot_of(nine, at(2026, 6, 1, 6, 59)).id == "2026-05-31T07:00:00Z"
    assert slot_of(nine, at(2026, 6, 1, 7, 0)).id == "2026-06-01T07:00:00Z"


def test_a_solar_slot_is_the_latest_event_to_the_second(bare_app: Celery) -> None:
    pytest.importorskip("ephem", reason="solar schedules need ephem (pip install ephem)")
    sunrise = solar("sunrise", 48.85, 2.35, app=bare_app)  # Paris, 1 June 2026: about 03:51:47 UTC
    before = {slot_of(sunrise, at(2026, 6, 1, 3, minute)).id for minute in range(0, 50, 7)}
    after = {slot_of(sunrise, at(2026, 6, 1, hour)).id for hour in range(4, 24)}
    assert len(before) == 1 and len(after) == 1  # one id, whenever in the day it is asked
    (yesterday,), (today,) = before, after
    assert yesterday.startswith("2026-05-31T03:5") and today.startswith("2026-06-01T03:51:")
    assert slot_of(sunrise, at(2026, 6, 1, 12)).end.date().isoformat() == "2026-06-02"


@pytest.mark.parametrize(
    ("event", "latitude", "longitude"),
    [("sunrise", 48.85, 2.35), ("dusk_nautical", 40.7, -74.0)],  # Paris, New York
)
def test_a_solar_slot_is_the_event_every_beat_sends_it_for(
    bare_app: Celery, event: Literal["sunrise", "dusk_nautical"], latitude: float, longitude: float
) -> None:
    """Solar event times come with up to 0.2 s of noise that depends on where the computation
    starts. A beat sends an event as soon as it falls due, reckoned from its last run (or from
    when it started): every day of 2026, the slot of that send is the event, named alike by
    a beat running for days and one started half a day before."""
    pytest.importorskip("ephem", reason="solar schedules need ephem (pip install ephem)")
    clock = [at(2026, 1, 1)]
    sun = solar(event, latitude, longitude, nowfun=lambda: clock[0], app=bare_app)

    def due_after(last_run: datetime) -> datetime:
        clock[0] = last_run
        return last_run + sun.remaining_estimate(last_run)

    running = at(2026, 1, 1)
    for _ in range(365):
        running = due_after(running)
        started = due_after(running - timedelta(hours=12))
        named = {slot_of(sun, when).start for when in (running, started)}
        assert len(named) == 1, (running, started, named)  # before: a second apart (New York)
        assert abs(min(named) - running) < timedelta(seconds=1), (running, named)  # before: a day (Paris)


class OneOff(BaseSchedule):
    """A schedule firing once (as django-celery-beat's ``clocked``)."""

    def __init__(self, when: datetime, nowfun: Callable[[], datetime] | None = None, app: Any = None) -> None:
        super().__init__(nowfun=nowfun, app=app)
        self.when = when

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        return self.when - self.now()


def test_a_one_off_slot_is_its_time(bare_app: Celery) -> None:
    slot = slot_of(OneOff(at(2026, 1, 1, 10, 0, 30), app=bare_app), at(2026, 1, 1, 10, 0, 31))
    assert slot.id == "2026-01-01T10:00:30Z" and slot.end == slot.start
    assert slot.marker_ttl() == ONE_OFF_TTL  # it is due until its beat saves that it ran


def test_a_schedule_without_slots_is_refused_by_name(bare_app: Celery) -> None:
    with pytest.raises(LockConfigurationError, match="cannot tell the slots of schedule 'hourly'"):
        slot_of("hourly", at(2026, 1, 1))
    with pytest.raises(LockConfigurationError, match="no remaining_estimate"):
        slot_of(BaseSchedule(app=bare_app), at(2026, 1, 1))
    with pytest.raises(LockConfigurationError, match="never fired"):
        slot_of(OneOff(at(2027, 1, 1), app=bare_app), at(2026, 1, 1))


# -- beats on an injected clock -------------------------------------------------------


class Clock:
    """The fake real time the simulated beats share."""

    def __init__(self, now: datetime) -> None:
        self.now = now


class SimulatedBeat:
    """A guarded Celery ``Scheduler`` whose clock is the fake one, ``skew`` seconds off,
    ticked as ``celery beat`` ticks it: again after the delay each tick returns."""

    def __init__(
        self,
        app: Celery,
        clock: Clock,
        skew: float,
        entries: dict[str, dict[str, Any]],
        spins: int = 0,
    ) -> None:
        #: a tick that sent returns 0 and beat ticks again at once: up to ``spins`` such ticks
        #: per step are a beat spinning (counted in ``spun``), one more fails the test
        self.clock, self.skew, self.spins, self.spun = clock, timedelta(seconds=skew), spins, 0
        self.scheduler = Scheduler(app, lazy=True)
        # celery-types takes only ScheduleEntry values; Celery's merge_inplace takes entry fields too
        self.scheduler.merge_inplace(
            {name: {**entry, "schedule": entry["schedule"](self.now)} for name, entry in entries.items()}  # type: ignore[misc]
        )
        guard(self.scheduler)
        self.wake_at = clock.now
        app.simulated.append(self)  # type: ignore[attr-defined]  # closed by the app fixture

    def now(self) -> datetime:
        return self.clock.now + self.skew

    def step(self) -> None:
        for _ in range(self.spins or 100):  # a tick that sent returns 0: tick again at once
            if self.clock.now < self.wake_at:
                return
            self.wake_at = self.clock.now + timedelta(seconds=self.scheduler.tick())
        if not self.spins:
            raise AssertionError("the scheduler kept asking to tick again at once")
        self.spun += 1  # the fake clock moves on, as a real one does while beat spins


def run(beats: list[SimulatedBeat], clock: Clock, until: datetime, step: float) -> None:
    while clock.now < until:
        for beat in beats:
            beat.step()
        clock.now += timedelta(seconds=step)


def every(seconds: float) -> Callable[[Callable[[], datetime]], schedule]:
    return lambda now: schedule(timedelta(seconds=seconds), nowfun=now)


def cron(**fields: Any) -> Callable[[Callable[[], datetime]], crontab]:
    return lambda now: crontab(nowfun=now, **fields)


@pytest.fixture
def app(redis_server: RedisServer, prefix: str) -> Iterator[Celery]:
    """The beats' app; the worker's, where one runs, is another with the same settings."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", without=("taskapp.beat_fallback",))
    app.simulated = []  # type: ignore[attr-defined]
    yield app
    for beat in app.simulated:  # type: ignore[attr-defined]
        beat.scheduler.close()
    app.recorder.client.delete(app.conf.task_default_queue)  # type: ignore[attr-defined]
    app.close()


def queued(app: Celery) -> list[dict[str, Any]]:
    """The messages in the app's queue, oldest first."""
    recorder: Recorder = app.recorder  # type: ignore[attr-defined]
    return [json.loads(raw) for raw in reversed(recorder.client.lrange(app.conf.task_default_queue, 0, -1))]


def sent(app: Celery) -> list[tuple[str, str | None, bool | None]]:
    """(arguments, slot, claimed) of each message in the queue, oldest first; the slot and
    claimed are None for a message without a slot."""
    out = []
    for message in queued(app):
        header = message["headers"].get(BEAT_HEADER) or {}
        out.append((message["headers"]["argsrepr"], header.get("slot"), header.get("claimed")))
    return out


def test_guarding_a_scheduler_twice_keeps_one_guard_whatever_wrapped_it_between(app: Celery) -> None:
    """``guard()`` is idempotent per scheduler: a second call (``beat_init`` and the user's own,
    or two installs) returns the first guard, even when something else (an APM tool, another
    extension) wrapped the scheduler's ``apply_async`` in between. Two guards would claim each
    slot twice with different tokens, and the slot would never be sent."""
    scheduler = Scheduler(app, lazy=True)
    first = guard(scheduler)
    guarded = scheduler.apply_async

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return guarded(*args, **kwargs)

    scheduler.apply_async = wrapped  # type: ignore[method-assign]
    assert guard(scheduler) is first
    assert scheduler.apply_async is wrapped


def test_three_beats_2s_apart_started_at_different_times_send_each_interval_slot_once(app: Celery) -> None:
    clock = Clock(at(2026, 1, 1, 10, 0, 0, 130000))
    entries = {"job": {"task": "taskapp.beat_job", "schedule": every(1), "args": ["a"]}}
    beats = [SimulatedBeat(app, clock, -1.0, entries)]
    run(beats, clock, clock.now + timedelta(seconds=3.4), 0.05)
    beats.append(SimulatedBeat(app, clock, 1.0, entries))  # started later, 2 s ahead of the first
    run(beats, clock, clock.now + timedelta(seconds=5.1), 0.05)
    beats.append(SimulatedBeat(app, clock, 0.0, entries))
    run(beats, clock, clock.now + timedelta(seconds=20), 0.05)
    slots = [slot for _, slot, _ in sent(app)]
    assert len(slots) == len(set(slots)), Counter(slots).most_common(3)
    seconds = sorted(datetime.fromisoformat(slot.replace("Z", "+00:00")) for slot in slots if slot)
    assert seconds == [seconds[0] + timedelta(seconds=n) for n in range(len(seconds))]  # none skipped
    assert len(seconds) >= 27
    assert all(claimed for _, _, claimed in sent(app))  # the beats claimed them


def test_three_beats_2s_apart_send_each_crontab_minute_once(app: Celery) -> None:
    clock = Clock(at(2026, 1, 1, 9, 58, 30))
    entries = {"minutely": {"task": "taskapp.beat_job", "schedule": cron(minute="*"), "args": ["m"]}}
    beats = [SimulatedBeat(app, clock, skew, entries) for skew in (-1.0, 1.0, 0.3)]
    run(beats, clock, at(2026, 1, 1, 10, 8, 30), 0.25)
    slots = [slot for _, slot, _ in sent(app)]
    assert slots == [f"2026-01-01T{9 + (58 + n) // 60:02d}:{(58 + n) % 60:02d}:00Z" for n in range(1, 11)]


def relative(run_every: timedelta, tz: str) -> Callable[[Callable[[], datetime]], schedule]:
    """``schedule(run_every, relative=True)`` whose clock reads in ``tz``, as beat's ``app.now()``
    does: Celery rounds a relative interval's next run down in the timezone of the last one."""
    zone = ZoneInfo(tz)
    return lambda now: schedule(run_every, relative=True, nowfun=lambda: now().astimezone(zone))


def each_run_a_slot_of_its_own(app: Celery, at_least: int) -> None:
    """One beat sent the entry opted in (``['o']``) as often as the same entry opted out
    (``['p']``), at least ``at_least`` times, each in a slot of its own: no run of its own beat
    dropped as the slot's duplicate."""
    messages = sent(app)
    plain = [m for m in messages if m[0] == "['p']"]
    opted = [slot for args, slot, _ in messages if args == "['o']"]
    assert len(plain) >= at_least
    assert len(opted) == len(set(opted)) == len(plain), opted


@pytest.mark.parametrize(
    ("run_every", "tz", "start", "until"),
    [  # Celery runs these every minute, and every local midnight (23 h apart as summer time starts)
        pytest.param(
            timedelta(seconds=90), "UTC", at(2026, 1, 1, 10, 0, 0, 130000), at(2026, 1, 1, 10, 10), id="90s"
        ),
        pytest.param(timedelta(days=1), "Europe/London", at(2026, 3, 26, 12), at(2026, 4, 2), id="day-dst"),
    ],
)
def test_a_relative_interval_sends_every_run_its_beat_makes(
    app: Celery, run_every: timedelta, tz: str, start: datetime, until: datetime
) -> None:
    """A relative interval runs at its ``run_every`` after the last run rounded down to a whole
    unit of it (minute, hour, day): more often than once per ``run_every`` when that is not a
    whole number of units. One beat's own runs are each a slot of their own; the same entry
    opted out (``lock_beat: False``) shows what Celery sends."""
    app.conf.update(timezone=tz)
    entries = {
        "opted": {"task": "taskapp.beat_job", "schedule": relative(run_every, tz), "args": ["o"]},
        "plain": {
            "task": "taskapp.beat_job",
            "schedule": relative(run_every, tz),
            "args": ["p"],
            "options": {"lock_beat": False},
        },
    }
    clock = Clock(start)
    run(
        [SimulatedBeat(app, clock, 0.0, entries)],
        clock,
        until,
        0.25 if run_every < timedelta(hours=1) else 60,
    )
    each_run_a_slot_of_its_own(app, at_least=6)


def test_relative_interval_slots_are_named_alike_by_beats_started_at_different_times(app: Celery) -> None:
    """Beats started a minute apart run a relative 2-minute interval at odd and even minutes:
    the job still runs once per 2-minute slot."""
    clock = Clock(at(2026, 1, 1, 10, 0, 0, 130000))
    entries = {
        "job": {"task": "taskapp.beat_job", "schedule": relative(timedelta(minutes=2), "UTC"), "args": ["r"]}
    }
    beats = [SimulatedBeat(app, clock, -1.0, entries)]
    run(beats, clock, at(2026, 1, 1, 10, 1, 0, 500000), 0.25)
    beats.append(SimulatedBeat(app, clock, 1.0, entries))
    run(beats, clock, at(2026, 1, 1, 10, 20), 0.25)
    slots = [slot for _, slot, _ in sent(app)]
    assert len(slots) == len(set(slots)) >= 9, slots


@pytest.mark.parametrize(
    ("start", "until"),
    [
        pytest.param(at(2026, 10, 24, 23), at(2026, 10, 25, 3), id="clocks-back"),  # 02:00-03:00 twice
        pytest.param(at(2026, 3, 28, 23), at(2026, 3, 29, 3), id="clocks-forward"),  # 02:00-03:00 skipped
    ],
)
def test_a_crontab_in_a_summer_time_zone_sends_every_run_its_beat_makes(
    app: Celery, start: datetime, until: datetime
) -> None:
    """A half-hourly crontab in Paris as clocks change: the beat's runs are each a slot of their
    own, as many as Celery sends for the same entry opted out."""
    app.conf.update(timezone="Europe/Paris")
    zone = ZoneInfo("Europe/Paris")

    def half_hourly(now: Callable[[], datetime]) -> crontab:
        return crontab(minute="0,30", nowfun=lambda: now().astimezone(zone), app=app)

    entries = {
        "opted": {"task": "taskapp.beat_job", "schedule": half_hourly, "args": ["o"]},
        "plain": {
            "task": "taskapp.beat_job",
            "schedule": half_hourly,
            "args": ["p"],
            "options": {"lock_beat": False},
        },
    }
    clock = Clock(start)
    run([SimulatedBeat(app, clock, 0.0, entries)], clock, until, 5)
    each_run_a_slot_of_its_own(app, at_least=5)


def test_beats_through_the_repeated_hour_send_each_run_celery_makes_once(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Paris, 25 October 2026: 02:00-03:00 comes twice, in summer time (00:00-01:00Z) then in
    winter time (01:00-02:00Z). Celery's crontab reckons the next run in wall-clock time from
    the last one (celery#10107), so a half-hourly job runs at the first 02:00 and 02:30, then at
    03:00: none in the hour repeated. The slot of a send at the second 02:00:01 (01:00:01Z) is
    therefore the first 02:30's (00:30Z), as the plain entry's sends show. A beat started in the
    repeated hour without schedule state (a container that lost its schedule file) finds its
    next run at 02:30 of the first occurrence, in the past: it sends at every tick until the
    second 02:30. Those sends are all of the 00:30Z slot, which ran: dropped. Beats 2 s apart
    and the late one send each run once, and no other."""
    app.conf.update(timezone="Europe/Paris")
    zone = ZoneInfo("Europe/Paris")
    half_hourly = crontab(minute="0,30", app=app)
    second_two = slot_of(half_hourly, at(2026, 10, 25, 1, 0, 1).astimezone(zone))  # 02:00:01, fold=1
    assert (second_two.id, second_two.end) == ("2026-10-25T00:30:00Z", at(2026, 10, 25, 2))

    def paris_half_hourly(now: Callable[[], datetime]) -> crontab:
        return crontab(minute="0,30", nowfun=lambda: now().astimezone(zone), app=app)

    opted = {"opted": {"task": "taskapp.beat_job", "schedule": paris_half_hourly, "args": ["o"]}}
    plain = {
        "plain": {
            "task": "taskapp.beat_job",
            "schedule": paris_half_hourly,
            "args": ["p"],
            "options": {"lock_beat": False},
        }
    }
    clock = Clock(at(2026, 10, 24, 22, 50))
    beats = [SimulatedBeat(app, clock, -1.0, {**opted, **plain}), SimulatedBeat(app, clock, 1.0, opted)]
    run(beats, clock, at(2026, 10, 25, 1, 20), 5)
    late = SimulatedBeat(app, clock, 0.0, opted, spins=5)
    with caplog.at_level(logging.INFO, logger="celery_redislock.beat"):
        run([*beats, late], clock, at(2026, 10, 25, 3, 10), 5)
    assert late.spun >= 100  # it sent at every tick for the rest of the second 02:00-02:30
    dropped = [r for r in caplog.records if "slot 2026-10-25T00:30:00Z not sent: a duplicate" in r.message]
    assert len(dropped) >= 500
    runs = ["2026-10-24T23:00:00Z", "2026-10-24T23:30:00Z", "2026-10-25T00:00:00Z", "2026-10-25T00:30:00Z"]
    runs += ["2026-10-25T02:00:00Z", "2026-10-25T02:30:00Z", "2026-10-25T03:00:00Z"]
    messages = sent(app)
    assert [slot for args, slot, _ in messages if args == "['o']"] == runs
    assert len([m for m in messages if m[0] == "['p']"]) == len(runs)  # Celery's runs, one beat's


def test_beats_coming_back_after_all_were_down_run_the_current_slot_once(app: Celery) -> None:
    clock = Clock(at(2026, 1, 1, 9, 59, 0))
    entries = {"hourly": {"task": "taskapp.beat_job", "schedule": cron(minute=0), "args": ["h"]}}
    beats = [SimulatedBeat(app, clock, skew, entries) for skew in (-1.0, 0.0, 1.0)]
    run(beats, clock, at(2026, 1, 1, 10, 5), 1.0)
    clock.now = at(2026, 1, 1, 13, 20)  # every beat was down: the 11:00 and 12:00 slots were missed
    run(beats[:2], clock, at(2026, 1, 1, 13, 40), 1.0)  # two come back; their schedule state is stale
    run(beats, clock, at(2026, 1, 1, 14, 1), 1.0)  # the third comes back later, as stale
    slots = [slot for _, slot, _ in sent(app)]
    assert slots == ["2026-01-01T10:00:00Z", "2026-01-01T13:00:00Z", "2026-01-01T14:00:00Z"]


def test_an_entry_opts_in_or_out_whatever_its_task_says(app: Celery) -> None:
    clock = Clock(at(2026, 1, 1, 10, 0, 0, 600000))
    entries = {
        "by-option": {
            "task": "taskapp.beat_off",
            "schedule": every(1),
            "args": ["o"],
            "options": {"lock_beat": True},
        },
        "by-header": {
            "task": "taskapp.beat_off",
            "schedule": every(1),
            "args": ["h"],
            "options": {"headers": {"lock_beat": True}},
        },
        "opted-out": {
            "task": "taskapp.beat_job",
            "schedule": every(1),
            "args": ["x"],
            "options": {"lock_beat": False},
        },
        "not-opted": {"task": "taskapp.beat_off", "schedule": every(1), "args": ["n"]},
    }
    beats = [SimulatedBeat(app, clock, skew, entries) for skew in (-0.5, 0.5)]
    run(beats, clock, clock.now + timedelta(seconds=10), 0.05)
    messages = sent(app)
    for args in ("['o']", "['h']"):  # opted in: each slot once, claimed by a beat
        slots = [slot for sent_args, slot, claimed in messages if sent_args == args and claimed]
        assert len(slots) == len(set(slots)) == len([m for m in messages if m[0] == args]) >= 9
    for args in ("['x']", "['n']"):  # not opted in: sent by both beats, as plain Celery does
        unslotted = [(slot, claimed) for sent_args, slot, claimed in messages if sent_args == args]
        assert unslotted == [(None, None)] * len(unslotted) and len(unslotted) >= 16
    assert all("lock_beat" not in message["properties"] for message in queued(app))  # not a message property


@pytest.mark.parametrize("fails", ["after the publish", "in the publish"])
def test_a_beat_whose_send_raises_frees_its_slot_only_if_nothing_went_out(
    app: Celery, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """An entry of a plain task opted in (``lock_beat``): the beat's claim is the slot's only
    guard, nothing on the worker checks it again. The first beat's send of the 10:00:10 slot
    raises once, either after its message went out (Celery's ``Scheduler.apply_async`` syncs the
    schedule in a ``finally``: a store that fails, or beat's SIGTERM handler raising
    ``SystemExit`` there), or in the publish itself (the broker unreachable: nothing went out).
    The slot is sent once: by that beat, whose claim stays, or by the other beat, once freed."""
    clock = Clock(at(2026, 1, 1, 10, 0, 0, 100000))
    entries = {
        "plain": {
            "task": "taskapp.beat_off",
            "schedule": every(10),
            "args": ["p"],
            "options": {"lock_beat": True},
        }
    }
    first = SimulatedBeat(app, clock, 0.0, entries)
    second = SimulatedBeat(app, clock, 0.3, entries)  # another beat, its clock 0.3 s ahead
    failed: list[str] = []
    if fails == "after the publish":

        def sync() -> None:
            if not failed:
                failed.append(fails)
                raise OSError("No space left on device")

        monkeypatch.setattr(first.scheduler, "sync", sync)
    else:
        publish = Producer.publish

        def refused(self: Producer, *args: Any, **kwargs: Any) -> Any:
            if not failed and first.scheduler.producer is self:
                failed.append(fails)
                raise OperationalError("the broker is unreachable")
            return publish(self, *args, **kwargs)

        monkeypatch.setattr(Producer, "publish", refused)
    run([first, second], clock, at(2026, 1, 1, 10, 0, 12), 0.05)
    assert failed == [fails]
    slots = [slot for _, slot, _ in sent(app)]
    assert slots.count("2026-01-01T10:00:10Z") == 1, slots


def claiming() -> bool:
    """Whether this thread is in a beat's claim of a slot."""
    frame = sys._getframe()
    while frame is not None and not (
        frame.f_code.co_name == "_claim" and frame.f_globals["__name__"] == "celery_redislock.beat"
    ):
        frame = frame.f_back  # type: ignore[assignment]
    return frame is not None


def publishing() -> bool:
    """Whether this thread is in a publish (kombu's ``Producer.publish``)."""
    frame = sys._getframe()
    while frame is not None and not (
        frame.f_code.co_name == "publish" and frame.f_globals["__name__"] == "kombu.messaging"
    ):
        frame = frame.f_back  # type: ignore[assignment]
    return frame is not None


def slots_sent_when_the_first_beat_exits(
    app: Celery, interrupt_read: Arm, inside: Callable[[], bool], closing: bool = False
) -> list[str | None]:
    """Two beats (the second 0.3 s behind) send an entry of a plain task opted in (the beat's
    claim is the slot's only guard) every 10 s; as the first steps through the 10:00:20 slot and
    ``inside()`` holds, one of its reads gets beat's SIGTERM/SIGINT handler (which closes the
    scheduler, if ``closing``, then raises ``SystemExit``), and that beat exits. The slots sent,
    in order."""
    clock = Clock(at(2026, 1, 1, 10, 0, 0, 500000))
    entries = {
        "plain": {
            "task": "taskapp.beat_off",
            "schedule": every(10),
            "args": ["p"],
            "options": {"lock_beat": True},
        }
    }
    first, second = SimulatedBeat(app, clock, 0.0, entries), SimulatedBeat(app, clock, -0.3, entries)
    run([first, second], clock, at(2026, 1, 1, 10, 0, 15), 0.05)  # the 10:00:10 slot: connected
    stepping_first = [False]
    fired = interrupt_read(
        lambda: stepping_first[0] and inside(), SystemExit, first.scheduler.close if closing else None
    )
    beats = [first, second]
    while clock.now < at(2026, 1, 1, 10, 0, 25):
        for beat in list(beats):
            stepping_first[0] = beat is first
            try:
                beat.step()
            except SystemExit:
                beats.remove(beat)  # that beat exits
            finally:
                stepping_first[0] = False
        clock.now += timedelta(seconds=0.05)
    assert fired == [1] and beats == [second]
    return [slot for _, slot, _ in sent(app)]


def test_a_beat_interrupted_as_it_claims_a_slot_leaves_it_to_the_other_beats(
    app: Celery, interrupt_read: Arm
) -> None:
    """The interrupt lands as the first beat reads the reply to its claim of the 10:00:20 slot
    (Redis ran it): that beat exits without sending. The other beat, which tries the slot next,
    sends it."""
    slots = slots_sent_when_the_first_beat_exits(app, interrupt_read, claiming)
    assert slots == ["2026-01-01T10:00:10Z", "2026-01-01T10:00:20Z"], slots


def test_a_beat_interrupted_as_it_reads_its_publish_reply_keeps_the_slot_it_sent(
    app: Celery, interrupt_read: Arm
) -> None:
    """The interrupt (the scheduler closed first, as beat's handler does) lands as the first beat
    reads the reply to the publish of the 10:00:20 slot (its message went out: the broker ran the
    push). The other beat, which tries the slot next, finds it taken; it is sent once."""
    slots = slots_sent_when_the_first_beat_exits(app, interrupt_read, publishing, closing=True)
    assert slots == ["2026-01-01T10:00:10Z", "2026-01-01T10:00:20Z"], slots


def test_the_send_task_fallback_is_deduplicated_by_the_worker(
    app: Celery, redis_server: RedisServer, prefix: str
) -> None:
    """The beats cannot see the task: they send every slot unclaimed, the worker runs each once."""
    clock = Clock(at(2026, 1, 1, 10, 0, 0, 200000))
    entries = {"fallback": {"task": "taskapp.beat_fallback", "schedule": every(1), "args": ["f"]}}
    beats = [SimulatedBeat(app, clock, skew, entries) for skew in (-1.0, 0.0, 1.0)]
    run(beats, clock, clock.now + timedelta(seconds=6), 0.05)
    messages = sent(app)
    per_slot = Counter(slot for _, slot, _ in messages)
    slots = set(per_slot)
    assert max(per_slot.values()) == 3 and list(per_slot.values()).count(3) >= 3  # every beat sent them
    assert not any(claimed for _, _, claimed in messages)
    dropped: list[dict[str, Any]] = []

    def on_dropped(sender: Any = None, **kwargs: Any) -> None:
        dropped.append(kwargs)

    signals.task_deduplicated.connect(on_dropped, weak=False, dispatch_uid="test-fallback-dropped")
    worker_app = make_app(redis_server.url, prefix, f"q-{prefix}")
    recorder: Recorder = worker_app.recorder  # type: ignore[attr-defined]
    try:
        with threads_worker(worker_app, concurrency=1):  # one at a time: none skipped as overlapping
            wait_for(lambda: recorder.client.llen(app.conf.task_default_queue) == 0, what="the queue drained")
            wait_for(
                lambda: len(recorder.runs()) + len(dropped) >= len(messages),
                what=lambda: f"every message dealt with: {recorder.runs()}, {dropped}, {len(messages)}",
            )
    finally:
        signals.task_deduplicated.disconnect(dispatch_uid="test-fallback-dropped")
        worker_app.close()
    ran = [run[2] for run in recorder.runs()]
    assert len(ran) == len(slots) and set(ran) == slots  # each slot ran once
    assert len(dropped) == len(messages) - len(slots)
    assert Counter(item["key"] for item in dropped) == {
        f"{prefix}:slot:fallback:{slot}": count - 1 for slot, count in per_slot.items() if count > 1
    }


def test_a_slot_published_twice_by_kombus_retry_runs_once(
    app: Celery, redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker took the beat's message, but the connection dropped before its reply: kombu's
    publish retry (``Producer.publish`` through ``connection.ensure``) sends the same message
    again, so two copies of one slot, with one task id and one claim token, reach the queue.
    A worker running them one after the other ran the slot twice: the token owns the marker,
    and the first copy's execution lock was gone by the time the second started. The second
    copy is ignored (IGNORED, no result stored over the first's)."""
    clock = Clock(at(2026, 1, 1, 10, 0, 0, 100000))
    entries = {"job": {"task": "taskapp.beat_job", "schedule": every(10), "args": ["twice"]}}
    beat = SimulatedBeat(app, clock, 0.0, entries)
    publish = Producer._publish

    def published_twice(self: Producer, *args: Any, **kwargs: Any) -> Any:
        publish(self, *args, **kwargs)  # went out; its reply lost: kombu's retry publishes again
        return publish(self, *args, **kwargs)

    monkeypatch.setattr(Producer, "_publish", published_twice)
    run([beat], clock, at(2026, 1, 1, 10, 0, 12), 0.05)
    messages = queued(app)
    assert len(messages) == 2 and messages[0]["headers"] == messages[1]["headers"]
    task_id = messages[0]["headers"]["id"]
    states: list[str] = []

    def on_postrun(sender: Any = None, task_id: str = "", state: str = "", **_: Any) -> None:
        if task_id == messages[0]["headers"]["id"]:
            states.append(state)

    task_postrun.connect(on_postrun, weak=False, dispatch_uid="test-published-twice")
    worker_app = make_app(redis_server.url, prefix, f"q-{prefix}")
    recorder: Recorder = worker_app.recorder  # type: ignore[attr-defined]
    try:
        with threads_worker(worker_app, concurrency=1):  # one after the other
            wait_for(lambda: len(states) == 2, what=lambda: f"both copies dealt with: {states}")
    finally:
        task_postrun.disconnect(dispatch_uid="test-published-twice")
        worker_app.close()
    assert [run[2] for run in recorder.runs()] == ["2026-01-01T10:00:10Z"]
    assert sorted(states) == ["IGNORED", "SUCCESS"]
    assert worker_app.AsyncResult(task_id).get(timeout=10) == "twice"


def test_a_slot_queued_again_by_a_busy_locks_retry_runs(app: Celery, prefix: str) -> None:
    """A slot's message finds the task's execution lock held (``lock_busy="retry"``): its run has
    claimed the slot, and queues the message again, with the same task id and attempt. That
    message is the slot's (a later one than the run it repeats, header field ``again``), not a
    copy of it: it runs once the lock is free."""
    task = app.tasks["taskapp.hold_retry"]
    recorder: Recorder = app.recorder  # type: ignore[attr-defined]
    with threads_worker(app, concurrency=2):
        held = task.delay("busy", True)
        wait_for(lambda: any(e[:4] == ["start", "hold_retry", "busy", held.id] for e in recorder.events()))
        slot = {"entry": "e", "slot": "1", "key": f"{prefix}:slot:e:1", "token": uuid.uuid4().hex}
        header = {**slot, "ttl": 60_000, "beat": "beat=test", "claimed": True}
        sent = app.send_task(task.name, ("busy", True), headers={BEAT_HEADER: header})
        wait_for(lambda: sent.state == "RETRY", what="the slot's message queued again")
        recorder.open_gate("busy", times=2)
        assert sent.get(timeout=60) == "busy"
    starts = [e[3] for e in recorder.events() if e[0] == "start"]
    assert starts == [held.id, sent.id]
    assert " again=" in text(recorder.client.get(slot["key"]))


# -- bad input -------------------------------------------------------------------------


def noop() -> None:
    """A task body."""


def test_bad_opt_ins_and_settings_name_the_task_entry_option_and_value(app: Celery, bare_app: Celery) -> None:
    bare_app.finalize()
    with pytest.raises(
        LockConfigurationError, match=r"task 'bad': lock_beat='yes' is not valid; allowed: True or False"
    ):
        bare_app.task(name="bad", base=LockedTask, lock_beat="yes", shared=False)(noop)
    for setting, value, allowed in [
        ("redislock_beat_leader", 1, "True or False"),
        ("redislock_beat_leader_ttl", 0.1, ">= 0.3"),
        ("redislock_beat_leader_ttl", "30s", "seconds"),
    ]:
        other = Celery("other", set_as_current=False)
        other.conf[setting] = value
        other.task(name="t", base=LockedTask, shared=False)(noop)  # bound when the app is finalized
        # The error names the app: whichever LockedTask binds first, this one or a shared one
        # another test module defined (finalize binds those to every app), raises it.
        with pytest.raises(
            LockConfigurationError,
            match=rf"app 'other': {setting}={value!r} is not valid; allowed: .*{allowed}",
        ):
            other.finalize()
    clock = Clock(at(2026, 1, 1))
    beat = SimulatedBeat(
        app,
        clock,
        0,
        {
            "typo": {
                "task": "taskapp.beat_job",
                "schedule": every(1),
                "args": ["t"],
                "options": {"lock_beat": "yes"},
            },
            "odd": {
                "task": "taskapp.beat_job",
                "schedule": lambda now: BaseSchedule(nowfun=now),
                "args": ["o"],
                "options": {"lock_beat": True},
            },
        },
    )
    with pytest.raises(LockConfigurationError, match=r"beat entry 'typo': lock_beat='yes' is not valid"):
        beat.scheduler.apply_async(beat.scheduler.schedule["typo"])
    with pytest.raises(LockConfigurationError, match=r"beat entry 'odd': cannot tell the slots"):
        beat.scheduler.apply_async(beat.scheduler.schedule["odd"])
    assert sent(app) == []  # neither was sent


@pytest.mark.parametrize(
    ("task", "options"),
    [("taskapp.beat_job", {}), ("taskapp.beat_job", {"lock_beat": True})],  # its task's opt-in, its own
)
def test_an_entry_whose_name_no_slot_marker_can_hold_is_refused_by_name(
    app: Celery, client: redis.Redis, prefix: str, task: str, options: dict[str, Any]
) -> None:
    """A slot marker holds its entry's name (``{prefix}:slot:{entry}:{slot}``): a name with a
    lone surrogate (not UTF-8 text) failed in redis-py with a ``UnicodeEncodeError`` naming
    neither the entry nor the marker."""
    name = "nightly\udcff"
    beat = SimulatedBeat(
        app, Clock(at(2026, 1, 1)), 0, {name: {"task": task, "schedule": every(1), "options": options}}
    )
    with pytest.raises(LockConfigurationError) as raised:
        beat.scheduler.apply_async(beat.scheduler.schedule[name])
    message = str(raised.value)
    assert message.startswith(f"beat entry {name!r}: ") and "UTF-8" in message
    assert sent(app) == []
    assert [*client.scan_iter(match=f"{prefix}*")] == []


def test_an_entry_of_a_task_beat_does_not_know_whose_name_no_marker_can_hold_is_sent_without_a_slot(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    """As an entry whose schedule has no slots: beat cannot tell whether its task wants one (the
    worker's task decides). It was sent with a slot whose marker the worker could not claim."""
    name = "nightly\udcff"
    entries = {name: {"task": "taskapp.beat_fallback", "schedule": every(1), "args": ["s"]}}
    beat = SimulatedBeat(app, Clock(at(2026, 1, 1)), 0, entries)
    beat.scheduler.apply_async(beat.scheduler.schedule[name])
    assert sent(app) == [("['s']", None, None)]
    assert [*client.scan_iter(match=f"{prefix}*")] == []


def test_only_a_guarded_beat_stamps_the_messages_it_sends() -> None:
    """``before_task_publish`` runs its receivers for every message a process sends: a process
    that binds a ``LockedTask`` connects none of ours there (a worker, a web server); a beat's
    guard connects the stamp. In a fresh interpreter: this one's beats guarded schedulers already."""
    code = """
from celery import Celery, signals
from celery.beat import Scheduler
from celery_redislock import LockedTask
from celery_redislock.beat import guard
from celery_redislock.state import app_state

def ours():
    return [key for key, _ in signals.before_task_publish.receivers if "celery_redislock" in str(key[0])]

app = Celery("stamp", broker="memory://", set_as_current=False)
app.conf.redislock_url = "redis://127.0.0.1:9/0"  # never connected to
@app.task(base=LockedTask, shared=False)
def locked():
    pass
locked._get_current_object()
assert app_state(app).installed
print(len(ours()))
guard(Scheduler(app=app, lazy=True))
print(len(ours()))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]
