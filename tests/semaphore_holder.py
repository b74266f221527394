"""A process that takes permits of a semaphore under the watchdog.

Usage: python -m tests.semaphore_holder URL NAME LIMIT TTL ROUNDS LOG.

ROUNDS 0: takes one permit, prints ``acquired <fence>`` and holds it until killed.
Else takes and gives back a permit ROUNDS times, holding each for up to 20 ms, and
records each hold in the list LOG as ``"<fence> <enter> <exit> <released>"``: the
server's clock in microseconds just after the permit was granted and just before it
was given back, and 1 if the release found it still held (0: it was lost meanwhile,
to an injected pause); prints ``done`` at the end.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import redis

from celery_redislock import LockNotOwned, RedisSemaphore


def server_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1_000_000 + micros


def main() -> None:
    url, name, limit, ttl, rounds, log = sys.argv[1:7]
    client = redis.Redis.from_url(url)
    semaphore = RedisSemaphore(client, name, int(limit), ttl=float(ttl))
    if int(rounds) == 0:
        semaphore.acquire()
        print("acquired", semaphore.fence, flush=True)
        threading.Event().wait()  # hold until killed
    for _ in range(int(rounds)):
        semaphore.acquire()
        fence, enter = semaphore.fence, server_us(client)
        time.sleep(random.uniform(0, 0.02))  # the work done under the permit
        leave = server_us(client)
        try:
            semaphore.release()
            released = 1
        except LockNotOwned:
            released = 0
        with client.pipeline() as record:  # MULTI/EXEC: the log never lacks its TTL
            record.rpush(log, f"{fence} {enter} {leave} {released}")
            record.pexpire(log, 600_000)
            record.execute()
    print("done", flush=True)


if __name__ == "__main__":
    main()
