"""Last one wins (``lock_duplicate="replace"``), rejected messages (``lock_busy="reject"``) and the
state of a skipped run (``redislock_skip_state``), on a real Redis (broker, results, locks) and a
real worker: the superseded messages are dropped, the last call runs, once, with its arguments."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import celery
import pytest
import redis
from celery import Celery, Task
from celery.app.task import Context
from celery.exceptions import Reject, SoftTimeLimitExceeded
from celery.result import AsyncResult
from kombu.exceptions import EncodeError, OperationalError

from celery_redislock import (
    LockConfigurationError,
    LockedTask,
    RedisLock,
    busy,
    enqueue,
    execution,
    run_lock,
    signals,
    task_lock_key,
)
from celery_redislock._task_scripts import DROP, REPLACE, UNREPLACE
from celery_redislock.attempt import companion_key
from celery_redislock.busy import policy_for
from celery_redislock.enqueue import superseded
from celery_redislock.found import Found
from celery_redislock.protocol import HEADER, holder_for, parse_holder, parse_value
from celery_redislock.run_lock import ExecutionLock
from tests.interrupts import Arm, Interrupt, on_this_thread
from tests.invariants import keys_of, stored
from tests.otel import Otel
from tests.taskapp import make_app, recorder
from tests.workers import threads_worker, wait_for

RESULT_TIMEOUT = 30
ENQUEUE_MODES = ("until_executing", "until_executed", "until_and_while_executing", "until_expired")
#: Celery 5.7 records a message rejected without requeue as failed (celery/celery#10369).
CELERY_RECORDS_REJECT = tuple(int(part) for part in celery.__version__.split(".")[:2]) >= (5, 7)


def define(app: Celery, name: str, **options: Any) -> Task[Any, Any]:
    """A locked task ``name`` keyed by ``x``, recording its runs; gated where ``gate`` is set
    (``until_expired``: kept for 60 s after a run)."""
    rec = recorder(app)
    if options.get("lock_mode") == "until_expired":
        options.setdefault("lock_period", 60)

    def body(self: Task[Any, Any], x: object, call: int = 0, gate: bool = False) -> object:
        rec.record(f"start@{call}", self, x)
        if gate:
            rec.wait_gate(x)
        rec.record("end", self, x)
        return call

    decorate: Any = app.task(base=LockedTask, bind=True, shared=False, name=name, lock_on=("x",), **options)
    return cast(Task[Any, Any], decorate(body))


def runs(app: Celery, x: object) -> list[list[str]]:
    """The starts of ``x``'s runs: ``["start@<call>", task, x, task id, ...]``."""
    return [event for event in recorder(app).events() if event[0].startswith("start@") and event[2] == str(x)]


def state(result: AsyncResult[Any]) -> str:
    """The state in the result backend (typed as any state: Celery's stubs list only its own)."""
    return str(result.state)


def holder_task(app: Celery, key: str) -> str:
    """The task id the lock ``key`` names now."""
    value = parse_value(stored(recorder(app).client, key))
    assert value is not None
    return parse_holder(value.holder)["task"]


@pytest.fixture
def dropped() -> Iterator[list[dict[str, Any]]]:
    """The ``task_deduplicated`` signals of superseded messages, as sent."""
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **fields: Any) -> None:
        if fields.get("superseded_task_id"):
            seen.append(fields)

    signals.task_deduplicated.connect(receiver, weak=False)
    yield seen
    signals.task_deduplicated.disconnect(receiver)


def wait_all(results: list[AsyncResult[Any]]) -> None:
    wait_for(lambda: all(result.ready() for result in results), timeout=120, what="every result ready")


@pytest.mark.parametrize("mode", ENQUEUE_MODES)
def test_a_storm_of_500_replacing_calls_from_4_threads_runs_once_the_last_to_take_the_lock(
    app: Celery, mode: str, dropped: list[dict[str, Any]]
) -> None:
    task = define(app, f"storm_{mode}", lock_mode=mode, lock_duplicate="replace", lock_retry_delay=0.2)
    key = task_lock_key(task, ("x",)) + (":queued" if mode == "until_and_while_executing" else "")
    sent: dict[str, int] = {}
    guard = threading.Lock()

    def send(thread: int) -> None:
        for i in range(125):
            call = thread * 125 + i
            result = task.apply_async(("x", call))
            with guard:
                sent[result.id] = call

    threads = [threading.Thread(target=send, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(sent) == 500
    winner = holder_task(app, key)  # the lock's own record of the last call to take it
    assert recorder(app).client.llen(app.conf.task_default_queue) == 500
    with threads_worker(app):
        results: list[AsyncResult[Any]] = [task.AsyncResult(task_id) for task_id in sent]
        wait_all(results)
    started = runs(app, "x")
    assert [(event[0], event[3]) for event in started] == [(f"start@{sent[winner]}", winner)]
    assert task.AsyncResult(winner).get(timeout=RESULT_TIMEOUT) == sent[winner]
    assert {result.id: result.result for result in results if result.id != winner} == {
        task_id: None for task_id in sent if task_id != winner
    }
    assert len(dropped) == 499
    assert {fields["superseded_task_id"] for fields in dropped} == set(sent) - {winner}
    client = recorder(app).client
    if mode == "until_expired":  # kept for its period after the run
        assert holder_task(app, key) == winner
        client.delete(key)
    assert not client.exists(key)
    marks = list(client.scan_iter(companion_key(key, "superseded:*")))
    assert len(marks) == 499  # kept, as dropped, so that a copy delivered again is dropped too
    assert all(stored(client, mark).startswith(b"d:") and client.pttl(mark) > 0 for mark in marks)
    assert not list(client.scan_iter(companion_key(key, "replaced:*")))  # each message was sent, and met


def test_a_superseded_message_is_logged_naming_both_tasks(
    app: Celery, caplog: pytest.LogCaptureFixture, dropped: list[dict[str, Any]]
) -> None:
    task = define(app, "logged", lock_mode="until_executing", lock_duplicate="replace")
    first, second = task.apply_async(("x", 1)), task.apply_async(("x", 2))
    with caplog.at_level(logging.INFO, logger="celery_redislock"), threads_worker(app):
        assert second.get(timeout=RESULT_TIMEOUT) == 2
        assert first.get(timeout=RESULT_TIMEOUT) is None  # SUCCESS with None: dropped, not run
    lines = [record.getMessage() for record in caplog.records if "superseded by" in record.getMessage()]
    assert lines == [
        f"task {task.name}[{first.id}] dropped: superseded by task {second.id}, "
        f"which took its enqueue lock {task_lock_key(task, ('x',))} over"
    ]
    assert dropped == [
        {"signal": signals.task_deduplicated, "key": task_lock_key(task, ("x",)),
         "existing_task_id": second.id, "superseded_task_id": first.id}
    ]  # fmt: skip
    assert [event[0] for event in runs(app, "x")] == ["start@2"]


def test_keep_latest_one_runs_and_the_latest_call_is_queued_behind_it(app: Celery) -> None:
    task = define(
        app, "latest", lock_mode="until_and_while_executing", lock_duplicate="replace", lock_retry_delay=0.2
    )
    with threads_worker(app):
        running = task.apply_async(("x", 0), {"gate": True})
        wait_for(lambda: runs(app, "x"), what="the first run")
        calls = [task.apply_async(("x", call)) for call in range(1, 6)]
        assert len({call.id for call in calls}) == 5  # each one sent, each taking the queued lock over
        recorder(app).open_gate("x")
        assert running.get(timeout=RESULT_TIMEOUT) == 0
        assert calls[-1].get(timeout=RESULT_TIMEOUT) == 5
        wait_all(calls)
    started = runs(app, "x")
    assert [event[0] for event in started] == ["start@0", "start@5"]
    assert [call.result for call in calls] == [None, None, None, None, 5]


def test_a_running_task_is_not_replaced(app: Celery) -> None:
    """until_executed: the lock is the run's once it started; a replacing call gets its result."""
    task = define(app, "running", lock_mode="until_executed", lock_duplicate="replace")
    with threads_worker(app):
        running = task.apply_async(("x", 1), {"gate": True})
        wait_for(lambda: runs(app, "x"), what="the run")
        again = task.apply_async(("x", 2))
        assert again.id == running.id  # nothing sent: a sent call would have an id of its own
        recorder(app).open_gate("x")
        assert again.get(timeout=RESULT_TIMEOUT) == 1
    assert [event[0] for event in runs(app, "x")] == ["start@1"]


def test_debounce_with_a_countdown_runs_once_with_the_last_calls_arguments(app: Celery) -> None:
    task = define(app, "debounced", lock_mode="until_executing", lock_duplicate="replace")
    calls = [task.apply_async(("x", call), countdown=1) for call in range(100)]
    with threads_worker(app):  # started after the burst: however slow the burst, its calls wait
        assert calls[-1].get(timeout=RESULT_TIMEOUT) == 99
        wait_all(calls)
    assert [event[0] for event in runs(app, "x")] == ["start@99"]


@pytest.mark.parametrize("mode", ENQUEUE_MODES)
def test_a_replacing_call_that_cannot_be_sent_gives_the_lock_back(app: Celery, mode: str) -> None:
    task = define(app, f"unsent_{mode}", lock_mode=mode, lock_duplicate="replace")
    key = task_lock_key(task, ("x",)) + (":queued" if mode == "until_and_while_executing" else "")
    client = recorder(app).client
    with pytest.raises(EncodeError):
        task.apply_async(("x", object()))  # the key is made of x alone: only sending fails
    assert not client.exists(key)
    queued = task.apply_async(("x", 1))
    before = stored(client, key)
    with pytest.raises(EncodeError):
        task.apply_async(("x", object()))
    assert stored(client, key) == before  # the queued message owns its lock again
    value = parse_value(before)
    assert value is not None
    assert not client.exists(companion_key(key, f"superseded:{value.token}"))  # and is not superseded
    with threads_worker(app):
        assert queued.get(timeout=RESULT_TIMEOUT) == 1
    assert [event[0] for event in runs(app, "x")] == ["start@1"]
    client.delete(key)  # until_expired keeps it for its period


def test_a_replacing_call_that_cannot_be_sent_counts_no_replacement(app: Celery, otel: Otel) -> None:
    """``duplicate-replaced`` counts a call that took the lock over and was sent: one whose send
    failed gave the lock back and replaced nothing; the next one that is sent counts."""
    task = define(app, "unsent_counted", lock_mode="until_executed", lock_duplicate="replace")
    attributes = {"task": task.name, "mode": "until_executed", "outcome": "duplicate-replaced"}
    queued = task.apply_async(("x", 1))
    with pytest.raises(EncodeError):
        task.apply_async(("x", object()))  # the key is made of x alone: only sending fails
    assert otel.count("redislock.lock.acquisitions", **attributes) == 0
    later = task.apply_async(("x", 2))
    assert otel.count("redislock.lock.acquisitions", **attributes) == 1
    with threads_worker(app):
        assert later.get(timeout=RESULT_TIMEOUT) == 2
        assert queued.get(timeout=RESULT_TIMEOUT) is None  # superseded by the later call: dropped
    assert [event[0] for event in runs(app, "x")] == ["start@2"]


QUEUED = holder_for("a", 0, "node", 1, "queued")
TOKENS = ["a" * 32, "b" * 32, "c" * 32]


def replace(client: Any, key: str, n: int) -> list[bytes]:
    """REPLACE for the n-th message (token ``TOKENS[n]``, task id ``"abc"[n]``)."""
    return cast(list[bytes], REPLACE(client, [key], [TOKENS[n], QUEUED, 60_000, "abc"[n]]))


def test_an_unsent_message_leaves_a_lock_taken_over_since_to_the_later_message(app: Celery) -> None:
    client, key = recorder(app).client, f"{recorder(app).prefix}:manual"
    assert replace(client, key, 0) == [b"taken"]
    status, old_value = replace(client, key, 1)
    assert status == b"replaced" and old_value.startswith(TOKENS[0].encode())
    assert replace(client, key, 2)[0] == b"replaced"
    assert UNREPLACE(client, [key], [TOKENS[1]]) == 0  # c took it over: c stands
    assert stored(client, key).startswith(TOKENS[2].encode())
    assert client.get(companion_key(key, f"superseded:{TOKENS[0]}")) == f"s:{TOKENS[2]}:c".encode()
    assert not client.exists(companion_key(key, f"superseded:{TOKENS[1]}"))  # b was never sent
    assert all(client.pttl(name) > 0 for name in keys_of(client, recorder(app).prefix))
    client.delete(key)


def test_two_failed_sends_in_a_row_give_the_lock_back_to_the_message_that_was_sent(app: Celery) -> None:
    """b replaces a, c replaces b, then both sends fail, b's undo first: the lock goes back to a
    (sent, queued), not to b (never sent); in the other order too."""
    client, key = recorder(app).client, f"{recorder(app).prefix}:chain"
    for undo_order in ((1, 2), (2, 1)):
        assert replace(client, key, 0) == [b"taken"]
        first = stored(client, key)
        replace(client, key, 1)
        replace(client, key, 2)
        for n in undo_order:
            UNREPLACE(client, [key], [TOKENS[n]])
        assert stored(client, key) == first  # a owns its lock again
        assert not client.exists(companion_key(key, f"superseded:{TOKENS[0]}"))  # and is not superseded
        assert all(client.pttl(name) > 0 for name in keys_of(client, recorder(app).prefix))
        client.delete(key)


def test_a_replace_sent_again_after_a_lost_reply_gets_the_same_answer(app: Celery) -> None:
    """redis-py sends a script again when its reply was lost: the call's undo must still know what
    it replaced, and give the lock back to it."""
    client, key = recorder(app).client, f"{recorder(app).prefix}:again"
    replace(client, key, 0)
    first = stored(client, key)
    answer = replace(client, key, 1)
    assert answer[0] == b"replaced"
    assert replace(client, key, 1) == answer
    assert UNREPLACE(client, [key], [TOKENS[1]]) == 1
    assert stored(client, key) == first
    assert not client.exists(companion_key(key, f"superseded:{TOKENS[0]}"))
    client.delete(key)


def test_an_unsent_message_that_replaced_one_whose_lock_ran_out_meanwhile_leaves_it_not_superseded(
    app: Celery,
) -> None:
    """Message b replaces queued message a, whose enqueue lock is near its end (a waited almost
    ``lock_queue_ttl`` in a backlog); b's send fails after a's lock would have run out, so b's undo
    frees the lock rather than give it back. Message a was not superseded by any message sent: when
    delivered, it runs (checked at execution as any message past its queue ttl), rather than be
    dropped for b, which nobody will ever run. Before, its mark still named b: dropped."""
    client, key = recorder(app).client, f"{recorder(app).prefix}:ran-out"
    assert REPLACE(client, [key], [TOKENS[0], QUEUED, 200, "a"]) == [b"taken"]
    assert replace(client, key, 1)[0] == b"replaced"
    record = stored(client, companion_key(key, f"replaced:{TOKENS[1]}"))
    expiry_ms = int(record.split(b":")[0])  # when a's lock would have run out (server ms)
    wait_for(
        lambda: (lambda t: t[0] * 1000 + t[1] // 1000)(client.time()) > expiry_ms, 10, "a's lock to run out"
    )
    assert UNREPLACE(client, [key], [TOKENS[1]]) == 1
    assert not client.exists(key)
    assert DROP(client, [key], [TOKENS[0], "0"]) == [b"kept"]  # not superseded: the worker runs a
    assert not client.exists(companion_key(key, f"superseded:{TOKENS[0]}"))


def test_a_failed_send_after_the_worker_dropped_the_replaced_message_frees_the_lock(
    app: Celery, monkeypatch: pytest.MonkeyPatch, dropped: list[dict[str, Any]]
) -> None:
    """Debounce: a countdown message waits in a worker's memory, and is dropped there when due. If
    the replacing call's send then fails, the lock must not go back to the dropped message."""
    task = define(app, "dropped_then_failed", lock_mode="until_executing", lock_duplicate="replace")
    client, key = recorder(app).client, task_lock_key(task, ("x",))
    first = task.apply_async(("x", 1))
    ticket = parse_value(stored(client, key))
    assert ticket is not None
    request = Context(id=first.id, retries=0, headers={HEADER: {"key": key, "token": ticket.token}})
    send_task_message = app.amqp.send_task_message

    def worker_drops_the_first_then_the_send_fails(*args: Any, **kwargs: Any) -> Any:
        assert superseded(task, client, request)  # what the worker does when the first is due
        raise OperationalError("the broker went away")

    monkeypatch.setattr(app.amqp, "send_task_message", worker_drops_the_first_then_the_send_fails)
    with pytest.raises(OperationalError):
        task.apply_async(("x", 2))
    monkeypatch.setattr(app.amqp, "send_task_message", send_task_message)
    assert [fields["superseded_task_id"] for fields in dropped] == [first.id]
    assert not client.exists(key)  # freed: the message it named was dropped, the other never sent
    assert stored(client, companion_key(key, f"superseded:{ticket.token}")).startswith(b"d:")
    assert superseded(task, client, request)  # its copy delivered again is dropped too
    later = task.apply_async(("x", 3))  # and nothing blocks the next call
    with threads_worker(app):
        assert later.get(timeout=RESULT_TIMEOUT) == 3
    assert [event[0] for event in runs(app, "x")] == ["start@3"]


def test_an_interrupted_replace_is_undone(app: Celery, interrupt_read: Arm) -> None:
    """A replacing call interrupted after its REPLACE was sent (a soft time limit, a signal): the
    lock goes back to the queued message, which runs."""
    task = define(app, "interrupted", lock_mode="until_executing", lock_duplicate="replace")
    client, key = recorder(app).client, task_lock_key(task, ("x",))
    queued = task.apply_async(("x", 1))
    before = stored(client, key)
    seen: list[str] = []

    def replaced() -> None:  # the REPLACE was sent: it runs on the server
        wait_for(lambda: holder_task(app, key) == "interrupted-call", what="the replace")
        seen.append(holder_task(app, key))

    fired = interrupt_read(on_this_thread(), then=replaced)
    with pytest.raises(Interrupt):
        task.apply_async(("x", 2), task_id="interrupted-call")
    assert fired and seen == ["interrupted-call"]
    assert stored(client, key) == before  # given back
    value = parse_value(before)
    assert value is not None
    assert not client.exists(companion_key(key, f"superseded:{value.token}"))
    with threads_worker(app):
        assert queued.get(timeout=RESULT_TIMEOUT) == 1
    assert [event[0] for event in runs(app, "x")] == ["start@1"]


def replaced_once_its_run_took_its_lock(app: Celery, task: Task[Any, Any]) -> AsyncResult[Any]:
    """Sends ``task("x", 1)``, whose run, once it took its lock (``lock_acquired``), is replaced
    by a call ``task("x", 2)``; runs both on a worker: the first ends with ``None``, the call
    with 2. The first's result."""
    later: list[AsyncResult[Any]] = []

    def replace_now(sender: Any = None, **_: Any) -> None:
        if sender.name == task.name and not later:
            later.append(task.apply_async(("x", 2)))

    signals.lock_acquired.connect(replace_now, weak=False)
    try:
        first = task.apply_async(("x", 1))
        with threads_worker(app):
            assert first.get(timeout=RESULT_TIMEOUT) is None
            assert later[0].get(timeout=RESULT_TIMEOUT) == 2
    finally:
        signals.lock_acquired.disconnect(replace_now)
    return first


def test_a_message_taken_over_after_its_check_but_before_its_enqueue_lock_went_is_dropped(
    app: Celery, dropped: list[dict[str, Any]]
) -> None:
    """until_and_while_executing: a replacing call lands after the run checked for being superseded,
    before it freed its enqueue lock: the run is dropped (its execution lock released), and the
    replacing call's message runs, once."""
    task = define(app, "late_replace", lock_mode="until_and_while_executing", lock_duplicate="replace")
    first = replaced_once_its_run_took_its_lock(app, task)
    assert [fields["superseded_task_id"] for fields in dropped] == [first.id]
    assert [event[0] for event in runs(app, "x")] == ["start@2"]


def test_a_message_taken_over_after_its_check_is_dropped_when_it_finds_its_lock_busy(
    app: Celery, dropped: list[dict[str, Any]]
) -> None:
    """until_executed: a replacing call may take the lock over between a run's check for being
    superseded and its adoption of the lock; the run then finds it held by that call's message."""
    task = define(app, "race", lock_mode="until_executed", lock_duplicate="replace")
    client, key = recorder(app).client, task_lock_key(task, ("x",))
    first = task.apply_async(("x", 1))
    ticket = parse_value(stored(client, key))
    second = task.apply_async(("x", 2))
    taken_over = parse_value(stored(client, key))
    assert ticket is not None and taken_over is not None
    request = Context(id=first.id, retries=0, headers={HEADER: {"key": key, "token": ticket.token}})
    options, settings = cast(LockedTask, task).lock_options, cast(LockedTask, task).lock_settings
    assert options is not None and settings is not None
    lock = ExecutionLock(client, key, 30, holder_for(first.id, 0, "node", 1), settings,
                         task_name=task.name, raise_on_lost=False, stop_child=False)  # fmt: skip
    now = time.monotonic()
    found = Found(task, options, lock, request, ("x", 1), {}, taken_over.holder, 30.0, now, now, now)
    assert busy.OUTCOMES[policy_for(found)] == "superseded"
    assert [fields["superseded_task_id"] for fields in dropped] == [first.id]
    assert busy.OUTCOMES[policy_for(found)] == "superseded"  # a copy delivered again: dropped too
    with threads_worker(app):  # its message finds the lock held by the second's, and is skipped
        assert second.get(timeout=RESULT_TIMEOUT) == 2
        assert first.get(timeout=RESULT_TIMEOUT) is None
    assert [event[0] for event in runs(app, "x")] == ["start@2"]


def test_a_retry_on_its_way_is_not_replaced(app: Celery) -> None:
    """until_executed keeps the lock for the retry (parked, try=1): a replacing call gets its result."""
    rec = recorder(app)

    @app.task(base=LockedTask, bind=True, shared=False, name="retried", lock_on=("x",),
              lock_mode="until_executed", lock_duplicate="replace")  # fmt: skip
    def retried(self: Task[Any, Any], x: object, call: int = 0) -> object:
        rec.record(f"start@{call}", self, x)
        if self.request.retries == 0:
            raise self.retry(countdown=1)
        return call

    with threads_worker(app):
        first = retried.apply_async(("x", 1))
        wait_for(lambda: runs(app, "x"), what="the first attempt")
        key = task_lock_key(retried, ("x",))
        wait_for(lambda: "try=1" in stored(rec.client, key).decode(), what="the hold parked for the retry")
        again = retried.apply_async(("x", 2))
        assert again.id == first.id
        assert first.get(timeout=RESULT_TIMEOUT) == 1
    assert [(event[0], event[6]) for event in runs(app, "x")] == [("start@1", "0"), ("start@1", "1")]


def test_a_retry_of_a_message_marked_superseded_runs(app: Celery) -> None:
    """A replacing call can take a message's enqueue lock over in the instant its run starts (before
    the run frees it): the run goes on, and so must its retry, which carries the same ticket."""
    rec = recorder(app)

    @app.task(base=LockedTask, bind=True, shared=False, name="retries", lock_on=("x",),
              lock_mode="until_executing", lock_duplicate="replace")  # fmt: skip
    def retries(self: Task[Any, Any], x: object) -> object:
        rec.record(f"start@{self.request.retries}", self, x)
        if self.request.retries == 0:
            ticket = (self.request.headers or {})["redislock"]
            mark = companion_key(ticket["key"], f"superseded:{ticket['token']}")
            rec.client.set(mark, f"s:{'f' * 32}:a-later-call", px=60_000)  # as that replacing call leaves it
            raise self.retry(countdown=0)
        return self.request.retries

    with threads_worker(app):
        assert retries.apply_async(("x",)).get(timeout=RESULT_TIMEOUT) == 1
    assert [event[0] for event in runs(app, "x")] == ["start@0", "start@1"]


def test_a_redelivered_copy_is_not_superseded_by_a_later_call(
    app: Celery, dropped: list[dict[str, Any]]
) -> None:
    """A redelivery (acks_late, a visibility timeout) of a message whose run started is the same
    message again: same task id, retry count and ticket. A call sent since holds the queued key,
    fresh (the run had freed it): the copy is handled as a redelivery, not dropped as superseded."""
    task = define(
        app, "redelivered", lock_mode="until_and_while_executing", lock_duplicate="replace", acks_late=True
    )
    client, queued_key = recorder(app).client, task_lock_key(task, ("x",)) + ":queued"
    first = task.apply_async(("x", 1), {"gate": True})
    ticket = parse_value(stored(client, queued_key))
    assert ticket is not None
    with threads_worker(app):
        wait_for(lambda: runs(app, "x"), what="the first run")
        later = task.apply_async(("x", 2))
        assert holder_task(app, queued_key) == later.id
        header = {HEADER: {"key": queued_key, "token": ticket.token}}
        task.apply_async(("x", 1), {"gate": True}, task_id=first.id, headers=header)  # type: ignore[arg-type]
        wait_for(lambda: [e for e in recorder(app).events() if e[0] == "busy" and e[3] == first.id])
        recorder(app).open_gate("x")
        assert first.get(timeout=RESULT_TIMEOUT) == 1
        assert later.get(timeout=RESULT_TIMEOUT) == 2
    assert dropped == []
    started = [(event[0], event[3]) for event in runs(app, "x")]
    assert started == [("start@1", first.id), ("start@2", later.id)]


@pytest.mark.parametrize("mode", ["while_executing", "until_and_while_executing"])
def test_reject_rejects_the_message_and_records_its_failure(app: Celery, mode: str) -> None:
    task = define(app, f"reject_{mode}", lock_mode=mode, lock_busy="reject", acks_late=True)
    client = recorder(app).client
    rejects: list[str | None] = []

    def receiver(sender: Any = None, task_id: str | None = None, outcome: str = "", **_: Any) -> None:
        if outcome == "busy-reject":
            rejects.append(task_id)

    signals.lock_busy.connect(receiver, weak=False)
    try:
        with threads_worker(app):
            holder = task.apply_async(("x", 1), {"gate": True})
            wait_for(lambda: runs(app, "x"), what="the holder's run")
            rejected = task.apply_async(("x", 2))
            wait_for(lambda: rejects == [rejected.id], what="the reject")
            if CELERY_RECORDS_REJECT:  # a message rejected without requeue is recorded as failed
                with pytest.raises(Reject):
                    rejected.get(timeout=RESULT_TIMEOUT)
                assert rejected.state == "FAILURE"
            if mode == "until_and_while_executing":
                assert not client.exists(task_lock_key(task, ("x",)) + ":queued")  # its enqueue lock went
            recorder(app).open_gate("x")
            assert holder.get(timeout=RESULT_TIMEOUT) == 1
    finally:
        signals.lock_busy.disconnect(receiver)
    assert client.llen(app.conf.task_default_queue) == 0  # not requeued
    assert [event[0] for event in runs(app, "x")] == ["start@1"]
    if not CELERY_RECORDS_REJECT:
        assert state(rejected) == "PENDING"


@pytest.fixture
def skip_app(redis_server: Any, prefix: str) -> Iterator[Celery]:
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_skip_state="SKIPPED")
    yield app
    app.close()


def test_a_skipped_run_records_the_skip_state(skip_app: Celery) -> None:
    app = skip_app
    task = define(app, "skipped", lock_busy="skip")
    replaced = define(app, "replaced", lock_mode="until_executing", lock_duplicate="replace")
    superseded, latest = replaced.apply_async(("y", 1)), replaced.apply_async(("y", 2))
    with threads_worker(app):
        holder = task.apply_async(("x", 1), {"gate": True})
        wait_for(lambda: runs(app, "x"), what="the holder's run")
        skipped = task.apply_async(("x", 2))
        wait_for(lambda: state(skipped) == "SKIPPED", what="the skip state")
        recorder(app).open_gate("x")
        assert holder.get(timeout=RESULT_TIMEOUT) == 1
        assert latest.get(timeout=RESULT_TIMEOUT) == 2
        wait_for(lambda: state(superseded) == "SKIPPED", what="the superseded message's state")
        assert state(skipped) == "SKIPPED" and skipped.result is None  # nothing stored over it
        assert not skipped.ready()  # not a ready state: .get() waits until its timeout
    assert [event[0] for event in runs(app, "x")] == ["start@1"]
    assert task.apply(("x", 3)).get() == 3  # eager: the skip state is a worker's


def test_without_a_skip_state_a_skipped_run_succeeds_with_none(app: Celery) -> None:
    task = define(app, "plain_skip", lock_busy="skip")
    with threads_worker(app):
        holder = task.apply_async(("x", 1), {"gate": True})
        wait_for(lambda: runs(app, "x"), what="the holder's run")
        skipped = task.apply_async(("x", 2))
        assert skipped.get(timeout=RESULT_TIMEOUT) is None and skipped.state == "SUCCESS"
        recorder(app).open_gate("x")
        assert holder.get(timeout=RESULT_TIMEOUT) == 1


@pytest.mark.parametrize(
    ("options", "conf", "message"),
    [
        ({"lock_duplicate": "replace"}, {},
         "task 'bad': lock_duplicate='replace' is not valid; lock_mode 'while_executing' takes no enqueue"),
        ({"lock_mode": "until_executing", "lock_duplicate": "replace"},
         {"redislock_replicas": 1, "redislock_replica_timeout": 0.1},  # below every lock_ttl
         "task 'bad': lock_duplicate='replace' is not valid; not supported with redislock_replicas"),
        ({"lock_mode": "until_executing", "lock_busy": "reject"}, {},
         "task 'bad': lock_busy='reject' is not valid; lock_mode 'until_executing' takes no lock a run"),
        ({"lock_duplicate": "last"}, {}, "task 'bad': lock_duplicate='last' is not valid; allowed:"),
        ({}, {"redislock_skip_state": "SUCCESS"}, "redislock_skip_state='SUCCESS' is not valid; allowed:"),
        ({}, {"redislock_skip_state": "skipped"}, "redislock_skip_state='skipped' is not valid"),
        ({}, {"redislock_skip_state": 5}, "redislock_skip_state=5 is not valid"),
    ],
)  # fmt: skip
def test_bad_input_is_named_and_leaves_nothing_in_redis(
    redis_server: Any, prefix: str, options: dict[str, Any], conf: dict[str, Any], message: str
) -> None:
    app = make_app(redis_server.url, prefix, f"q-{prefix}", **conf)
    define(app, "bad", **options)
    try:
        pattern = re.escape(message)
        if conf.get("redislock_replicas"):  # shared tasks (the docs' examples) with "replace" fail too
            pattern = pattern.replace(re.escape("task 'bad'"), "task '[^']+'")
        with pytest.raises(LockConfigurationError, match=pattern):
            app.tasks["bad"].apply_async(("x",))
    finally:
        app.close()
    client = redis_server.client()
    assert keys_of(client, prefix) == []
    client.close()


def test_replace_refuses_lock_in_canvas_and_leaves_nothing_in_redis(app: Celery) -> None:
    """A superseded group or chord member would leave its chord waiting forever."""
    task = define(app, "canvas", lock_mode="until_executing", lock_duplicate="replace")
    message = f"task '{task.name}': lock_duplicate='replace' cannot take lock_in_canvas=True"
    with pytest.raises(LockConfigurationError, match=re.escape(message)):
        task.apply_async(("x", 1), group_id="a-group", lock_in_canvas=True)  # type: ignore[call-arg]
    assert keys_of(recorder(app).client, recorder(app).prefix) == []
    assert recorder(app).client.llen(app.conf.task_default_queue) == 0


def skip(task: Task[Any, Any], **request: Any) -> None:
    """``busy.skipped`` for a worker's run of ``task`` with ``request`` (pushed as its current one)."""
    task.push_request(retries=0, is_eager=False, **request)
    try:
        busy.skipped(task, task.request)
    finally:
        task.pop_request()


def test_a_group_member_is_never_ignored_with_a_skip_state(skip_app: Celery) -> None:
    """``Ignore`` would leave the member's chord waiting forever: it succeeds with ``None``."""
    task = define(skip_app, "member")
    skip(task, id="a-member", group="a-group")  # returns: no Ignore
    skip(task, id="a-member", chord={"task": "callback"})
    assert state(task.AsyncResult("a-member")) == "PENDING"  # nothing stored


def test_a_skipped_chain_member_lets_its_chain_go_on_with_a_skip_state(skip_app: Celery) -> None:
    """``Ignore`` ends a run without sending the rest of its chain: a skipped member that raised it
    (to keep its skip state) left the chain's result ``PENDING`` forever. It succeeds with
    ``None``, as a group member does, and the chain goes on."""
    app = skip_app
    task, collect = app.tasks["taskapp.hold_skip"], app.tasks["taskapp.collect"]
    with threads_worker(app):
        holder = task.delay("x", gate=True)
        wait_for(lambda: [e for e in recorder(app).events() if e[0] == "start"], what="the holder's run")
        result = (task.si("x", gate=True) | collect.s()).apply_async()
        wait_for(
            lambda: [e for e in recorder(app).events() if e[0] == "busy" and e[3] != holder.id],
            what="the chain's head to find the lock held",
        )
        recorder(app).open_gate("x")
        assert holder.get(timeout=RESULT_TIMEOUT) == "x"
        assert result.get(timeout=RESULT_TIMEOUT) is None  # the head skipped: None passed on
        # no skip state stored; Celery stores the head's result after it sent the chain's next
        # task, which may end first
        head = cast(AsyncResult[Any], result.parent)
        wait_for(lambda: state(head) != "PENDING", what="the head's result")
        assert state(head) == "SUCCESS"


def test_a_skip_state_is_not_stored_for_a_task_that_ignores_its_results(skip_app: Celery) -> None:
    task = define(skip_app, "ignoring", ignore_result=True)
    skip(task, id="ignored")  # returns: no Ignore
    assert state(task.AsyncResult("ignored")) == "PENDING"


@pytest.mark.parametrize("step", ["reject", "superseded"])
def test_a_redis_error_after_the_lock_was_found_busy_never_runs_the_body_unlocked(
    redis_server: Any, prefix: str, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """With ``redislock_on_error="run"``, a Redis error is an unlocked run only where the lock could
    not be looked at: once it was found held, the busy policy applies (reject, skip)."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_on_error="run")
    if step == "reject":
        task = define(app, "rejects", lock_mode="until_and_while_executing", lock_busy="reject")
    else:
        task = define(app, "skips", lock_mode="until_executed", lock_duplicate="replace")
    client, key = recorder(app).client, task_lock_key(task, ("x",))
    failed: list[str] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        failed.append(step)
        raise redis.ConnectionError(f"injected: {step} failed")

    monkeypatch.setattr(busy, "release_token" if step == "reject" else "superseded", failing)
    queued = task.apply_async(("x", 1))
    if step == "superseded":  # the queued message's lock taken by a run (not a replacing call)
        client.delete(key)
    holder = RedisLock(client, key, 30)
    assert holder.acquire(blocking=False)
    try:
        with threads_worker(app):
            wait_for(queued.ready, what="the queued message's outcome")
    finally:
        holder.release()
        client.delete(key + ":queued")  # the reject's enqueue lock, left to its ttl by the error
        app.close()
    assert failed == [step]
    assert runs(app, "x") == []


def test_an_error_giving_the_lock_back_is_logged_and_the_send_error_raised(
    app: Celery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    task = define(app, "undo_fails", lock_mode="until_executing", lock_duplicate="replace")
    key = task_lock_key(task, ("x",))

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("injected: the undo failed")

    task.apply_async(("x", 1))  # queued: the failing call takes its lock over
    monkeypatch.setattr(enqueue, "UNREPLACE", unreachable)
    with caplog.at_level(logging.WARNING, logger="celery_redislock"), pytest.raises(EncodeError):
        task.apply_async(("x", object()))  # the send's error, not the undo's
    assert [record.getMessage() for record in caplog.records] == [
        f"task {task.name}[{holder_task(app, key)}]: could not give back enqueue lock {key} "
        "(injected: the undo failed); it expires within its ttl"
    ]
    recorder(app).client.delete(key)


def test_a_soft_time_limit_as_a_cut_off_replace_is_undone_propagates(
    redis_server: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``redislock_on_error="run"``: a replacing call's REPLACE runs and its reply is lost (a Redis
    error), and a soft time limit (an ``Exception``) lands as its undo is sent. The limit
    propagates, nothing sent; it was logged as the undo's failure, and the Redis error's
    ``"run"`` sent the message unlocked as the caller's body went on past its limit. (The lock
    the take left is left to its ``lock_queue_ttl``, as after any interrupted undo.)"""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_on_error="run")
    task = define(app, "undo_interrupted", lock_mode="until_executing", lock_duplicate="replace")
    client, key = recorder(app).client, task_lock_key(task, ("x",))

    def reply_lost(*args: Any, **kwargs: Any) -> Any:
        REPLACE(*args, **kwargs)
        raise redis.ConnectionError("injected: the reply was lost")

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise SoftTimeLimitExceeded()

    try:
        task.apply_async(("x", 1))  # queued: the call below takes its lock over
        monkeypatch.setattr(enqueue, "REPLACE", reply_lost)
        monkeypatch.setattr(enqueue, "UNREPLACE", interrupted)
        with pytest.raises(SoftTimeLimitExceeded):
            task.apply_async(("x", 2))
        assert client.llen(app.conf.task_default_queue) == 1  # the first call's message alone
    finally:
        client.delete(key, app.conf.task_default_queue)
        app.close()


def test_a_message_superseded_after_its_check_counts_one_outcome(
    app: Celery,
    monkeypatch: pytest.MonkeyPatch,
    otel: Otel,
) -> None:
    """until_executed: a replacing call lands between the run's check and its adoption of the lock;
    the run, dropped, counts one outcome, its acquisition's: ``superseded`` (as a message dropped
    at its check, and as its ``lock_busy`` says where it finds the lock busy), not ``busy-skip``."""
    task = define(app, "counted_once", lock_mode="until_executed", lock_duplicate="replace")
    later: list[AsyncResult[Any]] = []
    adopt = run_lock.adopt

    def replaced_first(lock: Any, token: str) -> Any:
        if not later:
            later.append(task.apply_async(("x", 2)))
        return adopt(lock, token)

    monkeypatch.setattr(execution, "adopt", replaced_first)
    first = task.apply_async(("x", 1))
    with threads_worker(app):
        assert first.get(timeout=RESULT_TIMEOUT) is None
        assert later[0].get(timeout=RESULT_TIMEOUT) == 2
    assert [event[0] for event in runs(app, "x")] == ["start@2"]
    outcomes = {
        outcome: otel.count(
            "redislock.lock.acquisitions", task=task.name, mode="until_executed", outcome=outcome
        )
        for outcome in ("acquired", "busy-skip", "superseded")
    }
    assert outcomes == {"acquired": 1, "busy-skip": 0, "superseded": 1}


def test_a_message_superseded_once_it_took_its_execution_lock_counts_one_outcome(
    app: Celery, otel: Otel, dropped: list[dict[str, Any]]
) -> None:
    """until_and_while_executing: a replacing call lands after the run took its execution lock,
    before it freed its enqueue lock; the run, dropped, counts one outcome, ``superseded``, not
    also ``acquired``, and no hold (its lock was let go of at once); the later call's run counts
    ``acquired``."""
    mode = "until_and_while_executing"
    task = define(app, "superseded_holding", lock_mode=mode, lock_duplicate="replace")
    first = replaced_once_its_run_took_its_lock(app, task)
    assert [fields["superseded_task_id"] for fields in dropped] == [first.id]
    outcomes = {
        outcome: otel.count("redislock.lock.acquisitions", task=task.name, mode=mode, outcome=outcome)
        for outcome in ("acquired", "busy-skip", "superseded")
    }
    assert outcomes == {"acquired": 1, "busy-skip": 0, "superseded": 1}
    assert otel.count("redislock.lock.held", task=task.name, mode=mode) == 1


def test_a_replacing_call_whose_send_fails_as_the_queued_message_starts_leaves_that_message_to_run(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_executed, lock_duplicate="replace". The queued message M1's worker sends ADOPT just
    after a replacing call M2's REPLACE (refused: the lock is M2's); M2's send then fails and
    UNREPLACE gives the lock back to M1 (docs: "the lock is given back to the message it was taken
    from, which is no longer superseded and runs"). M1's run then checks whether it was superseded
    (DROP: the mark is gone), finds it was not, and applies lock_busy="skip": M1 is skipped, M2
    was never sent, nothing runs, and the lock names M1, queued, for lock_queue_ttl."""
    task = define(app, "review.adopt_race", lock_mode="until_executed", lock_duplicate="replace")
    client, key = recorder(app).client, task_lock_key(task, ("x",))
    first = task.apply_async(("x", 1))
    real_adopt, real_send = run_lock.adopt, app.amqp.send_task_message  # as execution imported it
    refused: list[Any] = []
    raised: list[BaseException] = []

    def adopt(lock: Any, token: str) -> Any:
        if refused or raised:
            return real_adopt(lock, token)

        def send_fails(*args: Any, **kwargs: Any) -> Any:
            refused.append(real_adopt(lock, token))  # the worker's ADOPT lands after REPLACE
            raise OperationalError("the broker went away")

        monkeypatch.setattr(app.amqp, "send_task_message", send_fails)
        try:
            task.apply_async(("x", 2))  # the replacing call, on the worker's thread for ordering
        except OperationalError as exc:
            raised.append(exc)
        finally:
            monkeypatch.setattr(app.amqp, "send_task_message", real_send)
        return refused[0]

    monkeypatch.setattr(execution, "adopt", adopt)
    try:
        with threads_worker(app):
            outcome = first.get(timeout=RESULT_TIMEOUT)
        assert raised and refused and refused[0] is not None  # M2 not sent; M1's ADOPT was refused
        value = parse_value(client.get(key))
        left = None if value is None else parse_holder(value.holder)
        assert outcome == 1 and [run[0] for run in runs(app, "x")] == ["start@1"], (
            f"M1 returned {outcome!r}, runs {runs(app, 'x')}, lock left naming {left} "
            f"for {client.pttl(key)} ms"
        )
    finally:
        client.delete(key)
