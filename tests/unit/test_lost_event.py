"""A lock's ``lost`` event is made on first use (``LeaseLock.lost``): one per lock, whoever asks."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from celery_redislock import RedisLock, primitive
from tests.unit.threads import asked_at_once


def test_threads_asking_at_once_share_one_event() -> None:
    lock = RedisLock(redis.Redis(host="127.0.0.1", port=1), "k", ttl=5)  # never connects
    seen = asked_at_once(lambda: lock.lost)
    assert len(seen) == 8 and all(event is seen[0] for event in seen)
    assert lock.lost is seen[0] and not lock.lost.is_set()


def test_a_loss_set_before_a_hold_is_taken_is_cleared_by_it() -> None:
    lock = RedisLock(redis.Redis(host="127.0.0.1", port=1), "k", ttl=5, watchdog=False)
    lock.lost.set()
    lock.take_hold("0" * 32, 1, 0.0)
    assert not lock.lost.is_set()
    lock.forget()


def test_a_child_forked_while_a_lost_event_was_being_made_makes_its_own() -> None:
    """A thread of the parent holds the lock that guards the making of ``lost`` events at the
    fork (here: this thread): the child's first ``lost`` does not hang on the copy it inherited."""
    with primitive._MAKING_LOST:
        pid = os.fork()
        if pid == 0:  # the child: exits 0 once it made an event, never returns into pytest
            lock = RedisLock(redis.Redis(host="127.0.0.1", port=1), "k", ttl=5)
            os._exit(0 if not lock.lost.is_set() else 1)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the child's exit, with a deadline
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child hung making its lost event")
    assert os.waitstatus_to_exitcode(done[1]) == 0
