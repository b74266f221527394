"""Tasks for the LockedTask tests.

``make_app`` builds an app on the test's Redis (broker, results and locks)
with its own key prefix and queue. In-process workers use it directly;
worker subprocesses run ``celery -A tests.taskapp worker`` and build the same
app from ``TASKAPP_URL``, ``TASKAPP_PREFIX`` and ``TASKAPP_QUEUE``.

Bodies record what they do in the list ``{prefix}:events`` (entries
``"<event> <task> <x> <task id> <pid> <fence> <retries> <monotonic time>"``; a
lost lock adds ``"lost ... <reason>"``) and block, where a test
needs a slow body, on the list ``{prefix}:gate:<x>`` until the test pushes to
it: tests synchronise on these events, never on sleeps.

Beat jobs (``beat_*``) record ``"run <x> <slot> <sending beat> <task id> <start> <end>"``
(times from ``time.time()``) in ``{prefix}:runs``. ``celery beat`` subprocesses run the
same app, with ``beat_schedule`` from ``TASKAPP_CONF`` (schedules in seconds, on a clock
``TASKAPP_SKEW`` seconds off), and without the tasks named in ``TASKAPP_WITHOUT``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol, cast

import redis
from celery import Celery, Task
from celery.exceptions import Ignore, Reject, Retry
from celery.schedules import schedule
from celery.signals import task_postrun, worker_ready

from celery_redislock import LockedTask, signals
from celery_redislock.protocol import request_slot

EVENTS_TTL_MS = 600_000
#: Longest a gated body waits for its gate before giving up (a test that failed to open it).
GATE_TIMEOUT = 60
#: What ``lose_own_lock`` logs to (under the package's logger, whose handlers the watchdog's logs reach).
stress_logger = logging.getLogger("celery_redislock.tests.stress")

#: The lease of the tasks that outlast it (``long``, ``hog``): renewed every LEASE/3 s, so a
#: loaded machine must stall the watchdog for over a second before a live holder loses it.
LEASE = 2.0
#: How far this process's beat clock is off (``skewed_now``).
SKEW = timedelta(seconds=float(os.environ.get("TASKAPP_SKEW", "0")))


class LockFields(Protocol):
    """The fields a ``LockedTask`` adds to its request, for the body to read."""

    lock_key: str
    lock_fence: int | None
    lock_lost: bool
    lock_slot: str | None


def lock_fields(task: Task[Any, Any]) -> LockFields:
    return cast(LockFields, task.request)  # Celery's Context, with the fields LockedTask sets on it


def text(value: bytes | str) -> str:
    """A reply of the recorder's client (bytes: it does not decode), as text."""
    return value.decode() if isinstance(value, bytes) else value


def skewed_now() -> datetime:
    """The beat schedules' clock: UTC now, ``TASKAPP_SKEW`` seconds off (a module function,
    so that the default scheduler can pickle the schedules that use it)."""
    return datetime.now(timezone.utc) + SKEW


class Recorder:
    """Writes the events and reads the gates of one test's prefix."""

    def __init__(self, url: str, prefix: str) -> None:
        # redis-py 8 clients give up a read after 5 s by default: this one outlasts a gate's BLPOP
        self.client = redis.Redis.from_url(url, socket_timeout=GATE_TIMEOUT + 10)
        self.prefix = prefix
        self.events_key = f"{prefix}:events"

    def record(self, event: str, task: Task[Any, Any], x: object) -> None:
        request = task.request
        entry = f"{event} {task.name.rsplit('.', 1)[-1]} {x} {request.id} {os.getpid()} "
        entry += f"{getattr(request, 'lock_fence', None)} {request.retries} {time.monotonic():.6f}"
        self.push(self.events_key, entry)

    def record_lost(self, lock: Any, reason: str) -> None:
        """A ``lock_lost`` report, from the watchdog thread of the process that lost ``lock``."""
        request = lock.request
        name = (getattr(request, "task", None) or "-").rsplit(".", 1)[-1]
        x = request.args[0] if request is not None and request.args else None
        task_id = getattr(request, "id", None)
        entry = f"lost {name} {x} {task_id} {os.getpid()} {lock.fence} {getattr(request, 'retries', None)} "
        entry += f"{time.monotonic():.6f} {reason.replace(' ', '_')}"
        self.push(self.events_key, entry)

    def push(self, key: str, *values: str) -> None:
        """RPUSH with the TTL set in the same transaction."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.rpush(key, *values)
            pipe.pexpire(key, EVENTS_TTL_MS)
            pipe.execute()

    def gate_key(self, x: object) -> str:
        return f"{self.prefix}:gate:{x}"

    def wait_gate(self, x: object, poll: float | None = None, check: Callable[[], object] = bool) -> bool:
        """Block until the test opens ``x``'s gate; ``poll`` seconds per BLPOP, calling
        ``check`` between two (a task's ``check_lock``, which raises ``LockLost``)."""
        if poll is None:
            return self.client.blpop([self.gate_key(x)], timeout=GATE_TIMEOUT) is not None
        for _ in range(int(GATE_TIMEOUT / poll)):
            if self.client.blpop([self.gate_key(x)], timeout=poll) is not None:
                return True
            check()
        return False

    def idle(self, x: object, seconds: float) -> None:
        """A body's own duration, in cooperative I/O: a BLPOP on a gate never opened, of at least
        10 ms (Redis reads a timeout under 1 ms as 0: block forever)."""
        self.client.blpop([self.gate_key(f"never-{x}")], timeout=max(seconds, 0.01))

    def open_gate(self, x: object, times: int = 1) -> None:
        self.push(self.gate_key(x), *["open"] * times)

    def events(self) -> list[list[str]]:
        return [text(entry).split(" ") for entry in self.client.lrange(self.events_key, 0, -1)]

    def record_run(self, task: Task[Any, Any], x: object, started: float) -> None:
        """A beat job's run: which slot, sent by which beat, from when to now."""
        request, sender = task.request, (request_slot(task.request) or {}).get("beat")
        entry = f"run {x} {lock_fields(task).lock_slot} {sender} {request.id} {started:.3f} {time.time():.3f}"
        self.push(f"{self.prefix}:runs", entry)

    def runs(self) -> list[list[str]]:
        return [text(entry).split(" ") for entry in self.client.lrange(f"{self.prefix}:runs", 0, -1)]


#: prefix -> the recorder of the app using it, for the ``lock_lost`` receiver (its sender is a lock)
_recorders: dict[str, Recorder] = {}


def recorder(app: Celery) -> Recorder:
    """The ``Recorder`` of an app made by ``make_app``."""
    return app.recorder  # type: ignore[attr-defined, no-any-return]


def make_app(url: str, prefix: str, queue: str, without: tuple[str, ...] = (), **conf: Any) -> Celery:
    """The tests' app; the tasks named in ``without`` are not registered (a beat that
    does not import them sends them with ``send_task``)."""
    for entry in conf.get("beat_schedule", {}).values():
        if isinstance(entry["schedule"], (int, float)):
            entry["schedule"] = schedule(timedelta(seconds=entry["schedule"]), nowfun=skewed_now)
    app = Celery("taskapp", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        {
            "redislock_url": url,
            "redislock_prefix": prefix,
            "task_default_queue": queue,
            "result_expires": 600,
            "broker_connection_retry_on_startup": True,
            "worker_hijack_root_logger": False,
            "worker_prefetch_multiplier": 1,
            **conf,
        }
    )
    recorder = Recorder(url, prefix)
    app.recorder = recorder  # type: ignore[attr-defined]
    _recorders[prefix] = recorder
    locked_task = functools.partial(app.task, base=LockedTask, bind=True, shared=False)

    def gated(self: Task[Any, Any], x: object, gate: bool = False) -> object:
        recorder.record("start", self, x)
        if gate:
            recorder.wait_gate(x)
        recorder.record("end", self, x)
        return x

    for busy in ("skip", "retry", "wait", "raise"):
        locked_task(name=f"taskapp.hold_{busy}", lock_busy=busy, lock_retry_delay=0.2)(gated)

    for mode in ("until_executing", "until_executed", "until_and_while_executing", "until_expired"):
        period = 600 if mode == "until_expired" else None  # the only mode that keeps the lock after a run
        locked_task(name=f"taskapp.{mode}", lock_mode=mode, lock_retry_delay=0.2, lock_period=period)(gated)
    # its pool child dies once the run is over (``_die_after_the_run``), its result not stored
    locked_task(
        name="taskapp.until_expired_dies", lock_mode="until_expired", lock_period=600, ignore_result=True
    )(gated)
    locked_task(name="taskapp.waits_long", lock_ttl=300, lock_busy="wait", lock_wait_timeout=120)(gated)
    locked_task(name="taskapp.uawe_raise", lock_mode="until_and_while_executing", lock_busy="raise")(gated)
    locked_task(name="taskapp.refuse", lock_mode="until_executed", lock_duplicate="raise")(gated)
    locked_task(
        name="taskapp.requeued_slowly",
        lock_mode="until_and_while_executing",
        lock_queue_ttl=5,
        lock_retry_delay=60,
    )(gated)
    locked_task(name="taskapp.acks_late", lock_mode="until_executed", acks_late=True)(gated)

    def slow_start(self: Task[Any, Any], task_id: str, args: Any, kwargs: Any) -> None:
        recorder.record("before", self, args[0])
        recorder.wait_gate(args[0])

    # its run is held up before its body (``before_start``), its message's enqueue lock not freed yet
    locked_task(name="taskapp.slow_start", lock_mode="until_executing", before_start=slow_start)(gated)
    if not conf.get("redislock_replicas"):  # lock_limit > 1 is refused with replicas: permits are unconfirmed
        # up to 3 runs of one key at once; a long lease: after a kill, only the main process frees in time
        locked_task(name="taskapp.limited", lock_limit=3, lock_ttl=300)(gated)
        locked_task(name="taskapp.limited_acks_late", lock_limit=3, acks_late=True)(gated)
        locked_task(
            name="taskapp.limited_wait", lock_limit=2, lock_ttl=300, lock_busy="wait", lock_wait_timeout=120
        )(gated)
        locked_task(
            name="taskapp.limited_queued",
            lock_mode="until_and_while_executing",
            lock_limit=2,
            lock_retry_delay=0.2,
        )(gated)

    @locked_task(name="taskapp.moves_on", lock_mode="until_expired", lock_on=("x", "n"), lock_period=60)
    def moves_on(self: Task[Any, Any], x: object, n: int = 0) -> int:
        """Attempt 0 (``n`` 0) retries with other arguments, another key (``n`` 1), which returns 1."""
        if n == 0:
            raise self.retry(args=(x, 1), countdown=0)
        return n

    @locked_task(name="taskapp.retry_twice", lock_mode="until_executed")
    def retry_twice(self: Task[Any, Any], x: object) -> object:
        recorder.record(f"attempt@{self.request.retries}", self, x)
        if self.request.retries < 2:
            recorder.wait_gate(x)
            raise self.retry(countdown=0)
        return x

    @locked_task(name="taskapp.retry_once", lock_mode="until_executed", lock_wait_timeout=5, lock_beat=True)
    def retry_once(
        self: Task[Any, Any], x: object, how: str = "raise", countdown: float = 0, gate1: bool = False
    ) -> object:
        """Attempt 0 retries: ``raise`` raises the Retry, ``no_throw`` (``throw=False``) and
        ``catch`` (the body catches the Retry) go on until the gate of ``x`` opens; attempt 1
        returns ``x``, with ``gate1`` once the gate ``<x>-1`` opens."""
        recorder.record(f"attempt@{self.request.retries}", self, x)
        if self.request.retries == 0:
            if how == "raise":
                raise self.retry(countdown=countdown)
            if how == "no_throw":
                self.retry(countdown=countdown, throw=False)
            else:
                try:
                    raise self.retry(countdown=countdown)
                except Retry:
                    pass
            recorder.wait_gate(x)
            recorder.record("end", self, x)
            return None
        if gate1:
            recorder.wait_gate(f"{x}-1")
        recorder.record("end", self, x)
        return x

    @locked_task(
        name="taskapp.autoretry_once",
        lock_mode="until_executed",
        lock_wait_timeout=5,
        autoretry_for=(LookupError,),
        default_retry_delay=0,
        max_retries=1,
    )
    def autoretry_once(self: Task[Any, Any], x: object) -> object:
        recorder.record(f"attempt@{self.request.retries}", self, x)
        if self.request.retries == 0:
            raise LookupError("the first attempt fails")
        return x

    @locked_task(name="taskapp.keyed_by_x", lock_mode="until_executed", lock_on=("x",))
    def keyed_by_x(self: Task[Any, Any], x: object, blob: object = None) -> object:
        return x

    @app.task(name="taskapp.collect", shared=False)
    def collect(results: list[object]) -> list[object]:
        return results

    @locked_task(name="taskapp.per_user", lock_on=("user_id",))
    def per_user(self: Task[Any, Any], user_id: int, item: int, gate: bool = False) -> object:
        return gated(self, f"{user_id}-{item}", gate)

    @locked_task(name="taskapp.per_task", lock_on=())
    def per_task(self: Task[Any, Any], x: object, gate: bool = False) -> object:
        return gated(self, x, gate)

    @locked_task(name="taskapp.outcome")
    def outcome(self: Task[Any, Any], kind: str, x: object) -> object:
        recorder.record(f"{kind}@{self.request.retries}", self, x)
        if kind == "failure":
            raise ValueError("the body failed")
        if kind == "retry" and self.request.retries == 0:
            raise self.retry(countdown=0)
        if kind == "retry_race" and self.request.retries == 0:
            self.retry(countdown=0, throw=False)  # published while this attempt still holds the lock
            recorder.wait_gate(x)  # opened once the retry has found the lock busy
        if kind == "ignore":
            raise Ignore()
        if kind == "reject":
            raise Reject("rejected by the body", requeue=False)
        return x

    @locked_task(name="taskapp.long", lock_ttl=LEASE)
    def long(self: Task[Any, Any], x: object, leases: int) -> bool:
        """Runs for ``leases`` x ``lock_ttl`` in cooperative I/O (a BLPOP: gevent and eventlet
        patch its socket); whether the lock is still this body's at the end."""
        recorder.record("start", self, x)
        recorder.idle(x, LEASE * leases)
        lock = lock_fields(self)
        value = recorder.client.get(lock.lock_key)
        owned = isinstance(value, bytes) and int(value.split(b":")[1]) == lock.lock_fence
        recorder.record("end", self, x)
        return owned and not lock.lock_lost

    @locked_task(name="taskapp.hog", lock_ttl=LEASE)
    def hog(self: Task[Any, Any], x: object, leases: int) -> bool:
        """Holds the CPU for ``leases`` x ``lock_ttl`` in pure Python, never yielding: under
        gevent or eventlet nothing else in the worker runs meanwhile, its watchdog included.
        Whether the body saw its lock lost once it had yielded again (an I/O: the last event)."""
        recorder.record("start", self, x)
        deadline = time.monotonic() + LEASE * leases
        while time.monotonic() < deadline:
            pass  # the body's own duration, spent on the CPU: no I/O, no sleep, no switch
        recorder.record("spun", self, x)
        recorder.idle(x, 1)  # yields: the watchdog runs
        recorder.record("end", self, x)
        return bool(lock_fields(self).lock_lost)

    @locked_task(name="taskapp.lost", lock_ttl=0.6, lock_on_lost="raise")
    def lost(self: LockedTask, x: object) -> str:
        recorder.record("start", self, x)
        recorder.wait_gate(x, poll=0.05, check=self.check_lock)
        recorder.record("end", self, x)  # only if LockLost did not stop the body
        return "not stopped"

    @locked_task(name="taskapp.lost_at_end", lock_ttl=0.6, lock_on_lost="raise")
    def lost_at_end(self: Task[Any, Any], x: object) -> str:
        """One blocking call that nothing interrupts, then a normal return."""
        recorder.record("start", self, x)
        recorder.wait_gate(x)
        recorder.record("end", self, x)
        return "finished"

    @locked_task(name="taskapp.lose_own_lock", lock_ttl=0.6, lock_on_lost="raise")
    def lose_own_lock(self: Task[Any, Any], x: object, work: str) -> str:
        """Deletes its own lock, then logs (``work="log"``) or calls Redis (``"redis"``) in a
        tight loop until the watchdog has marked the loss; then returns normally."""
        recorder.client.delete(lock_fields(self).lock_key)
        deadline = time.monotonic() + GATE_TIMEOUT
        while not lock_fields(self).lock_lost and time.monotonic() < deadline:
            if work == "log":
                stress_logger.info("task %s still working on %s", self.request.id, x)
            else:
                recorder.client.get(f"{recorder.prefix}:stress:{x}")
        return "not stopped"

    @locked_task(name="taskapp.calls_after_loss", lock_ttl=0.6, lock_on_lost="raise")
    def calls_after_loss(self: Task[Any, Any], x: object) -> object:
        """Loses its lock, waits until the watchdog has marked the loss, then calls a locked task."""
        recorder.client.delete(lock_fields(self).lock_key)
        for _ in range(GATE_TIMEOUT * 20):
            if lock_fields(self).lock_lost:
                break
            recorder.client.blpop([recorder.gate_key(f"never-{x}")], timeout=0.05)
        return nested(x, 0)

    @locked_task(name="taskapp.terminated", lock_on_lost="terminate")
    def terminated(self: Task[Any, Any], x: object, gate: bool = True) -> object:
        """Waits for its gate in one blocking call; a lost lock stops its pool child."""
        return gated(self, x, gate)

    @locked_task(name="taskapp.terminated_checks", lock_ttl=0.6, lock_on_lost="terminate")
    def terminated_checks(self: LockedTask, x: object) -> str:
        recorder.record("start", self, x)
        recorder.wait_gate(x, poll=0.05, check=self.check_lock)
        recorder.record("end", self, x)
        return "not stopped"

    @locked_task(name="taskapp.outlives_sigterm", lock_busy="wait", lock_wait_timeout=60)
    def outlives_sigterm(self: Task[Any, Any], x: object, gate: bool = True) -> object:
        """Ignores SIGTERM (so a hard time limit needs SIGKILL); records ``overlap`` if a body
        that ran before it with the same ``x`` is still alive when it starts."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        earlier = {int(event[4]) for event in recorder.events() if event[0] == "start" and event[2] == str(x)}
        if any(running(pid) for pid in earlier - {os.getpid()}):
            recorder.record("overlap", self, x)
        return gated(self, x, gate)

    @locked_task(name="taskapp.lost_logged", lock_ttl=0.6)
    def lost_logged(self: Task[Any, Any], x: object) -> object:
        recorder.record("start", self, x)
        for _ in range(GATE_TIMEOUT * 20):  # until the watchdog marks the request
            if lock_fields(self).lock_lost:
                break
            recorder.client.blpop([recorder.gate_key(f"never-{x}")], timeout=0.05)
        recorder.record("noticed", self, x)
        recorder.wait_gate(x)
        return x

    @locked_task(name="taskapp.crash", lock_ttl=300)
    def crash(self: Task[Any, Any], x: object, gate: bool = True) -> object:
        """A long lease: after a kill, only the worker's main process can free it in time."""
        return gated(self, x, gate)

    @locked_task(name="taskapp.fenced", lock_on_lost="raise")
    def fenced(self: LockedTask, x: object, gate: bool = True) -> object:
        """Holds its lock (``redislock_ttl``) until its gate opens; a lost lock stops it (``LockLost``)."""
        recorder.record("start", self, x)
        if gate:
            recorder.wait_gate(x, poll=0.05, check=self.check_lock)
        recorder.record("end", self, x)  # only if LockLost did not stop the body
        return x

    @locked_task(name="taskapp.nested", lock_on=("x",))
    def nested(self: Task[Any, Any], x: object, depth: int) -> object:
        recorder.record(f"depth{depth}", self, x)
        return [depth, lock_fields(self).lock_fence, *([] if depth == 0 else nested(x, depth - 1))]

    def beat_job(self: Task[Any, Any], x: object, seconds: float = 0) -> object:
        started = time.time()
        if seconds:  # the body's own duration, not a synchronisation
            recorder.client.blpop([recorder.gate_key(f"never-{x}")], timeout=seconds)
        recorder.record_run(self, x, started)
        return x

    beat_jobs: dict[str, dict[str, object]] = {
        "beat_job": {},
        "beat_fallback": {},  # left out of the beat processes: sent by beat's send_task fallback
        "beat_wait": {"lock_busy": "wait", "lock_wait_timeout": 60},
        "beat_off": {"lock_beat": False},  # opted in by its schedule entry only
    }
    for name, options in beat_jobs.items():
        if f"taskapp.{name}" not in without:
            locked_task(name=f"taskapp.{name}", **{"lock_beat": True, **options})(beat_job)

    return app


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not terminated (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped during the read
        return False


@worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    """A worker subprocess tells the test it consumes (``{prefix}:ready``)."""
    if app is not None:
        recorder(app).push(f"{recorder(app).prefix}:ready", sender.hostname)


@task_postrun.connect
def _die_after_the_run(sender: Any = None, **_: Any) -> None:
    """A worker subprocess's pool child dies once a run of ``taskapp.until_expired_dies`` is over
    (its lock let go), before the worker's main process hears of it: as an OOM kill there would."""
    if app is not None and getattr(sender, "name", None) == "taskapp.until_expired_dies":
        os.kill(os.getpid(), signal.SIGKILL)


@signals.lock_busy.connect
def _record_busy(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    if hasattr(sender.app, "recorder"):  # an app of this module's
        sender.app.recorder.record("busy", sender, sender.request.args[0] if sender.request.args else None)


@signals.lock_released.connect
def _record_released(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    if hasattr(sender.app, "recorder"):
        args = sender.request.args
        sender.app.recorder.record("released", sender, args[0] if args else None)


@signals.lock_lost.connect
def _record_lost(sender: Any = None, key: str = "", reason: str = "", **_: Any) -> None:
    recorder = _recorders.get(key.partition(":")[0])
    if recorder is not None and getattr(sender, "request", None) is not None:
        recorder.record_lost(sender, reason)


app: Celery | None = (
    make_app(
        os.environ["TASKAPP_URL"],
        os.environ["TASKAPP_PREFIX"],
        os.environ["TASKAPP_QUEUE"],
        tuple(filter(None, os.environ.get("TASKAPP_WITHOUT", "").split(","))),
        **json.loads(os.environ.get("TASKAPP_CONF", "{}")),
    )
    if "TASKAPP_URL" in os.environ
    else None
)

if app is not None and "METRICS_PORT" in os.environ:  # a worker exporting its metrics (test_crashes.py)
    import examples.prometheus_worker  # noqa: F401  (connects its worker signals)
