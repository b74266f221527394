"""A Django project (``tests/django_project``: SQLite, Celery's Django fixup) keeps
``delay_on_commit`` and ``apply_async_on_commit`` with ``@shared_task(base=LockedTask)``: the
message is sent, and its enqueue lock taken, when the transaction commits; a rollback (also of
a savepoint) sends nothing and leaves nothing in Redis; outside a transaction it is sent at once;
a duplicate refused at the commit raises out of the block, its commit kept; a real worker runs
what was sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_redislock import LockConfigurationError, LockedTask
from celery_redislock.testing import RedisServer
from tests.workers import ROOT, Subprocess, wait_for


class DjangoWorker(Subprocess):
    """``celery -A tests.django_project worker``: prefork, one child."""

    def __init__(self, env: dict[str, str], queue: str) -> None:
        args = ["worker", "-P", "prefork", "-c", "1", "-Q", queue, "-n", "django@%h", "-l", "INFO"]
        args += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        super().__init__("worker", "django", env, args, app="tests.django_project")


def test_on_commit_sends_and_locks_after_the_commit_and_a_worker_runs_it(
    redis_server: RedisServer, prefix: str, tmp_path: Path, client: redis.Redis
) -> None:
    pytest.importorskip("django", reason="Django is not installed")
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.django_project.settings",
        "DJANGO_PROJECT_DB": str(tmp_path / "db.sqlite3"),
        "DJANGO_PROJECT_REDIS": redis_server.url,
        "DJANGO_PROJECT_PREFIX": prefix,
    }
    scenario = subprocess.run(
        [sys.executable, "-m", "tests.django_project.scenario"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert scenario.returncode == 0, scenario.stderr
    seen = json.loads(scenario.stdout)
    assert seen["plain is a DjangoTask"] and not seen["ship is a DjangoTask"]  # the fixup is on
    assert seen["inside"] == {"queued": 0, "locks": {}}  # nothing sent, nothing locked before the commit
    committed = seen["committed"]
    assert committed["queued"] == 1
    assert len(committed["locks"]) == 1 and all(ttl > 0 for ttl in committed["locks"].values())
    duplicate = seen["duplicate committed"]  # the lock taken at the first commit refused this send
    assert duplicate["queued"] == 1 and duplicate["locks"].keys() == committed["locks"].keys()
    assert seen["rolled back"]["queued"] == 1
    assert seen["rolled back"]["locks"].keys() == committed["locks"].keys()  # the rollback took nothing
    savepoint = seen["savepoint rolled back"]  # the outer block's call only
    assert savepoint["queued"] == 2 and len(savepoint["locks"]) == 2
    assert seen["autocommit"]["queued"] == 3 and len(seen["autocommit"]["locks"]) == 3
    raised = seen["raised at commit"]  # DuplicateTask out of the block, its commit kept
    assert raised is not None and raised["committed"], seen
    assert raised["queued"] == 4 and len(raised["locks"]) == 4  # ship_once's first; mug's not sent
    queue = f"q-{prefix}"
    worker = DjangoWorker(env, queue)
    worker.start()
    try:
        wait_for(lambda: client.llen(f"{prefix}:shipped") == 3, what=lambda: f"the runs\n{worker.output()}")
        wait_for(lambda: not client.exists(*raised["locks"]), what="the enqueue locks released")
    finally:
        worker.stop()
        client.delete(queue)
    assert sorted(client.lrange(f"{prefix}:shipped", 0, -1)) == [b"book", b"cup", b"pen"]


def test_without_django_they_raise_naming_the_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "django.db", None)  # as if Django were not installed
    app = Celery("no-django", set_as_current=False)

    @app.task(base=LockedTask, shared=False, name="no_django.ship")
    def ship(order_id: int) -> None:
        """Never sent."""

    needs = r"task 'no_django.ship': delay_on_commit and apply_async_on_commit need Django"
    with pytest.raises(LockConfigurationError, match=needs):
        ship.delay_on_commit(1)
    with pytest.raises(LockConfigurationError, match=needs):
        ship.apply_async_on_commit((1,))
    app.close()
