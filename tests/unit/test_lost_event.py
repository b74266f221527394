"""A lock's ``lost`` event is made on first use (``LeaseLock.lost``): one per lock, whoever asks."""

from __future__ import annotations

import threading

import redis

from celery_redislock import RedisLock


def test_threads_asking_at_once_share_one_event() -> None:
    lock = RedisLock(redis.Redis(host="127.0.0.1", port=1), "k", ttl=5)  # never connects
    start = threading.Barrier(8)
    seen: list[threading.Event] = []

    def ask() -> None:
        start.wait()
        seen.append(lock.lost)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8 and all(event is seen[0] for event in seen)
    assert lock.lost is seen[0] and not lock.lost.is_set()


def test_a_loss_set_before_a_hold_is_taken_is_cleared_by_it() -> None:
    lock = RedisLock(redis.Redis(host="127.0.0.1", port=1), "k", ttl=5, watchdog=False)
    lock.lost.set()
    lock.take_hold("0" * 32, 1, 0.0)
    assert not lock.lost.is_set()
    lock.forget()
