"""A long task kept alive by the watchdog: a 3-second run under a 1-second lease.

Run: ``python -m examples.long_task`` from the repository's root (a private
Redis is started unless ``REDIS_URL`` is set).
"""

from __future__ import annotations

import subprocess
import sys

import redis
from celery.exceptions import TimeoutError as ResultTimeout

from celery_redislock import task_lock_key
from celery_redislock.inventory import read_lock
from examples._support import ROOT, Worker, redis_url, say
from examples.tasks import long_report

#: The app's redislock_prefix (the default).
PREFIX = "redislock"
LIST = [sys.executable, "-m", "celery", "-A", "examples.tasks", "redislock", "list"]


def main() -> None:
    with redis_url() as url, Worker() as worker:
        client = redis.Redis.from_url(url)
        key = task_lock_key(long_report, (3.0,))
        say(f"long_report(3.0) runs 3 s with lock_ttl=1; a worker (pid {worker.pid}) runs it.")
        say("The lock, looked at every 0.5 s while the task runs:")
        result = long_report.delay(3.0)
        fences, shown = set(), False
        while True:
            try:
                outcome = result.get(timeout=0.5)  # paces the look at the lock, ends with the task
                break
            except ResultTimeout:
                lock = read_lock(client, key, PREFIX)
                if lock is None:
                    say("  not held yet")
                    continue
                fences.add(lock.fence)
                left = f"{lock.ttl:.2f}s of lease left"
                say(f"  held by task {lock.task_id}, pid {lock.pid}: {left}, fence {lock.fence}")
                if not shown:
                    say("  `celery -A examples.tasks redislock list` shows it too:")
                    listing = subprocess.run(LIST, cwd=ROOT, capture_output=True, text=True, check=True)
                    say("    " + listing.stdout.strip().replace("\n", "\n    "))
                    shown = True
        say(f"the task ended: lock_lost={outcome['lost']}, fence {outcome['fence']} all along")
        assert not outcome["lost"] and fences <= {outcome["fence"]}, (outcome, fences)
        assert read_lock(client, key, PREFIX) is None
        say("and its lock is released")
        result.forget()
        client.close()


if __name__ == "__main__":
    main()
