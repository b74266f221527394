"""Mutual exclusion under contention: many processes, one key, recorded hold intervals never overlap.

Run on each topology: one server, Redlock over three, a Cluster, a Sentinel-watched primary.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from typing import Any

import pytest

from celery_redislock import RedisLock
from tests.conftest import Topology

PROCESSES = 16
ROUNDS = 40


def _contend(topology: Topology, key: str, fair: bool, rounds: int, start: Any, results: Any) -> None:
    """Acquire ``key`` ``rounds`` times; inside, check a shared counter and record the hold interval."""
    lock = RedisLock(topology.lock_client(), key, ttl=5, fair=fair)
    client = topology.data_clients()[0]
    holds = []
    inside_key = f"{key}:inside"
    start.wait()
    for _ in range(rounds):
        lock.acquire()
        entered = time.monotonic_ns()
        inside, _ = client.pipeline().incr(inside_key).pexpire(inside_key, 60_000).execute()
        client.decr(inside_key)
        left = time.monotonic_ns()
        holds.append((entered, left, lock.fence, inside))
        lock.release()
    results.put(holds)


@pytest.mark.parametrize("fair", [False, True], ids=["unfair", "fair"])
def test_no_two_holders_overlap(topology: Topology, prefix: str, fair: bool) -> None:
    if fair and topology.kind == "redlock":
        pytest.skip("Redlock refuses fair=True (tested in test_redlock)")
    rounds = ROUNDS
    key = f"{prefix}:k"
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    workers = [
        context.Process(target=_contend, args=(topology, key, fair, rounds, start, results))
        for _ in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    try:
        start.set()
        holds = [hold for _ in workers for hold in results.get(timeout=120)]
        for worker in workers:
            worker.join(30)
            assert worker.exitcode == 0
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
    assert len(holds) == PROCESSES * rounds
    assert {inside for *_, inside in holds} == {1}  # nobody else inside at any time
    holds.sort()
    for (_, left, fence, _), (entered, _, next_fence, _) in itertools.pairwise(holds):
        assert left <= entered  # monotonic_ns is one clock for all processes on a machine
        assert fence < next_fence  # fences grow in the order the lock was held
    topology.delete(f"{key}:inside")
    assert topology.exists(key) == 0
