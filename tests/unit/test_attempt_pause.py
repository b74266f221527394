"""``Attempt.pause``: a waiter's only timer is the holder's remaining TTL (docs/design.md)."""

from __future__ import annotations

import time

import pytest

from celery_redislock.attempt import SHORTEST_PAUSE, Attempt


def paused_after(pttl_ms: int | None, deadline: float | None = None) -> float:
    """How long a 30 s waiter sleeps after a busy reply naming a holder with ``pttl_ms`` left."""
    attempt = Attempt("a" * 32, "30000:" + "a" * 32 + ":0:w", 30.0, True, deadline)
    attempt.mode()
    assert attempt.granted([pttl_ms, b"holder"]) is None
    return attempt.pause()


@pytest.mark.parametrize(
    ("pttl_ms", "sleeps"),
    [
        (1500, 1.5),  # until the holder's lease runs out
        (0, SHORTEST_PAUSE),  # the holder's last millisecond: the key goes at once (not the waiter's own ttl)
        (-2, SHORTEST_PAUSE),  # gone between the attempt's GET and PTTL: free now
        (-1, 30.0),  # a key without expiry (not a lock's): looked at again after the waiter's ttl
        (None, 30.0),  # no server said (a Redlock's all failed)
    ],
)
def test_a_waiter_sleeps_until_the_holders_ttl_runs_out(pttl_ms: int | None, sleeps: float) -> None:
    assert paused_after(pttl_ms) == pytest.approx(sleeps)


def test_the_deadline_bounds_the_sleep() -> None:
    assert paused_after(10_000, time.monotonic() + 0.5) <= 0.5
