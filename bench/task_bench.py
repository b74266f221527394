"""Benchmark LockedTask against a plain task, celery-once and celery-singleton in a real prefork worker.

Two private redis-servers: one is the broker and result backend, the other
holds only the locks, so its counters see lock traffic and nothing else.

For each variant, in every repeat (the order alternates between repeats):

1. start ``celery -A task_bench worker -P prefork -c 2`` (this file is the app
   module; ``TASK_BENCH_*`` environment variables pick the variant) on a fresh
   queue, logging at WARNING, and wait until it has run a few warm-up tasks
   (so both pool children have imported, connected and loaded their scripts);
2. enqueue N trivial tasks (``noop(run, i)``: distinct arguments, so no lock
   is ever busy) from this process and wait for all N results;
3. stop the worker by its pid (SIGTERM, warm shutdown) and empty both servers.

Variants, each configured with its own documented defaults and pointed at the
lock server: ``plain`` (``celery.Task``); ``bare lock`` (a plain task whose
body takes and frees a lock with lock_bench's bare loop, ``SET NX PX`` and an
``EVALSHA`` compare-and-delete: the floor for two round trips per task from
redis-py in the worker); ``LockedTask`` (``while_executing``,
``redislock_url``); ``celery-once`` (``QueueOnce`` with the README's ``ONCE``
setting: lock taken at enqueue, released after the run); ``celery-singleton``
(``Singleton`` with ``singleton_backend_url``: lock taken at enqueue, released
on success). The peers are installed from PyPI into this interpreter when
missing.

Measured per run:

* **wall**: from just before the first ``apply_async`` to the arrival of the
  last result, in this process. This is the headline: the peers lock in the
  producer, LockedTask in the worker, and only an end-to-end time charges both
  sides (producer and worker share the machine's CPUs, as they would on one host);
* **worker span**: from the first to the last ``date_done`` stored in the
  result backend (the worker side alone, for information);
* **round trips per task** to the lock server: the growth of its
  ``total_reads_processed`` (INFO stats: read events on client connections,
  one per request a client sends and then waits on) over the measured phase,
  minus this process's own INFO and DBSIZE calls, divided by N. Total commands
  (INFO commandstats) are not round trips here: Redis counts the commands a
  Lua script runs as commands too, so they are reported separately, per
  command, as ``commands_per_task``;
* **CPU ms per task** of the worker's main process and its pool children
  (``/proc``), this process (the producer) and each redis-server (INFO cpu):
  the run is CPU-bound on a small machine, and these say where a variant adds
  its cost, more steadily than the wall times.

Each repeat is a round: one run per variant, the order alternating between
rounds. The headline is the **paired ratio to plain**: each run's wall over
plain's run in the same round, the median over the rounds (at least 7 by
default), so both runs of a pair saw the same background load. Next to it,
**lock CPU µs per task**: the worker pool's and the producer's CPU less plain's
in the same round, plus the lock server's (median over the rounds); **all CPU
µs per task**: the same difference summed over every place, the worker's main
process and the broker's server included (where a design moves lock work, e.g.
into the main process, this is the figure that still sees it); round trips and
lock-server commands per task. Everything is printed and written to
``bench/results/task_bench.json`` (versions, machine, commit; paths relative to
the repository) with a PASS/FAIL summary against the issue's targets, as ratios
within the run (LockedTask at or below the best peer's ratio and lock CPU, <= 2
round trips per task; until_executed <= 1.03x the best peer; a refused
duplicate <= 1 round trip); the exit status stays 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from celery import Celery, Task
from celery.result import ResultSet

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "task_bench.json"
VARIANTS = ["plain", "bare lock", "LockedTask", "until_executed", "celery-once", "celery-singleton"]
#: The variants that de-duplicate at enqueue, measured refusing duplicates too.
DEDUPLICATING = ["until_executed", "celery-once", "celery-singleton"]
#: PyPI distribution -> module it provides.
PEERS = {"celery-once": "celery_once", "celery-singleton": "celery_singleton"}
TASK_NAME = "task_bench.noop"
WARMUP = 20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CPU_PLACES = ("worker main", "worker pool", "producer", "lock server", "broker server")


# -- the Celery app (also the worker's: ``celery -A task_bench``) -------------------


def make_app(variant: str, broker_url: str, lock_url: str, queue: str) -> tuple[Celery, Task[Any, Any]]:
    """An app with one task, ``noop``, of the variant's base class; only that variant's settings."""
    app = Celery("task_bench", broker=broker_url, backend=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=True)
    base: type[Task[Any, Any]] = Task
    options: dict[str, Any] = {}
    if variant in ("LockedTask", "until_executed"):
        from celery_redislock import LockedTask

        base = LockedTask
        app.conf.redislock_url = lock_url
        if variant == "until_executed":
            options["lock_mode"] = "until_executed"
    elif variant == "celery-once":
        from celery_once import QueueOnce  # type: ignore[import-not-found]

        base = QueueOnce
        # celery-once's README: the Redis backend and a one-hour default timeout.
        app.conf.ONCE = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": lock_url, "default_timeout": 60 * 60},
        }
    elif variant == "celery-singleton":
        from celery_singleton import Singleton  # type: ignore[import-not-found]

        base = Singleton
        app.conf.singleton_backend_url = lock_url
    elif variant == "bare lock":
        return app, bare_lock_task(app, lock_url)
    elif variant != "plain":
        raise ValueError(f"unknown variant {variant!r}")

    @app.task(base=base, name=TASK_NAME, **options)
    def noop(run: str, i: int) -> int:
        return i

    return app, noop


def bare_lock_task(app: Celery, lock_url: str) -> Task[Any, Any]:
    """A plain task locking its body with the least a lock needs: lock_bench's bare loop
    (``SET key token NX PX 30000``, then ``EVALSHA`` of a compare-and-delete), 2 round trips."""
    import redis
    from lock_bench import COMPARE_AND_DELETE

    client = redis.Redis.from_url(lock_url)  # redis-py reconnects in each pool child after fork
    release = client.register_script(COMPARE_AND_DELETE)

    @app.task(name=TASK_NAME)
    def noop(run: str, i: int) -> int:
        key, token = f"bare:{TASK_NAME}:{run}:{i}", secrets.token_hex(16)
        if not client.set(key, token, nx=True, px=30000):
            return -1
        try:
            return i
        finally:
            release(keys=[key], args=[token])

    return cast(Task[Any, Any], noop)


def profile_children(folder: Path) -> None:
    """Each pool child of this worker runs under cProfile from its start, timed by its CPU time
    (waits for replies do not count: the figures say where its CPU goes), and writes its profile
    to ``folder/<pid>.prof`` when it shuts down (a warm shutdown)."""
    import cProfile

    from celery import signals

    profiler = cProfile.Profile(time.process_time)

    @signals.worker_process_init.connect(weak=False)
    def start(**_: Any) -> None:
        profiler.enable()

    @signals.worker_process_shutdown.connect(weak=False)
    def write(**_: Any) -> None:
        profiler.disable()
        profiler.dump_stats(folder / f"{os.getpid()}.prof")


if os.environ.get("TASK_BENCH_VARIANT"):  # imported by the worker
    app, _ = make_app(
        os.environ["TASK_BENCH_VARIANT"],
        os.environ["TASK_BENCH_BROKER"],
        os.environ["TASK_BENCH_LOCKS"],
        os.environ["TASK_BENCH_QUEUE"],
    )
    if os.environ.get("TASK_BENCH_PROFILE"):  # --profile: each pool child profiles itself
        profile_children(Path(os.environ["TASK_BENCH_PROFILE"]))
    if os.environ.get("TASK_BENCH_OTEL"):  # bench/otel_bench.py: OpenTelemetry's SDK on, before the fork
        from otel_bench import instrument

        app.conf.update(instrument(os.environ["TASK_BENCH_OTEL"]))


# -- one run ---------------------------------------------------------------------


class Worker:
    """``celery -A task_bench worker -P prefork`` in a session of its own, stopped by its pid;
    ``wrapper``: a command that runs it (``instructions_bench.py``'s callgrind)."""

    def __init__(
        self,
        variant: str,
        broker_url: str,
        lock_url: str,
        queue: str,
        concurrency: int,
        wrapper: Sequence[str] = (),
    ) -> None:
        env = {
            **os.environ,
            "TASK_BENCH_VARIANT": variant,
            "TASK_BENCH_BROKER": broker_url,
            "TASK_BENCH_LOCKS": lock_url,
            "TASK_BENCH_QUEUE": queue,
        }
        command = [*wrapper, sys.executable, "-m", "celery", "-A", "task_bench", "worker", "-P", "prefork"]
        command += ["-c", str(concurrency), "-Q", queue, "-n", f"{queue}@%h", "-l", "WARNING"]
        command += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        self.log = Path(tempfile.mkstemp(prefix="task-bench-worker-", suffix=".log")[1])
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self, timeout: float = 30) -> None:
        """A warm shutdown (SIGTERM), killed with its pool after ``timeout`` seconds."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the group is its pid
                self.process.wait(timeout=30)
        self.log.unlink(missing_ok=True)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def tree_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by process ``pid`` and by its children (the pool)."""
    main = pool = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        used = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        if stat.parent.name == str(pid):
            main += used
        elif fields[1] == str(pid):  # its parent
            pool += used
    return main, pool


def server_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def lock_stats(client: Any) -> tuple[int, dict[str, int]]:
    """(total_reads_processed, calls per command) of the lock server, in one INFO call (``all``:
    Redis 6.2 takes one section name per call, and ``all`` holds both stats and commandstats)."""
    info = client.info("all")
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in info.items() if k.startswith("cmdstat_")}
    return int(info["total_reads_processed"]), calls


def cpu_now(worker: Worker, lock_client: Any, broker_client: Any) -> dict[str, float]:
    main, pool = tree_cpu(worker.process.pid)
    return {
        "worker main": main,
        "worker pool": pool,
        "producer": time.process_time(),
        "lock server": server_cpu(lock_client),
        "broker server": server_cpu(broker_client),
    }


def run_once(variant: str, tasks: int, concurrency: int, broker: Any, locks: Any) -> dict[str, Any]:
    run = secrets.token_hex(4)
    queue = f"task-bench-{variant}-{run}"
    broker_url, lock_url = broker.url, locks.url
    app, noop = make_app(variant, broker_url, lock_url, queue)
    worker = Worker(variant, broker_url, lock_url, queue, concurrency)
    try:
        warm = [noop.apply_async((run, -1 - i)) for i in range(WARMUP)]
        try:
            ResultSet(warm).get(timeout=60)
        except Exception as exc:
            log = worker.tail()
            raise RuntimeError(f"{variant}: worker not ready ({exc!r}); its log ends with:\n{log}") from exc
        with locks.client() as lock_client, broker.client() as broker_client:
            reads_before, calls_before = lock_stats(lock_client)
            cpu_before = cpu_now(worker, lock_client, broker_client)
            began = time.perf_counter()
            results = [noop.apply_async((run, i)) for i in range(tasks)]
            enqueued = time.perf_counter()
            values = ResultSet(results).get(timeout=600)
            ended = time.perf_counter()
            if values != list(range(tasks)):
                raise RuntimeError(f"{variant}: wrong results")
            # The peers release after storing the result: wait (a few ms) until the last release is in.
            polls, deadline = 0, time.monotonic() + 10
            while lock_client.dbsize() and time.monotonic() < deadline:
                polls += 1
                time.sleep(0.005)
            keys_left = lock_client.dbsize()
            cpu_after = cpu_now(worker, lock_client, broker_client)
            reads_after, calls_after = lock_stats(lock_client)
            metas = broker_client.mget([f"celery-task-meta-{r.id}" for r in results])
            done = sorted(datetime.fromisoformat(json.loads(m)["date_done"]).timestamp() for m in metas)
        app.close()
    finally:
        worker.stop()
    for server in (broker, locks):
        with server.client() as client:
            client.flushall()
    ignored = {"info", "dbsize"}  # this process's own
    commands = {
        name: (calls - calls_before.get(name, 0)) / tasks
        for name, calls in sorted(calls_after.items())
        if name not in ignored and calls != calls_before.get(name, 0)
    }
    return {
        "wall_s": ended - began,
        "enqueue_s": enqueued - began,
        "worker_span_s": done[-1] - done[0],
        "tasks_per_s": tasks / (ended - began),
        # minus this process's own reads: the polls, the two dbsize and INFO cpu calls, the last INFO
        "round_trips_per_task": (reads_after - reads_before - polls - 5) / tasks,
        "cpu_ms_per_task": {
            where: (cpu_after[where] - cpu_before[where]) * 1000 / tasks for where in CPU_PLACES
        },
        "commands_per_task": commands,
        "server_commands_per_task": sum(commands.values()),
        "lock_keys_left": keys_left,
    }


def refused_duplicates(variant: str, calls: int, broker: Any, locks: Any) -> dict[str, float]:
    """Enqueue ``noop(run, 0)`` on a queue no worker consumes, then ``calls`` duplicates of it:
    what refusing one costs the producer, in lock-server round trips, CPU and time."""
    run = secrets.token_hex(4)
    queue = f"task-bench-duplicates-{variant}-{run}"
    app, noop = make_app(variant, broker.url, locks.url, queue)
    first = noop.apply_async((run, 0))
    refused = 0
    with locks.client() as lock_client, broker.client() as broker_client:
        reads_before, _ = lock_stats(lock_client)
        cpu_before, began = time.process_time(), time.perf_counter()
        for _ in range(calls):
            try:
                duplicate = noop.apply_async((run, 0))
            except Exception as exc:  # celery-once raises AlreadyQueued; the others return the first's result
                if type(exc).__name__ != "AlreadyQueued":
                    raise
                refused += 1
            else:
                refused += duplicate.id == first.id
        cpu_used, took = time.process_time() - cpu_before, time.perf_counter() - began
        reads_after, _ = lock_stats(lock_client)
        published = broker_client.llen(queue)
    app.close()
    for server in (broker, locks):
        with server.client() as client:
            client.flushall()
    if refused != calls or published != 1:
        raise RuntimeError(f"{variant}: {refused} of {calls} duplicates refused, {published} messages queued")
    return {
        "round_trips": (reads_after - reads_before - 1) / calls,  # minus the second INFO
        "producer_cpu_us": cpu_used * 1e6 / calls,
        "wall_us": took * 1e6 / calls,
    }


# -- main ------------------------------------------------------------------------


def ensure_peers() -> dict[str, str]:
    """Install the PyPI peers that cannot be imported; returns distribution -> version."""
    missing = [dist for dist, module in PEERS.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(f"installing {', '.join(missing)} from PyPI ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)
        importlib.invalidate_caches()
    dists = [*PEERS, "celery", "kombu", "billiard", "redis", "celery-redislock"]
    return {dist: importlib.metadata.version(dist) for dist in dists}


def _beyond_plain_ms(run: dict[str, Any], plain: dict[str, Any], places: Sequence[str]) -> float:
    """CPU ms per task that ``run`` spent in ``places`` beyond ``plain``'s run in the same round."""
    cpu, base = run["cpu_ms_per_task"], plain["cpu_ms_per_task"]
    return sum(cpu[where] - base[where] for where in places)


def lock_cpu_us(run: dict[str, Any], plain: dict[str, Any]) -> float:
    """Lock CPU per task in µs of ``run``: its worker pool and producer less those of ``plain``'s
    run in the same round, plus the lock server's."""
    client = _beyond_plain_ms(run, plain, ("worker pool", "producer"))
    return (client + run["cpu_ms_per_task"]["lock server"]) * 1000


def all_cpu_us(run: dict[str, Any], plain: dict[str, Any]) -> float:
    """CPU per task in µs that ``run`` spent beyond ``plain``'s run in the same round, summed over
    every place (``CPU_PLACES``: the worker's main process and both servers too)."""
    return _beyond_plain_ms(run, plain, CPU_PLACES) * 1000


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians over the repeats; ``paired_ratio_to_plain``, ``lock_cpu_us_per_task`` and
    ``all_cpu_us_per_task`` are medians of per-round figures, each run paired with plain's run of
    the same round."""
    plain_runs = runs.get("plain") or []
    plain_wall = statistics.median(r["wall_s"] for r in plain_runs) if plain_runs else None
    summary: dict[str, dict[str, Any]] = {}
    for variant, rows in runs.items():
        row = {
            key: statistics.median(r[key] for r in rows)
            for key in ("wall_s", "enqueue_s", "worker_span_s", "tasks_per_s", "round_trips_per_task")
        }
        row["wall_ratio_to_plain"] = row["wall_s"] / plain_wall if plain_wall else None
        pairs = list(zip(rows, plain_runs, strict=True)) if plain_runs else []
        row["paired_ratios_to_plain"] = [run["wall_s"] / plain["wall_s"] for run, plain in pairs]
        row["paired_ratio_to_plain"] = statistics.median(row["paired_ratios_to_plain"]) if pairs else None
        for figure, per_round in (("lock_cpu_us_per_task", lock_cpu_us), ("all_cpu_us_per_task", all_cpu_us)):
            row[figure] = statistics.median(per_round(run, plain) for run, plain in pairs) if pairs else None
        row["server_commands_per_task"] = statistics.median(
            r.get("server_commands_per_task", sum(r["commands_per_task"].values())) for r in rows
        )
        row["cpu_ms_per_task"] = {
            where: statistics.median(r["cpu_ms_per_task"][where] for r in rows)
            for where in rows[0]["cpu_ms_per_task"]
        }
        row["walls_s"] = [r["wall_s"] for r in rows]
        row["commands_per_task"] = rows[-1]["commands_per_task"]
        row["lock_keys_left"] = max(r["lock_keys_left"] for r in rows)
        summary[variant] = row
    return summary


PEER_VARIANTS = ("celery-once", "celery-singleton")


def checks(summary: dict[str, dict[str, Any]], duplicates: dict[str, dict[str, float]]) -> list[Any]:
    """The issue's targets, as ratios within this run: ``LockedTask`` (while_executing) at or
    below the best peer's paired ratio to plain and lock CPU, <= 2 round trips per task;
    ``until_executed`` <= 1.03x the best peer; a refused duplicate <= 1 round trip."""
    from lock_bench import Check

    peers = [summary[peer] for peer in PEER_VARIANTS if peer in summary]
    best_ratio = min((peer["paired_ratio_to_plain"] for peer in peers), default=None)
    best_cpu = min((peer["lock_cpu_us_per_task"] for peer in peers), default=None)
    found = []
    if "LockedTask" in summary:
        locked = summary["LockedTask"]
        if best_ratio is not None and best_cpu is not None:
            found += [
                Check(
                    "LockedTask x plain / best peer's", locked["paired_ratio_to_plain"] / best_ratio, "<= 1"
                ),
                Check(
                    "LockedTask lock CPU us/task - best peer's",
                    locked["lock_cpu_us_per_task"] - best_cpu,
                    "<= 0",
                    "{:.0f}",
                ),
            ]
        found += [
            Check("LockedTask round trips per task", locked["round_trips_per_task"], "<= 2", "{:.2f}"),
            Check("LockedTask lock keys left", locked["lock_keys_left"], "== 0", "{:.0f}"),
        ]
    if "until_executed" in summary:
        until = summary["until_executed"]
        if best_ratio is not None:
            found.append(
                Check(
                    "until_executed x plain / best peer's",
                    until["paired_ratio_to_plain"] / best_ratio,
                    "<= 1.03",
                )
            )
        found.append(Check("until_executed lock keys left", until["lock_keys_left"], "== 0", "{:.0f}"))
    for variant, row in duplicates.items():
        target = "<= 1" if variant == "until_executed" else ""
        found.append(
            Check(f"{variant} round trips per refused duplicate", row["round_trips"], target, "{:.2f}")
        )
    for variant, row in summary.items():
        if variant != "plain":
            found += [
                Check(f"{variant} x plain (paired median)", row["paired_ratio_to_plain"], ""),
                Check(f"{variant} lock CPU us/task", row["lock_cpu_us_per_task"], "", "{:.0f}"),
                Check(f"{variant} all CPU us/task", row["all_cpu_us_per_task"], "", "{:.0f}"),
            ]
    return found


def profile(variants: list[str], tasks: int, concurrency: int, lines: int) -> None:
    """One run of each of ``variants`` with its pool children profiled: the top ``lines`` functions
    of their merged profile by own time, then by cumulative time."""
    import pstats

    from celery_redislock.testing import RedisServer

    print(f"load average at start: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    with RedisServer() as broker, RedisServer() as locks:
        for variant in variants:
            with tempfile.TemporaryDirectory(prefix="task-bench-profile-") as folder:
                os.environ["TASK_BENCH_PROFILE"] = folder
                try:
                    row = run_once(variant, tasks, concurrency, broker, locks)
                finally:
                    del os.environ["TASK_BENCH_PROFILE"]
                files = sorted(str(path) for path in Path(folder).glob("*.prof"))
                if not files:
                    raise RuntimeError(f"{variant}: no pool child wrote its profile")
                print(f"\n== {variant}: {tasks} tasks under cProfile, wall {row['wall_s']:.2f}s")
                stats = pstats.Stats(*files).strip_dirs()  # no absolute paths in what people paste
                for order in ("tottime", "cumulative"):
                    stats.sort_stats(order).print_stats(lines)


def main(argv: list[str] | None = None) -> int:
    from lock_bench import (  # the producer's helpers only
        print_summary,
        print_table,
        run_header,
        write_json,
    )

    from celery_redislock.testing import RedisServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per run (default 2000)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds: one run per variant each (default 7)")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork pool size (default 2)")
    parser.add_argument(
        "--duplicates", type=int, default=500, help="refused duplicates per run and variant (default 500)"
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    parser.add_argument(
        "--profile",
        type=int,
        metavar="LINES",
        help="instead: one run per variant with the pool children under cProfile; print the top LINES",
    )
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.variants, args.tasks, args.concurrency, args.profile)
        return 0
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")
    versions = ensure_peers()
    started = time.monotonic()
    load_at_start = list(os.getloadavg())
    print(f"load average at start: {' '.join(f'{load:.2f}' for load in load_at_start)}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in args.variants}
    with RedisServer() as broker, RedisServer() as locks:
        servers = {"broker and results": broker.url, "locks": locks.url}
        print(f"broker/results on {broker.url}, locks on {locks.url}", flush=True)
        for repeat in range(args.repeats):
            order = args.variants if repeat % 2 == 0 else args.variants[::-1]
            for variant in order:
                row = run_once(variant, args.tasks, args.concurrency, broker, locks)
                runs[variant].append(row)
                print(
                    f"  repeat {repeat + 1}/{args.repeats} {variant:<17} wall {row['wall_s']:.2f}s "
                    f"(enqueue {row['enqueue_s']:.2f}s, worker span {row['worker_span_s']:.2f}s), "
                    f"{row['round_trips_per_task']:.2f} round trips/task",
                    flush=True,
                )
        duplicate_runs = {
            variant: [
                refused_duplicates(variant, args.duplicates, broker, locks) for _ in range(args.repeats)
            ]
            for variant in DEDUPLICATING
            if variant in args.variants
        }
    duplicates = {
        variant: {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        for variant, rows in duplicate_runs.items()
    }
    summary = summarize(runs)
    print_table(
        f"{args.tasks} tasks, prefork -c {args.concurrency}, {args.repeats} rounds (order alternating): "
        "x plain = median of the per-round wall ratios to plain's run of the same round",
        ["variant", "x plain", "lock CPU us/task", "all CPU us/task", "lock RT/task", "server cmds/task"],
        [
            [
                variant,
                f"{row['paired_ratio_to_plain']:.3f}",
                f"{row['lock_cpu_us_per_task']:.0f}",
                f"{row['all_cpu_us_per_task']:.0f}",
                f"{row['round_trips_per_task']:.2f}",
                f"{row['server_commands_per_task']:.2f}",
            ]
            for variant, row in summary.items()
        ],
    )
    print(
        "  (lock CPU: worker pool + producer CPU less plain's in the same round, plus the lock server's;"
        " all CPU: every place's less plain's; RT: round trips)"
    )
    print_table(
        f"{args.tasks} tasks, prefork -c {args.concurrency}, medians of {args.repeats} runs "
        "(CPU: ms per task of the worker's main process, its pool, this producer, each redis-server)",
        ["variant", "wall", "tasks/s", "enqueue", "worker span", "lock RT/task"]
        + [f"{where.replace('server', 'srv')} CPU" for where in CPU_PLACES],
        [
            [
                variant,
                f"{row['wall_s']:.2f}s",
                f"{row['tasks_per_s']:.0f}",
                f"{row['enqueue_s']:.2f}s",
                f"{row['worker_span_s']:.2f}s",
                f"{row['round_trips_per_task']:.2f}",
                *(f"{row['cpu_ms_per_task'][where]:.2f}" for where in CPU_PLACES),
            ]
            for variant, row in summary.items()
        ],
    )
    print_table(
        f"a refused duplicate enqueue (one task queued, {args.duplicates} duplicates of it, "
        f"medians of {args.repeats} runs)",
        ["variant", "lock RT", "producer CPU", "wall"],
        [
            [
                variant,
                f"{row['round_trips']:.2f}",
                f"{row['producer_cpu_us']:.0f}us",
                f"{row['wall_us']:.0f}us",
            ]
            for variant, row in duplicates.items()
        ],
    )
    found = checks(summary, duplicates)
    print("\nlock server commands per task (those Lua scripts run included)")
    for variant, row in summary.items():
        print(f"  {variant}: " + (" ".join(f"{k}={v:g}" for k, v in row["commands_per_task"].items()) or "-"))
    print_summary(found)
    write_json(
        args.json,
        {
            **run_header(args),
            "load_average_at_start": load_at_start,
            "servers": servers,
            "versions": versions,
            "duration_s": time.monotonic() - started,
            "summary": summary,
            "refused_duplicates": duplicates,
            "runs": runs,
            "duplicate_runs": duplicate_runs,
            "checks": [check.line() for check in found],
        },
    )
    print(f"load average at the end: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    print(f"results written to {args.json} ({time.monotonic() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
