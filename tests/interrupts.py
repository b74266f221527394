"""An exception landing between a command's send and its reply's read (``interrupt_read``, the
fixture in ``tests/conftest.py``): what ``tests/test_interrupted_calls.py`` and
``tests/test_replace.py`` interrupt exchanges with; a signal handler landing while a
``threading.Lock`` is held (``HandlerWhileHeld``); and ``define``, the task the interrupt and
deferred-release tests run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis.connection

from celery_redislock import LockedTask

__all__ = ["Arm", "HandlerWhileHeld", "Interrupt", "arm_read_interrupts", "on_this_thread"]


class Interrupt(BaseException):
    """Stands for an exception landing from outside (a time limit, a signal): not an ``Exception``."""


Arm = Callable[..., list[int]]


def arm_read_interrupts(monkeypatch: pytest.MonkeyPatch) -> Arm:
    """``arm(when, error=Interrupt, then=None)``: from then on, the first ``read_response`` for
    which ``when()`` is true calls ``then()`` and raises ``error`` before reading anything.
    ``arm`` returns a list that gets a 1 when it did; ``monkeypatch`` undoes it."""

    def arm(
        when: Callable[[], bool],
        error: type[BaseException] = Interrupt,
        then: Callable[[], None] | None = None,
    ) -> list[int]:
        original = redis.connection.AbstractConnection.read_response
        fired: list[int] = []

        def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not fired and when():
                fired.append(1)
                if then is not None:
                    then()
                raise error
            return original(self, *args, **kwargs)

        monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_response)
        return fired

    return arm


class HandlerWhileHeld:
    """Stands for a ``threading.Lock`` (``real``): the first time it is taken with a ``with``
    while ``when()`` is true, ``handler()`` runs on the taking thread with the lock held, as a
    signal handler does that lands at the block's first statement; what the handler raises ends
    the block (the lock is released). ``fired`` gets a 1 when it did."""

    def __init__(self, real: Any, when: Callable[[], bool], handler: Callable[[], None]) -> None:
        self.real, self.when, self.handler = real, when, handler
        self.fired: list[int] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return bool(self.real.acquire(blocking, timeout))

    def release(self) -> None:
        self.real.release()

    def locked(self) -> bool:
        return bool(self.real.locked())

    def __enter__(self) -> bool:
        self.real.acquire()
        if not self.fired and self.when():
            self.fired.append(1)
            try:
                self.handler()
            except BaseException:
                self.real.release()
                raise
        return True

    def __exit__(self, *exc_info: object) -> None:
        self.real.release()


def on_this_thread() -> Callable[[], bool]:
    thread = threading.current_thread()
    return lambda: threading.current_thread() is thread


def define(app: Any, name: str, body: Any = None, **options: Any) -> Any:
    """A ``LockedTask`` ``interrupted.{name}`` of ``x`` on ``app``, returning ``x`` after
    ``body(self, x)``: a task the interrupt and deferred-release tests define with the options
    they need."""

    def run(self: Any, x: int) -> int:
        if body is not None:
            body(self, x)
        return x

    return app.task(
        **{"base": LockedTask, "bind": True, "shared": False, "name": f"interrupted.{name}", **options}
    )(run)
