"""Benchmark RedisLock against a bare SET NX PX loop and three PyPI peers, on a private Redis.

Peers (installed from PyPI into this interpreter when missing): redis-py's own
``redis.lock.Lock`` (``client.lock(...)``), python-redis-lock
(``redis_lock.Lock``) and pottery's ``Redlock`` (one master).

Scenarios, each run for every contender in the same invocation:

* **uncontended**: one process, one key per contender, acquire+release pairs
  for a fixed time per round, several rounds in rotating order; the best
  round counts (noise only ever slows a run down). Reports pairs/s, round
  trips per pair and the ratio to the bare loop (``SET key token NX PX 30000``
  plus ``EVALSHA`` of a compare-and-delete script, a fresh token per pair).
* **contention**: N forked processes (32) on one key, each looping
  acquire (blocking, no timeout) / hold 1 ms / release for a fixed wall time,
  started together by a barrier. Reports critical sections/s, the spread of
  acquisitions over processes (min/max), round trips per acquisition and the
  p50/p99 wait (from calling ``acquire`` to holding), also relative to the
  "FIFO ideal" wait of ``(N - 1) * wall / acquisitions``.
* **redlock**: on three private primaries of its own, uncontended
  acquire+release pairs/s of ``RedisLock([c1, c2, c3], ...)`` and pottery's
  ``Redlock(masters={c1, c2, c3})``, in rotating rounds, best round counts.
* **cluster**: uncontended ``RedisLock`` pairs/s on a private 3-primary Redis
  Cluster vs a private single server, same rounds.
* **watchdog**: one process holds 10,000 RedisLocks (ttl 3 s, so a renewal
  interval of 1 s) and, while its main thread only waits on an Event,
  measures the watchdog's renewal round trips per interval and the process's
  CPU time as a percentage of one core.

Round trips are counted client-side, never inferred from timings: every
client is built on ``CountingConnection``, a ``redis.connection.Connection``
subclass that counts each reply it reads (``read_response``). Every command
gets exactly one reply, read once, however it was packed and sent (redis-py's
``send_command``, a pipeline, or a hand-packed ``send_packed_command`` as the
watchdog's batches), so every command is counted exactly once; a sanity check
asserts that one ``SET`` counts 1 and a pipeline of three ``GET`` counts 3. A
command waits for its reply, so for these libraries (none pipelines) commands
equal network round trips. Connection set-up commands are counted too, but
every contender warms up its connections before measuring. Each process counts
its own commands; forked workers report theirs.

Run ``python bench/lock_bench.py --help`` for the options. The results are
printed and written as JSON to ``bench/results/lock_bench.json``; missed
targets print FAIL but the exit status stays 0 (a benchmark reports).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import platform
import queue
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.connection import Connection

from celery_redislock import RedisLock
from celery_redislock.testing import RedisClusterServers, RedisServer
from celery_redislock.watchdog import BATCH, get_watchdog

RESULTS = Path(__file__).resolve().parent / "results" / "lock_bench.json"

#: PyPI distribution -> module it provides.
PEERS = {"python-redis-lock": "redis_lock", "pottery": "pottery"}

#: The bare loop's release: delete the key only if it still holds our token.
COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

UNCONTENDED = [
    "bare",
    "RedisLock",
    "RedisLock watchdog=False",
    "RedisLock subclass",
    "redis-py Lock",
    "python-redis-lock",
    "pottery",
]
CONTENDED = ["RedisLock fair=False", "RedisLock fair=True", "redis-py Lock", "python-redis-lock", "pottery"]
PEER_NAMES = ("redis-py Lock", "python-redis-lock", "pottery")
HOLD = 0.001  # seconds a contended critical section lasts


# -- round-trip counting -------------------------------------------------------


class CountingConnection(Connection):
    """A redis-py connection that counts every reply it reads, one per command (see the module docstring)."""

    sent = 0
    _lock = threading.Lock()

    @classmethod
    def add(cls, commands: int) -> None:
        with cls._lock:
            cls.sent += commands

    @classmethod
    def reset(cls) -> None:
        """Start counting from 0 (also right after fork: the lock may have been copied held)."""
        cls._lock = threading.Lock()
        cls.sent = 0

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        self.add(1)
        return super().read_response(*args, **kwargs)  # type: ignore[no-untyped-call]


def counting_client(url: str) -> redis.Redis:
    """A client whose commands ``CountingConnection.sent`` counts, its connection already open."""
    pool = redis.ConnectionPool.from_url(url, connection_class=CountingConnection)
    client = redis.Redis(connection_pool=pool)
    client.ping()
    return client


def check_counting(url: str, prefix: str) -> None:
    """One SET must count 1 and a pipeline of three GETs 3, or the counts mean nothing."""
    client = counting_client(url)
    key = prefix + "sanity"
    before = CountingConnection.sent
    client.set(key, "x")
    single = CountingConnection.sent - before
    pipe = client.pipeline(transaction=False)
    for _ in range(3):
        pipe.get(key)
    before = CountingConnection.sent
    pipe.execute()
    piped = CountingConnection.sent - before
    client.delete(key)
    client.close()
    if (single, piped) != (1, 3):
        raise RuntimeError(
            f"command counting is off: SET counted {single} (want 1), pipeline {piped} (want 3)"
        )


# -- setup ---------------------------------------------------------------------


def ensure_peers() -> dict[str, str]:
    """Install the PyPI peers that cannot be imported; returns distribution -> version."""
    missing = [dist for dist, module in PEERS.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(f"installing {', '.join(missing)} from PyPI ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)
        importlib.invalidate_caches()
    versions = {dist: importlib.metadata.version(dist) for dist in [*PEERS, "redis", "celery-redislock"]}
    for module in PEERS.values():
        importlib.import_module(module)
    return versions


# -- uncontended -----------------------------------------------------------------

Pair = tuple[Callable[[], object], Callable[[], object]]


def uncontended_pair(name: str, client: redis.Redis, key: str) -> Pair:
    """(acquire, release) for one contender on ``key``; each acquire must find the lock free."""
    if name == "bare":
        sha = client.script_load(COMPARE_AND_DELETE)
        token = ""

        def acquire() -> None:
            nonlocal token
            token = secrets.token_hex(16)
            if not client.set(key, token, nx=True, px=30000):
                raise RuntimeError(f"bare loop: {key} was not free")

        def release() -> None:
            client.evalsha(sha, 1, key, token)

        return acquire, release
    lock = uncontended_lock(name, client, key)
    return lambda: checked(lock.acquire(blocking=False), name), lock.release


class SubclassedRedis(redis.Redis):
    """A ``redis.Redis`` subclass, as an instrumented or counting client is: every lock
    command goes through its ``execute_command``, not the plain client's fast path."""


def uncontended_lock(name: str, client: redis.Redis, key: str) -> Any:
    if name == "RedisLock":
        return RedisLock(client, key)
    if name == "RedisLock subclass":  # the same (counting) connections, through the subclass
        return RedisLock(SubclassedRedis(connection_pool=client.connection_pool), key)
    if name == "RedisLock watchdog=False":
        return RedisLock(client, key, watchdog=False)
    return peer_lock(name, client, key)


def peer_lock(name: str, client: redis.Redis, key: str) -> Any:
    if name == "redis-py Lock":
        return client.lock(key, timeout=30)
    if name == "python-redis-lock":
        import redis_lock

        return redis_lock.Lock(client, key, expire=30)
    if name == "pottery":
        import pottery

        return pottery.Redlock(key=key, masters={client}, auto_release_time=30)
    raise ValueError(name)


def checked(acquired: object, name: str) -> None:
    if not acquired:
        raise RuntimeError(f"{name}: an uncontended acquire failed")


@dataclass
class Run:
    pairs: int
    seconds: float
    commands: int
    client_cpu: float  # seconds of this process's CPU (all threads, the watchdog's included)
    server_cpu: float  # seconds of redis-server CPU (user + sys)

    @property
    def rate(self) -> float:
        return self.pairs / self.seconds


def server_cpu(admin: redis.Redis) -> float:
    info = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def time_pairs(pair: Pair, seconds: float, admin: redis.Redis) -> Run:
    """Acquire+release pairs for ``seconds`` (checking the clock every 100 pairs)."""
    acquire, release = pair
    gc.collect()
    start_server = server_cpu(admin)
    start_commands = CountingConnection.sent
    start_cpu = time.process_time()
    pairs = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(100):
            acquire()
            release()
        pairs += 100
        now = time.perf_counter()
        if now >= deadline:
            break
    return Run(
        pairs,
        now - start,
        CountingConnection.sent - start_commands,
        time.process_time() - start_cpu,
        server_cpu(admin) - start_server,
    )


def bench_uncontended(url: str, prefix: str, seconds: float, rounds: int) -> dict[str, Any]:
    client = counting_client(url)
    admin = redis.Redis.from_url(url)  # not counted: reads the server's CPU time between runs
    pairs = {name: uncontended_pair(name, client, f"{prefix}u:{i}") for i, name in enumerate(UNCONTENDED)}
    for pair in pairs.values():  # load scripts, open pool connections, start the watchdog thread
        time_pairs(pair, 0.05, admin)
    runs: dict[str, list[Run]] = {name: [] for name in UNCONTENDED}
    for r in range(rounds):  # rotate the order so no contender always runs first or last
        order = UNCONTENDED[r % len(UNCONTENDED) :] + UNCONTENDED[: r % len(UNCONTENDED)]
        for name in order:
            runs[name].append(time_pairs(pairs[name], seconds, admin))
    client.close()
    admin.close()
    bare = max(run.rate for run in runs["bare"])
    rows = {}
    for name, done in runs.items():
        best = max(done, key=lambda run: run.rate)
        total_pairs = sum(run.pairs for run in done)
        rows[name] = {
            "pairs_per_s": best.rate,
            "pairs_per_s_all_rounds": [run.rate for run in done],
            "ratio_to_bare": best.rate / bare,
            # the same round's bare run, so both saw the same background load
            "median_round_ratio_to_bare": statistics.median(
                run.rate / same.rate for run, same in zip(done, runs["bare"], strict=True)
            ),
            "round_trips_per_pair": sum(run.commands for run in done) / total_pairs,
            "client_cpu_us_per_pair": sum(run.client_cpu for run in done) / total_pairs * 1e6,
            "server_cpu_us_per_pair": sum(run.server_cpu for run in done) / total_pairs * 1e6,
        }
    print_table(
        f"uncontended acquire+release, one process (best of {rounds} rounds of {seconds:g}s)",
        ["lock", "pairs/s", "vs bare", "median", "RT/pair", "client CPU us", "server CPU us"],
        [
            [
                name,
                f"{row['pairs_per_s']:.0f}",
                f"{row['ratio_to_bare']:.3f}",
                f"{row['median_round_ratio_to_bare']:.3f}",
                f"{row['round_trips_per_pair']:.3f}",
                f"{row['client_cpu_us_per_pair']:.1f}",
                f"{row['server_cpu_us_per_pair']:.1f}",
            ]
            for name, row in rows.items()
        ],
    )
    print("  (vs bare: best round / best bare round; median: of per-round ratios; CPU per pair)")
    return rows


# -- contention ------------------------------------------------------------------


def blocking_lock(name: str, client: redis.Redis, key: str) -> Pair:
    """(acquire, release) that waits without a timeout for ``key``."""
    if name.startswith("RedisLock"):
        lock = RedisLock(client, key, fair=name.endswith("fair=True"))
        return lock.acquire, lock.release
    lock = peer_lock(name, client, key)
    if name == "pottery":
        return lambda: lock.acquire(blocking=True, timeout=-1), lock.release
    return lambda: lock.acquire(blocking=True), lock.release


@dataclass
class WorkerResult:
    index: int
    acquisitions: int
    commands: int
    start: float
    end: float
    cpu: float = 0.0  # this process's CPU seconds during the loop
    waits: list[float] = field(default_factory=list)
    error: str | None = None


def contention_worker(
    name: str,
    url: str,
    key: str,
    seconds: float,
    index: int,
    ready: multiprocessing.synchronize.Barrier,
    results: multiprocessing.queues.Queue[WorkerResult],
    contender: Callable[[str, redis.Redis, str], Pair] = blocking_lock,
) -> None:
    """One forked process: warm up on a key of its own, then loop on the shared ``key`` with the
    (acquire, release) ``contender`` makes."""
    CountingConnection.reset()
    result = WorkerResult(index, 0, 0, 0.0, 0.0)
    try:
        client = counting_client(url)
        warm_acquire, warm_release = contender(name, client, f"{key}:warm:{index}")
        warm_acquire()  # loads the scripts and opens every connection the loop will use
        warm_release()
        acquire, release = contender(name, client, key)
        ready.wait()
        CountingConnection.reset()
        cpu = time.process_time()
        result.start = time.monotonic()
        deadline = result.start + seconds
        waits = result.waits
        while time.monotonic() < deadline:
            asked = time.monotonic()
            acquire()
            waits.append(time.monotonic() - asked)
            time.sleep(HOLD)  # the critical section
            release()
        result.end = time.monotonic()
        result.acquisitions = len(waits)
        result.commands = CountingConnection.sent
        result.cpu = time.process_time() - cpu
    except BaseException as exc:  # reported by the parent, never lost in a child's stderr
        result.error = f"{type(exc).__name__}: {exc}"
    results.put(result)


def run_contended(
    name: str,
    url: str,
    key: str,
    processes: int,
    seconds: float,
    contender: Callable[[str, redis.Redis, str], Pair] = blocking_lock,
) -> list[WorkerResult]:
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Barrier(processes)
    results: multiprocessing.queues.Queue[WorkerResult] = ctx.Queue()
    arguments = (name, url, key, seconds)
    workers = [
        ctx.Process(target=contention_worker, args=(*arguments, i, ready, results, contender), daemon=True)
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    done: list[WorkerResult] = []
    try:
        give_up = time.monotonic() + seconds + 60
        while len(done) < processes:
            done.append(results.get(timeout=max(give_up - time.monotonic(), 0.001)))
    except queue.Empty:
        ready.abort()
        done.append(WorkerResult(-1, 0, 0, 0, 0, error=f"{processes - len(done)} worker(s) hung; terminated"))
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
    for worker in workers:
        worker.join()
    return done


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``values`` (0 < q <= 100)."""
    return values[max(0, min(len(values) - 1, round(q / 100 * len(values) + 0.5) - 1))]


def bench_contention(url: str, prefix: str, processes: int, seconds: float) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    admin = redis.Redis.from_url(url)  # not counted: reads the server's CPU time around each run
    for i, name in enumerate(CONTENDED):
        print(f"  contention: {name} ...", flush=True)
        start_server = server_cpu(admin)
        done = run_contended(name, url, f"{prefix}c:{i}", processes, seconds)
        server = server_cpu(admin) - start_server
        errors = [r.error for r in done if r.error]
        if errors:
            rows[name] = {"error": errors[0], "errors": len(errors)}
            print(f"  {name}: FAILED: {errors[0]}")
            continue
        total = sum(r.acquisitions for r in done)
        wall = max(r.end for r in done) - min(r.start for r in done)
        per_process = [r.acquisitions for r in done]
        waits = sorted(w for r in done for w in r.waits)
        fifo_ideal = (processes - 1) * wall / total
        rows[name] = {
            "critical_sections_per_s": total / wall,
            "hold_ms": HOLD * 1000,
            "acquisitions": total,
            "wall_s": wall,
            "min_per_process": min(per_process),
            "max_per_process": max(per_process),
            "min_max_ratio": min(per_process) / max(per_process),
            "round_trips_per_acquisition": sum(r.commands for r in done) / total,
            "round_trips_per_process": sorted(r.commands for r in done),
            "client_cpu_us_per_acquisition": sum(r.cpu for r in done) / total * 1e6,
            "server_cpu_us_per_acquisition": server / total * 1e6,
            "wait_p50_ms": percentile(waits, 50) * 1000,
            "wait_p99_ms": percentile(waits, 99) * 1000,
            "wait_max_ms": waits[-1] * 1000,
            "fifo_ideal_wait_ms": fifo_ideal * 1000,
            "p99_over_fifo_ideal": percentile(waits, 99) / fifo_ideal,
        }
    peers = [rows[name] for name in PEER_NAMES if "error" not in rows.get(name, {"error": "not run"})]
    best_peer = max((row["critical_sections_per_s"] for row in peers), default=0.0)
    print_table(
        f"contention: {processes} processes, one key, hold {HOLD * 1000:g} ms, {seconds:g}s",
        [
            "lock",
            "CS/s",
            "x best peer",
            "acq",
            "min",
            "max",
            "min/max",
            "RT/acq",
            "p50 ms",
            "p99 ms",
            "p99/FIFO",
            "CPU us c+s",
        ],
        [
            [name, "error", *[""] * 10]
            if "error" in row
            else [
                name,
                f"{row['critical_sections_per_s']:.0f}",
                f"{row['critical_sections_per_s'] / best_peer:.3f}" if best_peer else "-",
                str(row["acquisitions"]),
                str(row["min_per_process"]),
                str(row["max_per_process"]),
                f"{row['min_max_ratio']:.2f}",
                f"{row['round_trips_per_acquisition']:.2f}",
                f"{row['wait_p50_ms']:.1f}",
                f"{row['wait_p99_ms']:.1f}",
                f"{row['p99_over_fifo_ideal']:.2f}",
                f"{row['client_cpu_us_per_acquisition']:.0f}+{row['server_cpu_us_per_acquisition']:.0f}",
            ]
            for name, row in rows.items()
        ],
    )
    print(
        "  (x best peer: CS/s / the best peer's in this run; RT/acq: all processes' commands / acquisitions;"
        " CPU us c+s: client + server CPU per acquisition)"
    )
    admin.close()
    return rows


# -- watchdog at scale -----------------------------------------------------------


def bench_watchdog(url: str, prefix: str, count: int, intervals: int) -> dict[str, Any]:
    ttl = 3.0
    interval = ttl / 3
    client = counting_client(url)
    locks = [RedisLock(client, f"{prefix}w:{i}", ttl=ttl) for i in range(count)]
    started = time.monotonic()
    for lock in locks:
        checked(lock.acquire(blocking=False), "RedisLock")
    acquire_s = time.monotonic() - started
    watched = len(get_watchdog())
    idle = threading.Event()  # never set: the main thread only waits on it
    idle.wait(interval)  # let the first renewals pass before the window opens
    commands, cpu, wall = CountingConnection.sent, time.process_time(), time.monotonic()
    idle.wait(intervals * interval)
    commands = CountingConnection.sent - commands
    cpu = time.process_time() - cpu
    wall = time.monotonic() - wall
    lost = sum(lock.lost.is_set() for lock in locks)
    started = time.monotonic()
    for lock in locks:
        lock.release()
    release_s = time.monotonic() - started
    client.close()
    row = {
        "locks": count,
        "leases_in_watchdog": watched,
        "ttl_s": ttl,
        "interval_s": interval,
        "window_s": wall,
        "round_trips_per_interval": commands / (wall / interval),
        "ideal_round_trips_per_interval": -(-count // BATCH),
        "cpu_percent_of_one_core": cpu / wall * 100,
        "lost": lost,
        "acquire_all_s": acquire_s,
        "release_all_s": release_s,
    }
    print_table(
        f"watchdog: {count} held locks, ttl {ttl:g}s (renewal every {interval:g}s), {wall:.1f}s window",
        ["locks", "RT/interval", "ideal", "CPU % core", "lost", "acquire all", "release all"],
        [
            [
                str(count),
                f"{row['round_trips_per_interval']:.1f}",
                str(row["ideal_round_trips_per_interval"]),
                f"{row['cpu_percent_of_one_core']:.2f}",
                str(lost),
                f"{acquire_s:.2f}s",
                f"{release_s:.2f}s",
            ]
        ],
    )
    return row


# -- topologies: Redlock over three primaries, a Redis Cluster -------------------------


def best_of_rounds(pairs: dict[str, Pair], admin: redis.Redis, seconds: float, rounds: int) -> dict[str, Any]:
    """Best pairs/s of each contender over ``rounds`` rotating rounds, as in ``bench_uncontended``."""
    names = list(pairs)
    for pair in pairs.values():  # warm up: scripts, connections, threads
        time_pairs(pair, 0.05, admin)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(time_pairs(pairs[name], seconds, admin))
    return {
        name: {
            "pairs_per_s": max(run.rate for run in done),
            "pairs_per_s_all_rounds": [run.rate for run in done],
            "round_trips_per_pair": sum(run.commands for run in done) / sum(run.pairs for run in done),
        }
        for name, done in runs.items()
    }


def bench_redlock(prefix: str, seconds: float, rounds: int) -> dict[str, Any]:
    """Uncontended acquire+release over three private primaries: our Redlock vs pottery's."""
    import pottery

    servers = [RedisServer() for _ in range(3)]
    try:
        for server in servers:
            server.start()
        clients = [counting_client(server.url) for server in servers]
        admin = redis.Redis.from_url(servers[0].url)
        ours = RedisLock(clients, f"{prefix}r:ours")
        theirs = pottery.Redlock(key=f"{prefix}r:pottery", masters=set(clients), auto_release_time=30)
        rows = best_of_rounds(
            {
                "RedisLock over 3": (
                    lambda: checked(ours.acquire(blocking=False), "RedisLock"),
                    ours.release,
                ),
                "pottery Redlock over 3": (
                    lambda: checked(theirs.acquire(blocking=False), "pottery"),
                    theirs.release,
                ),
            },
            admin,
            seconds,
            rounds,
        )
        admin.close()
    finally:
        for server in servers:
            server.close()
    print_table(
        f"Redlock over 3 primaries, uncontended acquire+release (best of {rounds} rounds of {seconds:g}s)",
        ["lock", "pairs/s", "RT/pair"],
        [
            [name, f"{row['pairs_per_s']:.0f}", f"{row['round_trips_per_pair']:.2f}"]
            for name, row in rows.items()
        ],
    )
    return rows


def bench_cluster(prefix: str, seconds: float, rounds: int) -> dict[str, Any]:
    """Uncontended RedisLock acquire+release: a 3-primary Cluster vs one server, same machine."""
    with RedisServer() as single, RedisClusterServers(3) as cluster:
        plain = counting_client(single.url)
        clustered = cluster.client()
        admin = redis.Redis.from_url(single.url)
        on_single = RedisLock(plain, f"{prefix}s:single")
        on_cluster = RedisLock(clustered, f"{prefix}s:cluster")
        rows = best_of_rounds(
            {
                "RedisLock, one server": (
                    lambda: checked(on_single.acquire(blocking=False), "single"),
                    on_single.release,
                ),
                "RedisLock, Cluster": (
                    lambda: checked(on_cluster.acquire(blocking=False), "cluster"),
                    on_cluster.release,
                ),
            },
            admin,
            seconds,
            rounds,
        )
        admin.close()
        clustered.close()
    print_table(
        f"Cluster vs one server, uncontended acquire+release (best of {rounds} rounds of {seconds:g}s)",
        ["lock", "pairs/s"],
        [[name, f"{row['pairs_per_s']:.0f}"] for name, row in rows.items()],
    )
    return rows


# -- reporting -------------------------------------------------------------------


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    print(f"\n{title}")
    for i, line in enumerate([header, *rows]):
        print(
            "  "
            + "  ".join(
                cell.ljust(w) if j == 0 else cell.rjust(w)
                for j, (cell, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


@dataclass
class Check:
    name: str
    value: float | None
    target: str  # e.g. ">= 0.95"; "" for a number reported without a target
    fmt: str = "{:.3f}"

    @property
    def verdict(self) -> str:
        if not self.target:
            return "INFO"
        if self.value is None:
            return "FAIL"
        op, bound = self.target.split()
        ok = {
            ">=": self.value >= float(bound),
            "<=": self.value <= float(bound),
            "<": self.value < float(bound),
            "==": self.value == float(bound),
        }[op]
        return "PASS" if ok else "FAIL"

    def line(self) -> str:
        value = "n/a" if self.value is None else self.fmt.format(self.value)
        target = f" (target {self.target})" if self.target else ""
        return f"{self.name}: {value}{target} {self.verdict}"


def checks(results: dict[str, Any]) -> list[Check]:
    found: list[Check] = []
    if "uncontended" in results:
        rows = results["uncontended"]
        found += [
            Check("uncontended RedisLock/bare pairs/s", rows["RedisLock"]["ratio_to_bare"], ">= 0.95"),
            Check(
                "uncontended RedisLock round trips per pair",
                rows["RedisLock"]["round_trips_per_pair"],
                "== 2",
            ),
            Check(
                "uncontended RedisLock watchdog=False/bare pairs/s",
                rows["RedisLock watchdog=False"]["ratio_to_bare"],
                "",
            ),
            Check(
                "uncontended RedisLock subclass/bare pairs/s",
                rows["RedisLock subclass"]["ratio_to_bare"],
                ">= 0.90",
            ),
            Check(
                "uncontended RedisLock/best peer pairs/s",
                rows["RedisLock"]["pairs_per_s"] / max(rows[p]["pairs_per_s"] for p in PEER_NAMES),
                "",
            ),
        ]
    if "contention" in results:
        rows = results["contention"]
        peers = [rows[p]["critical_sections_per_s"] for p in PEER_NAMES if "error" not in rows[p]]
        best_peer = max(peers) if peers else None
        fair = rows["RedisLock fair=True"]
        found += [
            Check(
                "contention fair=True p99 wait / FIFO ideal",
                fair.get("p99_over_fifo_ideal"),
                "<= 3",
                "{:.2f}",
            ),
            Check(
                "contention fair=True min/max acquisitions per process",
                fair.get("min_max_ratio"),
                ">= 0.8",
                "{:.2f}",
            ),
        ]
        for name in ("RedisLock fair=False", "RedisLock fair=True"):
            row = rows[name]
            ours = row.get("critical_sections_per_s")
            ratio = None if ours is None or not best_peer else ours / best_peer
            found += [
                Check(f"contention {name}/best peer critical sections/s", ratio, ">= 1.0", "{:.2f}"),
                Check(
                    f"contention {name} round trips per acquisition",
                    row.get("round_trips_per_acquisition"),
                    "<= 4",
                    "{:.2f}",
                ),
            ]
        found.append(
            Check(
                "contention RedisLock fair=False min/max acquisitions per process",
                rows["RedisLock fair=False"].get("min_max_ratio"),
                "",
                "{:.2f}",
            )
        )
    if "watchdog" in results:
        row = results["watchdog"]
        locks = row["locks"]
        found += [
            Check(
                f"watchdog renewal round trips per interval ({locks} locks)",
                row["round_trips_per_interval"],
                "<= 10",
                "{:.1f}",
            ),
            Check(
                f"watchdog CPU % of one core ({locks} locks)", row["cpu_percent_of_one_core"], "< 2", "{:.2f}"
            ),
            Check("watchdog locks lost", row["lost"], "== 0", "{:.0f}"),
            Check(f"watchdog seconds to acquire {locks} locks", row["acquire_all_s"], "", "{:.2f}"),
            Check(f"watchdog seconds to release {locks} locks", row["release_all_s"], "", "{:.2f}"),
        ]
    if "redlock" in results:
        rows = results["redlock"]
        found.append(
            Check(
                "Redlock over 3: RedisLock/pottery pairs/s",
                rows["RedisLock over 3"]["pairs_per_s"] / rows["pottery Redlock over 3"]["pairs_per_s"],
                ">= 2",
                "{:.2f}",
            )
        )
    if "cluster" in results:
        rows = results["cluster"]
        found.append(
            Check(
                "uncontended RedisLock Cluster/one server pairs/s",
                rows["RedisLock, Cluster"]["pairs_per_s"] / rows["RedisLock, one server"]["pairs_per_s"],
                ">= 0.9",
            )
        )
    return found


def print_summary(found: list[Check]) -> None:
    print("\nsummary")
    for check in found:
        print("  " + check.line())


REPO = Path(__file__).resolve().parent.parent


def relative(path: Path) -> str:
    """``path`` as the results name it: relative to the repository (never an absolute path)."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else path.name


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor field."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_header(args: argparse.Namespace) -> dict[str, Any]:
    """What a results file says about the run: its arguments (paths relative to the repository),
    the machine (CPU model, cores, Python, OS, load average) and, for older readers, Python,
    platform and CPUs."""
    return {
        "args": {k: relative(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "python": sys.version.split()[0],
            "os": platform.platform(),
        },
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "commit": git("rev-parse", "--short", "HEAD"),
        "package_changes_not_committed": git("status", "--porcelain", "--", "celery_redislock"),
        #: the 1, 5 and 15 minute load averages as the run ends (a shared machine's other work)
        "load_average": list(os.getloadavg()),
    }


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


# -- main ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        choices=["uncontended", "contention", "watchdog", "redlock", "cluster"],
        help="run only this scenario (repeatable; default: all)",
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="wall time of each contended run (default 5)"
    )
    parser.add_argument(
        "--uncontended-seconds",
        type=float,
        default=0.3,
        help="length of one uncontended round per contender (default 0.3)",
    )
    parser.add_argument(
        "--rounds", type=int, default=10, help="uncontended rounds; the best counts (default 10)"
    )
    parser.add_argument("--processes", type=int, default=32, help="contending processes (default 32)")
    parser.add_argument(
        "--watchdog-locks", type=int, default=10_000, help="locks held by the watchdog scenario"
    )
    parser.add_argument(
        "--watchdog-intervals", type=int, default=5, help="renewal intervals measured (default 5)"
    )
    parser.add_argument(
        "--url", help="use this Redis instead of starting a private one (keys get a random prefix)"
    )
    parser.add_argument(
        "--json", type=Path, default=RESULTS, help=f"where to write the results (default {RESULTS})"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    prefix = f"lock_bench:{secrets.token_hex(4)}:"
    check_counting(url, prefix)
    scenarios = args.only or ["uncontended", "contention", "watchdog", "redlock", "cluster"]
    results: dict[str, Any] = {}
    if "uncontended" in scenarios:
        results["uncontended"] = bench_uncontended(url, prefix, args.uncontended_seconds, args.rounds)
    if "contention" in scenarios:
        results["contention"] = bench_contention(url, prefix, args.processes, args.seconds)
    if "watchdog" in scenarios:
        results["watchdog"] = bench_watchdog(url, prefix, args.watchdog_locks, args.watchdog_intervals)
    if "redlock" in scenarios:  # servers of their own
        results["redlock"] = bench_redlock(prefix, args.uncontended_seconds, args.rounds)
    if "cluster" in scenarios:
        results["cluster"] = bench_cluster(prefix, args.uncontended_seconds, args.rounds)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    versions = ensure_peers()
    began = time.monotonic()
    if args.url:
        url, server_info = args.url, "given by --url"
        results = run(args, url)
    else:
        with RedisServer() as server:
            with server.client() as probe:
                info = probe.info("server")
            server_info = f"redis-server {info['redis_version']} at {server.url} (pid {server.pid})"
            print(f"started {server_info}", flush=True)
            results = run(args, server.url)
    found = checks(results)
    print_summary(found)
    failed = [check.name for check in found if check.verdict == "FAIL"]
    print(f"\n{len(failed)} target(s) missed" + (": " + "; ".join(failed) if failed else ""))
    write_json(
        args.json,
        {
            **run_header(args),
            "server": server_info,
            "versions": versions,
            "duration_s": time.monotonic() - began,
            "results": results,
            "summary": [asdict(check) | {"verdict": check.verdict} for check in found],
            "summary_lines": [check.line() for check in found],
        },
    )
    print(f"results written to {args.json} ({time.monotonic() - began:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
