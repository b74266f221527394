"""No two holders that kept their lock overlap, and fences grow in hold order, under stress: 32
processes, 50,000+ acquisitions of 4 keys, pauses injected into holders.

Each process acquires a random key (two first-come keys, two fair ones) with
the watchdog on, writes to a resource that accepts a write only with a fence
greater than any it accepted before (what the README tells users to do), and
releases. Into the holds go:

* short pauses (a sleep of up to 2 ms: GC, a slow call), which the lease covers;
* freezes longer than the lease: the holder writes its pid to a pipe and
  stops itself (SIGSTOP: every thread, the watchdog included); the test sends
  SIGCONT 0.6-1.2 s later. Its lease runs out, another process takes the key,
  and the frozen one wakes up a stale holder.

A hold counts as *owned* when its ``release()`` succeeded: the key still had
its token then, and since a token is never reused, it had it throughout.
Owned holds of one key must not overlap in time (``time.monotonic_ns`` is one
clock for all processes of a machine), their fences must grow in the order
they were held, and every write they made must have been accepted. Stale
holders' writes that came after a newer holder's must have been refused.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import threading
import time
from collections import defaultdict
from itertools import pairwise
from typing import Any, NamedTuple

import pytest
import redis

from celery_redislock import LockNotOwned, RedisLock
from celery_redislock.testing import RedisServer
from tests.invariants import Sampler

PROCESSES = 32
ACQUISITIONS = 50_000
PER_PROCESS = -(-ACQUISITIONS // PROCESSES)
KEYS = 4  # keys 0-1 first-come, 2-3 fair (all users of one key agree on fairness)
TTL = 0.5
FREEZE_EVERY = 1500  # holds per freeze, on average
FREEZE = (0.6, 1.2)  # seconds, longer than TTL
RESOURCE_TTL_MS = 300_000

# KEYS[1] the resource; ARGV[1] the writer's fence, ARGV[2] the key's TTL in ms.
# Accepts (returns 1) only a fence greater than every fence accepted before.
FENCED_WRITE = """
local top = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > top then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


class Hold(NamedTuple):
    key: int
    fence: int
    entered: int  # monotonic_ns once acquire() returned
    left: int  # monotonic_ns before release() was sent
    owned: bool  # release() succeeded
    accepted: bool  # the fenced write was accepted
    frozen: bool


def _contend(url: str, prefix: str, freeze_fd: int, start: Any, results: Any) -> None:
    logging.disable(logging.CRITICAL)  # a frozen holder's watchdog reports its loss: expected here
    client = redis.Redis.from_url(url)
    write = client.register_script(FENCED_WRITE)
    locks = [RedisLock(client, f"{prefix}:k{i}", ttl=TTL, fair=i >= KEYS // 2) for i in range(KEYS)]
    rng = random.Random(os.getpid())
    holds: list[Hold] = []
    start.wait()
    for _ in range(PER_PROCESS):
        index = rng.randrange(KEYS)
        lock = locks[index]
        if not lock.acquire(timeout=60):
            results.put(f"process {os.getpid()} could not acquire key {index} in 60 s")
            return
        entered = time.monotonic_ns()
        fence = lock.fence or 0
        frozen = rng.randrange(FREEZE_EVERY) == 0
        if frozen:
            os.write(freeze_fd, b"%d\n" % os.getpid())
            os.kill(os.getpid(), signal.SIGSTOP)  # the test resumes us after the lease ran out
        elif rng.random() < 0.05:
            time.sleep(rng.uniform(0, 0.002))
        accepted = bool(write(keys=[f"{prefix}:resource{index}"], args=[fence, RESOURCE_TTL_MS]))
        left = time.monotonic_ns()
        try:
            lock.release()
            owned = True
        except LockNotOwned:
            owned = False
        holds.append(Hold(index, fence, entered, left, owned, accepted, frozen))
    results.put(holds)


def _thaw(read_fd: int, frozen: list[int], done: threading.Event) -> None:
    """Resume each process that froze itself, once it is stopped and FREEZE has passed."""
    rng = random.Random(0)
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        buffer = b""
        while not done.is_set():
            chunk = pipe.read(4096)
            if not chunk:
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                pid = int(line)
                deadline = time.monotonic() + 10
                while _state(pid) != "T":  # stopped: SIGSTOP delivered (poll against a deadline)
                    assert time.monotonic() < deadline, f"process {pid} never stopped"
                    time.sleep(0.001)
                done.wait(rng.uniform(*FREEZE))  # the freeze itself: a fault parameter
                os.kill(pid, signal.SIGCONT)
                frozen.append(pid)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0]


@pytest.mark.slow
def test_no_two_owning_holders_overlap_under_pauses(fresh_server: RedisServer, prefix: str) -> None:
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    read_fd, write_fd = os.pipe()
    children = [
        context.Process(target=_contend, args=(fresh_server.url, prefix, write_fd, start, results))
        for _ in range(PROCESSES)
    ]
    for child in children:
        child.start()
    os.close(write_fd)
    frozen: list[int] = []
    done = threading.Event()
    thawer = threading.Thread(target=_thaw, args=(read_fd, frozen, done), daemon=True)
    thawer.start()
    began = time.monotonic()
    try:
        with Sampler(fresh_server.client(), prefix, every=0.2):
            start.set()
            outcomes = [results.get(timeout=300) for _ in children]
        for child in children:
            child.join(30)
            assert child.exitcode == 0
    finally:
        done.set()
        for child in children:
            if child.is_alive():
                os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]
                child.kill()
                child.join()
    took = time.monotonic() - began
    errors = [outcome for outcome in outcomes if isinstance(outcome, str)]
    assert errors == []
    holds = [hold for outcome in outcomes for hold in outcome]
    assert len(holds) >= ACQUISITIONS
    by_key: dict[int, list[Hold]] = defaultdict(list)
    for hold in holds:
        by_key[hold.key].append(hold)
    for key, key_holds in by_key.items():
        owned = sorted((hold for hold in key_holds if hold.owned), key=lambda hold: hold.entered)
        for before, after in pairwise(owned):
            assert before.left <= after.entered, f"key {key}: owning holders overlapped: {before} {after}"
            assert before.fence < after.fence, f"key {key}: fences out of order: {before} {after}"
        assert all(hold.accepted for hold in owned), f"key {key}: an owning holder's write was refused"
    stale = [hold for hold in holds if not hold.owned]
    print(
        f"{len(holds)} acquisitions in {took:.1f}s ({len(holds) / took:.0f}/s), {len(frozen)} freezes, "
        f"{len(stale)} holders lost their lock ({sum(not hold.frozen for hold in stale)} not frozen), "
        f"{sum(not hold.accepted for hold in stale)} stale writes refused"
    )
    assert frozen and stale, "no pause made a holder lose its lock: the test proved nothing"
    assert any(not hold.accepted for hold in stale), "no stale write was refused"
    client = fresh_server.client()
    assert client.exists(*[f"{prefix}:k{i}" for i in range(KEYS)]) == 0
    client.delete(*[f"{prefix}:resource{i}" for i in range(KEYS)])
