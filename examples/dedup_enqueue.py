"""De-duplicated enqueue: 100 identical ``delay()`` calls send one message, and it runs once.

Run: ``python -m examples.dedup_enqueue`` from the repository's root (a private
Redis is started unless ``REDIS_URL`` is set).
"""

from __future__ import annotations

import redis

from examples._support import Worker, redis_url, say
from examples.tasks import app, rebuild_index


def main() -> None:
    with redis_url() as url:
        say("rebuild_index has lock_mode='until_executed': its lock is taken by delay() and held")
        say("until the task has run. 100 identical calls, while no worker is up yet:")
        results = [rebuild_index.delay("catalog") for _ in range(100)]
        ids = {result.id for result in results}
        client = redis.Redis.from_url(url)
        queued = client.llen(app.conf.task_default_queue)
        say(f"  {len(ids)} distinct task id among the 100 results, {queued} message in the queue")
        assert len(ids) == 1 and queued == 1, (ids, queued)
        with Worker() as worker:
            say(f"a worker starts (pid {worker.pid}) and runs it: {results[0].get(timeout=60)!r}")
            received = worker.log_lines("examples.tasks.rebuild_index[", "received")
            say(f"  the worker received {len(received)} rebuild_index message")
            assert len(received) == 1, received
            say(f"  every one of the 100 results gives the same answer: {results[-1].get(timeout=10)!r}")
            again = rebuild_index.delay("catalog")
            say(f"once it has run, the lock is gone: a new call is a new task ({again.get(timeout=60)!r})")
            assert again.id not in ids
            for result in (results[0], again):
                result.forget()
        client.close()


if __name__ == "__main__":
    main()
