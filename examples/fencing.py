"""Fencing tokens guarding a write: a holder paused past its lease cannot overwrite newer data.

Every hold of a lock gets a fence greater than all earlier ones
(``RedisLock.fence``; ``self.request.lock_fence`` inside a ``LockedTask``).
The database keeps the fence of the last write it accepted and refuses an
older one, in the same statement as the write::

    UPDATE prices SET price = ?, fence = ? WHERE sku = ? AND fence < ?

Here a holder process is paused (SIGSTOP, as a long GC pause or a VM stall
would) until its 1-second lease runs out; a second holder takes the lock and
writes; then the first one resumes and tries to write with its old fence.

Run: ``python -m examples.fencing`` from the repository's root (a private
Redis is started unless ``REDIS_URL`` is set).
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from celery_redislock import LockNotOwned, RedisLock
from examples._support import ROOT, redis_url, say

KEY = "examples:price:sku-1"


def write_price(db: Path, price: int, fence: int) -> bool:
    """Write ``price`` if ``fence`` is newer than the last write's; whether it was written."""
    with sqlite3.connect(db) as connection:
        cursor = connection.execute(
            "UPDATE prices SET price = ?, fence = ? WHERE sku = 'sku-1' AND fence < ?", (price, fence, fence)
        )
        return cursor.rowcount == 1


def verdict(written: bool) -> str:
    return "accepted" if written else "REFUSED"


def holder(url: str, db: Path) -> None:
    """The first holder (a process of its own): take the lock, wait for the word, write."""
    logging.basicConfig(stream=sys.stdout, format="   [first holder's log] %(levelname)s %(message)s")
    lock = RedisLock(redis.Redis.from_url(url), KEY, ttl=1)
    lock.acquire()
    print(f"fence {lock.fence}", flush=True)
    price = int(sys.stdin.readline())  # the work is done; this process may have been paused meanwhile
    written = write_price(db, price, lock.fence or 0)
    print(f"   [first holder] writes price {price} with fence {lock.fence}: {verdict(written)}")
    lock.lost.wait(timeout=5)  # the watchdog, running again, finds the lock gone
    print(f"   [first holder] its watchdog reports the loss: lock.lost={lock.lost.is_set()}")
    try:
        lock.release()
    except LockNotOwned as exc:
        print(f"   [first holder] and its release is refused: {exc}", flush=True)


def main() -> None:
    with redis_url() as url, tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "shop.db"
        with sqlite3.connect(db) as connection:
            connection.execute("CREATE TABLE prices (sku TEXT PRIMARY KEY, price INTEGER, fence INTEGER)")
            connection.execute("INSERT INTO prices VALUES ('sku-1', 100, 0)")
        first = subprocess.Popen(
            [sys.executable, "-m", "examples.fencing", "--holder", url, str(db)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert first.stdin is not None and first.stdout is not None
            stale = int(first.stdout.readline().split()[1])
            say(f"the first holder (pid {first.pid}) takes the lock with a 1 s lease: fence {stale}")
            os.kill(first.pid, signal.SIGSTOP)
            say("it is paused (SIGSTOP): its watchdog cannot renew the lease")
            started = time.monotonic()
            with RedisLock(redis.Redis.from_url(url), KEY, ttl=5, timeout=10) as lock:
                waited = time.monotonic() - started
                say(f"a second holder gets the lock {waited:.2f}s later: fence {lock.fence}")
                written = write_price(db, 120, lock.fence or 0)
                say(f"   [second holder] writes price 120 with fence {lock.fence}: {verdict(written)}")
                assert written and (lock.fence or 0) > stale
            say("the first holder resumes (SIGCONT) and writes price 90 with its old fence:")
            os.kill(first.pid, signal.SIGCONT)
            first.stdin.write("90\n")
            first.stdin.close()
            said = first.stdout.read()
            say(said.rstrip())
            assert first.wait(timeout=30) == 0 and "REFUSED" in said, said
        finally:
            if first.poll() is None:
                os.kill(first.pid, signal.SIGKILL)
                first.wait()
        with sqlite3.connect(db) as connection:
            price, fence = connection.execute("SELECT price, fence FROM prices").fetchone()
        say(f"the database keeps price {price}, written with fence {fence}")
        assert price == 120


if __name__ == "__main__":
    if sys.argv[1:2] == ["--holder"]:
        holder(sys.argv[2], Path(sys.argv[3]))
    else:
        main()
