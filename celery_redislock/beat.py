"""Once-per-slot periodic jobs, however many beat processes send them; an optional beat leader.

**Opting in.** A job runs once per *slot* of its schedule when its task is a
``LockedTask`` with ``lock_beat=True`` (or ``app.conf.redislock_beat = True``),
or when its schedule entry says ``lock_beat: True`` in its ``options`` (or in
``options["headers"]``, for django-celery-beat, which keeps only the headers;
``False`` there opts a task's entry out). Nothing changes for other entries.

**Slot identity** comes from the schedule and the sending beat's clock, never
from a beat's own ``last_run_at`` (which differs between beats and goes stale
while a beat is down):

* an interval (``schedule(run_every)``, a number, a ``timedelta``): the
  epoch-aligned bucket of ``run_every`` holding the send time, i.e. the one
  starting at ``floor(now / run_every) * run_every`` (UTC); with ``relative=True``,
  which Celery runs every ``run_every`` rounded down to a whole day, hour, minute or
  second, the bucket of that period (of whole days: of the app's local calendar);
* crontab, solar, clocked (any Celery ``BaseSchedule`` with
  ``remaining_estimate``): the latest time the schedule fires at or before the
  send time (a solar event: or up to a second after it), to the second.

A beat sends an entry at most once per slot of its own clock, so every beat
sends the same slot ids whenever it started; a beat whose clock is D seconds
ahead sends each slot D seconds earlier. The slot's marker
``{prefix}:slot:{entry name}:{slot id}`` lives for the slot's length plus
``CLOCK_TOLERANCE`` (60 s), so beats whose clocks differ by up to 30 s agree; a
one-off's (``clocked``) lives ``ONE_OFF_TTL`` (a day).
A beat coming back after every beat was down sends the current slot, which no
other beat can run again; slots missed meanwhile are not run (as Celery does).

**Who checks.** The beat claims the marker before sending (one round trip) when
it knows the entry opted in (the entry's option, or the ``lock_beat`` of the
task registered in the beat process); a beat that finds it claimed sends
nothing and logs which beat has the slot. The message carries the slot and the
claim's token (header ``redislock_beat``), and a ``LockedTask`` checks again on
the worker before it runs: where the beat cannot see the task (beat's
``send_task`` fallback, for a task not registered in the beat process), every
beat sends the slot unclaimed and the first of its messages to start claims it;
the worker drops the others (INFO log, ``task_deduplicated``). The run takes the slot over for
its task id and attempt: a copy of its message (kombu publishing it again after a lost
confirmation, a redelivery) is ignored; its retries, its replacement and the message a busy
lock's retry queues again (header field ``again``) run.

**Overlap.** A run that outlasts its interval holds the task's execution lock
(mode ``while_executing``, the default), so the next slot's run is skipped
(``lock_busy="skip"``) or waits for it (``lock_busy="wait"``).

**Leader** (``redislock_beat_leader = True``): of the beat processes started,
the one holding the lock ``{prefix}:beat-leader`` sends; the others wait for
it (woken when it is released or expires) and send nothing. The leader's lease
(``redislock_beat_leader_ttl``, 30 s) is renewed by the watchdog thread, not by
the scheduler loop, so a long tick cannot lose it. Before each send the leader
checks the lock: lost (found taken or expired by the watchdog, or renewals
late and Redis no longer naming it) means it steps down at once, logs a
WARNING, sends nothing more and stands by; it never crashes beat. A leader
SIGKILLed is replaced within one lease; one stopped cleanly (SIGTERM and SIGINT
included: ``Leadership.resign``) releases the lock and is replaced at once.
Use it with once-per-slot: a new leader's schedule state is stale, and the slot
markers keep its catch-up sends from re-running the slot the old leader ran.

Both work with any scheduler class (the default, django-celery-beat's,
RedBeat's): ``install(app)`` connects a ``beat_init`` receiver that wraps the
scheduler instance's ``apply_async``, ``tick`` and ``close``. It is called
when the first ``LockedTask`` is bound to the app; in a beat process that
imports no ``LockedTask``, call ``celery_redislock.install(app)`` yourself.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import secrets
import socket
import weakref
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from typing import Any, cast

import redis
from celery import signals as celery_signals
from celery.schedules import BaseSchedule, schedule, solar
from celery.utils.time import maybe_make_aware

from ._durations import to_ms
from ._process import current_pid
from ._task_scripts import CLAIM
from .attempt import is_utf8
from .config import app_settings, bound_options
from .connection import GIVEN_CLIENT, client_for
from .exceptions import LockConfigurationError, LockNotOwned, RedisLockError
from .inventory import release_token
from .keys import leader_key, slot_key
from .lock import RedisLock
from .protocol import BEAT_HEADER, text
from .state import app_state
from .telemetry import log_fields

__all__ = [
    "CLOCK_TOLERANCE",
    "ONE_OFF_TTL",
    "OPTION",
    "BeatGuard",
    "Leadership",
    "Slot",
    "connect",
    "guard",
    "slot_of",
]

logger = logging.getLogger(__name__)

#: Seconds a slot's marker outlives the slot: beat clocks may differ by half of it.
CLOCK_TOLERANCE = 60.0
#: Seconds a one-off's marker lives (django-celery-beat's ``clocked``, a slot that never ends): it
#: stays due until a beat that sent it saves that it ran (every 3 minutes), and a beat killed
#: before that, started again, or another one coming up meanwhile, sends it again.
ONE_OFF_TTL = 86400.0
#: The schedule entry option (or header) that opts an entry in or out.
OPTION = "lock_beat"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)
#: The units Celery rounds a relative interval's runs down to, largest first.
_UNITS = (timedelta(days=1), timedelta(hours=1), timedelta(minutes=1), timedelta(seconds=1))
#: How far back a fired slot is looked for (a crontab on 29 February fires every 4 to 8 years).
_LOOKBACK = timedelta(minutes=2**23)
#: The grid, from the epoch, a fire is looked for on: fires closer together than this are not told
#: apart (Celery's crontab fires at whole minutes).
_RESOLUTION = timedelta(seconds=30)
#: A solar event this soon after a send is the send's: event times come with up to 0.2 s of noise,
#: and a beat sends an event at the time it reckons from its last run, which the slot's may trail.
_SOLAR_NOISE = timedelta(seconds=1)

#: (task name, header, stages) of the message a guarded beat is sending in this thread; ``stages``
#: gets "publishing" as its publish begins (``before_task_publish``) and "published" once the
#: message went out (``after_task_publish``).
_sending: contextvars.ContextVar[tuple[str, dict[str, Any], list[str]] | None] = contextvars.ContextVar(
    "celery_redislock_beat_sending", default=None
)


@dataclass(frozen=True)
class Slot:
    """One slot of a schedule: from ``start`` (which names it) to the next slot's ``end``."""

    start: datetime
    end: datetime

    @property
    def id(self) -> str:
        """``start`` in UTC, ISO 8601: ``2026-11-22T10:00:00Z``."""
        return self.start.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")

    def marker_ttl(self) -> float:
        """Seconds the slot's marker lives: the slot's length plus ``CLOCK_TOLERANCE``; a one-off's
        (``end`` is ``start``), ``ONE_OFF_TTL``."""
        if self.end <= self.start:
            return ONE_OFF_TTL
        return (self.end - self.start).total_seconds() + CLOCK_TOLERANCE


def slot_of(entry_schedule: Any, now: datetime) -> Slot:
    """The slot of ``entry_schedule`` that a send at ``now`` (the beat's clock) is for.

    A naive ``now`` is UTC. Raises ``LockConfigurationError`` for a schedule
    whose slots cannot be told (not a Celery schedule, or never firing).
    """
    now = maybe_make_aware(now)
    if isinstance(entry_schedule, schedule):
        run_every: timedelta = cast(Any, entry_schedule).run_every  # not in celery-types' stubs
        if run_every // _MICROSECOND <= 0:
            raise LockConfigurationError(f"schedule {entry_schedule!r}: run_every must be > 0 for slots")
        if cast(Any, entry_schedule).relative:
            return _relative_slot(run_every, now)
        return _bucket(run_every, now)
    if not isinstance(entry_schedule, BaseSchedule):
        raise LockConfigurationError(
            f"cannot tell the slots of schedule {entry_schedule!r} ({type(entry_schedule).__name__}); "
            "allowed: a celery.schedules schedule, crontab, solar, or another BaseSchedule"
        )
    return _fired_slot(entry_schedule, now)


def _bucket(length: timedelta, now: datetime) -> Slot:
    """The epoch-aligned bucket of ``length`` holding ``now``."""
    step = length // _MICROSECOND
    elapsed = (now - _EPOCH) // _MICROSECOND
    start = _EPOCH + (elapsed - elapsed % step) * _MICROSECOND
    return Slot(start, start + step * _MICROSECOND)


def _relative_slot(run_every: timedelta, now: datetime) -> Slot:
    """The slot of ``schedule(run_every, relative=True)``, which runs at ``run_every`` after its
    last run rounded down to a whole unit of ``run_every`` (a day, hour, minute or second;
    ``celery.utils.time.delta_resolution``): every ``run_every`` rounded down to that unit (90 s:
    every minute). Its slots are the epoch-aligned buckets of that period; of whole days, of the
    calendar of ``now``'s timezone, whose midnights (the runs) move in UTC with summer time."""
    unit = next((unit for unit in _UNITS if run_every >= unit), None)
    if unit is None:
        return _bucket(run_every, now)
    period = run_every // unit * unit
    if unit < timedelta(days=1):
        return _bucket(period, now)
    day = now.date().toordinal()
    first = date.fromordinal(day - day % period.days)
    start, end = (datetime.combine(d, time(), tzinfo=now.tzinfo) for d in (first, first + period))
    return Slot(start.astimezone(timezone.utc), end.astimezone(timezone.utc))


def _fired_slot(fired: BaseSchedule, now: datetime) -> Slot:
    """The slot of a schedule that fires at points in time: the latest one at or before ``now``
    (for a solar event, or up to ``_SOLAR_NOISE`` after it).

    Times are reckoned in UTC and shown to the schedule in ``now``'s timezone: Python adds to,
    and compares, two times of one timezone by their wall clocks, which summer time repeats
    or skips (a wall-clock step back from 02:00 CET lands on the 02:00 CEST an hour before).
    The fire is reckoned from the last point of the ``_RESOLUTION`` grid before it, the same for
    every beat: a solar event's time depends on where its computation starts."""
    probe: Any = copy.copy(fired)  # asked "when next?" as seen from a moment of our choosing
    probe.app = fired.app
    local, now = now.tzinfo, now.astimezone(timezone.utc)
    seen, seen_from = now + (_SOLAR_NOISE if isinstance(fired, solar) else timedelta()), [now]
    probe.nowfun = lambda: seen_from[0]

    def next_fire(after: datetime) -> datetime:
        seen_from[0] = after.astimezone(local)
        try:
            remaining: timedelta = probe.remaining_estimate(seen_from[0])
        except NotImplementedError:
            raise LockConfigurationError(
                f"cannot tell the slots of schedule {fired!r}: it has no remaining_estimate()"
            ) from None
        return after + remaining

    def fired_after(point: int) -> bool:
        """Whether the first fire after grid point ``point`` is seen by ``now``."""
        return next_fire(_EPOCH + point * _RESOLUTION) <= seen

    # In grid points from the first at or after ``seen``: widen back to a fire, then halve around it.
    step, high = 1, -((_EPOCH - seen) // _RESOLUTION)
    while not fired_after(high - step):
        if step * _RESOLUTION >= _LOOKBACK:
            raise LockConfigurationError(f"schedule {fired!r} never fired in the {_LOOKBACK} before {now}")
        high, step = high - step, step * 2
    low = high - step
    while high - low > 1:
        middle = (low + high) // 2
        if fired_after(middle):
            low = middle
        else:
            high = middle
    fire = next_fire(_EPOCH + low * _RESOLUTION)
    while True:
        later = next_fire(fire)
        if later <= fire or later > seen:  # a one-off (clocked) fires no later
            break
        fire = later
    start = _whole_second(fire)
    return Slot(start, _whole_second(later) if later > fire else start)


def _whole_second(moment: datetime) -> datetime:
    """``moment`` to the nearest second (solar events come with sub-millisecond noise)."""
    return (moment + timedelta(microseconds=500_000)).replace(microsecond=0)


class Leadership:
    """The beat leader lock as one beat process sees it; see the module docstring."""

    def __init__(self, app: Any, key: str, ttl: float, holder: str) -> None:
        self.app, self.key, self.ttl, self.holder = app, key, ttl, holder
        #: the lock while this beat leads
        self.lock: RedisLock | None = None
        #: the leader this standby last logged
        self._seen: str | None = None

    def idle_for(self) -> float | None:
        """``None`` if this beat leads, else seconds to idle before asking again.

        A standby waits here, up to one lease, for the lock to be released or
        to expire; the wait ends early when it becomes the leader.
        """
        lock = self.lock
        if lock is not None:
            if not lock.lost.is_set():
                return None
            self.step_down("the watchdog found it lost")
        url = GIVEN_CLIENT
        try:
            client, url = client_for(self.app)
            candidate = RedisLock(client, self.key, self.ttl, holder=self.holder)
            leads = candidate.acquire(blocking=False)
            if not leads:
                leader = candidate.busy[0]
                if leader != self._seen:
                    self._seen = leader
                    logger.info(
                        "%s: standing by; the leader is %s (lock %s)",
                        self.holder,
                        leader,
                        self.key,
                        extra=log_fields(self.key, holder=leader, outcome="standby"),
                    )
                leads = candidate.acquire(timeout=self.ttl)
        except redis.RedisError as exc:
            logger.warning(
                "%s: cannot reach Redis at %s for the leader lock %s: %s",
                self.holder,
                url,
                self.key,
                exc,
                extra=log_fields(self.key, holder=self.holder, outcome="error"),
            )
            return self.ttl / 3
        if not leads:
            return 0.0
        self.lock, self._seen = candidate, None
        logger.info(
            "%s: leads (lock %s, lease %gs)",
            self.holder,
            self.key,
            self.ttl,
            extra=log_fields(self.key, holder=self.holder, fence=candidate.fence, outcome="leads"),
        )
        return None

    def still_leads(self) -> bool:
        """Checked before each send: whether this beat still holds the lock.

        Steps down if the watchdog found the lock lost, or if renewals are late
        (a pause) and Redis no longer names this beat.
        """
        lock = self.lock
        if lock is None:
            return False
        if not lock.lost.is_set():
            if lock.renewals_on_time():
                return True
            try:
                lock.extend()  # renewals are late: ask Redis, and renew if still ours
                return True
            except LockNotOwned:
                pass
            except redis.RedisError as exc:  # cannot tell: send nothing, the watchdog decides
                logger.warning(
                    "%s: cannot confirm the leader lock %s: %s",
                    self.holder,
                    self.key,
                    exc,
                    extra=log_fields(self.key, holder=self.holder, outcome="error"),
                )
                return False
        self.step_down("the lock was lost: expired or taken over")
        return False

    def step_down(self, why: str) -> None:
        self.lock = None
        logger.warning(
            "%s: stepped down as beat leader (%s); sends nothing until it leads again",
            self.holder,
            why,
            extra=log_fields(self.key, holder=self.holder, outcome="stepped-down"),
        )

    def resign(self) -> None:
        """Release the lock (beat is closing), so that a standby takes over at once.

        Beat's SIGTERM and SIGINT handler calls it (it closes the scheduler) on the main thread,
        inside whatever that was doing: maybe a call of this lock (``still_leads`` checking it)
        holding the lock's state, which the handler would wait for forever. The lock is then kept for the
        next close: ``Service.start`` closes the scheduler again once the handler's
        ``SystemExit`` unwound that call; without one, it expires within its lease. Nothing here
        makes the lock's ``lost`` event (``found_lost``): the handler may have interrupted that.
        """
        lock, self.lock = self.lock, None
        if lock is None or lock.found_lost():
            return
        try:
            if not lock.release_unless_busy():
                self.lock = lock
                logger.info(
                    "%s: leader lock %s is in use by the call a signal interrupted; released as beat "
                    "closes, else it expires within its lease",
                    self.holder,
                    self.key,
                    extra=log_fields(self.key, holder=self.holder, outcome="resign-later"),
                )
                return
        except (LockNotOwned, redis.RedisError) as exc:
            logger.info(
                "%s: leader lock %s not released (%s); it expires within its lease",
                self.holder,
                self.key,
                exc,
                extra=log_fields(self.key, holder=self.holder, outcome="error"),
            )
        else:
            logger.info(
                "%s: resigned as beat leader (lock %s released)",
                self.holder,
                self.key,
                extra=log_fields(self.key, holder=self.holder, outcome="resigned"),
            )


class BeatGuard:
    """What celery-redislock adds to one beat's scheduler: slot claims, and the leader.

    Installed on the scheduler instance by ``guard()``: its ``apply_async``,
    ``tick`` and ``close`` become this object's, which call the originals.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.app = scheduler.app
        settings = app_settings(self.app)
        self.prefix, self.on_error = settings.prefix, settings.on_error
        self.holder = f"beat={socket.gethostname()}:{current_pid()}"
        self.leader = (
            Leadership(self.app, leader_key(self.prefix), settings.beat_leader_ttl, self.holder)
            if settings.beat_leader
            else None
        )
        self._apply_async, self._tick, self._close = scheduler.apply_async, scheduler.tick, scheduler.close
        scheduler.apply_async, scheduler.tick, scheduler.close = self.apply_async, self.tick, self.close

    def tick(self, *args: Any, **kwargs: Any) -> Any:
        """One scheduler pass; with a leader, only by the leader (a standby waits in ``idle_for``)."""
        if self.leader is not None:
            idle = self.leader.idle_for()
            if idle is not None:
                return idle
        return self._tick(*args, **kwargs)

    def close(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._close(*args, **kwargs)
        finally:
            if self.leader is not None:
                self.leader.resign()

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        """Send ``entry``, unless this beat no longer leads or another beat has sent its slot.

        Returns what the scheduler's ``apply_async`` returns, or ``None`` when
        nothing was sent. Raises ``LockConfigurationError`` for an entry whose
        opt-in, schedule or name (not UTF-8 text) is invalid (beat logs it and
        sends nothing); an entry not opted in here is sent without a slot then.
        """
        if self.leader is not None and not self.leader.still_leads():
            fields = log_fields(holder=self.holder, outcome="not-leader")
            logger.info(
                "%s: entry %r not sent: this beat does not lead", self.holder, entry.name, extra=fields
            )
            return self._not_sent(entry, advance)
        opted = self._opted_in(entry)
        if opted is False:
            return self._apply_async(entry, producer, advance, **kwargs)
        try:
            if not is_utf8(entry.name):  # the slot's marker holds it
                raise LockConfigurationError("its name, which its slot marker holds, is not UTF-8 text")
            slot = slot_of(entry.schedule, entry.schedule.now())
        except LockConfigurationError as exc:
            if opted:
                raise LockConfigurationError(f"beat entry {entry.name!r}: {exc}") from None
            logger.debug(
                "%s: entry %r sent without a slot: %s",
                self.holder,
                entry.name,
                exc,
                extra=log_fields(holder=self.holder, outcome="no-slot"),
            )
            return self._apply_async(entry, producer, advance, **kwargs)
        header = {
            "entry": entry.name,
            "slot": slot.id,
            "key": slot_key(self.prefix, entry.name, slot.id),
            "token": secrets.token_hex(16),
            "ttl": to_ms(slot.marker_ttl()),
            "beat": self.holder,
            "claimed": bool(opted),
        }
        return self._send_slot(entry, header, producer, advance, kwargs)

    def _send_slot(
        self, entry: Any, header: dict[str, Any], producer: Any, advance: bool, kwargs: dict[str, Any]
    ) -> Any:
        """Claim the slot in ``header`` if it says so, and send ``entry``'s message carrying it. A
        claim whose claim or send raised before anything went out (an interrupt as the claim's
        reply is read: beat's ``SystemExit`` on SIGTERM; the publish failed, or never began) is
        freed, owner-checked: another beat may send the slot. One that did go out (an error after
        it: the schedule's sync, a ``SystemExit``), or may have (an interrupt during the publish,
        most likely as its reply is read, the broker having taken the message), keeps its claim."""
        stages: list[str] = []
        sending = _sending.set((entry.task, header, stages))
        try:
            if header["claimed"] and not self._claim(header):
                return self._not_sent(entry, advance)
            return self._apply_async(entry, producer, advance, **kwargs)
        except BaseException as exc:
            maybe_sent = "published" in stages or (bool(stages) and not isinstance(exc, Exception))
            if header["claimed"] and not maybe_sent:
                self._unclaim(header)
            raise
        finally:
            _sending.reset(sending)

    def _opted_in(self, entry: Any) -> bool | None:
        """The entry's opt-in, else its task's ``lock_beat``; ``None`` when the task is not
        registered here (the worker's task decides)."""
        options = entry.options or {}
        value = options.get(OPTION)
        if value is None:
            value = (options.get("headers") or {}).get(OPTION)
        if value is not None:
            if not isinstance(value, bool):
                raise LockConfigurationError(
                    f"beat entry {entry.name!r}: {OPTION}={value!r} is not valid; allowed: True or False"
                )
            return value
        task = self.app.tasks.get(entry.task)
        if task is None:
            return None
        lock_options = bound_options(task)
        return bool(lock_options is not None and lock_options.beat)

    def _claim(self, header: dict[str, Any]) -> bool:
        """Claim the slot in ``header`` for its token; ``False`` if another beat has it."""
        url = GIVEN_CLIENT
        try:
            client, url = client_for(self.app)
            reply = CLAIM(client, [header["key"]], [header["token"], self.holder, header["ttl"]])
        except redis.RedisError as exc:
            entry, slot = header["entry"], header["slot"]
            where = f"beat entry {entry!r}: could not claim slot {slot} in Redis at {url}: {exc}"
            if self.on_error == "fail":
                raise RedisLockError(where) from exc
            logger.warning(
                "%s; sending it unclaimed (redislock_on_error='run')",
                where,
                extra=log_fields(header["key"], holder=self.holder, outcome="unclaimed"),
            )
            header["claimed"] = False
            return True
        if isinstance(reply, int):
            logger.debug(
                "%s: entry %r slot %s claimed (%s)",
                self.holder,
                header["entry"],
                header["slot"],
                header["key"],
                extra=log_fields(header["key"], holder=self.holder, outcome="slot-claimed"),
            )
            return True
        logger.info(
            "%s: entry %r slot %s not sent: a duplicate, the slot went to %s (marker %s)",
            self.holder,
            header["entry"],
            header["slot"],
            text(reply),
            header["key"],
            extra=log_fields(header["key"], holder=text(reply), outcome="slot-dropped"),
        )
        return False

    def _unclaim(self, header: dict[str, Any]) -> None:
        try:
            client, _ = client_for(self.app)
            release_token(client, header["key"], header["token"])
        except redis.RedisError as exc:
            logger.warning(
                "%s: could not free slot marker %s: %s",
                self.holder,
                header["key"],
                exc,
                extra=log_fields(header["key"], holder=self.holder, outcome="error"),
            )

    def _not_sent(self, entry: Any, advance: bool) -> None:
        """Nothing sent; the entry still moves on to its next run, as a send would have moved it."""
        if advance:
            self.scheduler.reserve(entry)


#: Scheduler -> its guard, held weakly: one guard per scheduler, whatever wraps its methods later.
_GUARDS: weakref.WeakKeyDictionary[Any, BeatGuard] = weakref.WeakKeyDictionary()


def guard(scheduler: Any) -> BeatGuard:
    """Install slot claims (and the leader, if configured) on ``scheduler``; idempotent.

    Connects ``_stamp`` to ``before_task_publish`` (and ``_published`` to ``after_task_publish``)
    then, in a beat process only: every other
    process (workers, web servers) would run it for every message it sends, for nothing.
    """
    existing = _GUARDS.get(scheduler)
    if existing is None:
        existing = _GUARDS[scheduler] = BeatGuard(scheduler)
        celery_signals.before_task_publish.connect(
            _stamp, weak=False, dispatch_uid="celery_redislock.beat_stamp"
        )
        celery_signals.after_task_publish.connect(
            _published, weak=False, dispatch_uid="celery_redislock.beat_published"
        )
    return existing


def _guard_service(sender: Any = None, **_: Any) -> None:
    """``beat_init``: guard the scheduler of a beat whose app uses celery-redislock."""
    if app_state(sender.app).installed:
        guard(sender.scheduler)


def _stamp(sender: Any = None, headers: Any = None, properties: Any = None, **_: Any) -> None:
    """``before_task_publish``: a guarded beat's message carries its slot (and its publish
    begins); an entry's ``lock_beat`` option is not a message property."""
    if isinstance(properties, dict):
        properties.pop(OPTION, None)
    sending = _sending.get()
    if sending is not None and sending[0] == sender and isinstance(headers, dict):
        headers[BEAT_HEADER] = sending[1]
        sending[2].append("publishing")


def _published(sender: Any = None, **_: Any) -> None:
    """``after_task_publish``: a guarded beat's message went out (its slot is no longer to free)."""
    sending = _sending.get()
    if sending is not None and sending[0] == sender:
        sending[2].append("published")


def connect() -> None:
    """Connect the beat receiver (called by ``install``): ``beat_init`` guards the scheduler, and
    ``guard`` connects what a guarded beat's sends need; idempotent."""
    celery_signals.beat_init.connect(_guard_service, weak=False, dispatch_uid="celery_redislock.beat_init")
