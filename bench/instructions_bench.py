"""Instructions per task, counted by callgrind: what each lock costs where it runs, without timing noise.

``task_bench.py`` times the variants end to end, and on a shared two-core machine its rounds
scatter by as much as the variants differ. This script counts instead: valgrind's callgrind
tool counts the instructions a process executes, the same total for the same work whatever
else the machine does (``docs/benchmarks.md``). For each variant of ``task_bench.py``:

* **worker**: ``celery -A task_bench worker -P prefork -c 2`` runs under callgrind (which
  follows the fork into the pool children), twice: with ``--base`` tasks, then with
  ``--base`` + ``--tasks``. Each process writes its count when it exits; the difference of the
  two runs, over ``--tasks``, is what a task costs the pool children and the main process, the
  start-up and shut-down falling out;
* **producer**: the ``apply_async`` loop of ``task_bench.py`` (the results kept, as there), in a
  process of its own under callgrind, the same two sizes, on servers of its own.

* **lock server**: the worker runs' lock server runs under callgrind too, counting its command
  processing only (``SERVER_FUNCTIONS``: reading and running each request, scripts included,
  and writing its reply), not its event loop and cron, whose work follows the run's length
  rather than its commands. Its counts are zeroed as a worker run begins and dumped as it ends
  (``callgrind_control``): every lock command of the run, the sends' and the worker's (the
  producer runs' own lock server is not counted: its commands are those of the sends). Before
  the runs, the same server counts what it takes per call of each script on a task's path
  (``script_counts``): where its share goes.

**Lock instructions per task** are the pool's, the producer's and the lock server's less
plain's: the work a lock adds, wherever it runs. The worker's main process is shown apart: its
event loop's work follows the run's length (stretched some 50 times under callgrind) as much as
its tasks. The peers (celery-once, celery-singleton) lock in the producer and unlock in the
pool, ``LockedTask`` does both in the pool. Everything is printed and written to
``bench/results/instructions_bench.json``, with a summary line: ``LockedTask``'s lock
instructions over the best peer's (target <= 1).

Needs valgrind (``apt-get install valgrind``, with ``callgrind_control``); the servers are private
redis-servers on 127.0.0.1, as in ``task_bench.py``. About 15 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "instructions_bench.json"
#: What a lock's instructions are counted in: the pool children, the producer and the lock server
#: (as ``task_bench.py``'s lock CPU). The worker's main process is shown apart: its event loop's
#: work follows the run's length (slowed down some 50 times under callgrind) as much as its tasks.
LOCK_PLACES = ("worker pool", "producer", "lock server")
#: The functions of redis-server (6.2 and 7.x export them) whose instructions callgrind counts in
#: the lock server: ``readQueryFromClient`` reads a request and runs its commands (a script's own
#: ``redis.call``s included), the replies go out from ``handleClientsWithPendingWritesUsingThreads``.
#: Neither calls the other.
SERVER_FUNCTIONS = ("readQueryFromClient", "handleClientsWithPendingWritesUsingThreads")
#: A callgrind output's total of instructions executed (``summary:``, or ``totals:`` in newer ones).
_TOTAL = re.compile(rb"^(?:summary|totals): (\d+)", re.M)


def callgrind_total(path: Path) -> int:
    """The instructions counted in callgrind output ``path``."""
    found = _TOTAL.search(path.read_bytes())
    if found is None:
        raise RuntimeError(f"{path}: no instruction total (did the process end?)")
    return int(found.group(1))


def valgrind(out: str, *options: str) -> list[str]:
    """The command prefix that runs a program under callgrind, writing to ``out`` (``%p``: the pid)."""
    return ["valgrind", "--tool=callgrind", "--quiet", f"--callgrind-out-file={out}", *options]


def counted_server(out: Path) -> Any:
    """A redis-server (not started) under callgrind, counting its command processing
    (``SERVER_FUNCTIONS``) into dumps ``out.1``, ``out.2``... (``server_count``)."""
    from celery_redislock.testing import RedisServer

    return RedisServer(wrapper=valgrind(str(out), *(f"--toggle-collect={f}" for f in SERVER_FUNCTIONS)))


def check_counted(server: Any, out: Path) -> None:
    """Raise unless ``SERVER_FUNCTIONS`` all run in ``server`` (a ``counted_server`` writing to
    ``out``) when it answers a PING: in a redis-server that lacks one (not exported, renamed),
    callgrind would count less, or nothing, and say nothing."""
    with server.client() as client:
        _callgrind_control(server, "--zero")
        client.ping()
        text = _dump(server, out).read_bytes()
    missing = [function for function in SERVER_FUNCTIONS if function.encode() not in text]
    if missing:
        raise RuntimeError(f"{server.binary}: {', '.join(missing)} did not run (see SERVER_FUNCTIONS)")


@contextlib.contextmanager
def server_count(server: Any, out: Path) -> Iterator[dict[str, int]]:
    """The instructions ``server`` (a ``counted_server`` writing to ``out``) processes commands
    with during the block: its counts are zeroed as it begins, and dumped as it ends into the
    dict's ``"lock server"``."""
    _callgrind_control(server, "--zero")
    counted: dict[str, int] = {}
    yield counted
    counted["lock server"] = callgrind_total(_dump(server, out))


def _callgrind_control(server: Any, option: str) -> None:
    subprocess.run(["callgrind_control", option, str(server.pid)], check=True, capture_output=True)


def _dump(server: Any, out: Path) -> Path:
    """Dump the counts of ``server`` (a ``counted_server`` writing to ``out``) since they were last
    zeroed or dumped: the new file ``out.<n>``."""
    before = set(out.parent.glob(f"{out.name}.*"))
    _callgrind_control(server, "--dump")
    [dump] = set(out.parent.glob(f"{out.name}.*")) - before
    return dump


#: How many calls of each script ``script_counts`` counts.
SCRIPT_CALLS = 1000


def script_counts(server: Any, out: Path, calls: int = SCRIPT_CALLS) -> dict[str, float]:
    """The instructions ``server`` (a ``counted_server`` writing to ``out``) takes per call of the
    package's scripts on a task's path, each counted in a block of ``calls`` calls on one
    connection of a plain client, what sets each call up left out: a free lock's ``ACQUIRE``, the
    ``RELEASE`` of such a hold (no waiters), a watchdog's ``RENEW``, ``until_executed``'s
    ``ADOPT`` of an enqueue lock; and, for scale, a plain ``SET NX PX``."""
    from celery_redislock._scripts import ACQUIRE, RELEASE, RENEW
    from celery_redislock._task_scripts import ADOPT
    from celery_redislock.attempt import waiter_member

    holder = f"task={secrets.token_hex(16)} try=0 state=running node=celery@bench pid=4242"
    keys = [f"redislock:bench.noop:{secrets.token_hex(32)}" for _ in range(calls)]
    tokens = [secrets.token_hex(16) for _ in range(calls)]
    counts: dict[str, float] = {}

    def count(step: str, call: Any, expected: Any) -> None:
        with server_count(server, out) as counted:
            replies = [call(i) for i in range(calls)]
        wrong = [reply for reply in replies if not expected(reply)]
        if wrong:  # a script that failed counts instructions too
            raise RuntimeError(f"{step}: {len(wrong)} unexpected replies, e.g. {wrong[0]!r}")
        counts[step] = counted["lock server"] / calls

    def fence(reply: Any) -> bool:
        return isinstance(reply, int) and reply > 1

    with server.client() as client:
        for script in (ACQUIRE, RELEASE, RENEW, ADOPT):
            client.script_load(script.source)
        member = [waiter_member(30_000, token, False, holder) for token in tokens]
        count("ACQUIRE (a free lock)", lambda i: ACQUIRE(client, [keys[i]], [member[i], "try"]), fence)
        count("RELEASE (no waiters)", lambda i: RELEASE(client, [keys[i]], [tokens[i]]), lambda r: r == 1)
        ACQUIRE(client, [keys[0]], [member[0], "try"])
        count("RENEW", lambda i: RENEW(client, [keys[0]], [30_000, tokens[0]]), lambda r: r == [])
        client.delete(keys[0])
        for key, token in zip(keys, tokens, strict=True):
            client.set(key, f"{token}:1:{holder}", px=60_000)  # an enqueue lock for ``token``
        adopted = [secrets.token_hex(16) for _ in range(calls)]
        count("ADOPT", lambda i: ADOPT(client, [keys[i]], [tokens[i], adopted[i], 30_000, holder]), fence)
        client.delete(*keys)
        count("SET NX PX (for scale)", lambda i: client.set(keys[i], holder, nx=True, px=30_000), bool)
        client.delete(*keys)
    return counts


def worker_run(variant: str, tasks: int, broker: Any, locks: Any, locks_out: Path) -> dict[str, float]:
    """One run of ``task_bench.py``'s worker under callgrind with ``tasks`` tasks: instructions of
    its main process, its pool children (summed) and the lock server ``locks`` (a
    ``counted_server`` writing to ``locks_out``)."""
    import task_bench
    from celery.result import ResultSet

    run = secrets.token_hex(4)
    queue = f"instructions-{run}"
    with (
        tempfile.TemporaryDirectory(prefix="instructions-bench-") as folder,
        server_count(locks, locks_out) as lock_server,
    ):
        worker = task_bench.Worker(
            variant, broker.url, locks.url, queue, 2, wrapper=valgrind(f"{folder}/%p.out")
        )
        app, noop = task_bench.make_app(variant, broker.url, locks.url, queue)
        try:
            ResultSet([noop.apply_async((run, i)) for i in range(tasks)]).get(timeout=1800)
        except Exception as exc:
            raise RuntimeError(f"{variant}: {exc!r}; the worker's log ends with:\n{worker.tail()}") from exc
        finally:
            app.close()
            worker.stop(timeout=600)  # warm, slow under callgrind: each process writes its count
        counts = {int(path.stem): callgrind_total(path) for path in Path(folder).glob("*.out")}
    pid = worker.process.pid
    if pid not in counts or len(counts) < 2:
        raise RuntimeError(
            f"{variant}: callgrind counted {len(counts)} processes, not the worker and its pool"
        )
    main = counts.pop(pid)
    return {"worker main": main, "worker pool": sum(counts.values()), **lock_server}


def producer_run(variant: str, tasks: int, broker: Any, locks: Any) -> int:
    """Instructions of a process that sends ``tasks`` tasks of ``variant`` (``--produce``)."""
    with tempfile.TemporaryDirectory(prefix="instructions-bench-") as folder:
        out = Path(folder, "producer.out")
        produce = [
            sys.executable,
            str(Path(__file__)),
            "--produce",
            variant,
            str(tasks),
            broker.url,
            locks.url,
        ]
        subprocess.run(valgrind(str(out)) + produce, check=True, cwd=HERE)
        return callgrind_total(out)


def produce(variant: str, tasks: int, broker_url: str, lock_url: str) -> None:
    """``--produce``: send ``tasks`` tasks with distinct arguments to a queue no worker reads,
    keeping the results (as ``task_bench.py`` keeps them until they arrive)."""
    import task_bench

    app, noop = task_bench.make_app(
        variant, broker_url, lock_url, f"instructions-produce-{secrets.token_hex(4)}"
    )
    run = secrets.token_hex(4)
    kept = [noop.apply_async((run, i)) for i in range(tasks)]
    assert len(kept) == tasks
    app.close()


def per_task(small: dict[str, float], large: dict[str, float], tasks: int) -> dict[str, float]:
    """Per task: the difference of two runs' figures (``large`` had ``tasks`` more tasks)."""
    return {place: (large[place] - small[place]) / tasks for place in large}


def lock_instructions(row: dict[str, float], plain: dict[str, float]) -> float:
    """What a lock adds per task: the pool's, the producer's and the lock server's instructions
    less plain's."""
    return sum(row[place] - plain[place] for place in LOCK_PLACES)


def summarize(rows: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each variant's per-task figures with its lock instructions (``lock_instructions``)."""
    plain = rows["plain"]
    return {
        variant: {**row, "lock instructions": lock_instructions(row, plain)} for variant, row in rows.items()
    }


def checks(summary: dict[str, dict[str, float]]) -> list[Any]:
    """LockedTask's lock instructions over the best peer's (target <= 1), and each variant's."""
    from lock_bench import Check
    from task_bench import PEER_VARIANTS

    found = []
    peers = [summary[peer]["lock instructions"] for peer in PEER_VARIANTS if peer in summary]
    if "LockedTask" in summary and peers:
        best = min(peers)
        found.append(
            Check(
                "LockedTask lock instructions / best peer's",
                summary["LockedTask"]["lock instructions"] / best,
                "<= 1",
            )
        )
    for variant, row in summary.items():
        if variant != "plain":
            found.append(Check(f"{variant} lock instructions/task", row["lock instructions"], "", "{:,.0f}"))
    return found


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))  # task_bench and lock_bench, by name, as the worker imports them
    if argv is None and sys.argv[1:2] == ["--produce"]:
        produce(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return 0
    import task_bench
    from lock_bench import print_summary, print_table, run_header, write_json

    from celery_redislock.testing import RedisServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000, help="tasks counted per variant (default 1000)")
    parser.add_argument("--base", type=int, default=50, help="tasks of the smaller run (default 50)")
    parser.add_argument("--variants", nargs="+", choices=task_bench.VARIANTS, default=task_bench.VARIANTS)
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("valgrind or callgrind_control is not on PATH (Debian: apt-get install valgrind)")
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")
    versions = task_bench.ensure_peers()
    started = time.monotonic()
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="instructions-bench-") as dumps:
        lock_out = Path(dumps, "lock-server.out")
        with (
            counted_server(lock_out) as locks,
            RedisServer() as broker,
            RedisServer() as producer_broker,
            RedisServer() as producer_locks,
            ThreadPoolExecutor(1) as producers,
        ):
            check_counted(locks, lock_out)
            scripts = script_counts(locks, lock_out)
            for step, instructions in scripts.items():
                print(f"  lock server per call of {step:<22} {instructions:>9,.0f} instructions", flush=True)
            for variant in args.variants:
                # The producer's two runs go on beside the worker's (a count does not depend on what else
                # runs), on servers of their own.
                sent = [
                    producers.submit(producer_run, variant, n, producer_broker, producer_locks)
                    for n in (args.base, args.base + args.tasks)
                ]
                small, large = (
                    worker_run(variant, n, broker, locks, lock_out)
                    for n in (args.base, args.base + args.tasks)
                )
                small["producer"], large["producer"] = (future.result() for future in sent)
                rows[variant] = per_task(small, large, args.tasks)
                row = rows[variant]
                print(
                    f"  {variant:<17} pool {row['worker pool']:>11,.0f}  main {row['worker main']:>11,.0f}"
                    f"  producer {row['producer']:>11,.0f}  lock server {row['lock server']:>9,.0f}"
                    " instructions/task",
                    flush=True,
                )
                for server in (broker, locks, producer_broker, producer_locks):
                    with server.client() as client:
                        client.flushall()
    summary = summarize(rows)
    print_table(
        f"instructions per task (callgrind; runs of {args.base} and {args.base + args.tasks} tasks, "
        "prefork -c 2; lock: pool + producer + lock server less plain's)",
        ["variant", "lock", "pool", "main", "producer", "lock server"],
        [
            [
                variant,
                f"{row['lock instructions']:,.0f}",
                f"{row['worker pool']:,.0f}",
                f"{row['worker main']:,.0f}",
                f"{row['producer']:,.0f}",
                f"{row['lock server']:,.0f}",
            ]
            for variant, row in summary.items()
        ],
    )
    found = checks(summary)
    print_summary(found)
    write_json(
        args.json,
        {
            **run_header(args),
            "versions": versions,
            "duration_s": time.monotonic() - started,
            "summary": summary,
            "lock server per script call": scripts,
            "checks": [check.line() for check in found],
        },
    )
    print(f"results written to {args.json} ({time.monotonic() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
