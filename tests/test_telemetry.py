"""The lock metrics and spans (``celery_redislock.telemetry``), end to end: a real worker, an
in-memory metric reader and span exporter; the signals' new keyword arguments; the log fields;
the Grafana dashboard's queries against the names the Prometheus exporter gives the metrics.

OpenTelemetry's global providers can be set once per process: the ``otel`` fixture
(``tests/conftest.py``, ``tests/otel.py``) sets them for the rest of the session (later tests
run instrumented), and each test reads what changed.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import task_success
from opentelemetry import trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from prometheus_client import REGISTRY, generate_latest

import celery_redislock.lock
from celery_redislock import (
    LockConfigurationError,
    LockNotOwned,
    RedisLock,
    RedisLockError,
    busy,
    run_lock,
    signals,
    task_lock_key,
    telemetry,
)
from celery_redislock.config import app_settings
from celery_redislock.receivers import install
from celery_redislock.testing import RedisServer
from examples._support import ROOT
from tests.otel import Otel
from tests.taskapp import make_app, recorder
from tests.workers import threads_worker, wait_for

DASHBOARD = ROOT / "examples" / "grafana_dashboard.json"


@pytest.fixture
def instrumented_celery(otel: Otel) -> Iterator[None]:
    CeleryInstrumentor().instrument()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        CeleryInstrumentor().uninstrument()  # type: ignore[no-untyped-call]


class Signals:
    """What the package's signals sent during the test."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def receiver(self, name: str) -> Any:
        def receive(sender: Any = None, **kwargs: Any) -> None:
            self.sent.append((name, kwargs))

        return receive

    def of(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for sent, kwargs in self.sent if sent == name]


@pytest.fixture
def sent() -> Iterator[Signals]:
    record = Signals()
    receivers = {name: record.receiver(name) for name in ("lock_acquired", "lock_busy", "lock_released")}
    for name, receive in receivers.items():
        getattr(signals, name).connect(receive, weak=False)
    try:
        yield record
    finally:
        for name, receive in receivers.items():
            getattr(signals, name).disconnect(receive)


def spans_named(otel: Otel, name: str) -> list[ReadableSpan]:
    return [span for span in otel.spans.get_finished_spans() if span.name == name]


def run_spans(otel: Otel, task: Any, task_id: str) -> list[ReadableSpan]:
    """The spans Celery's instrumentation made for the runs of ``task`` whose id is ``task_id``
    (a busy retry runs again with the same id), in the order they started."""
    runs = [
        span
        for span in spans_named(otel, f"run/{task.name}")
        if (span.attributes or {}).get("messaging.message.id") == task_id
    ]
    return sorted(runs, key=lambda span: span.start_time or 0)


def run_span(otel: Otel, task: Any, task_id: str) -> ReadableSpan:
    """The span of the one run of ``task`` whose id is ``task_id``."""
    [run] = run_spans(otel, task, task_id)
    return run


def exceptions_on(span: ReadableSpan) -> int:
    """How many ``exception`` events ``span`` has."""
    return sum(event.name == "exception" for event in span.events)


def let_pass(seconds: float) -> None:
    """Poll until ``seconds`` have passed: a measured gap that a step's seconds must cover."""
    until = time.monotonic() + seconds
    wait_for(lambda: time.monotonic() >= until, what=f"{seconds}s to pass")


def lock_events(span: ReadableSpan) -> list[tuple[str, dict[str, Any]]]:
    """The lock's events on ``span``, in their order: name, attributes."""
    return [
        (event.name, dict(event.attributes or {}))
        for event in span.events
        if event.name.startswith("redislock.")
    ]


@pytest.mark.usefixtures("instrumented_celery")
def test_a_run_is_counted_timed_and_noted_on_its_task_span(
    otel: Otel, sent: Signals, fresh_server: RedisServer, prefix: str
) -> None:
    """``redislock_spans="auto"`` (the default): the acquisition is an event of the task's span,
    with its outcome, fence and seconds; a release that simply freed the lock is none (the
    ``held`` metric times it); no span of their own."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}")
    task = app.tasks["taskapp.hold_skip"]
    attributes = {"task": task.name, "mode": "while_executing"}
    before = otel.count("redislock.lock.acquisitions", **attributes, outcome="acquired")
    waits = otel.count("redislock.lock.wait", **attributes, outcome="acquired")
    waited = otel.total("redislock.lock.wait", **attributes, outcome="acquired")
    helds = otel.count("redislock.lock.held", **attributes)
    held = otel.total("redislock.lock.held", **attributes)

    def gap(sender: Any = None, **_: Any) -> None:  # between the release's send and its read
        if sender is task:
            let_pass(0.2)

    task_success.connect(gap, weak=False)
    try:
        with threads_worker(app):
            result = task.delay("x")
            assert result.get(timeout=30) == "x"
    finally:
        task_success.disconnect(gap)
    assert otel.count("redislock.lock.acquisitions", **attributes, outcome="acquired") == before + 1
    assert otel.count("redislock.lock.wait", **attributes, outcome="acquired") == waits + 1
    assert otel.count("redislock.lock.held", **attributes) == helds + 1
    run = run_span(otel, task, result.id)
    [acquired], [released] = sent.of("lock_acquired"), sent.of("lock_released")
    [(acquire, noted)] = lock_events(run)
    assert acquire == "redislock.acquire" and noted.keys() == {"task", "outcome", "fence", "waited"}
    assert (noted["task"], noted["outcome"], noted["fence"]) == (task.name, "acquired", acquired["fence"])
    assert noted["waited"] == pytest.approx(
        otel.total("redislock.lock.wait", **attributes, outcome="acquired") - waited, abs=1e-9
    )
    assert 0 < noted["waited"] < 5
    times = [run.start_time, *(event.timestamp for event in run.events), run.end_time]
    assert None not in times and times == sorted(times)  # type: ignore[type-var]
    assert not spans_named(otel, "redislock.acquire") + spans_named(otel, "redislock.release")
    assert acquired["mode"] == "while_executing" and 0 <= acquired["waited"] < 5
    assert released["fence"] == acquired["fence"] and 0 <= released["held"] < 5  # seconds, not ms
    # to the release's send, which began before the signal's count: not to its reply's read
    assert 0 <= otel.total("redislock.lock.held", **attributes) - held <= released["held"]
    app.close()


@pytest.mark.usefixtures("instrumented_celery")
def test_always_makes_the_lock_spans_children_of_the_task_span(
    otel: Otel, fresh_server: RedisServer, prefix: str
) -> None:
    """``redislock_spans="always"``: the acquisition and the release are spans, children of the
    task's, in order, with task, mode, outcome and fence; no event on the task's span."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}", redislock_spans="always")
    task = app.tasks["taskapp.hold_skip"]
    with threads_worker(app):
        result = task.delay("x")
        assert result.get(timeout=30) == "x"
    run = run_span(otel, task, result.id)
    [acquire], [release] = spans_named(otel, "redislock.acquire"), spans_named(otel, "redislock.release")
    fence = acquire.attributes["fence"] if acquire.attributes is not None else None
    assert isinstance(fence, int)
    for span, outcome in ((acquire, "acquired"), (release, "released")):
        assert span.parent is not None and span.parent.span_id == run.context.span_id
        attributes = {"task": task.name, "mode": "while_executing", "outcome": outcome, "fence": fence}
        assert dict(span.attributes or {}) == attributes
    times = [run.start_time, acquire.start_time, acquire.end_time, release.start_time, release.end_time]
    times.append(run.end_time)
    assert None not in times and times == sorted(times)  # type: ignore[type-var]
    assert not lock_events(run)
    app.close()


@pytest.mark.usefixtures("instrumented_celery")
@pytest.mark.parametrize("busy", ["skip", "raise", "retry", "wait"])
def test_a_busy_outcome_is_noted_on_the_task_span(
    otel: Otel, sent: Signals, fresh_server: RedisServer, prefix: str, busy: str
) -> None:
    """A run that finds the lock held notes its busy outcome on its span (no fence, no release).
    An outcome's exception is none of ours: the span's one ``exception`` is Celery's, where it
    fails the task (``raise``). A run that waits while the test holds the lock 0.2 s notes at
    least that as ``waited``, then its plain release nothing; a retried run notes its retry."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}")
    task = app.tasks[f"taskapp.hold_{busy}"]
    with threads_worker(app):
        first = task.delay("y", gate=True)
        wait_for(lambda: recorder(app).events(), what="the first run to start")
        second = task.delay("y", gate=True)
        wait_for(lambda: sent.of("lock_busy"), what="the second run to find the lock held")
        if busy == "wait":
            let_pass(0.2)
        recorder(app).open_gate("y", times=2)  # the second run's too, once it has the lock
        assert first.get(timeout=30) == "y"
        if busy == "raise":
            with pytest.raises(Exception, match="is busy held by") as raised:
                second.get(timeout=30)
            assert type(raised.value).__name__ == "LockNotAcquired"
        else:
            assert second.get(timeout=30) == (None if busy == "skip" else "y")
    busy_run, *retried = run_spans(otel, task, second.id)
    assert len(retried) == (busy == "retry")  # the retry found the lock free (the gate opened)
    [(name, noted)] = lock_events(busy_run)
    outcome = "busy-wait" if busy == "wait" else f"busy-{busy}"
    assert name == "redislock.acquire" and (noted["task"], noted["outcome"]) == (task.name, outcome)
    assert noted.keys() == {"task", "outcome", "waited", *(["fence"] if busy == "wait" else [])}
    assert noted["waited"] >= (0.2 if busy == "wait" else 0)
    assert [exceptions_on(busy_run), *map(exceptions_on, retried)] == [busy == "raise", *[0] * len(retried)]
    for run in (run_span(otel, task, first.id), *retried):
        plain = [(name, event["outcome"]) for name, event in lock_events(run)]
        assert plain == [("redislock.acquire", "acquired")]
    assert not spans_named(otel, "redislock.acquire")
    app.close()


def skipped_and_refused(app: Any) -> None:
    """On ``app``'s running worker: a run of ``taskapp.hold_skip`` skipped (its lock held), and a
    call of ``taskapp.until_executed`` refused as a duplicate of the queued one; both first calls
    then end."""
    skip, until = app.tasks["taskapp.hold_skip"], app.tasks["taskapp.until_executed"]
    first = skip.delay("y", gate=True)
    wait_for(lambda: recorder(app).events(), what="the first run to start")
    assert skip.delay("y", gate=True).get(timeout=30) is None  # skipped: the lock is held
    queued = until.delay("z", gate=True)
    assert until.delay("z", gate=True).id == queued.id  # refused: returns the queued one
    recorder(app).open_gate("y")
    recorder(app).open_gate("z")
    assert first.get(timeout=30) == "y" and queued.get(timeout=30) == "z"


def test_busy_and_duplicate_outcomes_are_counted_and_signalled(
    otel: Otel, sent: Signals, fresh_server: RedisServer, prefix: str
) -> None:
    """Celery not instrumented: with ``redislock_spans="always"`` the lock spans are roots."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}", redislock_spans="always")
    skip, until = app.tasks["taskapp.hold_skip"], app.tasks["taskapp.until_executed"]
    skipped = {"task": skip.name, "mode": "while_executing", "outcome": "busy-skip"}
    refused = {"task": until.name, "mode": "until_executed", "outcome": "duplicate-refused"}
    skips, refusals = (
        otel.count("redislock.lock.acquisitions", **skipped),
        otel.count("redislock.lock.acquisitions", **refused),
    )
    with threads_worker(app):
        skipped_and_refused(app)
    assert otel.count("redislock.lock.acquisitions", **skipped) == skips + 1
    assert otel.count("redislock.lock.acquisitions", **refused) == refusals + 1
    assert [busy["outcome"] for busy in sent.of("lock_busy")] == ["busy-skip"]
    acquires = spans_named(otel, "redislock.acquire")
    assert {span.attributes["outcome"] for span in acquires} >= {"acquired", "busy-skip"}  # type: ignore[index]
    assert all(span.parent is None for span in acquires + spans_named(otel, "redislock.release"))
    app.close()


def test_receivers_that_raise_change_no_outcome_and_leave_no_lock(
    fresh_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver of each of the package's signals raises: Celery logs it, and each run, refusal
    and release goes on as without it; no lock is left in Redis (the invariants, at teardown)."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}")
    raised: list[str] = []

    def raising(name: str) -> Any:
        def receive(sender: Any = None, **_: Any) -> None:
            raised.append(name)
            raise RuntimeError(f"a {name} receiver fails")

        return receive

    receivers = {name: raising(name) for name in signals.__all__}
    for name, receive in receivers.items():
        getattr(signals, name).connect(receive, weak=False)
    try:
        with threads_worker(app):
            skipped_and_refused(app)
            wait_for(lambda: raised.count("lock_released") == 2, what="both releases announced")
        with fresh_server.client() as client:
            lock = RedisLock(client, f"{prefix}:lost", ttl=0.6)
            assert lock.acquire()
            client.delete(lock.name)
            wait_for(lambda: "lock_lost" in raised, what="the loss reported")
    finally:
        for name, receive in receivers.items():
            getattr(signals, name).disconnect(receive)
        app.close()
    assert sorted(set(raised)) == sorted(signals.__all__)
    assert any("a lock_released receiver fails" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    ("spans", "instrumented"),
    [pytest.param("auto", False, id="auto-without-a-task-span"), pytest.param("never", True, id="never")],
)
def test_no_lock_spans_without_a_task_span_or_when_turned_off(
    request: pytest.FixtureRequest,
    otel: Otel,
    fresh_server: RedisServer,
    prefix: str,
    spans: str,
    instrumented: bool,
) -> None:
    """``redislock_spans="auto"`` (the default) makes no span and no event where the run has no
    span; ``"never"`` makes none even under the task's span. The metrics are recorded."""
    if instrumented:
        request.getfixturevalue("instrumented_celery")
    conf: dict[str, Any] = {} if spans == "auto" else {"redislock_spans": spans}  # "auto": the default
    app = make_app(fresh_server.url, prefix, f"q-{prefix}", **conf)
    task = app.tasks["taskapp.hold_skip"]
    attributes = {"task": task.name, "mode": "while_executing"}
    helds = otel.count("redislock.lock.held", **attributes)
    with threads_worker(app):
        assert task.delay("v").get(timeout=30) == "v"
    assert otel.count("redislock.lock.held", **attributes) == helds + 1
    names = [span.name for span in otel.spans.get_finished_spans()]
    assert (f"run/{task.name}" in names) == instrumented
    assert not {"redislock.acquire", "redislock.release"} & set(names), names
    assert not [event for span in otel.spans.get_finished_spans() for event in lock_events(span)]
    app.close()


class Broken(SpanProcessor):
    """A span processor that raises as the lock's spans start or end (one that breaks the SDK's
    contract: ``on_start`` and ``on_end`` must not raise), or a histogram whose ``record`` raises."""

    def __init__(self, where: str, error: type[Exception] = RuntimeError) -> None:
        self.where, self.error = where, error

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.where == "span-start":
            raise self.error("the span processor broke")

    def on_end(self, span: Any) -> None:
        if self.where == "span-end":
            raise self.error("the span processor broke")

    def record(self, *args: Any, **kwargs: Any) -> None:
        raise self.error("the histogram broke")


@pytest.mark.parametrize("where", ["span-start", "span-end", "histogram"])
def test_telemetry_that_raises_changes_no_runs_outcome_and_leaves_no_lock(
    otel: Otel,
    fresh_server: RedisServer,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    """``redislock_spans="always"``, an OpenTelemetry SDK that raises as a lock's span starts or
    ends (a span processor's ``on_start`` or ``on_end``), or as a histogram's values are handed to
    it: the run's body runs and its result stands, the lock is released, the next run takes it;
    the failure is logged. (Celery's own instrumentation runs in signal receivers, whose
    exceptions Celery logs: a tracing fault fails no task there either.)"""
    broken = Broken(where)
    if where == "histogram":
        monkeypatch.setattr(telemetry, "BATCH", 1)  # each value goes to the SDK as it is recorded
        monkeypatch.setattr(telemetry._on.wait, "_histogram", broken)
    else:
        provider = TracerProvider()
        provider.add_span_processor(broken)
        monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("broken"))
    app = make_app(fresh_server.url, prefix, f"q-{prefix}", redislock_spans="always")
    task = app.tasks["taskapp.until_executed"]
    key = task_lock_key(task, ("t",))
    client = fresh_server.client()
    with caplog.at_level(logging.ERROR, logger="celery_redislock"), threads_worker(app):
        result = task.delay("t")
        assert result.get(timeout=30, propagate=False) == "t", result.traceback
        wait_for(lambda: not client.exists(key), what="the lock's release")
        assert task.delay("t").get(timeout=30) == "t"
    client.close()
    runs = [event[0] for event in recorder(app).events() if event[0] in ("start", "end")]
    assert runs == ["start", "end", "start", "end"]  # both bodies ran
    assert any("broke" in str(record.exc_info) for record in caplog.records), caplog.text
    app.close()


@pytest.mark.parametrize("where", ["span-start", "span-end"])
def test_a_soft_time_limit_landing_in_telemetry_stops_the_run(
    otel: Otel, fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A soft time limit (an ``Exception``) landing as a lock's span starts or ends is no SDK
    fault to log and carry on from: it propagates, the run fails with it (its body not run when
    it lands as the acquisition is traced), and the lock is released."""
    provider = TracerProvider()
    provider.add_span_processor(Broken(where, SoftTimeLimitExceeded))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("interrupted"))
    app = make_app(fresh_server.url, prefix, f"q-{prefix}", redislock_spans="always")
    task = app.tasks["taskapp.hold_skip"]
    key = task_lock_key(task, ("t",))
    client = fresh_server.client()
    with threads_worker(app):
        result = task.delay("t")
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=30)
        wait_for(lambda: not client.exists(key), what="the lock's release")
    client.close()
    assert not [event for event in recorder(app).events() if event[0] == "end"]  # no body ran to its end
    app.close()


def test_an_acquisition_that_fails_is_noted_on_the_current_span(
    otel: Otel, redis_server: RedisServer, prefix: str, refused_port: int
) -> None:
    """Redis is down when a run takes its lock: the block raises a ``ConnectionError``, no outcome;
    under ``"auto"`` the run's span gets the acquire event naming the exception's type, and no
    ``exception`` event of ours (Celery's instrumentation records the one that fails a task)."""
    down = f"redis://127.0.0.1:{refused_port}/0"  # refuses, as a stopped server (tests/ports.py)
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_url=down)
    task = app.tasks["taskapp.hold_skip"]
    with trace.get_tracer("test").start_as_current_span("run"):
        failed = task.apply(("x",))
    assert isinstance(failed.result, RedisLockError), failed.result
    [run] = spans_named(otel, "run")
    [(name, noted)] = lock_events(run)
    assert name == "redislock.acquire" and noted.keys() == {"task", "error.type", "waited"}
    assert noted["error.type"] == "redis.exceptions.ConnectionError" and noted["waited"] > 0
    assert exceptions_on(run) == 0
    assert not spans_named(otel, "redislock.acquire")
    app.close()


def test_an_acquisition_that_fails_marks_its_span_failed_under_the_run(
    otel: Otel, redis_server: RedisServer, prefix: str, refused_port: int
) -> None:
    """The same with ``redislock_spans="always"``: the acquire span, a child of the run's, records
    the exception and the ERROR status."""
    down = f"redis://127.0.0.1:{refused_port}/0"
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_spans="always", redislock_url=down)
    task = app.tasks["taskapp.hold_skip"]
    with trace.get_tracer("test").start_as_current_span("run") as run:
        failed = task.apply(("x",))
    assert isinstance(failed.result, RedisLockError), failed.result
    [acquire] = spans_named(otel, "redislock.acquire")
    assert acquire.parent is not None and acquire.parent.span_id == run.get_span_context().span_id
    assert acquire.status.status_code is trace.StatusCode.ERROR
    assert "ConnectionError" in (acquire.status.description or "")
    [event] = acquire.events
    assert event.name == "exception" and event.attributes is not None
    assert str(event.attributes["exception.type"]).endswith("ConnectionError")
    assert "outcome" not in (acquire.attributes or {})
    app.close()


def test_a_bad_spans_setting_names_the_setting_and_what_is_allowed(
    fresh_server: RedisServer, prefix: str
) -> None:
    app = make_app(fresh_server.url, prefix, f"q-{prefix}", redislock_spans="sometimes")
    with pytest.raises(
        LockConfigurationError,
        match="redislock_spans='sometimes' is not valid; allowed: 'auto', 'always', 'never'",
    ):
        app_settings(app)
    app.close()


def test_a_lost_lock_and_its_renewals_are_counted(otel: Otel, fresh_server: RedisServer, prefix: str) -> None:
    """A ``RedisLock`` of no task: its loss counts with ``task=""``; each renewal counts once, the
    one that found the lock gone as failed."""
    lost = otel.count("redislock.lock.lost", task="", reason="not owned")
    renewed = otel.count("redislock.lock.renewals", result="renewed")
    failed = otel.count("redislock.lock.renewals", result="failed")
    client = fresh_server.client()
    lock = RedisLock(client, f"{prefix}:lock", ttl=0.6)
    assert lock.acquire(blocking=False)
    wait_for(lambda: otel.count("redislock.lock.renewals", result="renewed") > renewed, what="a renewal")
    client.delete(lock.name)
    assert lock.lost.wait(5)
    wait_for(
        lambda: otel.count("redislock.lock.lost", task="", reason="not owned") == lost + 1, what="the loss"
    )
    assert (
        otel.count("redislock.lock.renewals", result="failed") == failed + 1
    )  # the renewal that found it gone
    client.close()


def test_a_task_lock_lost_counts_once_under_its_task(
    otel: Otel, fresh_server: RedisServer, prefix: str
) -> None:
    """Lost while the body runs: counted by the watchdog under the task's name, not again by the
    release that then finds it gone (whose span says ``lost``)."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}", redislock_ttl=0.6, redislock_spans="always")
    task, client = app.tasks["taskapp.hold_skip"], fresh_server.client()
    lost = {"task": task.name, "reason": "not owned"}
    before = otel.count("redislock.lock.lost", **lost)
    with threads_worker(app):
        result = task.delay("w", gate=True)
        wait_for(lambda: recorder(app).events(), what="the run to start")
        client.delete(task_lock_key(task, ("w",), {"gate": True}))
        wait_for(lambda: otel.count("redislock.lock.lost", **lost) == before + 1, what="the loss")
        recorder(app).open_gate("w")
        assert result.get(timeout=30) == "w"
    assert otel.count("redislock.lock.lost", **lost) == before + 1
    assert otel.count("redislock.lock.lost", task=task.name, reason="not owned at release") == 0
    [release] = spans_named(otel, "redislock.release")
    assert release.attributes is not None and release.attributes["outcome"] == "lost"
    client.close()
    app.close()


@pytest.mark.usefixtures("instrumented_celery")
def test_a_release_that_finds_its_lock_lost_is_noted_on_the_task_span(
    otel: Otel, fresh_server: RedisServer, prefix: str
) -> None:
    """``"auto"``: a release that did not simply free the lock (its key deleted while the body
    ran: ``lost``) is noted after the acquisition, with its outcome, fence and held seconds (at
    least the 0.2 s the test kept the body running)."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}")
    task, client = app.tasks["taskapp.hold_skip"], fresh_server.client()
    with threads_worker(app):
        result = task.delay("w", gate=True)
        wait_for(lambda: recorder(app).events(), what="the run to start")
        client.delete(task_lock_key(task, ("w",), {"gate": True}))
        let_pass(0.2)
        recorder(app).open_gate("w")
        assert result.get(timeout=30) == "w"
    [(acquire, noted), (release, ended)] = lock_events(run_span(otel, task, result.id))
    assert (acquire, release) == ("redislock.acquire", "redislock.release")
    assert ended.keys() == {"task", "outcome", "fence", "held"}
    assert (ended["task"], ended["outcome"], ended["fence"]) == (task.name, "lost", noted["fence"])
    assert 0.2 <= ended["held"] < 30
    client.close()
    app.close()


@pytest.mark.parametrize("spans", ["auto", "always"])
@pytest.mark.parametrize("first", ["instrumentation", "package"])
def test_a_deferred_release_is_traced_on_its_task_span_whatever_the_receivers_order(
    otel: Otel, fresh_server: RedisServer, prefix: str, spans: str, first: str
) -> None:
    """A worker's run sends its release before the result is stored, the step entered in the
    task's span, and reads the reply after it (``receivers.after_run``), before OpenTelemetry's
    Celery instrumentation ends the task's span at ``task_postrun``, whether that was set up
    before the package's ``install`` or after it: ``"auto"`` notes a lost release on the task's
    span, ``"always"`` makes its span a child of the task's, ended before it."""
    if first == "instrumentation":
        CeleryInstrumentor().instrument()  # type: ignore[no-untyped-call]
    app = make_app(fresh_server.url, prefix, f"q-{prefix}", redislock_spans=spans)
    task, client = app.tasks["taskapp.hold_skip"], fresh_server.client()
    install(app)
    if first == "package":
        CeleryInstrumentor().instrument()  # type: ignore[no-untyped-call]
    try:
        with threads_worker(app):
            result = task.delay("w", gate=True)
            wait_for(lambda: recorder(app).events(), what="the run to start")
            client.delete(task_lock_key(task, ("w",), {"gate": True}))
            recorder(app).open_gate("w")
            assert result.get(timeout=30) == "w"
    finally:
        CeleryInstrumentor().uninstrument()  # type: ignore[no-untyped-call]
    run = run_span(otel, task, result.id)
    if spans == "auto":
        assert [(name, noted["outcome"]) for name, noted in lock_events(run)][1:] == [
            ("redislock.release", "lost")
        ]
    else:
        [release] = spans_named(otel, "redislock.release")
        assert release.parent is not None and release.parent.span_id == run.context.span_id
        assert release.attributes is not None and release.attributes["outcome"] == "lost"
        assert release.end_time is not None and run.end_time is not None and release.end_time <= run.end_time
    client.close()
    app.close()


@pytest.mark.parametrize("spans", ["auto", "always"])
@pytest.mark.parametrize("ended", [False, True], ids=["A-open-B-current", "A-ended-no-span"])
def test_a_step_exited_later_traces_in_the_span_it_was_entered_in(
    otel: Otel,
    fresh_server: RedisServer,
    prefix: str,
    spans: str,
    ended: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run's release may be over once its task's span is no longer current, or has ended: its
    event goes on the span current when the step was entered while that span records, nothing
    once it ended, not even tried (``"auto"``: the SDK warns of an ended span); its span is that
    span's child either way (``"always"``)."""
    client, tracer, steps = fresh_server.client(), trace.get_tracer("test"), contextlib.ExitStack()
    lock = RedisLock(client, f"{prefix}:lock", ttl=30)
    assert lock.acquire(blocking=False)
    with tracer.start_as_current_span("A", end_on_exit=False) as a:
        ending = steps.enter_context(telemetry.Release("t", "while_executing", lock, spans))
    if ended:
        a.end()
    with contextlib.nullcontext() if ended else tracer.start_as_current_span("B"):
        client.delete(lock.name)
        with pytest.raises(LockNotOwned):
            lock.release()
        ending.outcome = "lost"
        steps.close()
    if not ended:
        a.end()
    [run] = spans_named(otel, "A")
    finished = otel.spans.get_finished_spans()
    assert not [event for span in finished if span.name != "A" for event in lock_events(span)]
    if spans == "always":
        [release] = spans_named(otel, "redislock.release")
        assert release.parent is not None and release.parent.span_id == run.context.span_id
        assert release.attributes is not None and release.attributes["outcome"] == "lost"
        assert not lock_events(run)
    else:
        assert not spans_named(otel, "redislock.release")
        noted = [(name, event["task"], event["outcome"]) for name, event in lock_events(run)]
        assert noted == ([] if ended else [("redislock.release", "t", "lost")])
    assert not [record for record in caplog.records if "ended span" in record.getMessage()]
    client.close()


@pytest.fixture
def held(fresh_server: RedisServer, prefix: str) -> Iterator[RedisLock]:
    """A lock taken, with its fence, on ``fresh_server``; released after the test."""
    lock = RedisLock(fresh_server.client(), f"{prefix}:lock", ttl=30)
    assert lock.acquire(blocking=False) and lock.fence is not None
    yield lock
    lock.release()
    lock.client.close()


@pytest.mark.parametrize("outcome", ["parked", "settled", "taken-over", "lost", "error", "released"])
def test_auto_notes_a_release_unless_it_simply_freed_the_lock(
    otel: Otel, held: RedisLock, outcome: str
) -> None:
    """``"auto"``: a release's event, with its outcome, fence and held seconds (the value its
    ``held`` metric records), unless it is ``released``; its metric either way."""
    attributes = {"task": "t-release", "mode": "while_executing"}
    helds = otel.count("redislock.lock.held", **attributes)
    held_before = otel.total("redislock.lock.held", **attributes)
    tracer = trace.get_tracer("test")
    with (
        tracer.start_as_current_span("A"),
        telemetry.Release("t-release", "while_executing", held, "auto") as step,
    ):
        step.outcome = outcome
    [run] = spans_named(otel, "A")
    assert otel.count("redislock.lock.held", **attributes) == helds + 1
    if outcome == "released":
        assert not lock_events(run)
    else:
        [(name, noted)] = lock_events(run)
        assert name == "redislock.release" and noted.keys() == {"task", "outcome", "fence", "held"}
        assert (noted["task"], noted["outcome"], noted["fence"]) == ("t-release", outcome, held.fence)
        total = otel.total("redislock.lock.held", **attributes)
        assert noted["held"] == pytest.approx(total - held_before, abs=1e-9) and noted["held"] > 0


@pytest.mark.parametrize("spans", ["auto", "always"])
def test_a_release_that_comes_to_nothing_traces_and_records_nothing(
    otel: Otel, held: RedisLock, spans: str
) -> None:
    """A release whose block leaves no outcome (the lock not held) and raises nothing: no event,
    no span, no metric."""
    attributes = {"task": "t-nothing", "mode": "while_executing"}
    helds = otel.count("redislock.lock.held", **attributes)
    with (
        trace.get_tracer("test").start_as_current_span("A"),
        telemetry.Release("t-nothing", "while_executing", held, spans),
    ):
        pass
    [run] = spans_named(otel, "A")
    assert not lock_events(run) and not spans_named(otel, "redislock.release")
    assert otel.count("redislock.lock.held", **attributes) == helds


def test_a_release_that_fails_is_noted_with_its_error_type(otel: Otel, held: RedisLock) -> None:
    """``"auto"``: a release whose block raises notes its event with ``error.type``, no outcome,
    and no ``exception`` event of ours; no metric (no outcome)."""
    attributes = {"task": "t-failed", "mode": "while_executing"}
    helds = otel.count("redislock.lock.held", **attributes)
    releasing = telemetry.Release("t-failed", "while_executing", held, "auto")
    with trace.get_tracer("test").start_as_current_span("A"), pytest.raises(RedisLockError), releasing:
        raise RedisLockError("the release failed")
    [run] = spans_named(otel, "A")
    [(name, noted)] = lock_events(run)
    assert name == "redislock.release" and noted.keys() == {"task", "error.type", "fence", "held"}
    assert (noted["task"], noted["error.type"]) == ("t-failed", "celery_redislock.exceptions.RedisLockError")
    assert noted["fence"] == held.fence and noted["held"] > 0
    assert exceptions_on(run) == 0 and otel.count("redislock.lock.held", **attributes) == helds


def test_a_deferred_release_interrupted_before_its_send_ends_its_step_once_and_keeps_the_hold(
    otel: Otel, fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_lock.release_later`` interrupted before anything is sent (a soft time limit while
    the connection is checked): the release step ends once, failed (``"auto"``: its event with
    ``error.type``, no metric), and the hold is kept for ``finish_release``, whose release is
    then reported as ``released``, no second event."""
    attributes = {"task": "t-interrupted", "mode": "while_executing"}
    helds = otel.count("redislock.lock.held", **attributes)
    lock = RedisLock(fresh_server.client(), f"{prefix}:lock", ttl=30)
    assert lock.acquire(blocking=False)
    task = type("Task", (), {"name": "t-interrupted", "app": None})()  # what the signal receivers read

    def interrupted(*args: Any) -> bool:
        raise SoftTimeLimitExceeded()

    released: list[dict[str, Any]] = []

    def on_released(sender: Any, **details: Any) -> None:
        released.append(details)

    signals.lock_released.connect(on_released, sender=task, weak=False)
    try:
        with trace.get_tracer("test").start_as_current_span("A"):
            with monkeypatch.context() as patched:
                patched.setattr(celery_redislock.lock, "send_later", interrupted)
                ending = telemetry.Release("t-interrupted", "while_executing", lock, "auto")
                with pytest.raises(SoftTimeLimitExceeded):
                    run_lock.release_later(task, lock, "id-1", ending)
            assert lock.held()
            run_lock.finish_release(task, lock, "id-1", lambda: None)  # a mode that keeps nothing
    finally:
        signals.lock_released.disconnect(on_released, sender=task)
    assert not lock.held() and not lock.client.exists(lock.name)
    [run] = spans_named(otel, "A")
    [(name, noted)] = lock_events(run)
    assert (name, noted["error.type"]) == ("redislock.release", "billiard.exceptions.SoftTimeLimitExceeded")
    assert [details["key"] for details in released] == [lock.name]
    assert otel.count("redislock.lock.held", **attributes) == helds
    lock.client.close()


def test_every_log_line_carries_its_fields(
    caplog: pytest.LogCaptureFixture, fresh_server: RedisServer, prefix: str
) -> None:
    """A skipped run and a refused duplicate: their INFO lines carry the key, task id, holder and
    outcome as record attributes; every line the package logs carries some of the fields."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}")
    skip, until = app.tasks["taskapp.hold_skip"], app.tasks["taskapp.until_executed"]
    with caplog.at_level(logging.DEBUG, logger="celery_redislock"), threads_worker(app):
        first = skip.delay("y", gate=True)
        wait_for(lambda: recorder(app).events(), what="the first run to start")
        second = skip.delay("y", gate=True)
        assert second.get(timeout=30) is None
        queued = until.delay("z", gate=True)
        until.delay("z", gate=True)
        recorder(app).open_gate("y")
        recorder(app).open_gate("z")
        first.get(timeout=30), queued.get(timeout=30)
    ours = [record for record in caplog.records if record.name.startswith("celery_redislock")]
    fields = ("lock_key", "task_id", "holder", "fence", "outcome")
    assert all(any(hasattr(record, field) for field in fields) for record in ours), [
        record.getMessage() for record in ours if not any(hasattr(record, field) for field in fields)
    ]
    [skipped] = [record for record in ours if getattr(record, "outcome", None) == "busy-skip"]
    assert (skipped.task_id, skipped.lock_key) == (second.id, first_key(app, "y"))  # type: ignore[attr-defined]
    assert f"task={first.id}" in skipped.holder  # type: ignore[attr-defined]
    [refused] = [record for record in ours if getattr(record, "outcome", None) == "duplicate-refused"]
    assert f"task={queued.id}" in refused.holder  # type: ignore[attr-defined]
    app.close()


def first_key(app: Any, x: str) -> str:
    return task_lock_key(app.tasks["taskapp.hold_skip"], (x,), {"gate": True})


def exported_names() -> set[str]:
    """The metric names the Prometheus exporter gives the package's instruments (each recorded once)."""
    provider = MeterProvider(metric_readers=[PrometheusMetricReader()])
    try:
        made = telemetry.Instruments(provider.get_meter("test"))
        for histogram in (made.wait, made.held):
            histogram.record(1.0, {"task": "t", "mode": "m", "outcome": "acquired"})
        for counts in (made.acquisitions, made.lost, made.renewals, made.crash_releases):
            counts.add(1, (("task", "t"),))
        text = generate_latest(REGISTRY).decode()
    finally:
        provider.shutdown()  # takes the reader's collector out of the registry
    return set(re.findall(r"^(redislock_\w+?)(?:\{| )", text, re.MULTILINE))


def test_the_dashboard_queries_only_metrics_the_package_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queried = {name for query in queries for name in re.findall(r"\bredislock_\w+", query)}
    exported = exported_names()
    assert queried and queried <= exported, queried - exported
    assert {"redislock_lock_wait_seconds_bucket", "redislock_lock_lost_total"} <= queried


def test_the_busy_policies_outcomes_are_telemetry_outcomes() -> None:
    assert set(busy.OUTCOMES.values()) <= set(telemetry.OUTCOMES)


def test_log_fields_are_those_that_apply() -> None:
    assert telemetry.log_fields("k", None, "h", 3) == {"lock_key": "k", "holder": "h", "fence": 3}


def test_every_logging_call_of_the_package_passes_its_fields() -> None:
    """Each ``logger.<level>(...)`` in the package passes ``extra=`` (``telemetry.log_fields``)."""
    missing = [
        f"{path.name}:{call.lineno}"
        for path in sorted((ROOT / "celery_redislock").glob("*.py"))
        for call in ast.walk(ast.parse(path.read_text()))
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "logger"
        and not any(keyword.arg == "extra" for keyword in call.keywords)
    ]
    assert missing == []


def exit_code(pid: int, what: str) -> int:
    """The exit code of forked child ``pid`` once it ended (killed by its pid if it does not)."""

    def ended() -> tuple[int, ...]:  # (its wait status) once it ended
        done, status = os.waitpid(pid, os.WNOHANG)
        return (status,) if done == pid else ()

    try:
        [status] = wait_for(ended, 10, what)
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_counts_only_its_own_with_a_lock_of_its_own() -> None:
    """The fork happens while another thread holds the sums' lock: the child still counts, from
    none of its parent's (``tests/faults/test_crashes.py``: a pool child and the crash releases)."""
    counts, at = telemetry.Counts(), (("task", "t"),)
    counts.add(1, at)
    with counts._lock:
        pid = os.fork()
        if pid == 0:  # the child: count once, exit 0 if the sum is 1
            counts.add(1, at)
            os._exit(0 if [seen.value for seen in counts.observe(None)] == [1] else 1)
    assert exit_code(pid, "the child to count") == 0
    assert [seen.value for seen in counts.observe(None)] == [1]


def test_instruments_are_collected_once_unreferenced() -> None:
    """Nothing of the package keeps them (their fork hooks hold them weakly): once their provider
    is shut down and nothing refers to them, the instruments, buffers and sums are collected."""
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    made = telemetry.Instruments(provider.get_meter("test"))
    made.held.record(0.5, {"task": "t", "mode": "m"})
    made.acquisitions.add(1, (("task", "t"),))
    refs = [weakref.ref(kept) for kept in (made, made.held, made.acquisitions)]
    provider.shutdown()
    del made, provider
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]


def own_instruments() -> tuple[telemetry.Instruments, Otel]:
    """The package's instruments made by a ``MeterProvider`` of their own, and its reader."""
    otel = Otel()
    return telemetry.Instruments(MeterProvider(metric_readers=[otel.reader]).get_meter("test")), otel


def count_and_sum(reader: MetricReader) -> tuple[float, float]:
    """The count and sum (rounded to 9 places) of ``redislock.lock.wait``, one set of attributes,
    that ``reader`` collects."""
    if isinstance(reader, PrometheusMetricReader):  # a scrape: the registry collects through it
        text = generate_latest(REGISTRY).decode()
        found = [
            float(value)
            for what in ("count", "sum")
            for value in re.findall(
                rf"^redislock_lock_wait_seconds_{what}(?:{{.*}})? (\S+)$", text, re.MULTILINE
            )
        ]
        assert len(found) == 2, text
        return found[0], round(found[1], 9)
    assert isinstance(reader, InMemoryMetricReader)
    [point] = Otel(reader).points("redislock.lock.wait").values()
    return point.count, round(point.sum, 9)


@pytest.mark.parametrize(
    "second",
    [
        pytest.param(None, id="one-in-memory-reader"),
        pytest.param(InMemoryMetricReader, id="two-in-memory-readers"),
        pytest.param(PrometheusMetricReader, id="in-memory-and-prometheus-readers"),
    ],
)
def test_a_collection_sees_every_value_recorded_before_it(second: type[MetricReader] | None) -> None:
    """Fewer than a batch, one of them from another thread: each collection of each reader has
    them all, once, whichever reader collects first (a collection of the SDK runs every callback)."""
    otel = Otel()
    readers = [otel.reader] if second is None else [otel.reader, second()]
    provider = MeterProvider(metric_readers=readers)
    try:
        made = telemetry.Instruments(provider.get_meter("test"))
        at = {"task": "t", "mode": "m", "outcome": "acquired"}
        made.wait.record(0.002, at)
        recorder = threading.Thread(target=made.wait.record, args=(0.2, at))
        recorder.start()
        recorder.join()
        [point] = otel.points("redislock.lock.wait").values()
        assert (point.count, point.sum, point.min, point.max) == (2, 0.202, 0.002, 0.2)
        others = readers[1:]
        assert [count_and_sum(reader) for reader in others] == [(2, 0.202)] * len(others)
        made.wait.record(7.0, at)  # the other reader collects first now
        assert [count_and_sum(reader) for reader in others] == [(3, 7.202)] * len(others)
        [point] = otel.points("redislock.lock.wait").values()
        assert (point.count, point.max) == (3, 7.0)
    finally:
        provider.shutdown()  # takes a Prometheus reader's collector out of the registry


def test_values_recorded_in_a_span_carry_no_exemplar_of_it() -> None:
    """The values go to the SDK outside any span, whether a full batch or a collection sends them
    from inside one: no exemplar names a trace (the SDK's default filter takes sampled spans)."""
    made, otel = own_instruments()
    at = {"task": "t", "mode": "m", "outcome": "acquired"}
    with TracerProvider().get_tracer("test").start_as_current_span("run") as run:
        assert run.get_span_context().trace_flags.sampled
        for _ in range(telemetry.BATCH + 1):  # a batch sent at its last value, one at the collection
            made.wait.record(0.002, at)
        [point] = otel.points("redislock.lock.wait").values()
    assert point.count == telemetry.BATCH + 1
    assert not point.exemplars


def test_threads_recording_while_collections_run_lose_and_repeat_nothing() -> None:
    """Four threads record many batches each while this one collects: every value counts once."""
    made, otel = own_instruments()
    at, per_thread = {"task": "t", "mode": "m"}, telemetry.BATCH * 20 + 3

    def record() -> None:
        for _ in range(per_thread):
            made.held.record(0.01, at)

    threads = [threading.Thread(target=record) for _ in range(4)]
    for thread in threads:
        thread.start()
    counts = [0]
    while any(thread.is_alive() for thread in threads):
        counts.append(sum(point.count for point in otel.points("redislock.lock.held").values()))
    for thread in threads:
        thread.join()
    [point] = otel.points("redislock.lock.held").values()
    assert counts == sorted(counts) and point.count == 4 * per_thread


def test_a_full_batch_goes_to_the_sdk_without_a_collection() -> None:
    made, _ = own_instruments()
    for _ in range(telemetry.BATCH - 1):
        made.held.record(0.01, {"task": "t", "mode": "m"})
    assert len(made.held._values) == telemetry.BATCH - 1
    made.held.record(0.01, {"task": "t", "mode": "m"})
    assert not made.held._values


def test_a_forked_child_hands_over_only_its_own_values_with_a_lock_of_its_own() -> None:
    """A value buffered at the fork counts in the parent only, not again in the child. The fork
    happens while another thread holds the buffer's lock: the child's full batch still goes."""
    made, otel = own_instruments()
    at = {"task": "t", "mode": "m"}
    made.held.record(0.5, at)  # buffered: no collection yet
    with made.held._lock:
        pid = os.fork()
        if pid == 0:  # the child: record a batch (a flush), exit 0 if its collection has it alone
            for _ in range(telemetry.BATCH):
                made.held.record(0.25, at)
            [point] = otel.points("redislock.lock.held").values()
            os._exit(0 if (point.count, point.sum) == (telemetry.BATCH, telemetry.BATCH * 0.25) else 1)
    assert exit_code(pid, "the child to collect") == 0
    [point] = otel.points("redislock.lock.held").values()
    assert (point.count, point.sum) == (1, 0.5)


def test_values_are_dropped_a_batch_at_a_time_until_a_provider_is_set() -> None:
    """In a fresh process, values recorded into the package's histogram buffer directly (the
    hooks record none before a provider is set: ``_meter_provider_set``): with no provider each full
    batch goes nowhere (as through the API's proxies), the rest stays buffered; once the app
    sets one, after the import, a later value and those still buffered are seen.
    Also an internals check: the API's proxies are told from real instruments by their module
    (``telemetry._records``); should that change upstream, the values would go to the proxies
    (no harm, a cost) and this fails."""
    script = textwrap.dedent(
        """
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        from celery_redislock import telemetry

        wait = telemetry._on.wait
        for _ in range(telemetry.BATCH * 3 + 5):
            wait.record(1.0, {"task": "t", "mode": "m", "outcome": "acquired"})
        print(len(wait._values), wait._forwards)
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        wait.record(0.5, {"task": "t", "mode": "m", "outcome": "acquired"})
        [scope] = reader.get_metrics_data().resource_metrics[0].scope_metrics
        [[point]] = [metric.data.data_points for metric in scope.metrics if metric.name.endswith("wait")]
        print(point.count, point.sum)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["5", "False", "6", "5.5"], done.stderr


def test_without_the_otel_extra_or_django_a_locked_task_runs_and_traces_nothing(
    redis_server: RedisServer, prefix: str
) -> None:
    """In a process where neither ``opentelemetry`` nor Django can be imported (an install without
    the ``otel`` extra, a project without Django): the package imports, its telemetry hooks do
    nothing (also under ``redislock_spans="always"``), and a ``LockedTask`` runs under its lock,
    which it releases; a ``RedisLock`` of its own likewise."""
    script = textwrap.dedent(
        """
        import sys

        for name in ("opentelemetry", "django", "django.db"):
            sys.modules[name] = None  # as if not installed: importing them raises ImportError
        from celery import Celery

        from celery_redislock import LockedTask, RedisLock, task_lock_key, telemetry

        url, prefix = sys.argv[1:]
        app = Celery("no-extras", broker=url, backend=url, set_as_current=False)
        app.conf.update(
            redislock_url=url, redislock_prefix=prefix, redislock_spans="always", task_always_eager=True
        )

        @app.task(base=LockedTask, bind=True, shared=False, name="no_extras.t", lock_mode="until_executed")
        def t(self, x):
            return x, self.request.lock_fence is not None

        lock = RedisLock(app.backend.client, f"{prefix}:own", ttl=5)
        with lock:
            print(t.delay(1).get(), t(2), lock.owned(), telemetry.trace, telemetry.metrics)
        print(app.backend.client.exists(task_lock_key(t, (1,)), task_lock_key(t, (2,)), f"{prefix}:own"))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, redis_server.url, prefix],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["(1, True) (2, True) True None None", "0"], done.stderr


def test_nothing_is_recorded_or_made_until_the_app_sets_providers() -> None:
    """In a fresh process with the API installed and no global provider set (the API's proxies
    would drop it all): a run's steps record no metric, and under ``"always"`` make no span (nor
    look the current one up). Under ``"auto"`` they still note their event on a recording task
    span: an instrumentation given a provider of its own (``CeleryInstrumentor().instrument(
    tracer_provider=...)``) makes one with no global provider set. Once the app sets a
    ``MeterProvider`` and a ``TracerProvider``, they record and make spans too.
    Also an internals check: the hooks read the API's set-once flags of its global providers
    (``telemetry._provider_set``); should those move upstream, the hooks work always (a cost,
    no harm) and this fails."""
    script = textwrap.dedent(
        """
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from celery_redislock import telemetry

        looked_up = []
        current_span = trace.get_current_span
        trace.get_current_span = lambda *a: looked_up.append(1) or current_span(*a)

        class Lock:
            fence = 7

        def run(spans):
            with telemetry.Acquisition("t", "while_executing", Lock(), spans) as step:
                step.busy, step.taken = True, True  # a wait: noted as an event under "auto"
            telemetry.counted("t", "until_executed", "duplicate-refused")

        def provider():
            spans = InMemorySpanExporter()
            made = TracerProvider()
            made.add_span_processor(SimpleSpanProcessor(spans))
            return made, spans

        run("always")
        print(len(looked_up), len(telemetry._on.wait._values), len(telemetry._on.acquisitions._sums))
        own, own_spans = provider()  # an instrumentation's own, not set globally
        with own.get_tracer("instrumentation").start_as_current_span("task"):
            run("auto")
        [task] = own_spans.get_finished_spans()
        print([event.name for event in task.events], len(telemetry._on.wait._values))
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        tracing, spans = provider()
        trace.set_tracer_provider(tracing)
        with trace.get_tracer("test").start_as_current_span("task"):
            run("always")
        [scope] = reader.get_metrics_data().resource_metrics[0].scope_metrics
        points = {m.name: list(m.data.data_points) for m in scope.metrics}
        print(
            [p.count for p in points["redislock.lock.wait"]],
            sorted(p.value for p in points["redislock.lock.acquisitions"]),
            sorted(span.name for span in spans.get_finished_spans()),
        )
        print(telemetry._meter_provider_set, telemetry._tracer_provider_set)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    before, own_provider, after, flags = done.stdout.splitlines()
    assert before == "0 0 0", done.stderr
    assert own_provider == "['redislock.acquire'] 0", done.stderr
    assert after == "[1] [1, 1] ['redislock.acquire', 'task']", done.stderr
    assert flags.count("opentelemetry.util._once.Once object") == 2, flags
