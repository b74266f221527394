"""A message redelivered by kombu's Redis transport while its first delivery still runs does not run.

With ``acks_late``, a message stays in kombu's ``unacked`` hash while its task
runs; ``restore_visible`` puts it back in the queue once it has been there
longer than ``visibility_timeout``. Each worker's event loop runs that sweep
every ``unacked_restore_interval`` seconds, but scans Redis only on every
``unacked_restore_throttle``-th call: 10 s x 10 by default, which is why a
redelivery can take 100 s (and, with the default ``visibility_timeout`` of an
hour, an hour). Here both are 1, with a 1 s ``visibility_timeout``: the
message is back in the queue about a second after it was delivered, and a
second worker receives it, same task id, attempt and headers, flagged
``redelivered``. It must not run while the first delivery runs.

``tests/test_enqueue.py::test_a_message_redelivered_while_its_first_delivery_runs_does_not_run``
republishes the same message by hand; this lets kombu redeliver it.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from typing import Any

import pytest

from celery_redislock import task_lock_key
from celery_redislock.lock import companion_key
from celery_redislock.protocol import BEAT_HEADER, parse_value
from tests.faults.conftest import RESULT_TIMEOUT, Stage, fresh
from tests.invariants import leftover_locks, stored
from tests.workers import WorkerProcess, wait_for

TRANSPORT = {"visibility_timeout": 1, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}


#: Workers that never put a message back themselves: the test does, when it chooses (``redeliver``).
NO_SWEEP = {"visibility_timeout": 3600}


def acks_late(ttl: float) -> dict[str, Any]:
    """A worker's settings: ``acks_late``, messages restored within a second, ``ttl`` leases."""
    return {"broker_transport_options": TRANSPORT, "task_acks_late": True, "redislock_ttl": ttl}


#: The workers' lock_ttl: a redelivered twin watches a live holder's lease for lock_ttl/3.
TTL = 1.5


@pytest.mark.parametrize(
    ("name", "conf"),
    [("acks_late", {}), ("hold_skip", {"task_acks_late": True})],
    ids=["until_executed", "while_executing"],
)
def test_a_message_redelivered_while_its_first_delivery_runs_does_not_run_again(
    stage: Stage, name: str, conf: dict[str, Any]
) -> None:
    first = stage.worker("first", broker_transport_options=TRANSPORT, redislock_ttl=TTL, **conf)
    x, task = fresh(), stage.task(name)
    result = task.delay(x, gate=True)
    start = stage.wait_events("start", x)[0]
    twin = stage.worker("twin", broker_transport_options=TRANSPORT, redislock_ttl=TTL, **conf)
    busy = wait_for(
        lambda: [event for event in stage.events("busy", x) if event[3] == result.id],
        timeout=20,
        what="kombu to redeliver the message to the second worker",
    )
    assert busy[0][4] == str(twin.pid) != start[4]  # the redelivered copy, in the other worker
    # The twin watches the lease for one renewal interval: renewed, so its first delivery is alive.
    twin.wait_for_line("redelivered while its first delivery runs; ignored", what="the twin ignored")
    stage.recorder.open_gate(x)
    assert result.get(timeout=RESULT_TIMEOUT) == x
    assert [event[3] for event in stage.events("start", x)] == [result.id]  # one run, no twin
    wait_for(lambda: stage.client.zcard("unacked_index") == 0, what="nothing left to redeliver")
    assert "Task taskapp" in first.output()


def test_a_redelivered_twin_that_sees_its_first_delivery_end_sends_no_lock_released(stage: Stage) -> None:
    """The twin watches its first delivery's hold (queued for it), and the first delivery ends
    meanwhile: its release hands the hold to the twin, which lets go of it at once. That hold was
    never a run's: ``lock_released`` is sent once, by the first delivery. A 300 s lease: the
    twin watches for a renewal interval (100 s), so the first delivery ends while it watches,
    however slow either worker is."""
    conf = acks_late(300)
    first = stage.worker("first", **conf)
    x, task = fresh(), stage.task("hold_skip")
    key = task_lock_key(task, (x,), {"gate": True})
    result = task.delay(x, gate=True)
    stage.wait_events("start", x)
    twin = stage.worker("twin", **conf)
    wait_for(
        lambda: [event for event in stage.events("busy", x) if event[4] == str(twin.pid)],
        timeout=20,
        what="kombu to redeliver the message to the second worker",
    )
    wait_for(lambda: stage.client.zcard(companion_key(key, "queue")), what="the twin to watch the hold")
    stage.recorder.open_gate(x)  # the first delivery ends while the twin watches its hold
    assert result.get(timeout=RESULT_TIMEOUT) == x
    twin.wait_for_line("its first delivery", what="the twin to decide")
    assert "redelivered while its first delivery runs; ignored" in twin.output()
    # lock_released comes after the result is stored (LockedTask.after_return): wait for it
    released = stage.wait_events("released", x)
    wait_for(lambda: not stage.client.exists(key), what="the twin to let go of the hold")
    assert [event[4] for event in stage.events("released", x)] == [str(first.pid)], released
    assert [event[3] for event in stage.events("start", x)] == [result.id]


@pytest.mark.parametrize("slot", [False, True], ids=["message", "beat slot's message"])
def test_a_message_redelivered_after_its_worker_died_runs_once_the_lease_ran_out(
    stage: Stage, slot: bool
) -> None:
    """``acks_late`` promises a run for a message whose worker died mid-task. Its redelivery finds
    the lock still naming the same task and attempt, as a twin's would, but nobody renews it:
    once the dead worker's lease has run out, the redelivered message runs. A beat slot's
    message too: its first delivery's run claimed the slot, and the copy, flagged
    ``redelivered``, is not a copy kombu's publish retry made (ignored): it claims the slot again.

    The survivor already consumes the queue when the worker dies, and the test puts the message
    back as soon as it has died (kombu's sweep does it only ``visibility_timeout`` after the
    delivery, here never): the copy reaches a running worker while the dead worker's lease
    lasts, not whenever a survivor started after the death came up. The lease, 12 s, has at
    least 8 s left at the death (renewed every 4 s): time for the copy's delivery and busy
    event on a loaded machine."""
    ttl = 12.0
    conf: dict[str, Any] = {
        "task_acks_late": True,
        "redislock_ttl": ttl,
        "broker_transport_options": {"visibility_timeout": 3600},
    }
    doomed = stage.worker("doomed", **conf)
    x, task = fresh(), stage.task("hold_skip")
    key = task_lock_key(task, (x,), {"gate": True})
    marker = {"entry": "e", "slot": "1", "key": f"{stage.prefix}:slot:e:1", "token": secrets.token_hex(16)}
    header = {BEAT_HEADER: {**marker, "ttl": 600_000, "beat": "beat=test", "claimed": True}}
    result = task.apply_async((x,), {"gate": True}, headers=header if slot else None)
    start = stage.wait_events("start", x)[0]
    survivor = stage.worker("survivor", **conf)  # nothing to consume: the message is unacknowledged
    doomed.kill()
    runs_out = time.monotonic() + stage.client.pttl(key) / 1000
    stage.redeliver(result.id)
    busy = stage.wait_events("busy", x)[0]
    assert float(busy[7]) < runs_out  # redelivered while the dead worker's lease lasted
    starts = stage.wait_events("start", x, 2, timeout=30)
    assert starts[1][3] == result.id and starts[1][4] == str(survivor.pid)
    assert float(starts[1][7]) >= runs_out - 0.2  # not before the lease ran out
    assert int(starts[1][5]) > int(start[5])
    assert "redelivered after its first delivery's worker died" in survivor.output()
    stage.recorder.open_gate(x)
    assert result.get(timeout=RESULT_TIMEOUT) == x


def another_call_wins_then_the_copy_runs_as_any_other(
    stage: Stage, survivor: WorkerProcess, x: str, winner: str, n: int, ttl: float
) -> None:
    """The copy in ``survivor`` waits for the dead worker's lease, as ``winner``'s call does: with
    ``survivor`` paused, ``winner`` takes what the lease held once it ran out (the ``n``th start of
    ``x``); the copy then decides that its first delivery died, not that it runs."""
    os.killpg(survivor.pid, signal.SIGSTOP)  # the copy waits; the winner's call wins the race
    try:
        starts = stage.wait_events("start", x, n, timeout=ttl + 10)
    finally:
        os.killpg(survivor.pid, signal.SIGCONT)
    assert starts[n - 1][3] == winner
    survivor.wait_for_line("its first delivery", timeout=ttl, what="the copy to decide")
    assert "redelivered while its first delivery runs; ignored" not in survivor.output()
    assert "redelivered after its first delivery's worker died" in survivor.output()


@pytest.mark.parametrize(
    "name", ["hold_wait", "until_and_while_executing"], ids=["while_executing-wait", "uawe-retry"]
)
def test_a_message_redelivered_after_its_worker_died_runs_when_another_call_took_the_lock_first(
    stage: Stage, name: str
) -> None:
    """The whole prefork worker running a message dies (``acks_late``: the message comes back).
    While its lease lasts, another call of the same key (``lock_busy`` ``"wait"`` or
    ``"retry"``) and the redelivered message both wait for it; when it runs out, the other
    call takes the lock first (here always: the redelivered copy's worker is paused until it
    has). The copy must not take the lock passing to another call for its first delivery
    having ended (its release would have handed the lock to the copy): its first delivery
    died, so it is a run like any other, which ``lock_busy`` makes wait for the other call
    (``"wait"``) or try again until it is done (``"retry"``), then run. Ignored, it was
    acknowledged, and the message lost.

    The message comes back when the test puts it back (``redeliver``), the workers all started
    before the kill: well inside the dead worker's lease (16 s), whatever the machine's load.
    The other call is acknowledged on receipt (no ``acks_late``): never put back."""
    ttl = 16.0
    conf = acks_late(ttl) | {"broker_transport_options": NO_SWEEP}
    doomed = stage.worker("doomed", "prefork", 1, **conf)
    x, task = fresh(), stage.task(name)
    first = task.delay(x, gate=True)
    stage.wait_events("start", x)
    stage.worker("other", "prefork", 1, queue="other", **(conf | {"task_acks_late": False}))
    survivor = stage.worker("survivor", "prefork", 1, **conf)
    doomed.kill()  # the main process and its pool child: nobody releases
    other = task.apply_async((x,), {"gate": True}, queue="other")
    stage.wait_events("busy", x)  # the other call waits for the dead worker's lease
    stage.redeliver(first.id)
    wait_for(lambda: [event for event in stage.events("busy", x) if event[3] == first.id], what="the copy")
    assert len(stage.events("start", x)) == 1  # the copy found the dead worker's lease
    # the lease runs out: the other call takes the lock
    another_call_wins_then_the_copy_runs_as_any_other(stage, survivor, x, other.id, 2, ttl)
    stage.recorder.open_gate(x)
    assert other.get(timeout=RESULT_TIMEOUT) == x
    starts = stage.wait_events("start", x, 3)  # the copy, once the other call let go
    assert starts[2][3] == first.id and int(starts[2][5]) > int(starts[1][5])
    stage.recorder.open_gate(x)
    assert first.get(timeout=RESULT_TIMEOUT) == x
    assert [event[3] for event in stage.events("start", x)] == [first.id, other.id, first.id]


@pytest.mark.parametrize("how", ["worker_died_before_the_ack", "visibility_timeout"])
def test_a_message_redelivered_after_its_run_ended_is_ignored_while_its_lock_is_kept_for_its_period(
    stage: Stage, how: str
) -> None:
    """``until_expired``: the run ends and keeps its lock for ``lock_period`` (600 s), but its
    message comes back (``acks_late``): its worker died after the run, before the message was
    acknowledged, or the message was restored once ``visibility_timeout`` passed while the run
    went on. The copy finds the lock held by its own first delivery, which ran: it must be
    ignored at once, not watch the kept hold, holding a worker slot, until the period runs out,
    then run the body again within what was its period; and nothing of its must be left."""
    conf = acks_late(TTL)
    first = stage.worker("first", "prefork", 1, **conf)
    x, task = fresh(), stage.task("until_expired")
    key = task_lock_key(task, (x,), {"gate": True})
    result = task.delay(x, gate=True)
    start = stage.wait_events("start", x)[0]
    if how == "worker_died_before_the_ack":
        first.signal(signal.SIGSTOP)  # its main process: the pool child runs on, nothing acknowledges
    else:  # the worker's own sweep puts the message back while the run goes on
        wait_for(lambda: stage.client.llen(stage.queue) == 1, what="the message to be put back")
    stage.recorder.open_gate(x)
    assert result.get(timeout=RESULT_TIMEOUT) == x
    wait_for(lambda: stage.client.pttl(key) > 60_000, what="the run to keep its lock for its period")
    copy = first
    if how == "worker_died_before_the_ack":
        first.kill()
        copy = stage.worker("survivor", "prefork", 1, **conf)
    wait_for(
        lambda: [event for event in stage.events("busy", x) if event[3] == result.id],
        timeout=20,
        what="kombu to deliver the message again",
    )
    copy.wait_for_line(
        "redelivered once its first delivery ran", timeout=20, what="the copy to be ignored at once"
    )
    wait_for(
        lambda: stage.client.zcard("unacked_index") == 0 and stage.client.llen(stage.queue) == 0,
        what="the copy to be acknowledged",
    )
    assert [event[3] for event in stage.events("start", x)] == [result.id]  # one run
    kept = parse_value(stage.client.get(key))
    assert kept is not None and kept.fence == int(start[5])  # the run's hold, kept for its period
    assert stage.client.pttl(key) > 60_000
    stage.client.delete(key)
    assert leftover_locks(stage.client, stage.prefix) == []  # the copy left nothing behind


def test_a_copy_watching_its_first_delivery_learns_at_once_that_its_run_ended_and_kept_the_lock(
    stage: Stage,
) -> None:
    """``until_expired``: a copy of the message, delivered again while its first delivery runs,
    watches that run's hold (for ``lock_ttl/3``, 20 s here). The run ends and keeps its lock for
    ``lock_period``: the copy is told so at once, and is ignored as a copy that arrives once
    the run ended is (not, a renewal interval later, as one whose first delivery runs)."""
    conf: dict[str, Any] = {"task_acks_late": True, "redislock_ttl": 60}  # put back by the test only
    stage.worker("first", "prefork", 1, **conf)
    x, task = fresh(), stage.task("until_expired")
    key = task_lock_key(task, (x,), {"gate": True})
    result = task.delay(x, gate=True)
    start = stage.wait_events("start", x)[0]
    twin = stage.worker("twin", "prefork", 1, **conf)
    stage.redeliver(result.id)
    wait_for(lambda: stored(stage.client, key)[32:33] != b":", what="the copy to watch the run's hold")
    stage.recorder.open_gate(x)
    assert result.get(timeout=RESULT_TIMEOUT) == x
    twin.wait_for_line("its first delivery", timeout=60, what="the copy to decide")
    assert "redelivered once its first delivery ran, which keeps lock" in twin.output(), twin.output()[-3000:]
    assert "redelivered while its first delivery runs" not in twin.output()
    wait_for(
        lambda: stage.client.zcard("unacked_index") == 0 and stage.client.llen(stage.queue) == 0,
        what="the copy to be acknowledged",
    )
    assert [event[3] for event in stage.events("start", x)] == [result.id]  # one run
    kept = parse_value(stage.client.get(key))
    assert kept is not None and kept.kept and kept.fence == int(start[5])  # the run's, kept
    stage.client.delete(key)
    assert leftover_locks(stage.client, stage.prefix) == []  # the copy left nothing behind


def test_an_until_executed_message_redelivered_after_its_run_ended_runs_again(stage: Stage) -> None:
    """``until_executed`` keeps nothing once the run ended: its release frees the lock. A copy of
    the message restored once ``visibility_timeout`` passed during the run finds the lock free,
    as a message whose first delivery died would, and runs (``acks_late``: at least once)."""
    first = stage.worker("first", "prefork", 1, **acks_late(TTL))
    x, task = fresh(), stage.task("until_executed")
    key = task_lock_key(task, (x,), {"gate": True})
    result = task.delay(x, gate=True)
    stage.wait_events("start", x)
    wait_for(lambda: stage.client.llen(stage.queue) == 1, what="the message to be put back")
    stage.recorder.open_gate(x)
    assert result.get(timeout=RESULT_TIMEOUT) == x
    starts = stage.wait_events("start", x, 2)
    assert [event[3] for event in starts] == [result.id, result.id]
    assert int(starts[1][5]) > int(starts[0][5])
    assert "redelivered" not in first.output()  # a run like any other: the lock was free
    stage.recorder.open_gate(x)
    stage.wait_events("end", x, 2)
    wait_for(lambda: not stage.client.exists(key), what="the copy's run to release the lock")


def test_a_message_redelivered_after_its_worker_died_runs_when_another_call_took_its_permit_first(
    stage: Stage,
) -> None:
    """As above, with ``lock_limit=2`` (``until_and_while_executing``, ``lock_busy="retry"``): the
    dead worker's run held one permit, another call the other; a third call retries. When the
    dead permit runs out, the third call takes it first (the redelivered copy's worker is paused
    until it has), and no permit is left for the copy. Its first delivery died: the copy is a run
    like any other, which retries until a permit is free, then runs. It took the permit going
    to another call for its first delivery having ended, and was ignored: the message lost."""
    ttl = 16.0
    conf = acks_late(ttl) | {"broker_transport_options": NO_SWEEP}
    doomed = stage.worker("doomed", "prefork", 1, **conf)
    x, task = fresh(), stage.task("limited_queued")
    first = task.delay(x, gate=True)
    stage.wait_events("start", x)
    stage.worker("other", "prefork", 2, queue="other", **(conf | {"task_acks_late": False}))
    second = task.apply_async((x,), {"gate": True}, queue="other")  # holds the other permit
    stage.wait_events("start", x, 2)
    survivor = stage.worker("survivor", "prefork", 1, **conf)
    doomed.kill()  # the main process and its pool child: nobody releases
    third = task.apply_async((x,), {"gate": True}, queue="other")
    wait_for(lambda: [event for event in stage.events("busy", x) if event[3] == third.id], what="a retry")
    stage.redeliver(first.id)
    wait_for(lambda: [event for event in stage.events("busy", x) if event[3] == first.id], what="the copy")
    assert len(stage.events("start", x)) == 2  # the copy found the dead worker's permit
    # the permit runs out: the third call takes it
    another_call_wins_then_the_copy_runs_as_any_other(stage, survivor, x, third.id, 3, ttl)
    stage.recorder.open_gate(x, 2)
    assert second.get(timeout=RESULT_TIMEOUT) == x
    assert third.get(timeout=RESULT_TIMEOUT) == x
    starts = stage.wait_events("start", x, 4)  # the copy, once a permit was free
    assert starts[3][3] == first.id
    stage.recorder.open_gate(x)
    assert first.get(timeout=RESULT_TIMEOUT) == x
    assert sorted(event[3] for event in stage.events("start", x)) == sorted(
        [first.id, first.id, second.id, third.id]
    )
