"""Fixtures of the fault suite: a Redis server of the test's own, worker subprocesses, a sampler.

Each fault test gets ``stage``: a private redis-server (broker, results and
locks, unless the test points the locks elsewhere), the test-side app, and a
way to start worker subprocesses that are stopped by pid when the test ends.
While the test runs, a ``Sampler`` checks that no key of the test is ever
without a TTL; once it ends, the suite-wide checker (``tests/conftest.py``)
checks that no lock is left.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock.testing import RedisServer
from tests.invariants import Sampler
from tests.taskapp import Recorder, make_app, text
from tests.workers import WorkerProcess, wait_for

RESULT_TIMEOUT = 30


class KeyEvents:
    """What happens to one key, in the order Redis did it, however slow each process is: its
    keyspace events (``set``, ``expire`` as a renewal's PEXPIRE, ``del``, ``expired``), with the
    test's own marks among them (``mark``: a PUBLISH, after every command Redis has run)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.channel = client, f"__keyspace@0__:{key}"
        client.config_set("notify-keyspace-events", "Kg$x")  # the stage's server is the test's own
        self.pubsub = client.pubsub()  # type: ignore[no-untyped-call]  # untyped in redis-py
        self.pubsub.subscribe(self.channel)
        wait_for(lambda: self.pubsub.get_message(timeout=0.01), what="the subscription")
        self.seen: list[str] = []

    def mark(self, label: str) -> None:
        self.client.publish(self.channel, label)

    def until(self, done: Callable[[list[str]], bool], what: str) -> list[str]:
        """Every event so far, once ``done`` says they are enough."""

        def enough() -> bool:
            while (message := self.pubsub.get_message(timeout=0.01)) is not None:
                self.seen.append(message["data"].decode())
            return done(self.seen)

        wait_for(enough, what=lambda: f"{what}; the key's events: {self.seen}")
        return self.seen

    def close(self) -> None:
        self.pubsub.close()


class Stage:
    """A fault test's world: ``server``, ``app`` (the test side), workers, events."""

    def __init__(self, server: RedisServer, prefix: str) -> None:
        self.server = server
        self.prefix = prefix
        self.queue = f"q-{prefix}"
        self.app = make_app(server.url, prefix, self.queue)
        self.recorder: Recorder = self.app.recorder  # type: ignore[attr-defined]
        self.client: redis.Redis = self.recorder.client
        self.workers: list[WorkerProcess] = []
        self.watched: list[KeyEvents] = []

    def task(self, name: str) -> Any:
        return self.app.tasks[f"taskapp.{name}"]

    def app_with(self, **conf: Any) -> Celery:
        """Another test-side app on the same prefix, with more settings."""
        return make_app(self.server.url, self.prefix, self.queue, **conf)

    def worker(
        self,
        name: str,
        pool: str = "solo",
        concurrency: int = 1,
        queue: str | None = None,
        url: str | None = None,
        **conf: Any,
    ) -> WorkerProcess:
        """Start ``celery worker`` (``conf``: more app settings) and wait until it consumes."""
        worker = WorkerProcess(
            url or self.server.url,
            self.prefix,
            queue or self.queue,
            pool,
            concurrency,
            name,
            json.dumps(conf),
        )
        self.workers.append(worker)
        worker.start()
        process = worker.process
        assert process is not None
        wait_for(
            lambda: (
                any(
                    (entry.decode() if isinstance(entry, bytes) else entry).startswith(f"{name}@")
                    for entry in self.client.lrange(f"{self.prefix}:ready", 0, -1)
                )
                or process.poll() is not None
            ),
            what=f"worker {name} to start",
        )
        assert process.poll() is None, f"worker {name} died:\n{worker.output()}"
        return worker

    def key_events(self, key: str) -> KeyEvents:
        """The events of ``key`` from now on (``KeyEvents``), until the test ends."""
        self.watched.append(KeyEvents(self.client, key))
        return self.watched[-1]

    def redeliver(self, task_id: str) -> None:
        """Put the unacknowledged message of ``task_id`` back in its queue at once, flagged
        ``redelivered``, as kombu's ``visibility_timeout`` sweep does (``restore_by_tag``), at the
        moment the test picks: that message only, not a live worker's (a countdown's message,
        say, stays unacknowledged until it runs)."""
        with self.app.connection_for_write() as connection:
            qos: Any = connection.default_channel.qos  # type: ignore[attr-defined]  # the Redis channel's
            for tag, raw in self.client.hgetall(qos.unacked_key).items():
                if json.loads(raw)[0]["headers"]["id"] == task_id:
                    qos.restore_by_tag(text(tag))
                    return
        raise AssertionError(f"no unacknowledged message of {task_id}")

    def events(self, kind: str | None = None, x: object = None) -> list[list[str]]:
        return [
            event
            for event in self.recorder.events()
            if (kind is None or event[0] == kind) and (x is None or event[2] == str(x))
        ]

    def wait_events(self, kind: str, x: object, n: int = 1, timeout: float = 60.0) -> list[list[str]]:
        """Wait until ``n`` events ``kind`` of ``x`` were recorded; all of them."""

        def enough() -> list[list[str]]:
            found = self.events(kind, x)
            return found if len(found) >= n else []

        return wait_for(
            enough,
            timeout=timeout,
            what=lambda: f"{n} {kind} event(s) of {x}; events: {self.events(x=x)}",
        )

    def stop_workers(self) -> None:
        """Stop every worker by its pid; print the end of their logs (shown if the test failed)."""
        for worker in self.workers:  # all at once: a prefork worker takes ~2 s to shut down
            if worker.process is not None and worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
        for worker in self.workers:
            worker.stop()  # waits, and kills the worker's process group if it hangs
            print(
                f"--- {worker.args[worker.args.index('-n') + 1]} ({worker.log}):\n{worker.output()[-6000:]}"
            )


@pytest.fixture
def stage(fresh_server: RedisServer, prefix: str) -> Iterator[Stage]:
    stage = Stage(fresh_server, prefix)
    sampler = Sampler(fresh_server.client(), prefix).start()
    try:
        yield stage
    finally:
        stage.stop_workers()
        for events in stage.watched:
            events.close()
        # The results a failed test left unread stay subscribed to: collected later (in another
        # test, this server gone), each would unsubscribe, fail to reach it, and fail that test.
        stage.app.backend.result_consumer.subscribed_to.clear()  # type: ignore[attr-defined]  # Redis backend
        stage.app.close()
        sampler.stop()


def fresh() -> str:
    return uuid.uuid4().hex[:10]
