"""How long ``celery redislock stats`` takes over 100,000 lock keys.

Starts a private redis-server on 127.0.0.1 (``celery_redislock.testing.RedisServer``,
stopped at the end), fills it with a realistic mix of lock keys written as the
package writes them (its own key, holder and waiter-member functions), plus keys
outside the prefix (a broker's), then runs ``stats`` in this process, as the
``celery`` command would (click's runner), once for the table and once with
``--json``, and prints the time each took and what the summary counted.

The mix, of ``--keys`` lock keys (100,000): 60 % execution locks of 20 tasks
(held for up to 10 minutes, 1 % of them with a late renewal), 30 % enqueue locks
(``until_executed``, queued up to 2 hours ago: those over an hour are orphans),
8 % ``…:queued`` enqueue locks (``until_and_while_executing``), 1,000 locks with
1 to 5 waiters queued, 30 beat entries' slot markers, the beat leader and plain
``RedisLock`` names for the rest; and ``--foreign`` keys outside the prefix (20,000).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_redislock import LockedTask, task_lock_key
from celery_redislock.attempt import companion_key, waiter_member
from celery_redislock.cli import redislock
from celery_redislock.keys import leader_key, slot_key
from celery_redislock.protocol import holder_for
from celery_redislock.testing import RedisServer

PREFIX = "redislock"
TASKS = 20
LEASE = 30.0
QUEUE_TTL = 3 * 3600.0
ENTRIES = 30
WAITED = 1_000


def identity(n: int) -> int:
    return n


def make_app(url: str) -> Celery:
    """20 tasks of each mode used below, on the server at ``url``."""
    app = Celery("stats_bench", broker=url, set_as_current=False)
    app.conf.update(redislock_url=url, redislock_prefix=PREFIX, redislock_ttl=LEASE)
    for mode in ("while_executing", "until_executed", "until_and_while_executing"):
        for i in range(TASKS):
            options: dict[str, Any] = {"lock_mode": mode, "lock_queue_ttl": QUEUE_TTL}
            register: Any = app.task(name=f"bench.{mode}.t{i}", base=LockedTask, **options)
            register(identity)
    return app


def value(fence_us: int, holder: str) -> str:
    """A lock value as the scripts write it: ``<token>:<fence>:<holder>``."""
    return f"{os.urandom(16).hex()}:{fence_us}:{holder}"


def fill(server: RedisServer, app: Celery, keys: int, foreign: int) -> None:
    """``keys`` lock keys of the mix in the module docstring, and ``foreign`` other keys."""
    client = server.client()
    seconds, micros = client.time()
    now_us = seconds * 1_000_000 + micros
    rng = random.Random(7)
    pipe = client.pipeline(transaction=False)

    def task_lock(mode: str, n: int, state: str, age: float, ttl: float, suffix: str = "") -> str:
        task = app.tasks[f"bench.{mode}.t{n % TASKS}"]
        key = task_lock_key(task, (n,)) + suffix
        holder = holder_for(f"id-{n}", 0, f"worker{n % 8}@host", 1000 + n % 64, state)
        pipe.set(key, value(now_us - int(age * 1e6), holder), px=int(ttl * 1000))
        return key

    execution, enqueue, queued = int(keys * 0.6), int(keys * 0.3), int(keys * 0.08)
    late = []  # their renewals late: under a third of the lease left (set last, as they expire soon)
    for n in range(execution):
        key = task_lock("while_executing", n, "running", rng.uniform(0, 600), LEASE)
        if n % 100 == 0:
            late.append(key)
        if n < WAITED:
            for w in range(1 + n % 5):
                member = waiter_member(int(LEASE * 1000), os.urandom(16).hex(), False, f"waiter{w}")
                pipe.zadd(companion_key(key, "queue"), {member: now_us + w})
                pipe.zadd(companion_key(key, "waiters"), {member: now_us // 1000 + 120_000})
                pipe.pexpire(companion_key(key, "queue"), 120_000)
                pipe.pexpire(companion_key(key, "waiters"), 120_000)
        if len(pipe) > 5000:
            pipe.execute()
    for n in range(enqueue):
        age = rng.uniform(0, 7200)
        task_lock("until_executed", n, "queued", age, QUEUE_TTL - age)
    for n in range(queued):
        age = rng.uniform(0, 3000)
        task_lock("until_and_while_executing", n, "queued", age, QUEUE_TTL - age, ":queued")
    pipe.execute()
    slots_each = (keys - execution - enqueue - queued) // 2 // ENTRIES
    for entry in range(ENTRIES):
        for slot in range(slots_each):
            slot_id = time.strftime("%Y-%m-%dT%H:%M:00Z", time.gmtime(seconds - 60 * slot))
            pipe.set(slot_key(PREFIX, f"entry-{entry}", slot_id), value(0, "beat=host:1"), px=120_000)
    pipe.set(leader_key(PREFIX), value(now_us, "beat=host:1"), px=int(LEASE * 1000))
    plain = keys - execution - enqueue - queued - ENTRIES * slots_each - 1
    for n in range(plain):
        pipe.set(f"{PREFIX}:plain-{n}", value(now_us - n, f"host:{n}"), px=600_000)
    for n in range(foreign):
        pipe.set(f"celery-task-meta-{n}", "{}", px=600_000)
    for key in late:
        pipe.pexpire(key, int(rng.uniform(0.25, 0.33) * LEASE * 1000))
    pipe.execute()
    client.close()


def timed(app: Celery, server: RedisServer, *args: str) -> tuple[dict[str, float], str]:
    """Wall and CPU seconds (this process's, the server's) of ``celery redislock stats ARGS``,
    run in this process, and what it printed."""
    obj = CLIContext(app=app, no_color=True, workdir=None)
    client = server.client()

    def server_cpu() -> float:
        cpu = client.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    before, cpu, start = server_cpu(), time.process_time(), time.perf_counter()
    result = CliRunner().invoke(redislock, ["stats", *args], obj=obj)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    server_seconds = server_cpu() - before
    client.close()
    if result.exit_code != 0:
        raise SystemExit(f"stats failed: {result.output}")
    return {"wall": wall, "cpu": cpu, "server_cpu": server_seconds}, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000, help="lock keys under the prefix")
    parser.add_argument("--foreign", type=int, default=20_000, help="keys outside the prefix")
    options = parser.parse_args()
    with RedisServer() as server:
        app = make_app(server.url)
        fill(server, app, options.keys, options.foreign)
        client = server.client()
        print(f"redis-server {client.info()['redis_version']}, {client.dbsize()} keys in all")
        client.close()
        table_times, table = timed(app, server)
        json_times, printed = timed(app, server, "--json")
        found: dict[str, Any] = json.loads(printed)
        print(table)
        print()
        print(f"held: {found['held']}")
        for name in ("waited_for", "oldest", "expiring", "orphans"):
            print(f"{name}: {found[name]['count']}")
        print(f"beat: {found['beat']['markers']} slot markers, leader {found['beat']['leader'] is not None}")
        for what, times in (("stats", table_times), ("stats --json", json_times)):
            print(
                f"{what}: {times['wall']:.2f} s wall (target < 2 s); CPU {times['cpu']:.2f} s here, "
                f"{times['server_cpu']:.2f} s in redis-server"
            )
        print(f"load average: {' '.join(f'{load:.2f}' for load in os.getloadavg())} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
