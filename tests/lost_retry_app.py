"""``celery -A tests.lost_retry_app worker``: ``tests.taskapp``'s app, in a worker whose main
process fails as it handles the retry Celery sends for a lost pool child's task
(``task_retry_on_worker_lost``), as ``LOST_RETRY_FAULT`` says:

* ``interrupted-after-park``: the ``WorkerTerminate`` of a hard shutdown (a third Ctrl+C or
  SIGQUIT during a cold one, ``celery.apps.worker.on_hard_shutdown``) raised by the signal
  handler right after ``PARK``'s reply was read, before the retry is sent. The reply is pushed
  to ``{prefix}:parked`` first, for the test to see that the hold was parked;
* ``on-retry-raises``: ``taskapp.slow_start``'s ``on_retry``, which Celery calls once the retry
  was sent, raises.
"""

from __future__ import annotations

import os
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


def _on_retry_raises(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("on_retry failed")


_FAULT = os.environ["LOST_RETRY_FAULT"]
assert app is not None
if _FAULT == "interrupted-after-park":
    pytest.MonkeyPatch().setattr(celery_redislock.lost_retry, "park", _park_then_interrupted)  # for good
elif _FAULT == "on-retry-raises":
    pytest.MonkeyPatch().setattr(app.tasks["taskapp.slow_start"], "on_retry", _on_retry_raises)  # for good
else:
    raise ValueError(f"LOST_RETRY_FAULT={_FAULT!r}")
