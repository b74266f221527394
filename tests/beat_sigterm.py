"""A real ``celery beat`` (``celery.apps.beat.Beat``, its SIGTERM handler installed) that leads
and gets a real SIGTERM, from its own main thread, while its leader lock's state is held: inside the
``with`` block of ``renewals_on_time``, as the leader checks before its first send that it
still leads.

Usage: python -m tests.beat_sigterm URL PREFIX. Prints ``SIGTERM sent`` as it sends the signal
and ``beat exited`` once ``Beat.run`` returned; beat logs to stderr.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, cast

from celery import Celery
from celery.apps.beat import Beat

import celery_redislock.beat
from celery_redislock import RedisLock
from tests.taskapp import make_app


def leader_lock(*args: Any, **kwargs: Any) -> RedisLock:
    """The beat leader's lock, whose first ``held()`` inside ``renewals_on_time`` (where the
    lock's state is held) sends SIGTERM to this process; the handler runs there."""
    lock = RedisLock(*args, **kwargs)
    held, sent = lock.held, list[int]()

    def held_or_signal() -> bool:
        if not sent and sys._getframe(1).f_code.co_name == "renewals_on_time":
            sent.append(1)
            assert lock._state.locked()
            print("SIGTERM sent", flush=True)
            # to this thread: pending as the call returns, handled right after it, in the block
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            raise AssertionError("the SIGTERM handler did not run inside the block")
        return held()

    lock.held = held_or_signal  # type: ignore[method-assign]
    return lock


def leader_app(url: str, prefix: str) -> Celery:
    """An app whose beat leads (a lease longer than a test) and sends an entry every 0.2 s."""
    return make_app(
        url,
        prefix,
        f"q-{prefix}",
        beat_schedule={"e": {"task": "taskapp.beat_off", "schedule": 0.2, "args": ["e"]}},
        redislock_beat_leader=True,
        redislock_beat_leader_ttl=30,
        beat_enable_remote_control=False,
    )


def main() -> None:
    app = leader_app(sys.argv[1], sys.argv[2])
    cast(Any, celery_redislock.beat).RedisLock = leader_lock  # the lock Leadership makes
    Beat(app=app, scheduler="celery.beat:Scheduler", loglevel="INFO", quiet=True).run()
    print("beat exited", flush=True)


if __name__ == "__main__":
    main()
