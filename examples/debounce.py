"""Debounce: ``lock_duplicate="replace"`` plus a ``countdown``. 100 calls in a burst run once,
with the last call's arguments.

Run: ``python -m examples.debounce`` from the repository's root (a private
Redis is started unless ``REDIS_URL`` is set).
"""

from __future__ import annotations

from examples._support import Worker, redis_url, say
from examples.tasks import reindex_user


def main() -> None:
    with redis_url():
        say("reindex_user has lock_mode='until_executing', lock_duplicate='replace' and")
        say("lock_on=('user_id',): its key is the user, whatever the version. 100 calls for")
        say("user 7, versions 0 to 99, each with countdown=2 (the debounce window):")
        results = [reindex_user.apply_async((7, version), countdown=2) for version in range(100)]
        say(f"  {len({result.id for result in results})} messages sent: each took the lock over")
        with Worker() as worker:
            say(f"a worker starts (pid {worker.pid}); the last call runs: {results[-1].get(timeout=60)!r}")
            superseded = [result.get(timeout=60) for result in results[:-1]]
            assert superseded == [None] * 99, superseded
            dropped = worker.log_lines("examples.tasks.reindex_user[", "dropped: superseded by task")
            say(f"  the 99 calls before it were dropped unrun ({len(dropped)} INFO lines), each:")
            say(f"  {dropped[0].split('] ', 1)[-1]}" if dropped else "  (none logged)")
            assert len(dropped) == 99, len(dropped)
            # Celery logs a success after storing its result: the line may still be on its way
            ran = worker.wait_for_log("examples.tasks.reindex_user[", "succeeded", "reindexed at version")
            say(f"  reindex_user ran {len(ran)} time")
            assert len(ran) == 1, ran
        for result in results:
            result.forget()


if __name__ == "__main__":
    main()
