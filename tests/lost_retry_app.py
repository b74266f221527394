"""``celery -A tests.lost_retry_app worker``: ``tests.taskapp``'s app, in a worker whose main
process is interrupted as it parks a lost pool child's hold for the retry Celery sends
(``task_retry_on_worker_lost``): the ``WorkerTerminate`` of a hard shutdown (a third Ctrl+C or
SIGQUIT during a cold one, ``celery.apps.worker.on_hard_shutdown``) raised by the signal
handler right after ``PARK``'s reply was read, before the retry is sent. The reply is pushed
to ``{prefix}:parked`` first, for the test to see that the hold was parked."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import WorkerTerminate

import celery_redislock.lost_retry
from celery_redislock.run_lock import park
from tests.taskapp import app, recorder

__all__ = ["app"]


def _park_then_interrupted(*args: Any, **kwargs: Any) -> int:
    parked = park(*args, **kwargs)
    assert app is not None
    recorder(app).push(f"{recorder(app).prefix}:parked", str(parked))
    raise WorkerTerminate(1)


pytest.MonkeyPatch().setattr(celery_redislock.lost_retry, "park", _park_then_interrupted)  # for good
