"""``lock_fields``: the ``lock_*`` fields of a run's request, typed."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task
from celery.app.task import Context

from celery_redislock import LockedTask, LockFields, lock_fields, task_lock_key
from celery_redislock.testing import RedisServer


def test_a_run_reads_its_lock_fields_and_a_plain_request_has_none(
    fresh_server: RedisServer, prefix: str
) -> None:
    app = Celery("fields", set_as_current=False)
    app.conf.update(redislock_url=fresh_server.url, redislock_prefix=prefix)

    @app.task(base=LockedTask, bind=True, shared=False, name="fields.read")
    def read(self: Task[Any, Any], x: int) -> LockFields:
        return lock_fields(self.request)

    fields = read.apply((1,)).get()
    assert isinstance(fields, LockFields)
    assert (fields.key, fields.lost, fields.slot) == (task_lock_key(read, (1,)), False, None)
    assert isinstance(fields.fence, int) and fields.fence > 0
    assert lock_fields(Context()) == LockFields(key=None, fence=None, lost=False, slot=None)
    app.close()
