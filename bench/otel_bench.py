"""The cost of the OpenTelemetry instrumentation: task_bench's trivial-task benchmark, LockedTask
with the SDK's providers on against the same without, in one run.

Each round runs ``task_bench.run_once("LockedTask", ...)`` once per way, the order rotating
between rounds: ``off`` as task_bench runs it (opentelemetry-api installed, no provider set);
``metrics``, with ``TASK_BENCH_OTEL=metrics``, under which the worker (its main process, before
the pool forks) sets an SDK ``MeterProvider`` (an in-memory reader, read by nobody: every
measurement is aggregated, as for an exporter); ``all``, which also sets a ``TracerProvider`` (a
batch processor into an exporter that drops the spans) under the default
``redislock_spans="auto"``: Celery is not instrumented, so no task span, and no lock span;
``spans``, the same with ``redislock_spans="always"``: every lock's metrics and its two spans
are recorded. Then where users have spans: ``celery-never``, the SDK's providers and Celery
instrumented (opentelemetry-instrumentation-celery: each task has its span, recorded and
exported) with ``redislock_spans="never"``; ``celery``, the same with the default ``"auto"``:
each run's acquisition is an event of its task's span (its release too, where it did not simply
free the lock: never here), one event a run; and ``celery-spans``, with ``"always"``: its
acquisition and release are two spans, children of the task's.

The headline is, for each instrumented way, the median over the rounds of the per-round ratio
to ``off`` of the worker pool's CPU per task and of the wall time (target < 1.03), and the same
of ``celery`` and ``celery-spans`` to ``celery-never`` (what the lock's events, or its spans, add
where tasks are traced). Before the
runs, the hooks' own cost per run in this process without the API, with no provider, and with
the SDK each way (a tight loop: a lower bound; the ``celery`` ways in a span of their own), then
what the SDK's metrics add to a run among its other work (``metrics_in_runs_us``) and from it an
estimate of the ``metrics`` ratio with less noise on a shared machine; the load average before
and after. Results go to ``bench/results/otel_bench.json``.

Run: ``.venv/bin/python bench/otel_bench.py`` (``--tasks``, ``--repeats``; about 6 min at the
defaults). Needs the SDK: ``pip install -e '.[test]'``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "otel_bench.json"
#: The environment variable that turns the SDK on in task_bench's worker (``metrics`` or ``all``).
SWITCH = "TASK_BENCH_OTEL"
#: Uninstrumented, then the SDK's metrics, then its metrics and tracer (spans "auto"), then
#: its metrics and spans ("always"); then Celery instrumented too, with nothing of the lock on
#: its spans ("never"), with the lock's acquire event on them ("auto"), and with the lock's spans
#: under them ("always").
WAYS = ("off", "metrics", "all", "spans", "celery-never", "celery", "celery-spans")
#: ``redislock_spans`` each way (the default elsewhere).
SPANS = {"spans": "always", "celery-never": "never", "celery-spans": "always"}
#: Each instrumented way against the way it adds to.
BASES = {
    "metrics": "off",
    "all": "off",
    "spans": "off",
    "celery": "celery-never",
    "celery-spans": "celery-never",
}


def instrument(way: str) -> dict[str, Any]:
    """Set the SDK's global providers: the ``MeterProvider``, and for ``way`` other than
    ``"metrics"`` the ``TracerProvider`` too, and for the ``celery`` ways instrument Celery
    (the worker calls this with ``SWITCH``'s value); return the app settings of the way."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropping(SpanExporter):
        """Exports nothing: the spans are made, batched and handed over, then dropped."""

        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    if way != "metrics":
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(BatchSpanProcessor(Dropping()))
        trace.set_tracer_provider(tracer_provider)
    if way.startswith("celery"):
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        CeleryInstrumentor().instrument()  # type: ignore[no-untyped-call]
    return {"redislock_spans": SPANS.get(way, "auto")}


def hook_cost_us(rounds: int = 100_000, spans: str = "auto", in_task_span: bool = False) -> float:
    """Microseconds per plain run (acquired, released) spent in the hooks it calls
    (``Acquisition``, ``Release``), with this process's providers (none is set here: the API's
    proxies, or no API at all), in a task's span if ``in_task_span`` (as under an instrumented
    Celery)."""
    from contextlib import nullcontext

    from celery_redislock import telemetry

    class Hold:  # what the hooks read of a held lock
        fence, taken_at = 1, 0.0

    def task_span() -> Any:
        if not in_task_span:
            return nullcontext()
        from opentelemetry import trace

        return trace.get_tracer("otel_bench").start_as_current_span("task")

    hold, began = Hold(), time.perf_counter()
    for _ in range(rounds):
        with task_span():
            with telemetry.Acquisition("bench", "while_executing", hold, spans) as acquisition:
                acquisition.taken = True
            with telemetry.Release("bench", "while_executing", hold, spans) as release:
                release.outcome = "released"
    return (time.perf_counter() - began) / rounds * 1e6


def hook_cost_elsewhere_us(setup: str, spans: str = "auto", in_task_span: bool = False) -> float:
    """``hook_cost_us`` in a fresh process after ``setup`` (Python)."""
    code = (
        f"{setup}; from otel_bench import hook_cost_us; "
        f"print(hook_cost_us(20_000, {spans!r}, {in_task_span!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, check=True)
    return float(done.stdout)


def noop(i: int) -> int:
    """The trivial task's body."""
    return i


def metrics_in_runs_us(url: str, rounds: int = 30, batch: int = 200) -> float:
    """What the SDK's metrics add to a run among a run's other work (µs): in this process, a
    LockedTask's ``apply()`` against the server at ``url``, in batches that alternate the
    package's instruments made by an SDK ``MeterProvider`` and by the API's no-op one; the
    median over ``rounds`` of the paired difference in CPU per run. A tight loop of the hooks
    (``hook_cost_us``) keeps the SDK's code and data in the CPU's caches: it says less."""
    from celery import Celery
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from celery_redislock import LockedTask, telemetry

    ways = {
        "sdk": telemetry.Instruments(MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("b")),
        "no-op": telemetry.Instruments(NoOpMeterProvider().get_meter("b")),
    }
    app = Celery("otel_bench", broker=url, set_as_current=False)
    app.conf.redislock_url = url
    task = app.task(base=LockedTask, name="otel_bench.noop", shared=False)(noop)
    kept, differences = telemetry._on, []
    try:
        for repeat in range(rounds + 1):  # the first round warms up
            cpu = {}
            for way in sorted(ways, reverse=repeat % 2 == 1):
                telemetry._on, began = ways[way], time.process_time()
                for i in range(batch):
                    task.apply((i,))
                cpu[way] = (time.process_time() - began) / batch * 1e6
            differences.append(cpu["sdk"] - cpu["no-op"])
    finally:
        telemetry._on = kept
        app.close()
    return statistics.median(differences[1:])


def run(way: str, tasks: int, concurrency: int, broker: Any, locks: Any) -> dict[str, Any]:
    """One task_bench run of LockedTask, its worker instrumented ``way`` (``WAYS``)."""
    from task_bench import run_once

    if way != "off":
        os.environ[SWITCH] = way
    try:
        return run_once("LockedTask", tasks, concurrency, broker, locks)
    finally:
        os.environ.pop(SWITCH, None)


def pool_cpu_of(row: dict[str, Any]) -> float:
    """The worker pool's CPU per task of a run (ms)."""
    return float(row["cpu_ms_per_task"]["worker pool"])


def wall_of(row: dict[str, Any]) -> float:
    """The wall time of a run (s)."""
    return float(row["wall_s"])


def paired_ratio(on: list[dict[str, Any]], off: list[dict[str, Any]], read: Any) -> float | None:
    """The median over the rounds of ``read(on) / read(off)``, each round's runs paired; ``None``
    if a run read 0: a pool's CPU under one clock tick of ``/proc`` (too few tasks to measure it)."""
    pairs = [(read(one), read(other)) for one, other in zip(on, off, strict=True)]
    if not all(one and other for one, other in pairs):
        return None
    return statistics.median(one / other for one, other in pairs)


def shown(ratio: float | None) -> str:
    """A ratio as printed; ``-``: not measured."""
    return f"{'-':>5}" if ratio is None else f"{ratio:.3f}"


def main(argv: list[str] | None = None) -> int:
    from lock_bench import run_header, write_json
    from task_bench import CLOCK_TICKS

    from celery_redislock.testing import RedisServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per run (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds: one run each way (default 5)")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork pool size (default 2)")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    args = parser.parse_args(argv)
    # by way ("off": the API, no provider), and without the API at all
    hooks = {
        "no API": hook_cost_elsewhere_us("import sys; sys.modules['opentelemetry'] = None"),
        "off": hook_cost_us(),
        **{
            way: hook_cost_elsewhere_us(
                f"import otel_bench; otel_bench.instrument({way!r})",
                SPANS.get(way, "auto"),
                in_task_span=way.startswith("celery"),
            )
            for way in WAYS[1:]
        },
    }
    print(
        "hooks per run, a tight loop: "
        + ", ".join(f"{cost:.1f}us ({where})" for where, cost in hooks.items())
    )
    load_before, started = os.getloadavg(), time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    with RedisServer() as broker, RedisServer() as locks:
        in_runs = metrics_in_runs_us(locks.url)
        print(f"the SDK's metrics among a run's other work (apply(), paired): +{in_runs:.1f}us a run")
        for repeat in range(args.repeats):
            for way in WAYS[repeat % len(WAYS) :] + WAYS[: repeat % len(WAYS)]:
                row = run(way, args.tasks, args.concurrency, broker, locks)
                runs[way].append(row)
                print(f"  round {repeat + 1}/{args.repeats} {way:<12} {row['wall_s']:.2f}s", flush=True)
    load_after = os.getloadavg()
    measures = (("pool_cpu", pool_cpu_of), ("wall", wall_of))
    ratios = {
        measure: {way: paired_ratio(runs[way], runs["off"], read) for way in WAYS[1:]}
        for measure, read in measures
    }
    to_base = {
        measure: {way: paired_ratio(runs[way], runs[base], read) for way, base in BASES.items()}
        for measure, read in measures
    }
    pool_cpu = {way: statistics.median(pool_cpu_of(row) for row in rows) for way, rows in runs.items()}
    print(f"\n{args.tasks} LockedTask tasks, prefork -c {args.concurrency}, {args.repeats} rounds")
    print(
        "  the median of the per-round ratios (target < 1.03) to off, then to the way each adds to:"
        " pool CPU, wall; pool CPU per task"
    )
    # the metrics' cost among a run's other work over off's pool CPU per task: less noise
    estimate = 1 + in_runs / (pool_cpu["off"] * 1000) if pool_cpu["off"] else None
    print(f"  off          {1:.3f}  {1:.3f}  {pool_cpu['off'] * 1000:.0f}us")
    for way in WAYS[1:]:
        cpu, wall = ratios["pool_cpu"][way], ratios["wall"][way]
        based = (
            f"; x {BASES[way]}: {shown(to_base['pool_cpu'][way])}  {shown(to_base['wall'][way])}"
            if way in BASES and BASES[way] != "off"
            else ""
        )
        print(f"  {way:<12} {shown(cpu)}  {shown(wall)}  {pool_cpu[way] * 1000:.0f}us{based}")
    print(f"  metrics, estimated: {shown(estimate)} (+{in_runs:.1f}us a run over off's pool CPU per task)")
    if estimate is None or None in ratios["pool_cpu"].values():
        print(
            f"  -: a run's pool CPU was under one clock tick ({1000 / CLOCK_TICKS:g} ms, what /proc counts):"
            f" too few tasks to measure it; give more --tasks than {args.tasks}"
        )
    print(f"  load average (1, 5, 15 min): before {load_before}, after {load_after}; {os.cpu_count()} CPUs")
    write_json(
        args.json,
        {
            **run_header(args),
            "duration_s": time.monotonic() - started,
            "ratio_to_off": ratios,
            "ratio_to_base": {"bases": BASES, **to_base},
            "hook_us_per_run": hooks,
            "metrics_in_runs_us": in_runs,
            "metrics_estimate_to_off": estimate,
            "pool_cpu_ms_per_task": pool_cpu,
            "load_average": {"before": load_before, "after": load_after},
            "runs": runs,
        },
    )
    print(f"results written to {args.json} ({time.monotonic() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
