"""Every example runs end to end, and so does ``make demo``, stopping all it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from celery_redislock.inventory import held_locks
from celery_redislock.testing import RedisServer
from examples._support import QUEUE, ROOT, Worker

#: module -> lines its narration must contain
EXAMPLES = {
    "examples.dedup_enqueue": [
        "1 distinct task id among the 100 results, 1 message in the queue",
        "the worker received 1 rebuild_index message",
    ],
    "examples.debounce": [
        "100 messages sent: each took the lock over",
        "the last call runs: 'user 7 reindexed at version 99'",
        "the 99 calls before it were dropped unrun (99 INFO lines)",
        "reindex_user ran 1 time",
    ],
    "examples.mutual_exclusion": ["account 7's runs never overlap; account 8's ran alongside them"],
    "examples.long_task": ["redislock list` shows it too", "lock_lost=False", "and its lock is released"],
    "examples.fencing": [
        "[second holder] writes price 120 with fence",
        ": REFUSED",
        "its watchdog reports the loss: lock.lost=True",
        "the database keeps price 120",
    ],
    "examples.primitive_demo": ["demo keys left in Redis: none"],
    "examples.prometheus_worker": [
        "one waited for the other's lock",
        "the worker's main process serves port",
        'outcome="acquired",task="examples.tasks.sync_account"} 1.0',
        'outcome="busy-wait",task="examples.tasks.sync_account"} 1.0',
    ],
    "examples.from_celery_once": [
        "1 task id among the 3 results: the duplicates got the queued task's result",
        "import_feed_strict refuses its duplicate: DuplicateTask, existing task",
        "a worker runs the one queued import_feed: 'feed 7 imported (changes)'",
        "once it has run, its lock is gone: a new call is a new task",
    ],
    "examples.once_per_slot": [
        "duplicates dropped by the beats, which log:",
        "not sent: a duplicate, the slot went to",
        "alone goes on sending each slot:",
        "duplicates dropped by beats",
        "both beats are stopped; their",
    ],
    "examples.demo": [
        "100 x rebuild_index.delay('catalog') -> 1 task id, 1 message in the queue",
        "the worker ran it 1 time",
        "slots, each run once by the worker;",
        "not sent: a duplicate, the slot went to",
        "lock_lost=False, one fence all along",
        "by the worker's main process",
        "locks left in Redis: none",
    ],
}


def run_example(module: str, *args: str, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{module} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("module", sorted(EXAMPLES))
def test_example_runs_on_your_redis_and_leaves_no_key_of_its_own(
    module: str, fresh_server: RedisServer
) -> None:
    output = run_example(module, env={**os.environ, "REDIS_URL": fresh_server.url})
    for line in EXAMPLES[module]:
        assert line in output, f"{module} did not say {line!r}:\n{output}"
    client = fresh_server.client()
    assert held_locks(client, "redislock") == []
    # What is left is the broker's own bookkeeping of the queue it used (kombu's bindings), and the
    # marks of messages dropped as superseded, kept for a redelivery until their TTL.
    marks = client.keys("*:superseded:*")
    assert all(client.pttl(mark) > 0 for mark in marks)
    assert [
        key
        for key in client.keys("*")
        if not (isinstance(key, bytes) and key.startswith(b"_kombu.binding")) and key not in marks
    ] == []
    client.close()


def test_the_producer_sends_duplicates_that_run_once(
    fresh_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", fresh_server.url)
    monkeypatch.setenv("EXAMPLES_QUEUE", QUEUE)  # the queue the examples' Worker consumes
    with Worker(name="producer"):
        output = run_example("examples.producer", "--rounds", "2", "--every", "0.1", env=dict(os.environ))
    for number in (1, 2):
        assert (
            f"round {number}: 20 x rebuild_index.delay('catalog') sent 1 task: index catalog rebuilt"
            in output
        )
        assert f"round {number}: two syncs of account 1 ran one after the other: True" in output


#: How long ``make demo`` may take before it counts as hung: it narrates its steps in well under
#: a minute (README.md), but how long is not what this test checks (a machine running test files
#: in parallel is slower); that it ends, having stopped what it started, is.
DEMO_DEADLINE = 180.0


def test_make_demo_runs_the_demo_on_a_redis_of_its_own_and_stops_all_it_started() -> None:
    recipe = re.search(r"^demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert recipe is not None and recipe.group(1) == "$(BIN)/python -m examples.demo"
    env = {name: value for name, value in os.environ.items() if name != "REDIS_URL"}
    done = subprocess.Popen(
        [sys.executable, "-m", "examples.demo"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        output, _ = done.communicate(timeout=DEMO_DEADLINE)
    except subprocess.TimeoutExpired:
        done.send_signal(signal.SIGINT)  # KeyboardInterrupt: its with blocks stop what it started
        try:
            output, _ = done.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            done.kill()
            output, _ = done.communicate()
        pytest.fail(
            f"make demo did not end within {DEMO_DEADLINE:.0f} s (it takes well under a minute): "
            f"hung, and stopped (SIGINT, then SIGKILL after 30 s); its output:\n{output}"
        )
    assert done.returncode == 0, output
    for line in EXAMPLES["examples.demo"]:
        assert line in output
    pids = re.search(r"started a private redis-server, pid (\d+)", output)
    worker = re.search(r"the worker \(pid (\d+)\) and its pool processes are stopped", output)
    beats = re.search(r"the beats \(pids (\d+), (\d+)\) are stopped; their (\d+) slot markers", output)
    assert pids is not None and worker is not None and beats is not None
    for pid in (int(pids.group(1)), int(worker.group(1)), int(beats.group(1)), int(beats.group(2))):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # each of the 4 slots ran once (the narration has a line per slot, and asserts it)
    slots = re.findall(r"slot (\S+): run (\d+)x, sent by beat (\d+)", output)
    assert len(slots) == int(beats.group(3)) >= 4 and {runs for _, runs, _ in slots} == {"1"}
    assert {beat for _, _, beat in slots} <= {beats.group(1), beats.group(2)}
    # nothing runs under the demo's worker or beat names any more (pool processes included);
    # a beat's name is in its schedule file's path
    names = [f"demo-{done.pid}@".encode(), f"beat-1-{done.pid}-".encode(), f"beat-2-{done.pid}-".encode()]
    left = [
        path.parent.name
        for path in Path("/proc").glob("[0-9]*/cmdline")
        if any(name in _read(path) for name in names)
    ]
    assert left == []


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended meanwhile
        return b""


def test_the_prometheus_example_picks_its_ports_below_the_ephemeral_range() -> None:
    """The example picks its worker's three metrics ports before the worker binds them: below
    the range a bind to port 0 draws from, so that no other process (a parallel test's
    redis-server) takes one meanwhile, as once happened in CI ("Address already in use").

    Asked in a process of its own: importing the example connects its ``worker_init`` receiver,
    which would set a Prometheus ``MeterProvider`` as OpenTelemetry's global one at the start of
    every later in-process worker of this test process, before the ``otel`` fixture's, whose
    reader then sees no metric."""
    script = "from examples.prometheus_worker import free_ports; print(*(free_ports(3) for _ in range(50)))"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [int(port) for port in done.stdout.split()]
    assert len(ports) == 50, done.stdout
    assert all(port >= 1024 and port + 2 < ephemeral for port in ports), ports
