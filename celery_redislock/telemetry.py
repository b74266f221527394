"""OpenTelemetry metrics and traces of the locks, and the fields of every log line.

Optional: ``pip install celery-redislock[otel]`` installs opentelemetry-api
only. Without it every hook here returns at once. With it, the instruments
come from the global ``MeterProvider`` and ``TracerProvider``: the API's
proxies, which do nothing until the application sets real providers (before
or after importing this package) and then forward to them.

A run's metrics are gathered here and handed to the SDK in bulk. The counters
are summed, under a lock, and read by the SDK at each collection (asynchronous
counters: the same cumulative sums, without an SDK measurement per run). The
histograms' values are buffered (``Samples``) and recorded into the SDK's
histograms ``BATCH`` at a time, and at each collection by a callback of the
counters. With the OpenTelemetry Python SDK, whose collection runs every
callback (under one lock) before it reads the histograms, a collection of
any of its readers sees every value recorded before it began, the same
buckets, sums, counts, minimum and maximum; the values carry no exemplars.
Until the application sets a ``MeterProvider`` the hooks record nothing (as
the API's proxies would drop it), and until it sets a ``TracerProvider`` they
make no span (``"always"``): see ``_meter_provider_set``. A process that exits
without a last collection (a prefork pool child, which the SDK does not shut
down) loses what it recorded since its last one, buffered or not, as the SDK
would. A forked child reports only the counts and values it recorded itself.

A run's acquisition and release are traced as ``redislock_spans`` says, in
the span current when the step began (a run's release may be over later,
once that span is no longer current, or has ended): ``"auto"`` adds the
event ``redislock.acquire`` to that span if it records (the task's, when
Celery is instrumented), and ``redislock.release`` too unless the release
simply freed the lock (``released``: the span's end says as much), and
nothing where no span records; ``"always"`` makes them spans, children of
that span or roots; ``"never"`` traces nothing (``bench/otel_bench.py``
measures each). Events, not spans, by default: two spans cost a sixth of a
trivial task's CPU end to end, an event a fraction of that (docs/operations.md).
One event a plain run keeps the cost low; a release that lost the lock, or kept
it (parked, settled, taken over), or failed is what a trace's reader needs to
see, and is noted. Events, not the span's attributes: a span may hold more
than one run (a ``LockedTask`` called directly in another task's body, several
``apply()`` in a span of the caller's), whose attributes would overwrite each
other; events keep each step, in order, with its time.

Metrics (attributes never hold a key, a digest or an argument):

* ``redislock.lock.wait`` (s): a run's first acquire attempt to its outcome; task, mode, outcome;
* ``redislock.lock.held`` (s): a run's acquisition to its release, park or settle; task, mode;
* ``redislock.lock.acquisitions``: task, mode, outcome (``OUTCOMES``);
* ``redislock.lock.lost``: task (``""`` for a ``RedisLock`` of your own), reason;
* ``redislock.lock.renewals``: result, ``renewed`` or ``failed``, one per lease;
* ``redislock.lock.crash_releases``: task; a dead pool child's lock the main process released.

The events ``redislock.acquire`` and ``redislock.release`` (none for ``released``) are timed
when their step is over; their attributes: task, outcome (or ``error.type``, the type of the
exception that failed the step, which is not recorded here: Celery's instrumentation records
it on the task's span where it fails the task), fence, and ``waited`` (acquire: from the first
attempt) or ``held`` (release: from the acquisition) seconds. The spans of the same names
(task, mode, outcome, fence) run from the step's start to its end; one failed records its
exception and is marked so. An SDK that raises as a step is traced or recorded (a span
processor's ``on_start``, say) is logged; the step's outcome stands and the run goes on.
"""

from __future__ import annotations

import abc
import collections
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar

from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from .exceptions import LockNotAcquired

try:
    from opentelemetry import context, metrics, trace
except ImportError:  # the [otel] extra is not installed: every hook is a no-op
    context = metrics = trace = None  # type: ignore[assignment]

__all__ = [
    "OUTCOMES",
    "Acquisition",
    "Instruments",
    "Release",
    "counted",
    "crash_released",
    "log_fields",
    "lost",
    "renewals",
]

logger = logging.getLogger(__name__)

#: What a run, an enqueue or a beat slot's message came to (``redislock.lock.acquisitions``):
#: ``acquired`` (the lock was free), ``busy-wait`` (held: waited, then took it), ``busy-skip``
#: (held: skipped, or ignored as a redelivered or stale copy), ``busy-retry`` (held: retried
#: later), ``busy-raise`` (held: ``LockNotAcquired``, also a wait that timed out),
#: ``busy-reject`` (held: the message rejected), ``duplicate-refused`` (an enqueue refused),
#: ``duplicate-replaced`` (an enqueue, once sent, that took the lock over from the queued message),
#: ``superseded`` (that message dropped by a worker), ``slot-dropped`` (a beat slot's
#: duplicate message dropped).
OUTCOMES = (
    "acquired",
    "busy-wait",
    "busy-skip",
    "busy-retry",
    "busy-raise",
    "busy-reject",
    "duplicate-refused",
    "duplicate-replaced",
    "superseded",
    "slot-dropped",
)
#: Bucket bounds (seconds) of the two histograms: a millisecond to an hour.
BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
#: How many values a histogram buffers before they go to the SDK (``Samples``): the run whose value
#: fills the buffer hands them over on its own thread (about 9 µs a value with the SDK). 16 keeps
#: most of what 64 saves a run, a quarter of the wait (docs/operations.md).
BATCH = 16
#: What a busy policy raising this means (``Acquisition``).
_RAISED = {Retry: "busy-retry", Ignore: "busy-skip", LockNotAcquired: "busy-raise", Reject: "busy-reject"}


def _in_forked_child(method: Callable[[], None]) -> None:
    """Call ``method`` in each child forked while its object lives: the registration lasts as
    long as the process, so it holds the object weakly (as the SDK's own fork hooks do)."""
    held = weakref.WeakMethod(method)

    def after_fork() -> None:
        alive = held()
        if alive is not None:
            alive()

    os.register_at_fork(after_in_child=after_fork)


class Counts:
    """The cumulative sums of a counter, by attributes: ``add`` costs a dict update, and the
    SDK reads them at each collection (``observe``, the asynchronous counter's callback).

    Each process reports what it counted itself: a forked child starts from no sums (a prefork
    pool child forked after the main process counted crash releases would serve them too, and
    every scrape summing the worker's processes count them again), with a new lock (the
    parent's may have been held by another thread at the fork).
    """

    def __init__(self) -> None:
        self._sums: dict[tuple[tuple[str, str], ...], int] = {}
        self._lock = threading.Lock()  # watchdog and pool threads add too
        _in_forked_child(self._forget)

    def _forget(self) -> None:
        self._sums, self._lock = {}, threading.Lock()

    def add(self, amount: int, attributes: tuple[tuple[str, str], ...]) -> None:
        """Add ``amount`` at ``attributes`` (name, value pairs, the same order each time)."""
        with self._lock:
            self._sums[attributes] = self._sums.get(attributes, 0) + amount

    def observe(self, options: Any) -> Iterable[Any]:
        """The sums as observations (``options``: the SDK's ``CallbackOptions``, unused)."""
        with self._lock:
            sums = list(self._sums.items())
        return [metrics.Observation(total, dict(attributes)) for attributes, total in sums]


class Samples:
    """A histogram's values, buffered: ``record`` costs an append, and the values go to the
    SDK's ``histogram`` in bulk (``flush``): once ``BATCH`` are buffered, and at each collection
    (``observe``, a callback the SDK runs before it reads its histograms). Each value is handed
    over once, by the process that recorded it: a forked child starts with an empty buffer
    (the values buffered at the fork are the parent's to hand over) and a new lock.
    """

    def __init__(self, histogram: Any) -> None:
        self._histogram = histogram
        self._values: collections.deque[tuple[float, dict[str, str]]] = collections.deque()
        self._lock = threading.Lock()  # one flush at a time: a collection waits for one under way
        self._forwards = False  # the histogram records: a real provider made it, or is set now
        _in_forked_child(self._forget)

    def _forget(self) -> None:
        self._values, self._lock = collections.deque(), threading.Lock()

    def record(self, value: float, attributes: dict[str, str]) -> None:
        """Buffer ``value`` at ``attributes`` (append is atomic: no lock)."""
        self._values.append((value, attributes))
        if len(self._values) >= BATCH:
            self.flush()

    def flush(self) -> None:
        """Record the buffered values into the histogram, outside any span (no exemplar names a
        run's trace: the values are not recorded in their runs' contexts); drop them while no
        real provider is set."""
        with self._lock:
            values = self._values
            self._forwards = self._forwards or _records(self._histogram)
            if not self._forwards:
                values.clear()
                return
            token = context.attach(context.Context())
            try:
                for _ in range(len(values)):
                    self._histogram.record(*values.popleft())
            finally:
                context.detach(token)

    def observe(self, options: Any) -> Iterable[Any]:
        """Flush, and observe nothing (a callback of an asynchronous counter: the SDK runs
        the callbacks of a collection before it reads the histograms)."""
        self.flush()
        return ()


def _records(histogram: Any) -> bool:
    """Whether ``histogram`` records: not the API's own (its proxy or no-op), or a proxy that
    forwards now, a ``MeterProvider`` being set (``_meter_provider_set``, as the hooks ask)."""
    return not type(histogram).__module__.startswith(metrics.__name__ + ".") or _meter_provider_set()


class Instruments:
    """The package's instruments, made by ``meter`` (names and units are what dashboards read);
    the histograms' values are buffered here (``Samples``), the counters are asynchronous, their
    sums kept here (``Counts``)."""

    def __init__(self, meter: Any) -> None:
        self._attributes: dict[
            tuple[str, str, str | None], tuple[tuple[tuple[str, str], ...], dict[str, str]]
        ] = {}
        self.wait = _histogram(meter, "wait", "From a run's first acquire attempt to its outcome")
        self.held = _histogram(meter, "held", "From a run's acquisition to its release, park or settle")
        self.acquisitions = _counter(
            meter,
            "acquisitions",
            "Runs, enqueues and beat slots, by outcome",
            flushes=(self.wait.observe, self.held.observe),
        )
        self.lost = _counter(meter, "lost", "Locks lost while held")
        self.renewals = _counter(meter, "renewals", "Lease renewals, by result")
        self.crash_releases = _counter(
            meter, "crash_releases", "Locks the worker's main process released after their pool child died"
        )

    def attributes(
        self, task: str, mode: str, outcome: str | None = None
    ) -> tuple[tuple[tuple[str, str], ...], dict[str, str]]:
        """The attributes ``task``, ``mode`` and ``outcome`` (if any) as a key of ``Counts`` and as
        a histogram's, made once (a few sets: the attributes are of low cardinality).

        The dict is shared by every value recorded at those attributes, and nothing changes it:
        the SDK copies it per measurement (1.45), or keeps the first it is given as its data
        points' attributes, which exporters only read (1.30). Not a ``MappingProxyType``: the
        data points' ``to_json`` (the console exporter) cannot copy one (``dataclasses.asdict``).
        """
        made = self._attributes.get((task, mode, outcome))
        if made is None:
            key = (("task", task), ("mode", mode)) + ((("outcome", outcome),) if outcome is not None else ())
            made = self._attributes[task, mode, outcome] = (key, dict(key))
        return made


def _histogram(meter: Any, name: str, description: str) -> Samples:
    """The histogram ``redislock.lock.<name>`` of ``meter``, in seconds, its values buffered in the result."""
    return Samples(
        meter.create_histogram(
            f"redislock.lock.{name}",
            unit="s",
            description=description,
            explicit_bucket_boundaries_advisory=BOUNDS,
        )
    )


def _counter(
    meter: Any, name: str, description: str, flushes: Iterable[Callable[[Any], Iterable[Any]]] = ()
) -> Counts:
    """The asynchronous counter ``redislock.lock.<name>`` of ``meter``, its sums kept in the
    result; ``flushes``: callbacks to run first at each collection."""
    counts = Counts()
    meter.create_observable_counter(
        f"redislock.lock.{name}", callbacks=[*flushes, counts.observe], description=description
    )
    return counts


def _provider_set(module: Any, name: str) -> Callable[[], bool]:
    """Whether the API's global provider guarded by its ``Once`` ``module.name`` is set: that
    object's ``_done``, read by ``getattr`` (it is the API's private); always true if the API
    has no such flag (a later version: see ``_meter_provider_set``)."""
    flag = getattr(module, name, None)
    if not isinstance(getattr(flag, "_done", None), bool):
        return lambda: True
    return functools.partial(getattr, flag, "_done")


# The API's proxies, which forward once the app sets providers, and the counters' sums.
if metrics is not None:
    _on = Instruments(metrics.get_meter("celery_redislock"))
    _tracer = trace.get_tracer("celery_redislock")
    #: Whether the app has set a ``MeterProvider`` (``set_meter_provider``, or the environment's
    #: ``OTEL_PYTHON_METER_PROVIDER``, loaded by ``get_meter`` above) and a ``TracerProvider``:
    #: the API sets each once per process. Until then its proxies drop what is recorded, and
    #: ``_tracer``'s spans do not record, so the hooks record nothing, and make no span under
    #: ``"always"``. (``"auto"`` still looks at the current span: an instrumentation given a
    #: provider of its own, ``CeleryInstrumentor().instrument(tracer_provider=...)``, makes
    #: recording task spans with no global provider set.) A run with the API installed and no
    #: SDK set up pays for none of the metrics (docs/operations.md). The API's own test,
    #: ``get_meter_provider()``, reads ``os.environ`` each time and costs more than the hooks
    #: (docs/benchmarks.md): its set-once flags are read instead. Should they move upstream,
    #: the hooks work always (a cost, no harm; tests/test_telemetry.py fails).
    _meter_provider_set = _provider_set(getattr(metrics, "_internal", None), "_METER_PROVIDER_SET_ONCE")
    _tracer_provider_set = _provider_set(trace, "_TRACER_PROVIDER_SET_ONCE")


def log_fields(
    key: str | None = None,
    task_id: str | None = None,
    holder: str | None = None,
    fence: int | None = None,
    outcome: str | None = None,
) -> dict[str, Any]:
    """The ``extra=`` of a log line: ``lock_key``, ``task_id``, ``holder``, ``fence`` and
    ``outcome``, those that apply (a formatter reads them as record attributes)."""
    fields = {"lock_key": key, "task_id": task_id, "holder": holder, "fence": fence, "outcome": outcome}
    return {name: value for name, value in fields.items() if value is not None}


def counted(task: str, mode: str, outcome: str) -> None:
    """An outcome decided without a wait (a duplicate refused, a slot dropped)."""
    if metrics is not None and _meter_provider_set():
        _on.acquisitions.add(1, _on.attributes(task, mode, outcome)[0])


def lost(task: str, reason: str) -> None:
    """A held lock was lost (``task``: ``""`` for a lock of no task)."""
    if metrics is not None and _meter_provider_set():
        _on.lost.add(1, (("task", task), ("reason", reason)))


def renewals(count: int, result: str) -> None:
    """``count`` leases were ``renewed``, or their renewal ``failed``."""
    if metrics is not None and count and _meter_provider_set():
        _on.renewals.add(count, (("result", result),))


def crash_released(task: str) -> None:
    """The worker's main process released the lock of ``task``, whose pool child died."""
    if metrics is not None and _meter_provider_set():
        _on.crash_releases.add(1, (("task", task),))


_Step_ = TypeVar("_Step_", bound="_Step")


class _Step(abc.ABC):
    """A step of a run's hold of ``lock`` (its task's name ``task``, its ``mode``): its
    metrics (``_record``), and its trace as ``spans`` (``redislock_spans``) asks, with the
    step's outcome (``_outcome_of``; ``None``: the exception the block raised failed the step),
    the hold's fence and the step's ``SECONDS`` (``_seconds``).

    The trace goes to the span current when the step is entered (``parent``), wherever it is
    exited: a release may be over later, once the task's span is no longer current, or ended.
    No span is made (``"always"``) while the app has set no ``TracerProvider``, and no metric
    is recorded while it has set no ``MeterProvider`` (the API's proxies would drop them).
    ``"auto"``: the event ``NAME`` on that span if it still records (the task's, when Celery is
    instrumented), cheaper than a span; not for an outcome in
    ``PLAIN`` (a release that simply freed the lock: the task's span ending says as much), so
    that a plain run notes one event. ``"always"``: the span ``NAME``, a child of that span
    or a root, made once the step is over with its start time and all its attributes at once.
    The block runs in no span of ours; it does not change the context. A step that came to no
    outcome and raised nothing (a release of a lock not held) records and traces nothing. The
    metrics' seconds are taken before the trace is made (under ``"auto"`` and ``"always"``,
    what the tracing costs is not in them).
    """

    NAME = ""
    #: The event's attribute holding ``_seconds``.
    SECONDS = ""
    #: The outcomes ``"auto"`` notes no event for.
    PLAIN: frozenset[str] = frozenset()
    __slots__ = ("fence", "lock", "mode", "parent", "spans", "started", "task")

    def __init__(self, task: str, mode: str, lock: Any, spans: str) -> None:
        self.task, self.mode, self.lock, self.spans = task, mode, lock, spans

    def __enter__(self: _Step_) -> _Step_:
        self.started, self.fence = time.monotonic(), self.lock.fence
        spans = self.spans
        traced = trace is not None and (spans == "auto" or (spans == "always" and _tracer_provider_set()))
        parent = trace.get_current_span() if traced else None
        # "auto" notes an event only on a span that records; one that does not now never will
        self.parent = None if spans == "auto" and parent is not None and not parent.is_recording() else parent
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if trace is None:
            return
        metered = _meter_provider_set()
        if self.parent is None and not metered:
            return  # nothing to trace or record (no provider set, no span that records, spans off)
        outcome = self._outcome_of(kind)
        failed = exc if outcome is None else None
        if outcome is None and failed is None:  # nothing came of it (a release of a lock not held)
            return
        seconds, parent = self._seconds(), self.parent
        try:  # telemetry never changes the step's outcome, nor keeps the run from going on
            if parent is not None:  # traced: "auto", or "always" with a TracerProvider set when it began
                if self.spans == "always":
                    self._trace(parent, outcome, failed)
                elif outcome not in self.PLAIN and parent.is_recording():  # "auto"
                    self._note(parent, outcome, seconds, failed)
            if outcome is not None and metered:
                self._record(outcome, seconds)
        except SoftTimeLimitExceeded:  # an interrupt landing here, no SDK fault: the run's to end
            raise
        except Exception:  # an SDK that raises (a span processor's on_start or on_end, say)
            logger.exception(
                "celery-redislock: tracing or recording %s of task %s failed; carrying on",
                self.NAME,
                self.task,
                extra=log_fields(outcome="error"),
            )

    def _fence(self) -> int | None:
        """The hold's fence: the lock's, or the one it had when the step began (a release clears it)."""
        fence: int | None = self.lock.fence
        return self.fence if fence is None else fence

    def _attributes(self, outcome: str | None, more: dict[str, Any]) -> dict[str, Any]:
        """The step's attributes: the task's name, ``more``, its outcome and the hold's fence where known."""
        attributes: dict[str, Any] = {"task": self.task, **more}
        if outcome is not None:
            attributes["outcome"] = outcome
        fence = self._fence()
        if fence is not None:
            attributes["fence"] = fence
        return attributes

    def _note(self, parent: Any, outcome: str | None, seconds: float, failed: BaseException | None) -> None:
        """Add the step's event to ``parent`` (the span it began in), timed now: the task's name (the span
        may be another run's, or the caller's), the step's outcome, or ``error.type``, the type of the
        exception ``failed`` (not recorded here: where it fails the task, Celery's instrumentation
        records it on the task's span), its fence and its ``SECONDS``."""
        more: dict[str, Any] = {self.SECONDS: seconds}
        if outcome is None and failed is not None:
            more["error.type"] = _type_name(failed)
        parent.add_event(self.NAME, self._attributes(outcome, more))

    def _trace(self, parent: Any, outcome: str | None, failed: BaseException | None) -> None:
        """Make the step's span, a child of ``parent`` (the span it began in), from ``started``
        to now; the exception ``failed`` fails it."""
        attributes = self._attributes(outcome, {"mode": self.mode})
        ended = time.time_ns()
        started = ended - int((time.monotonic() - self.started) * 1e9)
        span = _tracer.start_span(
            self.NAME,
            context=trace.set_span_in_context(parent),
            attributes=attributes,
            start_time=started,
        )
        if failed is not None:
            span.record_exception(failed)
            span.set_status(trace.Status(trace.StatusCode.ERROR, repr(failed)))
        span.end(end_time=ended)

    @abc.abstractmethod
    def _outcome_of(self, kind: type[BaseException] | None) -> str | None:
        """What the step came to, the block having raised ``kind`` (``None``: returned)."""

    @abc.abstractmethod
    def _seconds(self) -> float:
        """How long the step's measure (``SECONDS``) lasted, until now."""

    @abc.abstractmethod
    def _record(self, outcome: str, seconds: float) -> None:
        """Record the step's metrics (``seconds``: ``_seconds``)."""


def _type_name(exc: BaseException) -> str:
    """The type of ``exc`` as the SDK's ``exception.type`` names it (module, then qualified name)."""
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


class Acquisition(_Step):
    """A run's acquisition of ``lock``, from its first attempt to its outcome: the
    ``redislock.acquire`` event (its ``waited`` seconds) or span, ``redislock.lock.wait`` and
    ``redislock.lock.acquisitions``.

    The block sets ``busy`` once the lock was found held and ``taken`` to what it
    decided, or ``outcome`` to one these do not tell (``superseded``: the message dropped);
    a busy policy's exception is an outcome too (``_RAISED``), any other
    exception records none and fails the step.
    """

    NAME = "redislock.acquire"
    SECONDS = "waited"
    __slots__ = ("busy", "outcome", "taken")

    def __init__(self, task: str, mode: str, lock: Any, spans: str) -> None:
        super().__init__(task, mode, lock, spans)
        self.busy = self.taken = False
        self.outcome: str | None = None

    def _outcome_of(self, kind: type[BaseException] | None) -> str | None:
        if kind is None:
            if self.outcome is not None:
                return self.outcome
            return ("busy-wait" if self.busy else "acquired") if self.taken else "busy-skip"
        return next((name for raised, name in _RAISED.items() if issubclass(kind, raised)), None)

    def _seconds(self) -> float:
        return time.monotonic() - self.started

    def _record(self, outcome: str, seconds: float) -> None:
        key, attributes = _on.attributes(self.task, self.mode, outcome)
        _on.wait.record(seconds, attributes)
        _on.acquisitions.add(1, key)


class Release(_Step):
    """The end of a run's hold of ``lock``: the ``redislock.release`` event (its ``held``
    seconds, from the acquisition) or span, and ``redislock.lock.held``. The block sets
    ``outcome``: ``released``, ``parked`` (for a retry), ``settled`` (kept for ``lock_period``),
    ``taken-over`` (a park that found the retry holding it), ``lost``, ``error``; ``None``
    (not held) records no metric. ``"auto"`` notes no event for ``released``."""

    NAME = "redislock.release"
    SECONDS = "held"
    PLAIN = frozenset({"released"})
    __slots__ = ("outcome",)

    def __init__(self, task: str, mode: str, lock: Any, spans: str) -> None:
        super().__init__(task, mode, lock, spans)
        self.outcome: str | None = None

    def _outcome_of(self, kind: type[BaseException] | None) -> str | None:
        return self.outcome

    def _seconds(self) -> float:
        # Entered right before the release (or park, or settle) is sent: the hold ends there,
        # not when its reply is read (maybe as the trace ends, see ``run_lock.release_later``).
        taken_at: float = self.lock.taken_at
        return self.started - taken_at

    def _record(self, outcome: str, seconds: float) -> None:
        _on.held.record(seconds, _on.attributes(self.task, self.mode)[1])
