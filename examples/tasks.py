"""The example app: one task per thing celery-redislock does (see README.md in this folder).

Run a worker for it with ``celery -A examples.tasks worker`` from the
repository's root, with ``REDIS_URL`` pointing at your Redis.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, Task

from celery_redislock import LockedTask, lock_fields

app = Celery("examples")
app.config_from_object("examples.celeryconfig")


@app.task(base=LockedTask, bind=True, lock_busy="wait", lock_wait_timeout=60)
def sync_account(self: Task[Any, Any], account_id: int) -> dict[str, Any]:
    """Never two syncs of one account at once: a second call waits for the first
    (``lock_busy="wait"``), while other accounts sync alongside."""
    started = time.time()
    time.sleep(0.5)  # the work
    return {"account": account_id, "start": started, "end": time.time(), "pid": os.getpid()}


@app.task(base=LockedTask, bind=True, lock_mode="until_executed")
def rebuild_index(self: Task[Any, Any], name: str) -> str:
    """Queued or running at most once per index: a duplicate ``delay()`` sends
    nothing and returns the ``AsyncResult`` of the one already queued or running."""
    time.sleep(0.5)  # the work
    return f"index {name} rebuilt by task {self.request.id}"


@app.task(base=LockedTask, bind=True, lock_ttl=1)
def long_report(self: Task[Any, Any], seconds: float) -> dict[str, Any]:
    """Runs ``seconds``, longer than its 1-second lease: the watchdog renews the
    lock every 1/3 s, so it is never lost (``lock_lost`` stays False)."""
    time.sleep(seconds)  # the work
    lock = lock_fields(self.request)  # self.request.lock_fence etc., typed
    return {"fence": lock.fence, "lost": lock.lost}


@app.task(base=LockedTask, bind=True, lock_ttl=60)
def import_batch(self: Task[Any, Any], batch_id: int) -> int:
    """A long job with a long lease: if its pool process dies (SIGKILL, OOM), the
    worker's main process frees its lock at once instead of after 60 s."""
    time.sleep(30)  # the work
    return batch_id


@app.task(base=LockedTask, bind=True, lock_beat=True, ignore_result=True)
def send_digest(self: Task[Any, Any]) -> str:
    """Sent by beat (``examples.celeryconfig.beat_schedule``): ``lock_beat=True`` runs it
    once per slot of its schedule, however many beats send it; ``self.request.lock_slot``
    names the slot."""
    return f"digest of slot {lock_fields(self.request).slot} sent by task {self.request.id}"


@app.task(
    base=LockedTask,
    bind=True,
    lock_mode="until_executing",
    lock_duplicate="replace",
    lock_on=("user_id",),
)
def reindex_user(self: Task[Any, Any], user_id: int, version: int) -> str:
    """Debounced per user: each call takes the queued one's place (``lock_duplicate="replace"``),
    so a burst of calls sent with a ``countdown`` runs once, with the last call's arguments."""
    return f"user {user_id} reindexed at version {version}"
