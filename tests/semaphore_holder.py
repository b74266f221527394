"""A process that takes permits of a semaphore under the watchdog.

Usage: python -m tests.semaphore_holder URL NAME LIMIT TTL ROUNDS LOG [PAUSE].

ROUNDS 0: takes one permit, prints ``acquired <fence>`` and holds it until killed.
Else takes and gives back a permit ROUNDS times, holding each for up to 20 ms, and
records every hold in the list LOG as ``"<fence> <end> <released>"``: the fence is
the server's clock in microseconds when the permit was granted (``_permit_scripts``),
``end`` the server's clock just before the release, or, when the release found the
permit lost meanwhile (``released`` 0), just after it: when the holder learnt of the
loss. In round PAUSE (if given) it stops itself (SIGSTOP) right after printing
``acquired <fence>``, for the test to resume it (SIGCONT) past its lease. Prints
``done`` at the end.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

import redis

from celery_redislock import LockNotOwned, RedisSemaphore


def server_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1_000_000 + micros


def hold(client: redis.Redis, semaphore: RedisSemaphore, pause: bool) -> str:
    """Take a permit, do the work, give it back; the hold's record."""
    semaphore.acquire()
    fence = semaphore.fence
    print("acquired", fence, flush=True)
    if pause:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen here, holding the permit, until the test resumes it
    time.sleep(random.uniform(0, 0.02))  # the work done under the permit
    end = server_us(client)
    try:
        semaphore.release()
    except LockNotOwned:
        return f"{fence} {server_us(client)} 0"
    return f"{fence} {end} 1"


def main() -> None:
    url, name, limit, ttl, rounds, log, *pause = sys.argv[1:]
    client = redis.Redis.from_url(url)
    semaphore = RedisSemaphore(client, name, int(limit), ttl=float(ttl))
    if int(rounds) == 0:
        semaphore.acquire()
        print("acquired", semaphore.fence, flush=True)
        threading.Event().wait()  # hold until killed
    for round_ in range(int(rounds)):
        record = hold(client, semaphore, [str(round_)] == pause)
        with client.pipeline() as push:  # MULTI/EXEC: the log never lacks its TTL
            push.rpush(log, record)
            push.pexpire(log, 600_000)
            push.execute()
    print("done", flush=True)


if __name__ == "__main__":
    main()
