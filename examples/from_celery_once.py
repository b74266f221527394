"""A celery-once task converted to ``LockedTask`` (docs/migrating.md), run end to end.

Before, with celery-once::

    from celery_once import AlreadyQueued, QueueOnce

    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": REDIS_URL, "default_timeout": 60 * 60},
    }

    @app.task(base=QueueOnce, once={"keys": ["feed_id"], "timeout": 10 * 60, "graceful": True})
    def import_feed(feed_id, full=False): ...

    @app.task(base=QueueOnce, once={"keys": ["feed_id"]})  # graceful=False: AlreadyQueued
    def import_feed_strict(feed_id, full=False): ...

After: the two tasks below. ``once["keys"]`` is ``lock_on``, ``once["timeout"]`` the
longest wait of a queued message (``lock_queue_ttl``; a running task's lock is renewed
instead of timing out), ``graceful=True`` the default ``lock_duplicate="return"`` (the
queued task's own result, not an empty one) and ``graceful=False`` is
``lock_duplicate="raise"`` (``DuplicateTask`` instead of ``AlreadyQueued``).

Run: ``python -m examples.from_celery_once`` from the repository's root (a private
Redis is started unless ``REDIS_URL`` is set).
"""

from __future__ import annotations

import uuid

from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redislock import DuplicateTask, LockedTask
from examples._support import redis_url, say


def make_app(url: str) -> Celery:
    app = Celery("from_celery_once", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        redislock_url=url,  # was ONCE["settings"]["url"]; the default is the broker's Redis anyway
        redislock_queue_ttl=60 * 60,  # was ONCE["settings"]["default_timeout"]
        task_default_queue=f"from-celery-once-{uuid.uuid4().hex[:8]}",  # its own, on your Redis
    )

    @app.task(
        base=LockedTask,
        name="feeds.import_feed",
        lock_mode="until_executed",  # QueueOnce: locked by delay(), until the task has run
        lock_on=("feed_id",),  # once={"keys": ["feed_id"]}
        lock_queue_ttl=10 * 60,  # once={"timeout": 600}, for the queued message
    )  # once={"graceful": True}: lock_duplicate="return", the default
    def import_feed(feed_id: int, full: bool = False) -> str:
        return f"feed {feed_id} imported ({'full' if full else 'changes'})"

    @app.task(
        base=LockedTask,
        name="feeds.import_feed_strict",
        lock_mode="until_executed",
        lock_on=("feed_id",),
        lock_duplicate="raise",  # once={"graceful": False}: DuplicateTask, was AlreadyQueued
    )
    def import_feed_strict(feed_id: int, full: bool = False) -> str:
        return f"feed {feed_id} imported"

    return app


def main() -> None:
    with redis_url() as url:
        app = make_app(url)
        import_feed, import_feed_strict = (
            app.tasks["feeds.import_feed"],
            app.tasks["feeds.import_feed_strict"],
        )
        say("no worker yet: three calls for feed 7, the third with full=True (lock_on covers feed_id only)")
        results = [import_feed.delay(7), import_feed.delay(7), import_feed.delay(7, full=True)]
        ids = {result.id for result in results}
        say(f"  {len(ids)} task id among the 3 results: the duplicates got the queued task's result")
        assert len(ids) == 1, ids
        first = import_feed_strict.delay(7)
        refused: DuplicateTask | None = None
        try:
            import_feed_strict.delay(7)
        except DuplicateTask as duplicate:
            refused = duplicate
        assert refused is not None and refused.existing_task_id == first.id, refused
        say(f"  import_feed_strict refuses its duplicate: DuplicateTask, existing task {first.id}")
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            answer = results[0].get(timeout=60)
            say(f"a worker runs the one queued import_feed: {answer!r}; every result says the same")
            assert all(result.get(timeout=10) == answer for result in results)
            first.get(timeout=60)
            again = import_feed.delay(7)
            say(f"once it has run, its lock is gone: a new call is a new task ({again.get(timeout=60)!r})")
            assert again.id not in ids
        for result in (results[0], first, again):
            result.forget()
        app.close()


if __name__ == "__main__":
    main()
