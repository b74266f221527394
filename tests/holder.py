"""A process that takes a lock under the watchdog and holds it until killed.

Usage: python -m tests.holder URL KEY TTL. Prints ``acquired <fence>`` once held.
"""

from __future__ import annotations

import sys
import threading

import redis

from celery_redislock import RedisLock


def main() -> None:
    url, key, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    lock = RedisLock(redis.Redis.from_url(url), key, ttl=ttl)
    lock.acquire()
    print("acquired", lock.fence, flush=True)
    threading.Event().wait()  # hold until killed


if __name__ == "__main__":
    main()
