"""Benchmark RedisSemaphore against a bare SET NX PX loop, on a private Redis.

* **uncontended**: one process, acquire+release pairs of a semaphore nobody
  else uses, in rotating rounds, best round counts (``lock_bench``'s
  ``time_pairs``), against ``lock_bench``'s bare loop (``SET key token NX PX``
  plus a compare-and-delete script). Pairs/s, round trips per pair, ratio.
* **contention**: P forked processes (32) on one semaphore of ``--limit``
  permits, each looping acquire (blocking) / hold 1 ms / release for a fixed
  wall time, started together by a barrier, against the bare semaphore: a
  loop trying ``SET NX PX`` on each of the ``--limit`` slot keys, sleeping
  1 ms when none is free (polling: what the semaphore's wake-ups replace).
  Critical sections/s, round trips per acquisition, p50/p99 wait, ratios.

Round trips are counted client-side by ``lock_bench.CountingConnection``; the
contention run is ``lock_bench``'s, with this benchmark's contenders.
Run ``python bench/semaphore_bench.py --help`` for the options; it prints its
results and the load average (the machine may be shared) and writes nothing.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import time
from typing import Any

import lock_bench
import redis
from lock_bench import COMPARE_AND_DELETE, Pair, counting_client, time_pairs, uncontended_pair

from celery_redislock import RedisSemaphore
from celery_redislock.testing import RedisServer

UNCONTENDED = ["bare", "RedisSemaphore", "RedisSemaphore watchdog=False"]
CONTENDED = ["bare", "RedisSemaphore fair=False", "RedisSemaphore fair=True"]


def uncontended(url: str, prefix: str, seconds: float, rounds: int) -> dict[str, dict[str, float]]:
    client = counting_client(url)
    admin = redis.Redis.from_url(url)
    pairs: dict[str, Pair] = {"bare": uncontended_pair("bare", client, f"{prefix}u:bare")}
    for name in UNCONTENDED[1:]:
        semaphore = RedisSemaphore(client, f"{prefix}u:{name}", 4, watchdog="watchdog=False" not in name)
        pairs[name] = (functools.partial(semaphore.acquire, blocking=False), semaphore.release)
    for pair in pairs.values():  # load scripts, open connections, start the watchdog thread
        time_pairs(pair, 0.05, admin)
    best: dict[str, dict[str, float]] = {}
    for r in range(rounds):
        for name in UNCONTENDED[r % 3 :] + UNCONTENDED[: r % 3]:
            run = time_pairs(pairs[name], seconds, admin)
            if run.rate > best.get(name, {}).get("pairs_per_s", 0):
                best[name] = {"pairs_per_s": run.rate, "round_trips_per_pair": run.commands / run.pairs}
    client.close()
    admin.close()
    return best


def bare_permit(client: redis.Redis, name: str, limit: int) -> Pair:
    """(acquire, release) of the bare semaphore: SET NX PX on a free slot key, polling every 1 ms."""
    held: list[tuple[str, str]] = []
    sha = client.script_load(COMPARE_AND_DELETE)

    def acquire() -> None:
        token = secrets.token_hex(16)
        while True:
            for i in range(limit):
                if client.set(f"{name}:{i}", token, nx=True, px=30000):
                    held.append((f"{name}:{i}", token))
                    return
            time.sleep(0.001)

    def release() -> None:
        key, token = held.pop()
        client.evalsha(sha, 1, key, token)

    return acquire, release


def contended(url: str, prefix: str, processes: int, limit: int, seconds: float) -> dict[str, Any]:
    """``lock_bench``'s contention run, its forked workers taking (acquire, release) from this
    benchmark's ``contender``."""

    def contender(name: str, client: redis.Redis, key: str) -> Pair:
        if name == "bare":
            return bare_permit(client, key, limit)
        semaphore = RedisSemaphore(client, key, limit, fair=name.endswith("fair=True"))
        return semaphore.acquire, semaphore.release

    rows = {}
    for name in CONTENDED:
        done = lock_bench.run_contended(name, url, f"{prefix}c:{name}", processes, seconds, contender)
        errors = [result.error for result in done if result.error]
        if errors:
            raise RuntimeError(f"{name}: {errors[0]}")
        acquisitions = sum(result.acquisitions for result in done)
        wall = max(result.end for result in done) - min(result.start for result in done)
        waits = sorted(wait for result in done for wait in result.waits)
        rows[name] = {
            "sections_per_s": acquisitions / wall,
            "round_trips_per_acquisition": sum(result.commands for result in done) / acquisitions,
            "p50_wait_ms": lock_bench.percentile(waits, 50) * 1000,
            "p99_wait_ms": lock_bench.percentile(waits, 99) * 1000,
        }
    return rows


def print_rows(title: str, rows: dict[str, Any], rate: str) -> None:
    print(f"\n{title}")
    bare = rows["bare"][rate]
    for name, row in rows.items():
        fields = "  ".join(f"{field}={value:,.2f}" for field, value in row.items())
        print(f"  {name:32} {fields}  ratio to bare={row[rate] / bare:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each run (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="uncontended rounds (default 3)")
    parser.add_argument("--processes", type=int, default=32, help="contending processes (default 32)")
    parser.add_argument("--limit", type=int, default=4, help="permits of the contended semaphore (default 4)")
    args = parser.parse_args()
    prefix = f"semaphore_bench:{secrets.token_hex(4)}:"
    with RedisServer() as server:
        print_rows("uncontended", uncontended(server.url, prefix, args.seconds, args.rounds), "pairs_per_s")
        rows = contended(server.url, prefix, args.processes, args.limit, args.seconds)
        print_rows(f"contention: P={args.processes}, limit={args.limit}", rows, "sections_per_s")
    print(f"\nload average: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")


if __name__ == "__main__":
    main()
