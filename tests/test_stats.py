"""``celery redislock stats`` (``celery_redislock.stats``) on a real Redis.

Each figure is checked against a known set-up: a task run holding its lock in
an in-process worker, enqueue locks taken by real ``apply_async`` calls (to a
queue no worker consumes), waiters queued by blocking acquires, and, for what
takes time to happen (an enqueue lock an hour old, a renewal two thirds of a
lease late), locks written with the package's own key and holder functions;
then the JSON schema, the tables, an empty prefix, many keys read in batches by
a ``decode_responses`` client, and a Redis Cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import schedule

from celery_redislock import RedisLock, RedisSemaphore, task_lock_key
from celery_redislock._task_scripts import CLAIM, DECLINE, PARK
from celery_redislock.attempt import companion_key
from celery_redislock.beat import slot_of
from celery_redislock.config import app_settings
from celery_redislock.connection import client_for, redis_client
from celery_redislock.keys import leader_key, slot_key
from celery_redislock.protocol import KEPT_TOKEN, holder_for
from celery_redislock.stats import summary
from celery_redislock.testing import RedisClusterServers, RedisServer
from tests.conftest import calls_since, command_calls
from tests.faults.test_security import COMMANDS, acl_url
from tests.taskapp import make_app, recorder
from tests.test_cli import run
from tests.workers import threads_worker, wait_for

#: The keys of every lock row (``list --json``'s, and what ``stats`` adds).
LOCK_ROW = {
    "key",
    "task",
    "task_id",
    "attempt",
    "state",
    "mode",
    "node",
    "pid",
    "ttl",
    "fence",
    "holder",
    "waiters",
    "permit",
    "kind",
    "age",
    "lease",
}
TOP = {"redis", "prefix", "time", "held", "tasks", "waited_for", "oldest", "expiring", "orphans", "beat"}
SECTIONS = ("waited_for", "oldest", "expiring", "orphans")
#: ``lock_ttl`` of the tests' tasks (``redislock_ttl``'s default).
LEASE = 30.0
TWO_HOURS = 7200.0
PAGES = Path(__file__).resolve().parent.parent / "docs"


def stats(app: Celery, *args: str) -> dict[str, Any]:
    ran = run(app, "stats", "--json", *args)
    assert ran.exit_code == 0, ran.output
    found: dict[str, Any] = json.loads(ran.stdout)
    return found


def server_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def claim_slot(client: Any, prefix: str, entry: str, start: datetime) -> str:
    """The marker of ``entry``'s slot starting at ``start``, claimed as a beat claims it."""
    slot = slot_of(schedule(timedelta(minutes=1)), start)
    key = slot_key(prefix, entry, slot.id)
    assert CLAIM(client, [key], [uuid.uuid4().hex, "beat=b1:7", 60_000]) == 1
    return slot.id


def waited(lock: RedisLock | RedisSemaphore) -> None:
    """Wait for ``lock`` (queued behind its holder), then free it."""
    if lock.acquire(timeout=60):
        lock.release()


@contextlib.contextmanager
def one_waiter(client: redis.Redis, key: str, limit: int) -> Iterator[None]:
    """A thread queued for a place of the semaphore ``key`` of ``limit`` (all taken) during the
    block; it takes one, and frees it, once the block's holders have let go."""
    thread = threading.Thread(target=waited, args=(RedisSemaphore(client, key, limit, ttl=60),))
    thread.start()
    try:
        wait_for(lambda: client.zcard(companion_key(key, "queue")) == 1, what="the waiter to queue")
        yield
    finally:
        thread.join(timeout=30)


@dataclass
class Setup:
    """What the big set-up holds, to compare ``stats`` with."""

    run_key: str
    run_id: str
    run_started_us: int
    queued_key: str
    swapped_key: str
    orphan_key: str
    late_key: str
    plain_key: str
    slots: list[str]
    taken_us: int


@pytest.fixture
def setup(app: Celery, client: redis.Redis, prefix: str) -> Iterator[Setup]:
    """A run holding its lock with two waiters, enqueue locks (one two hours old), a late
    renewal, a plain lock, the beat leader and slot markers; all freed at the end."""
    idle = f"idle-{prefix}"
    hold, executed = app.tasks["taskapp.hold_skip"], app.tasks["taskapp.until_executed"]
    swapped = app.tasks["taskapp.until_and_while_executing"]
    held: list[RedisLock] = []
    with threads_worker(app):
        result = hold.delay("run", gate=True)
        wait_for(lambda: any(e[0] == "start" for e in recorder(app).events()), what="the run to start")
        run_started_us = server_us(client)
        run_key = task_lock_key(hold, ("run", True))
        waiters = [RedisLock(client, run_key, ttl=5) for _ in range(2)]
        threads = [
            threading.Thread(target=lambda w=w: w.acquire(timeout=60) and w.release()) for w in waiters
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: client.zcard(companion_key(run_key, "queue")) == 2, what="two waiters to queue")
        executed.apply_async(("queued",), queue=idle)
        swapped.apply_async(("swapped",), queue=idle)
        orphan_key = task_lock_key(executed, ("orphan",))
        two_hours_ago = server_us(client) - int(TWO_HOURS * 1e6)
        orphan = holder_for("orphan-id", 0, "w@host", 11, "queued")
        client.set(orphan_key, f"{uuid.uuid4().hex}:{two_hours_ago}:{orphan}", px=600_000)
        late_key = task_lock_key(hold, ("late", False))
        late = holder_for("late-id", 0, "w@host", 12)
        held.append(RedisLock(client, late_key, ttl=LEASE / 4, watchdog=False, holder=late))
        held.append(RedisLock(client, f"{prefix}:plain", ttl=10))
        held.append(RedisLock(client, leader_key(prefix), ttl=30, holder="beat=b1:7"))
        for lock in held:
            assert lock.acquire(blocking=False)
        now = datetime.now(timezone.utc)
        slots = [claim_slot(client, prefix, "nightly", now - timedelta(minutes=m)) for m in (2, 0, 1)]
        slots.append(claim_slot(client, prefix, "hourly", now))
        taken_us = server_us(client)
        try:
            yield Setup(
                run_key=run_key,
                run_id=result.id,
                run_started_us=run_started_us,
                queued_key=task_lock_key(executed, ("queued",)),
                swapped_key=task_lock_key(swapped, ("swapped",)) + ":queued",
                orphan_key=orphan_key,
                late_key=late_key,
                plain_key=f"{prefix}:plain",
                slots=slots,
                taken_us=taken_us,
            )
        finally:
            recorder(app).open_gate("run")
            result.get(timeout=30)
            for thread in threads:
                thread.join(timeout=30)
            for lock in held:
                lock.release()
            client.delete(idle, orphan_key, task_lock_key(executed, ("queued",)))
            client.delete(task_lock_key(swapped, ("swapped",)) + ":queued")


def test_each_figure_matches_a_known_setup(
    app: Celery, client: redis.Redis, prefix: str, setup: Setup
) -> None:
    found = stats(app)
    elapsed = (server_us(client) - setup.taken_us) / 1e6
    assert set(found) == TOP
    assert found["prefix"] == prefix
    assert found["held"] == {"execution": 2, "enqueue": 3, "leader": 1, "other": 1, "waiters": 2}
    assert found["tasks"] == [
        {"task": "taskapp.hold_skip", "mode": "while_executing", "execution": 2, "enqueue": 0, "waiters": 2},
        {
            "task": "taskapp.until_executed",
            "mode": "until_executed",
            "execution": 0,
            "enqueue": 2,
            "waiters": 0,
        },
        {
            "task": "taskapp.until_and_while_executing",
            "mode": "until_and_while_executing",
            "execution": 0,
            "enqueue": 1,
            "waiters": 0,
        },
    ]
    rows = [row for name in SECTIONS for row in found[name]["locks"]]
    assert rows and all(set(row) == LOCK_ROW for row in rows)

    [waited] = found["waited_for"]["locks"]
    assert found["waited_for"]["count"] == 1
    assert (waited["key"], waited["waiters"], waited["kind"], waited["task_id"]) == (
        setup.run_key,
        2,
        "execution",
        setup.run_id,
    )
    assert (waited["lease"], waited["node"], waited["state"]) == (LEASE, waited["node"], "running")
    assert 0 <= waited["age"] <= (server_us(client) - setup.run_started_us) / 1e6 + 1  # granted before

    oldest = found["oldest"]
    assert oldest["count"] == 7  # every lock but the slot markers
    assert [row["key"] for row in oldest["locks"]][:1] == [setup.orphan_key]
    ages = [row["age"] for row in oldest["locks"]]
    assert ages == sorted(ages, reverse=True) and all(age >= 0 for age in ages)
    assert TWO_HOURS <= ages[0] <= TWO_HOURS + elapsed + 1

    [late] = found["expiring"]["locks"]
    assert (found["expiring"]["count"], late["key"], late["lease"]) == (1, setup.late_key, LEASE)
    assert 0 < late["ttl"] <= LEASE / 4

    [orphan] = found["orphans"]["locks"]
    assert (found["orphans"]["count"], orphan["key"], orphan["kind"]) == (1, setup.orphan_key, "enqueue")
    assert (orphan["task"], orphan["task_id"], orphan["state"]) == (
        "taskapp.until_executed",
        "orphan-id",
        "queued",
    )

    beat = found["beat"]
    assert (beat["leader"]["key"], beat["leader"]["kind"], beat["leader"]["holder"]) == (
        leader_key(prefix),
        "leader",
        "beat=b1:7",
    )
    assert beat["leader"]["lease"] == 30.0  # redislock_beat_leader_ttl
    assert beat["markers"] == 4
    assert [{k: v for k, v in entry.items() if k != "ttl"} for entry in beat["entries"]] == [
        {"entry": "hourly", "markers": 1, "slot": setup.slots[3], "holder": "beat=b1:7"},
        {"entry": "nightly", "markers": 3, "slot": setup.slots[1], "holder": "beat=b1:7"},
    ]
    assert all(0 < entry["ttl"] <= 60 for entry in beat["entries"])


def test_the_tables_show_each_section_and_limit_cuts_the_lists(
    app: Celery, prefix: str, setup: Setup
) -> None:
    shown = run(app, "stats")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"locks under prefix {prefix!r} in Redis at redis://127.0.0.1:")
    assert lines[0].endswith(": 2 execution, 3 enqueue, 1 beat leader, 1 other; 2 waiting")
    header = next(n for n, line in enumerate(lines) if line.startswith("TASK "))
    assert lines[header].split() == ["TASK", "MODE", "EXECUTION", "ENQUEUE", "WAITERS"]
    assert lines[header + 1].split() == ["taskapp.hold_skip", "while_executing", "2", "0", "2"]
    for title, key in (
        ("waited for, most waiters first (1 of 1)", setup.run_key),
        ("oldest holds (7 of 7)", setup.orphan_key),
        ("expiring: under a third of the lease left, renewals late (1 of 1)", setup.late_key),
        ("orphans: enqueue locks older than 1h (1 of 1)", setup.orphan_key),
    ):
        start = lines.index(title)
        assert lines[start + 2].endswith(key)  # the title, the header, the first row
    assert "beat: leader beat=b1:7 (ttl " in shown.stdout and "; 4 slot markers" in shown.stdout
    assert any(line.split()[:2] == ["nightly", "3"] for line in lines)

    limited = stats(app, "--limit", "2")
    assert (limited["oldest"]["count"], len(limited["oldest"]["locks"])) == (7, 2)
    assert len(stats(app, "--limit", "0")["oldest"]["locks"]) == 7
    refused = run(app, "stats", "--limit", "-1")
    assert refused.exit_code == 2 and "--limit" in refused.output


def test_an_empty_prefix_gives_zeros_and_empty_lists(app: Celery, prefix: str) -> None:
    found = stats(app)
    assert found == {
        "redis": found["redis"],
        "prefix": prefix,
        "time": found["time"],
        "held": {"execution": 0, "enqueue": 0, "leader": 0, "other": 0, "waiters": 0},
        "tasks": [],
        **{name: {"count": 0, "locks": []} for name in SECTIONS},
        "beat": {"leader": None, "markers": 0, "entries": []},
    }
    assert abs(found["time"] - time.time()) < 60
    shown = run(app, "stats").stdout
    assert ": 0 execution, 0 enqueue, 0 beat leader, 0 other; 0 waiting" in shown
    assert "oldest holds (none)" in shown and "beat: no leader; 0 slot markers" in shown


def test_many_keys_are_read_in_batches_alike_with_decode_responses(
    fresh_server: RedisServer, prefix: str
) -> None:
    """1,200 locks (three script calls of 500 keys), beside keys outside the prefix and keys
    under it that are no lock (a list; a name no lock can have): SCAN, never KEYS; the same
    figures through a client that decodes replies."""
    raw, decoding = fresh_server.client(), fresh_server.client(decode_responses=True)
    app = make_app(fresh_server.url, prefix, f"q-{prefix}")
    task: Any = app.tasks["taskapp.until_executed"]
    locks = [
        RedisLock(raw, task_lock_key(task, (n,)), ttl=60, holder=holder_for(f"id-{n}", 0, "w@h", 1, "queued"))
        for n in range(1200)
    ]
    for lock in locks:
        assert lock.acquire(blocking=False)
    raw.set("elsewhere", "x", px=60_000)
    raw.set(f"{prefix}:odd}}", f"{uuid.uuid4().hex}:1:{prefix}", px=60_000)  # no lock has such a name
    raw.rpush(f"{prefix}:list", "not a lock")
    raw.pexpire(f"{prefix}:list", 60_000)
    settings, options = app_settings(app), {task.name: task.lock_options}
    summary(raw, settings, options)  # a new server: NOSCRIPT, then the script is loaded and sent again
    before = command_calls(raw)
    read = summary(raw, settings, options, limit=0)
    calls = calls_since(raw, before)
    assert (calls["evalsha"], "keys" in calls, calls["scan"] >= 1) == (3, False, True)
    decoded = summary(decoding, settings, options, limit=0)
    for found in (read, decoded):
        assert found["held"] == {"execution": 0, "enqueue": 1200, "leader": 0, "other": 0, "waiters": 0}
        assert {row["key"] for row in found["oldest"]["locks"]} == {lock.name for lock in locks}
    assert read["oldest"]["locks"][0]["key"] == locks[0].name  # the first taken is the oldest
    ignore = ("age", "ttl")
    assert [{k: v for k, v in row.items() if k not in ignore} for row in read["oldest"]["locks"]] == [
        {k: v for k, v in row.items() if k not in ignore} for row in decoded["oldest"]["locks"]
    ]
    for lock in locks:
        lock.release()
    raw.delete(f"{prefix}:odd}}", f"{prefix}:list")
    app.close()
    raw.close()
    decoding.close()


def test_a_cluster_is_read_on_each_primary(cluster: RedisClusterServers, prefix: str) -> None:
    client = redis_client(cluster.url)
    locks = [RedisLock(client, f"{prefix}:{n}", ttl=30) for n in range(60)]  # in slots of every node
    for lock in locks:
        assert lock.acquire(blocking=False)
    waiter = RedisLock(client, locks[0].name, ttl=5)
    thread = threading.Thread(target=waited, args=(waiter,))
    thread.start()
    slot = claim_slot(client, prefix, "nightly", datetime.now(timezone.utc))
    app = Celery("cluster-stats", set_as_current=False)
    app.conf.update(redislock_url=cluster.url, redislock_prefix=prefix)
    try:
        wait_for(lambda: client.zcard(companion_key(locks[0].name, "queue")) == 1, what="the waiter to queue")
        found = stats(app, "--limit", "0")
        assert found["held"] == {"execution": 0, "enqueue": 0, "leader": 0, "other": 60, "waiters": 1}
        assert {row["key"] for row in found["oldest"]["locks"]} == {lock.name for lock in locks}
        assert [row["key"] for row in found["waited_for"]["locks"]] == [locks[0].name]
        assert [(entry["entry"], entry["slot"]) for entry in found["beat"]["entries"]] == [("nightly", slot)]
        pids = {row["pid"] for row in found["oldest"]["locks"]}
        assert pids == {os.getpid()} and found["oldest"]["locks"][0]["node"] == socket.gethostname()
    finally:
        for lock in locks:
            lock.release()
        thread.join(timeout=30)
        app.close()
        client.close()


#: What the user running ``celery redislock`` needs beyond the lock user's commands.
CLI_COMMANDS = ["scan", "zcount"]


def test_the_documented_permissions_suffice_and_a_refusal_is_one_line(
    fresh_server: RedisServer, prefix: str
) -> None:
    """With the lock user's commands and ``+scan +zcount`` (docs/operations.md), ``stats``
    reads 1,200 locks (three script calls); without ``+zcount`` the first call is refused:
    a one-line error, and the connection, with the later calls' replies unread, is dropped."""
    assert f"`celery redislock`, `{' '.join('+' + command for command in CLI_COMMANDS)}`" in (
        (PAGES / "operations.md").read_text()
    )
    admin = fresh_server.client()
    locks = [RedisLock(admin, f"{prefix}:{n}", ttl=60) for n in range(1200)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    allowed = make_app(acl_url(fresh_server, prefix, [*COMMANDS, *CLI_COMMANDS]), prefix, f"q-{prefix}")
    refused = make_app(acl_url(fresh_server, prefix, [*COMMANDS, "scan"]), prefix, f"q-{prefix}")
    try:
        assert stats(allowed)["held"]["other"] == 1200
        ran = run(refused, "stats")
        assert (ran.exit_code, len(ran.output.splitlines())) == (1, 1)
        # Redis 7 names the refusal itself; 6.2 wraps it in "Error running script (call to ...)"
        assert ran.output.startswith("Error: ResponseError: ")
        assert "The user executing the script can't run this command" in ran.output
        client, _ = client_for(refused)
        assert client.time()[0] > 0  # a clean connection: not the reply to a call of the refused walk
    finally:
        for lock in locks:
            lock.release()
        for app in (allowed, refused):
            app.close()
    admin.close()


def test_a_hold_kept_for_its_period_is_an_execution_lock_whatever_its_holder_says(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    """``until_expired``: a retry that will never adopt the hold its previous attempt parked for
    it (revoked, rejected, its pool child died) has ``DECLINE`` keep that hold for the rest of
    ``lock_period``, owned by no token, under the retry's holder, which says ``state=queued``.
    No message waits for it: ``stats`` counts it as an execution lock (``list`` says ``kept``),
    not as an enqueue lock, nor, once an hour old (a daily job's period), as an orphan, "a
    message waiting that long"."""
    task = app.tasks["taskapp.until_expired"]
    running, retry = holder_for("kept-id", 0, "w@host", 11), holder_for("kept-id", 1, "w@host", 11, "queued")
    declined = task_lock_key(task, ("declined",))
    run = RedisLock(client, declined, ttl=LEASE, watchdog=False, holder=running)
    assert run.acquire(blocking=False)
    token = uuid.uuid4().hex
    assert PARK(client, [declined], [run.stop_renewing(), running, token, retry, 600_000, 600_000]) == 1
    run.forget()
    assert DECLINE(client, [declined], [token, 600_000, 600_000]) == 3  # kept for its period
    old = task_lock_key(task, ("old",))  # as a daily job's is two hours on
    two_hours_ago = server_us(client) - int(TWO_HOURS * 1e6)
    client.set(old, f"{KEPT_TOKEN}:{two_hours_ago}:{retry}", px=600_000)
    try:
        found = stats(app)
        assert found["held"] == {"execution": 2, "enqueue": 0, "leader": 0, "other": 0, "waiters": 0}
        assert found["orphans"] == {"count": 0, "locks": []}
        rows = {row["key"]: row for row in found["oldest"]["locks"]}
        assert {key: (rows[key]["kind"], rows[key]["state"]) for key in (declined, old)} == {
            declined: ("execution", "kept"),
            old: ("execution", "kept"),
        }
    finally:
        client.delete(declined, old)


def test_permits_count_as_their_tasks_holds_and_their_waiters_once(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    """Two runs' permits of a task with ``lock_limit=2`` (``{KEY}:permit:<i>``, outside
    ``prefix:*``) and one waiter queued for either: 2 execution holds of the task, 1 waiter."""
    key = task_lock_key(app.tasks["taskapp.limited"], ("x",))
    permits = [
        RedisSemaphore(client, key, 2, ttl=60, holder=holder_for(f"run-{i}", 0, "w@host", 10 + i))
        for i in range(2)
    ]
    for permit in permits:
        assert permit.acquire(blocking=False)
    with one_waiter(client, key, 2):
        try:
            found = stats(app)
        finally:
            for permit in permits:
                permit.release()
        assert found["held"] == {"execution": 2, "enqueue": 0, "leader": 0, "other": 0, "waiters": 1}
        assert [(row["task"], row["execution"], row["waiters"]) for row in found["tasks"]] == [
            ("taskapp.limited", 2, 1)
        ]
        oldest = found["oldest"]["locks"]
        assert sorted((row["key"], row["permit"], row["task_id"]) for row in oldest) == [
            (companion_key(key, f"permit:{i + 1}"), i + 1, f"run-{i}") for i in range(2)
        ]


def test_a_lock_of_a_semaphores_name_and_its_permits_count_their_waiters_once(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    """A run holding the name's lock from before ``lock_limit`` was raised to 2, a run holding a
    permit, and one waiter for either place: its waiters are counted once."""
    key = task_lock_key(app.tasks["taskapp.limited"], ("y",))
    lock = RedisLock(client, key, ttl=60, holder=holder_for("run-0", 0, "w@host", 10))
    permit = RedisSemaphore(client, key, 2, ttl=60, holder=holder_for("run-1", 0, "w@host", 11))
    assert lock.acquire(blocking=False) and permit.acquire(blocking=False)
    with one_waiter(client, key, 2):
        try:
            found = stats(app)
        finally:
            lock.release()
            permit.release()
    assert found["held"]["execution"] == 2 and found["held"]["waiters"] == 1
