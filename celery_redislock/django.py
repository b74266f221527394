"""Django: ``delay_on_commit`` and ``apply_async_on_commit``, which every ``LockedTask`` has.

Celery's Django fixup makes an app's tasks ``DjangoTask``s, which have them;
``@app.task(base=LockedTask)`` replaces that base, so ``LockedTask`` brings
them itself, as ``DjangoTask`` defines them: the call is registered with
Django's ``transaction.on_commit``, and ``apply_async`` runs when the
transaction commits. The message is sent, and in the enqueue modes its
enqueue lock taken, only then; a rollback sends nothing and takes nothing.
Outside a transaction (autocommit) it is sent at once. Whatever ``apply_async``
raises at the commit (``DuplicateTask`` with ``lock_duplicate="raise"``, a
``RedisLockError``) propagates as Django propagates an ``on_commit`` callback's
exception: out of the block that committed, after the commit.

Django is imported when one of them is called, never by importing the package.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery import Task

from .exceptions import LockConfigurationError

__all__ = ["OnCommit"]


class OnCommit(Task):  # type: ignore[type-arg]
    """``DjangoTask``'s two methods, for a task class that cannot have it as its base."""

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``delay(*args, **kwargs)`` once the current transaction commits."""
        _on_commit(self, functools.partial(self.delay, *args, **kwargs))

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``apply_async(*args, **kwargs)`` once the current transaction commits."""
        _on_commit(self, functools.partial(self.apply_async, *args, **kwargs))


def _on_commit(task: Task[Any, Any], send: Callable[[], Any]) -> None:
    try:
        from django.db import transaction
    except ImportError:
        raise LockConfigurationError(
            f"task {task.name!r}: delay_on_commit and apply_async_on_commit need Django"
        ) from None
    transaction.on_commit(send)
