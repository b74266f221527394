"""Helpers of the unit tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def asked_at_once(ask: Callable[[], T], threads: int = 8) -> list[T]:
    """What ``ask()`` returned in each of ``threads`` threads released together (a barrier)."""
    start = threading.Barrier(threads)
    seen: list[T] = []

    def run() -> None:
        start.wait()
        seen.append(ask())

    started = [threading.Thread(target=run) for _ in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()
    return seen
