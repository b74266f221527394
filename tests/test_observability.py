"""Lock commands are visible to APM tools that wrap redis-py's ``execute_command``
(OpenTelemetry, Sentry, ddtrace): with opentelemetry-instrumentation-redis and an
in-memory span exporter, every ``EVALSHA`` the server runs has its span."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from opentelemetry.instrumentation.redis import RedisInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_redislock import RedisLock
from celery_redislock.connection import redis_client
from celery_redislock.testing import RedisClusterServers, RedisServer
from examples._support import ROOT
from tests.conftest import calls_since, command_calls
from tests.taskapp import make_app
from tests.workers import threads_worker


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """redis-py instrumented by OpenTelemetry for the test (after this package was imported);
    the exporter holds the finished spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    RedisInstrumentor().instrument(tracer_provider=provider)
    try:
        yield exporter
    finally:
        RedisInstrumentor().uninstrument()


def evalsha_spans(exporter: InMemorySpanExporter) -> int:
    return sum(span.name == "EVALSHA" for span in exporter.get_finished_spans())


def lock_round(client: redis.Redis | redis.cluster.RedisCluster, key: str) -> None:
    """acquire, extend, release: one EVALSHA each."""
    lock = RedisLock(client, key, ttl=10, watchdog=False)
    assert lock.acquire(blocking=False)
    lock.extend(20)
    lock.release()


def test_acquire_extend_release_each_have_a_span(
    spans: InMemorySpanExporter, fresh_server: RedisServer, prefix: str
) -> None:
    """An app instrumented after importing this package sees the lock's three commands."""
    client = fresh_server.client()
    lock_round(client, f"{prefix}:lock")  # loads the scripts (a NOSCRIPT reply is a call too)
    spans.clear()
    before = command_calls(client)
    lock_round(client, f"{prefix}:lock")
    run = calls_since(client, before)
    assert run["evalsha"] == 3
    assert evalsha_spans(spans) == 3
    client.close()


def test_a_client_instrumented_alone_shows_its_lock_commands(fresh_server: RedisServer, prefix: str) -> None:
    """``RedisInstrumentor.instrument_client`` wraps one client's ``execute_command`` (on the
    instance, not the class): that client's lock commands have their spans too."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = fresh_server.client()
    lock_round(client, f"{prefix}:lock")  # loads the scripts
    RedisInstrumentor.instrument_client(client, tracer_provider=provider)
    try:
        lock_round(client, f"{prefix}:lock")
    finally:
        RedisInstrumentor.uninstrument_client(client)
    assert evalsha_spans(exporter) == 3
    client.close()


@pytest.mark.parametrize("instrumented", ["the classes", "the Cluster client alone"])
def test_a_cluster_clients_lock_commands_have_spans(
    instrumented: str, cluster: RedisClusterServers, prefix: str
) -> None:
    """A Cluster client sends a script straight to its node's client, unless its own
    ``execute_command`` or the node's is wrapped: then each command has its span."""
    client = redis_client(cluster.url)
    key = f"{{{prefix}}}:lock"
    lock_round(client, key)  # loads the scripts on the key's node
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    if instrumented == "the classes":
        RedisInstrumentor().instrument(tracer_provider=provider)
    else:
        RedisInstrumentor.instrument_client(client, tracer_provider=provider)
    try:
        lock_round(client, key)
    finally:
        if instrumented == "the classes":
            RedisInstrumentor().uninstrument()
        else:
            RedisInstrumentor.uninstrument_client(client)
    assert evalsha_spans(exporter) == 3
    client.close()


def test_a_locked_task_run_by_a_worker_shows_every_lock_command(
    spans: InMemorySpanExporter, fresh_server: RedisServer, prefix: str
) -> None:
    """A LockedTask's acquire and release in a real worker are spans, as many as the server ran."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}")
    client = fresh_server.client()
    with threads_worker(app):
        lock_round(client, f"{prefix}:warm-up")  # loads the scripts
        before = command_calls(client)
        spans.clear()
        assert app.tasks["taskapp.hold_skip"].delay("x").get(timeout=30) == "x"
        run = calls_since(client, before)
    assert run["evalsha"] >= 2  # acquire and release, at least
    assert evalsha_spans(spans) == run["evalsha"]
    client.close()
    app.close()


def test_uninstrumenting_restores_the_fast_path(
    fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once uninstrumented, lock commands skip ``execute_command`` again (seen by a spy on the
    layer below it, which a plain command goes through)."""
    RedisInstrumentor().instrument(tracer_provider=TracerProvider())
    RedisInstrumentor().uninstrument()
    layered: list[Any] = []
    command_layer = redis.Redis._execute_command

    def spy(self: redis.Redis, *args: Any, **options: Any) -> Any:
        layered.append(args[0])
        return command_layer(self, *args, **options)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    monkeypatch.setattr(redis.Redis, "_execute_command", spy)
    client = fresh_server.client()
    lock_round(client, f"{prefix}:lock")
    assert "EVALSHA" not in layered
    client.ping()
    assert layered[-1] == "PING"  # the spy does see commands sent through execute_command
    client.close()


def test_instrumented_before_this_package_is_imported(fresh_server: RedisServer, prefix: str) -> None:
    """An app that instruments redis-py first and imports this package after sees the spans too."""
    script = textwrap.dedent(
        f"""
        import redis
        from opentelemetry.instrumentation.redis import RedisInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        RedisInstrumentor().instrument(tracer_provider=provider)

        from celery_redislock import RedisLock

        lock = RedisLock(redis.Redis.from_url({fresh_server.url!r}), {prefix + ":lock"!r}, watchdog=False)
        assert lock.acquire(blocking=False)
        lock.release()
        print(sum(span.name == "EVALSHA" for span in exporter.get_finished_spans()))
        """
    )
    client = fresh_server.client()
    before = command_calls(client)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    run = calls_since(client, before)
    assert run["evalsha"] >= 2  # acquire and release (and again after NOSCRIPT on this new server)
    assert int(done.stdout) == run["evalsha"], done.stderr
    client.close()
