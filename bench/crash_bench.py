"""Crash recovery: how soon after a kill the same task runs again; LockedTask, celery-once, celery-singleton.

Two private redis-servers: the broker and results on one, the locks on the
other. For each variant (each with its documented defaults, pointed at the
lock server) and each kind of kill:

1. start the worker that will be killed, ``celery -A crash_bench worker -P
   prefork -c 2`` on queue ``doomed`` (this file is the app module;
   ``CRASH_BENCH_*`` environment variables pick the variant), and, for a
   whole-worker kill, a second worker on queue ``survivor``;
2. send ``hold(x)``: the first run of ``x`` reports its pool child's pid and
   blocks;
3. kill the pool child running it (``child``: SIGKILL to that pid) or the whole
   worker (``worker``: SIGKILL to its process group, as the OOM killer of a
   container or a host's death would);
4. from the kill on, every ``--every`` seconds, send the duplicate ``hold(x)``
   as a user would (to ``doomed`` after a child kill, to ``survivor`` after a
   worker kill) until one runs (its body reports) or ``--cap`` seconds pass.
   A refused send (celery-once raises ``AlreadyQueued``, celery-singleton
   returns the running task's result) and a skipped run (``LockedTask``'s
   ``lock_busy="skip"``) count as not yet.

Reported: seconds from the kill to the duplicate's body starting, or more than
``--cap`` with the lock's TTL left then (``-1``: no expiry); and that time in
its parts, each from the kill:

* **Celery noticed**: the worker's main process reports the run lost (its
  ``task_failure`` signal with ``WorkerLostError``, timed there). Celery's, not
  the lock's: at once when the pool's check on the child's exit finds it gone,
  else at the pool's next periodic check, up to 5 s later. Nobody notices a
  whole worker's kill;
* **lock freed**: the first run's lock gone, or another run's (polled every
  20 ms); and **release after notice**, the difference: what the lock takes
  once Celery has reported the death (``LockedTask``'s main process releases
  then; the peers never do).

The rest, to the duplicate's start, is the wait for the next send (``--every``)
and its run. Results go to ``bench/results/crash_bench.json``. celery-once and
celery-singleton are installed from PyPI into this interpreter when missing.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from billiard.exceptions import WorkerLostError
from celery import Celery, Task, signals

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "crash_bench.json"
VARIANTS = ["LockedTask", "celery-once", "celery-singleton"]
KILLS = ["child", "worker"]
TASK_NAME = "crash_bench.hold"


def make_app(variant: str, broker_url: str, lock_url: str) -> tuple[Celery, Task[Any, Any]]:
    """The app with ``hold(x)``, of the variant's base class and its default settings."""
    app = Celery("crash_bench", broker=broker_url, backend=broker_url, set_as_current=False)
    app.conf.update(task_default_queue="doomed", broker_connection_retry_on_startup=True)
    if variant == "LockedTask":
        from celery_redislock import LockedTask

        base: type[Task[Any, Any]] = LockedTask
        app.conf.redislock_url = lock_url  # lock_ttl 30 s, lock_busy "skip"
    elif variant == "celery-once":
        from celery_once import QueueOnce  # type: ignore[import-not-found]

        base = QueueOnce
        app.conf.ONCE = {  # celery-once's README: the Redis backend, a one-hour default timeout
            "backend": "celery_once.backends.Redis",
            "settings": {"url": lock_url, "default_timeout": 60 * 60},
        }
    elif variant == "celery-singleton":
        from celery_singleton import Singleton  # type: ignore[import-not-found]

        base = Singleton
        app.conf.singleton_backend_url = lock_url  # no lock expiry by default
    else:
        raise ValueError(f"unknown variant {variant!r}")
    reports = redis.Redis.from_url(broker_url)

    @app.task(base=base, name=TASK_NAME, bind=True)
    def hold(self: Task[Any, Any], x: str) -> str:
        """Reports ``<pid> <monotonic time>``; the first run of ``x`` then blocks until killed."""
        reports.rpush(f"started:{x}", f"{os.getpid()} {time.monotonic():.6f}")
        if reports.set(f"first:{x}", 1, nx=True, ex=3600):
            reports.blpop([f"never:{x}"], timeout=3600)
        return x

    return app, hold


if os.environ.get("CRASH_BENCH_VARIANT"):  # imported by the worker
    app, _ = make_app(
        os.environ["CRASH_BENCH_VARIANT"], os.environ["CRASH_BENCH_BROKER"], os.environ["CRASH_BENCH_LOCKS"]
    )
    noticed_reports = redis.Redis.from_url(os.environ["CRASH_BENCH_BROKER"])

    @signals.task_failure.connect
    def noticed(args: Any, exception: BaseException, **_: Any) -> None:
        """In the worker's main process, Celery reports a run lost: when it noticed its child's death."""
        if isinstance(exception, WorkerLostError):
            noticed_reports.rpush(f"lost:{args[0]}", f"{time.monotonic():.6f}")


class Worker:
    """``celery -A crash_bench worker -P prefork -c 2`` in a session of its own, stopped by its pid."""

    def __init__(self, variant: str, broker_url: str, lock_url: str, queue: str) -> None:
        env = {
            **os.environ,
            "CRASH_BENCH_VARIANT": variant,
            "CRASH_BENCH_BROKER": broker_url,
            "CRASH_BENCH_LOCKS": lock_url,
        }
        command = [sys.executable, "-m", "celery", "-A", "crash_bench", "worker", "-P", "prefork", "-c", "2"]
        command += ["-Q", queue, "-n", f"{queue}-{uuid.uuid4().hex[:6]}@%h", "-l", "WARNING"]
        command += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        self.log = Path(tempfile.mkstemp(prefix="crash-bench-worker-", suffix=".log")[1])
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self) -> None:
        """SIGKILL the worker and its pool children (its session's process group is its pid)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.unlink(missing_ok=True)


def wait_until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling against a deadline
    return result


def ready(app: Celery, task: Task[Any, Any], queue: str, reports: redis.Redis) -> None:
    """Wait until a worker on ``queue`` runs tasks (a warm-up call of its own)."""
    x = f"warmup-{uuid.uuid4().hex}"
    reports.set(f"first:{x}", 1, ex=600)  # not blocking
    task.apply_async((x,), queue=queue).get(timeout=120)


def send_duplicate(variant: str, task: Task[Any, Any], x: str, queue: str, first_id: str) -> bool:
    """Send ``hold(x)`` once; whether it was sent (not refused at enqueue)."""
    try:
        result = task.apply_async((x,), queue=queue)
    except Exception as exc:  # celery-once: AlreadyQueued
        if type(exc).__name__ == "AlreadyQueued":
            return False
        raise
    return bool(result.id != first_id)  # celery-singleton returns the running task's result


def freed(lock_client: redis.Redis, first_locks: dict[bytes, bytes]) -> bool:
    """Whether none of ``first_locks`` (key: value) holds its value any longer."""
    now = lock_client.mget(list(first_locks))
    return all(value != held for value, held in zip(now, first_locks.values(), strict=True))


def run_once(variant: str, kill: str, broker: Any, locks: Any, cap: float, every: float) -> dict[str, Any]:
    app, task = make_app(variant, broker.url, locks.url)
    reports = redis.Redis.from_url(broker.url)
    lock_client = redis.Redis.from_url(locks.url)
    workers = [Worker(variant, broker.url, locks.url, "doomed")]
    if kill == "worker":
        workers.append(Worker(variant, broker.url, locks.url, "survivor"))
    try:
        ready(app, task, "doomed", reports)
        if kill == "worker":
            ready(app, task, "survivor", reports)
        x = uuid.uuid4().hex
        before = set(lock_client.keys())
        first = task.apply_async((x,), queue="doomed")
        child = int(wait_until(lambda: reports.lindex(f"started:{x}", 0), 60, "the first run").split()[0])
        first_locks = {key: lock_client.get(key) for key in set(lock_client.keys()) - before}
        if not first_locks:
            raise RuntimeError(f"{variant}: the first run holds no lock")
        killed_at = time.monotonic()
        if kill == "child":
            os.kill(child, signal.SIGKILL)
        else:
            workers[0].kill()
        queue = "doomed" if kill == "child" else "survivor"
        sends = refused = 0
        freed_at = ran_at = None
        while ran_at is None and time.monotonic() - killed_at < cap:
            if send_duplicate(variant, task, x, queue, first.id):
                sends += 1
            else:
                refused += 1
            deadline = time.monotonic() + every
            while ran_at is None and time.monotonic() < deadline:  # a duplicate sent earlier may start
                if freed_at is None and freed(lock_client, first_locks):
                    freed_at = time.monotonic()
                started = reports.lrange(f"started:{x}", 1, 1)
                if started:
                    ran_at = float(started[0].split()[1])
                else:
                    time.sleep(0.02)  # polling the lock and the report, between two sends
        lost = reports.lindex(f"lost:{x}", 0)  # timed by the worker's main process, if it noticed
        keys = [key for key in lock_client.scan_iter(match="*") if not key.startswith(b"_kombu")]
        ttls = {key.decode(): lock_client.pttl(key) for key in keys}  # ms; -1: no expiry
        return {
            "variant": variant,
            "kill": kill,
            "recovered_s": None if ran_at is None else ran_at - killed_at,
            "noticed_s": None if lost is None else float(lost) - killed_at,
            "lock_freed_s": None if freed_at is None else freed_at - killed_at,
            "cap_s": cap,
            "duplicate_sends": sends,
            "refused_sends": refused,
            "lock_ttls_left_ms": ttls,
        }
    finally:
        for worker in workers:
            worker.stop()
        reports.flushall()  # both servers are the benchmark's own
        lock_client.flushall()
        app.close()


def describe(row: dict[str, Any]) -> str:
    if row["recovered_s"] is not None:
        return f"{row['recovered_s']:.1f} s"
    ttls = [ttl for ttl in row["lock_ttls_left_ms"].values() if ttl != -2]
    left = ", ".join("no expiry" if ttl == -1 else f"{ttl / 1000:.0f} s left" for ttl in ttls) or "no lock"
    return f"> {row['cap_s']:.0f} s (lock: {left})"


def parts(row: dict[str, Any]) -> list[str]:
    """The time to the duplicate in its parts, from the kill: Celery noticed (``-``: nobody), the
    release after that, the lock freed, the duplicate running."""
    noticed, lock_freed = row["noticed_s"], row["lock_freed_s"]
    return [
        "-" if noticed is None else f"{noticed:.2f} s",
        "-" if noticed is None or lock_freed is None else f"{lock_freed - noticed:.2f} s",
        f"> {row['cap_s']:.0f} s" if lock_freed is None else f"{lock_freed:.2f} s",
        describe(row),
    ]


def main(argv: list[str] | None = None) -> int:
    from lock_bench import print_table, run_header, write_json
    from task_bench import ensure_peers

    from celery_redislock.testing import RedisServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cap", type=float, default=120.0, help="longest wait for the duplicate (default 120 s)"
    )
    parser.add_argument(
        "--every", type=float, default=0.5, help="seconds between duplicate sends (default 0.5)"
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--kills", nargs="+", choices=KILLS, default=KILLS)
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    args = parser.parse_args(argv)
    versions = ensure_peers()
    started = time.monotonic()
    rows = []
    with RedisServer() as broker, RedisServer() as locks:
        for variant in args.variants:
            for kill in args.kills:
                row = run_once(variant, kill, broker, locks, args.cap, args.every)
                rows.append(row)
                print(f"  {variant:<17} {kill:<6} kill -> duplicate running: {describe(row)}", flush=True)
    print_table(
        f"time from the kill to the duplicate running (sent every {args.every} s, cap {args.cap:.0f} s)",
        ["variant", *(f"{kill} killed" for kill in args.kills)],
        [
            [variant, *(describe(row) for row in rows if row["variant"] == variant)]
            for variant in args.variants
        ],
    )
    print_table(
        "in parts, from the kill: Celery noticed the death (its worker's main process reports the run lost;"
        " -: nobody did), the lock's release after that, the lock freed, the duplicate running",
        ["variant", "killed", "Celery noticed", "release after notice", "lock freed", "duplicate running"],
        [[row["variant"], row["kill"], *parts(row)] for row in rows],
    )
    write_json(
        args.json,
        {
            **run_header(args),
            "versions": versions,
            "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
            ).stdout.strip(),
            "duration_s": time.monotonic() - started,
            "rows": rows,
        },
    )
    print(f"results written to {args.json} ({time.monotonic() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
