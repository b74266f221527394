"""The cost of the OpenTelemetry instrumentation: task_bench's trivial-task benchmark, LockedTask
with the SDK's providers on against the same without, in one run.

Each round runs ``task_bench.run_once("LockedTask", ...)`` twice, the order alternating between
rounds: once as task_bench runs it (opentelemetry-api installed, no provider set: the hooks are
the API's proxies), once with ``TASK_BENCH_OTEL=1``, which makes the worker (its main process,
before the pool forks) set an SDK ``MeterProvider`` (an in-memory reader, read by nobody: every
measurement is aggregated, as for an exporter) and ``TracerProvider`` (a batch processor into an
in-memory exporter): every lock's metrics and its two spans are recorded. The headline is the
median over the rounds of the per-round wall ratio, instrumented over not (target < 1.03), and the
worker pool's CPU per task both ways; the load average is printed before and after. Results go to
``bench/results/otel_bench.json``.

Run: ``.venv/bin/python bench/otel_bench.py`` (``--tasks``, ``--repeats``; about 1 min at the
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
#: The environment variable that turns the SDK on in task_bench's worker.
SWITCH = "TASK_BENCH_OTEL"


def instrument() -> None:
    """Set the SDK's global providers, exporting to memory (the worker calls this when ``SWITCH`` is set)."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    trace.set_tracer_provider(tracer_provider)


def hook_cost_us(rounds: int = 100_000) -> float:
    """Microseconds per run spent in the hooks a run calls (``Acquisition``, ``Release``), with
    this process's providers (none is set here: the API's proxies, or no API at all)."""
    from celery_redislock import telemetry

    class Hold:  # what the hooks read of a held lock
        fence, taken_at = 1, 0.0

    hold, began = Hold(), time.perf_counter()
    for _ in range(rounds):
        with telemetry.Acquisition("bench", "while_executing", hold) as acquisition:
            acquisition.taken = True
        with telemetry.Release("bench", "while_executing", hold) as release:
            release.outcome = "released"
    return (time.perf_counter() - began) / rounds * 1e6


def hook_cost_without_the_api_us() -> float:
    """``hook_cost_us`` in a process where ``import opentelemetry`` fails, as without the extra."""
    code = "import sys; sys.modules['opentelemetry'] = None; from otel_bench import hook_cost_us; "
    code += "print(hook_cost_us())"
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, check=True)
    return float(done.stdout)


def run(on: bool, tasks: int, concurrency: int, broker: Any, locks: Any) -> dict[str, Any]:
    """One task_bench run of LockedTask, with the SDK ``on`` in its worker or not."""
    from task_bench import run_once

    if on:
        os.environ[SWITCH] = "1"
    try:
        return run_once("LockedTask", tasks, concurrency, broker, locks)
    finally:
        os.environ.pop(SWITCH, None)


def main(argv: list[str] | None = None) -> int:
    from lock_bench import run_header, write_json

    from celery_redislock.testing import RedisServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per run (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds: one run each way (default 5)")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork pool size (default 2)")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    args = parser.parse_args(argv)
    hooks = {"no API": hook_cost_without_the_api_us(), "API, no provider": hook_cost_us()}
    print("hooks per run: " + ", ".join(f"{cost:.2f}us ({where})" for where, cost in hooks.items()))
    load_before, started = os.getloadavg(), time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with RedisServer() as broker, RedisServer() as locks:
        for repeat in range(args.repeats):
            for way in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
                row = run(way == "on", args.tasks, args.concurrency, broker, locks)
                runs[way].append(row)
                print(f"  round {repeat + 1}/{args.repeats} SDK {way:<3} {row['wall_s']:.2f}s", flush=True)
    load_after = os.getloadavg()
    pairs = zip(runs["on"], runs["off"], strict=True)
    ratio = statistics.median(on["wall_s"] / off["wall_s"] for on, off in pairs)
    pool_cpu = {
        way: statistics.median(row["cpu_ms_per_task"]["worker pool"] for row in rows)
        for way, rows in runs.items()
    }
    print(f"\n{args.tasks} LockedTask tasks, prefork -c {args.concurrency}, {args.repeats} rounds")
    print(f"  instrumented x uninstrumented (median of the per-round wall ratios): {ratio:.3f} (< 1.03)")
    print(f"  worker pool CPU per task: {pool_cpu['off'] * 1000:.0f}us off, {pool_cpu['on'] * 1000:.0f}us on")
    print(f"  load average (1, 5, 15 min): before {load_before}, after {load_after}; {os.cpu_count()} CPUs")
    write_json(
        args.json,
        {
            **run_header(args),
            "duration_s": time.monotonic() - started,
            "ratio_on_to_off": ratio,
            "hook_us_per_run": hooks,
            "pool_cpu_ms_per_task": pool_cpu,
            "load_average": {"before": load_before, "after": load_after},
            "runs": runs,
        },
    )
    print(f"results written to {args.json} ({time.monotonic() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
