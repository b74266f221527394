"""System calls per task in a pool child's work: a variant's task run through Celery's tracer.

``task_bench.py`` times a real worker, where the pool's CPU swings by more between runs than a
few system calls cost; system calls are counted exactly. This script runs a variant of
``task_bench.py`` (its ``make_app``) N times through Celery's tracer (``build_tracer``, what a
prefork pool child runs for each message) in one process, against two private redis-servers on
127.0.0.1 (broker and results; locks), each task with distinct arguments (no lock is ever
busy), after 50 warm-up tasks. Its request is that of a message sent by a plain
``apply_async``: the producer's side of the enqueue modes and of the peers is not run here.

    .venv/bin/python bench/tracer_run.py --syscalls LockedTask "bare lock" plain

starts the two servers, then runs each variant twice under ``strace -f -c`` (``--base`` and
``--base`` + ``--tasks`` tasks) and prints the difference per task, by system call: what the
tasks make in the process (its threads included, the servers not), start-up and shut-down
falling out. ``bench/tracer_run.py VARIANT N`` alone runs N tasks on servers of its own, for
other profilers (``py-spy record``, ``valgrind --tool=callgrind``). Needs strace for ``--syscalls``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: One row of ``strace -c``'s table: % time, seconds, usecs/call, calls, [errors,] syscall.
_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", re.M)
WARM_UP = 50


def run(variant: str, tasks: int, broker_url: str, lock_url: str) -> None:
    """Run ``tasks`` tasks of ``variant`` through Celery's tracer in this process."""
    sys.path.insert(0, str(HERE))
    import task_bench
    from celery.app.trace import build_tracer

    app, task = task_bench.make_app(variant, broker_url, lock_url, "tracer-run")
    app.finalize()
    trace = build_tracer(task.name, task, app=app, hostname="tracer-run@host")
    delivery = {"routing_key": "tracer-run", "exchange": "", "priority": 0, "redelivered": False}
    for i in range(-WARM_UP, tasks):
        task_id = str(uuid.uuid4())
        request = {
            "id": task_id,
            "task": task.name,
            "hostname": "tracer-run@host",
            "delivery_info": delivery,
            "retries": 0,
            "is_eager": False,
            "args": ("run", i),
            "kwargs": {},
        }
        trace(task_id, ("run", i), {}, request)
    app.close()


def syscalls(summary: str) -> dict[str, int]:
    """``strace -c``'s table as calls by system call (its ``total`` row left out)."""
    return {name: int(calls) for calls, name in _ROW.findall(summary) if name != "total"}


def per_task(small: dict[str, int], large: dict[str, int], tasks: int) -> dict[str, float]:
    """Calls per task by system call: the difference of two runs (``large`` had ``tasks`` more
    tasks), those that differ by at least one call in ten tasks, most first."""
    found = {name: (large.get(name, 0) - small.get(name, 0)) / tasks for name in {*small, *large}}
    return dict(sorted(((n, c) for n, c in found.items() if abs(c) >= 0.1), key=lambda item: -item[1]))


def counted(variant: str, tasks: int, urls: list[str]) -> dict[str, int]:
    """System calls of a run of ``tasks`` tasks of ``variant`` on the servers at ``urls`` (broker,
    locks): this script, under ``strace -f -c``."""
    with tempfile.TemporaryDirectory(prefix="tracer-run-") as folder:
        out = Path(folder, "strace.txt")
        this = [sys.executable, str(Path(__file__)), variant, str(tasks), *urls]
        subprocess.run(
            ["strace", "-f", "-c", "-o", str(out), *this], check=True, cwd=HERE, stdout=subprocess.DEVNULL
        )
        return syscalls(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="variants of task_bench.py, or VARIANT N [BROKER LOCKS]")
    parser.add_argument("--syscalls", action="store_true", help="count system calls per task under strace")
    parser.add_argument("--tasks", type=int, default=1000, help="tasks counted (default 1000)")
    parser.add_argument("--base", type=int, default=200, help="tasks of the smaller run (default 200)")
    args = parser.parse_args(argv)
    from celery_redislock.testing import RedisServer

    if args.syscalls and shutil.which("strace") is None:
        parser.error("strace is not on PATH (Debian: apt-get install strace)")
    if not args.syscalls and len(args.variants) not in (2, 4):
        parser.error("without --syscalls, give VARIANT N, or VARIANT N BROKER_URL LOCK_URL")
    if not args.syscalls and len(args.variants) == 4:
        variant, tasks, broker_url, lock_url = args.variants
        run(variant, int(tasks), broker_url, lock_url)
        return 0
    with RedisServer() as broker, RedisServer() as locks:
        urls = [broker.url, locks.url]
        if not args.syscalls:
            variant, tasks = args.variants
            run(variant, int(tasks), *urls)
            return 0
        for variant in args.variants:
            small, large = (counted(variant, n, urls) for n in (args.base, args.base + args.tasks))
            calls = per_task(small, large, args.tasks)
            listed = ", ".join(f"{name} {count:.1f}" for name, count in calls.items())
            print(f"{variant}: {sum(calls.values()):.1f} system calls per task ({listed})", flush=True)
            for server in (broker, locks):
                with server.client() as client:
                    client.flushall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
