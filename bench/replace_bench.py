"""A replacing storm: ``apply_async`` calls/s with ``lock_duplicate="replace"`` against refused ones.

Starts a private redis-server on 127.0.0.1 (``celery_redislock.testing.RedisServer``,
stopped at the end), the broker and the locks both on it, no worker. For each
variant, ``--threads`` threads send ``--calls`` calls of one signature between
them as fast as they can (``until_executing``, keyed by its first argument):

* ``replace``: every call takes the enqueue lock over (one ``REPLACE`` script) and
  is sent: a script and a publish per call;
* ``refused``: ``lock_duplicate="return"``: the first call is sent, the others find
  the lock held and send nothing: one failed acquire per call.

Prints calls/s for each, the ratio, and the load average (1 minute) before and after.
The queue is purged and the superseded marks deleted between variants; the server goes
at the end.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_redislock import LockedTask
from celery_redislock.testing import RedisServer

RESULTS = Path(__file__).resolve().parent / "results" / "replace_bench.json"


def echo(key: str, call: int) -> int:
    return call


def make_app(url: str) -> Celery:
    app = Celery("replace_bench", broker=url, set_as_current=False)
    app.conf.update(redislock_url=url, redislock_prefix="bench", task_default_queue="bench")
    for duplicate in ("replace", "return"):
        register: Any = app.task(
            name=f"bench.{duplicate}",
            base=LockedTask,
            lock_mode="until_executing",
            lock_duplicate=duplicate,
            lock_on=("key",),
        )
        register(echo)
    return app


def storm(app: Celery, name: str, calls: int, threads: int) -> float:
    """Calls/s of ``calls`` calls of ``name`` from ``threads`` threads, all of one key (thread
    ``k`` sends calls ``k``, ``k + threads``...: every call, however few)."""
    task = app.tasks[name]
    start = threading.Barrier(threads + 1)

    def send(first: int) -> None:
        start.wait()
        for call in range(first, calls, threads):
            task.apply_async(("one", call))

    workers = [threading.Thread(target=send, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    return calls / (time.perf_counter() - began)


def main() -> None:
    from lock_bench import run_header, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    args = parser.parse_args()
    with RedisServer() as server:
        app = make_app(server.url)
        client = server.client()
        load_before = os.getloadavg()[0]
        rates = {}
        for variant, name in (("replace", "bench.replace"), ("refused", "bench.return")):
            storm(app, name, args.threads * 50, args.threads)  # warm up: connections, scripts
            client.flushdb()  # our own server: nothing else is on it
            rates[variant] = storm(app, name, args.calls, args.threads)
            client.flushdb()
        load_after = os.getloadavg()[0]
        client.close()
        app.close()
    summary = {
        **run_header(args),
        "replace_calls_per_s": round(rates["replace"]),
        "refused_calls_per_s": round(rates["refused"]),
        "replace_vs_refused": round(rates["replace"] / rates["refused"], 3),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": load_after,
    }
    print(f"{args.calls} calls of one signature from {args.threads} threads (until_executing):")
    print(f"  replace (each takes the lock over and is sent): {summary['replace_calls_per_s']:>8} calls/s")
    print(f"  refused (lock_duplicate='return', nothing sent): {summary['refused_calls_per_s']:>7} calls/s")
    ratio = summary["replace_vs_refused"]
    print(f"  ratio {ratio}; load average (1 min) {load_before:.2f} -> {load_after:.2f}")
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
