"""``make demo``: celery-redislock at work in a real prefork worker, narrated, in under a minute.

Starts a private redis-server (unless ``REDIS_URL`` is set) and a worker
(``celery -A examples.tasks worker -P prefork``), then shows, one step each:
100 duplicate enqueues collapsing into one run; two ``celery beat``
processes sending one job every second, each slot run once (the beats are
started and stopped by that step); a task three times longer than its lease
keeping its lock; a worker child SIGKILLed mid-task and its lock freed at
once by the worker's main process. It stops everything it started, by pid,
checks that no lock or slot marker is left in Redis, and exits 0.

A step is a function of ``Demo`` in ``STEPS``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import redis
from celery.exceptions import TimeoutError as ResultTimeout

from celery_redislock import task_lock_key
from celery_redislock.inventory import HeldLock, held_locks, read_lock
from examples import once_per_slot, tasks
from examples._support import Worker, redis_url, say

#: The example app's redislock_prefix (the default).
PREFIX = "redislock"


@dataclass
class Demo:
    """What the steps share: the Redis client, and the worker, started by the first step
    that needs it and stopped when ``stack`` closes."""

    client: redis.Redis
    stack: ExitStack
    started: Worker | None = field(default=None)

    def worker(self) -> Worker:
        if self.started is None:
            started = time.monotonic()
            self.started = self.stack.enter_context(Worker(concurrency=2, name="demo"))
            say(
                f"   (a prefork worker with 2 pool processes started, pid {self.started.pid}, "
                f"ready in {time.monotonic() - started:.1f}s)"
            )
        return self.started

    def wait_for_lock(self, key: str, timeout: float = 30.0) -> HeldLock:
        deadline = time.monotonic() + timeout
        while (lock := read_lock(self.client, key, PREFIX)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"lock {key} was not taken within {timeout}s")
            time.sleep(0.01)  # a polling step with a deadline
        return lock


def duplicates(demo: Demo) -> None:
    say("\n1. 100 duplicate enqueues collapse into one run")
    say("   rebuild_index has lock_mode='until_executed': delay() takes the lock, the run frees it.")
    results = [tasks.rebuild_index.delay("catalog") for _ in range(100)]
    ids = {result.id for result in results}
    queued = demo.client.llen(tasks.app.conf.task_default_queue)
    say(f"   100 x rebuild_index.delay('catalog') -> {len(ids)} task id, {queued} message in the queue")
    assert len(ids) == 1 and queued == 1, (ids, queued)
    worker = demo.worker()
    outcome = results[-1].get(timeout=60)
    runs = len(worker.log_lines("examples.tasks.rebuild_index[", "received"))
    say(f"   the worker ran it {runs} time: {outcome!r}")
    assert runs == 1
    results[0].forget()


def two_beats(demo: Demo) -> None:
    say("\n2. Two beats, each slot once")
    say("   send_digest has lock_beat=True; two `celery beat` processes both send it every second.")
    once_per_slot.two_beats(demo.client, demo.worker())


def long_task(demo: Demo) -> None:
    say("\n3. A task three times longer than its lease keeps its lock")
    say("   long_report(3.0) runs 3 s with lock_ttl=1; the watchdog renews the lease every 1/3 s.")
    demo.worker()
    result = tasks.long_report.delay(3.0)
    lock = demo.wait_for_lock(task_lock_key(tasks.long_report, (3.0,)))
    started, fences = time.monotonic(), {lock.fence}
    while True:
        try:
            outcome = result.get(timeout=0.5)  # paces the look at the lock; ends with the task
            break
        except ResultTimeout:
            now = read_lock(demo.client, lock.key, PREFIX)
            if now is not None:
                fences.add(now.fence)
                say(
                    f"   {time.monotonic() - started:.1f}s in: {now.ttl:.2f}s of lease left, "
                    f"same hold (fence {now.fence})"
                )
    say(f"   done after {time.monotonic() - started:.1f}s: lock_lost={outcome['lost']}, one fence all along")
    assert not outcome["lost"] and fences == {outcome["fence"]}, (outcome, fences)
    result.forget()


def killed_child(demo: Demo) -> None:
    say("\n4. A worker child SIGKILLed mid-task: its lock is freed at once")
    say("   import_batch(1) holds a lock with a 60 s lease; we kill the pool process running it.")
    worker = demo.worker()
    result = tasks.import_batch.delay(1)
    lock = demo.wait_for_lock(task_lock_key(tasks.import_batch, (1,)))
    assert lock.pid is not None
    say(f"   held by task {lock.task_id} in pool process {lock.pid}, {lock.ttl:.0f}s of lease left; SIGKILL")
    killed = time.monotonic()
    os.kill(lock.pid, signal.SIGKILL)
    while read_lock(demo.client, lock.key, PREFIX) is not None:
        if time.monotonic() - killed > 30:
            raise AssertionError(f"lock {lock.key} still held 30 s after its holder was killed")
        time.sleep(0.005)  # a polling step with a deadline
    freed = time.monotonic() - killed
    say(f"   the lock was freed {freed:.2f}s after the kill, by the worker's main process:")
    for line in worker.wait_for_log(f"import_batch[{lock.task_id}]", "released its lock"):
        say(f"   [worker log] {line.split('] ', 1)[-1]}")
    say(f"   the task's outcome: {type(result.get(timeout=30, propagate=False)).__name__}")
    result.forget()


#: The demo's steps, in order.
STEPS: list[Callable[[Demo], None]] = [duplicates, two_beats, long_task, killed_child]


def main() -> None:
    started = time.monotonic()
    with redis_url() as url:
        client = redis.Redis.from_url(url)
        with ExitStack() as stack:
            demo = Demo(client, stack)
            for step in STEPS:
                step(demo)
        if demo.started is not None:
            say(f"\nthe worker (pid {demo.started.pid}) and its pool processes are stopped")
        left = held_locks(client, PREFIX) + list(client.scan_iter(match=f"{{{PREFIX}:*"))
        say(f"locks left in Redis: {left or 'none'}")
        assert not left, left
        client.close()
    say(f"done in {time.monotonic() - started:.1f}s")


if __name__ == "__main__":
    main()
