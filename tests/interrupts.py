"""An exception landing between a command's send and its reply's read (``interrupt_read``, the
fixture in ``tests/conftest.py``): what ``tests/test_interrupted_calls.py`` and
``tests/test_replace.py`` interrupt exchanges with; and ``define``, the task the interrupt and
deferred-release tests run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis.connection

from celery_redislock import LockedTask

__all__ = ["Arm", "Interrupt", "arm_read_interrupts", "on_this_thread"]


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
