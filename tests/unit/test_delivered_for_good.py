"""``LockedRequest._delivered_for_good`` reads Celery's decision on the message (acknowledge,
reject, requeue), which the worker's event loop carries out on the message later (its ``ack`` or
``reject`` is called soon after, ``call_soon``): the message's own state still says
``RECEIVED`` when the worker's main process lets go of a dead pool child's lock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.mocks import TaskMessage

from celery_redislock.request import LockedRequest


@pytest.mark.parametrize(
    ("decide", "for_good"),
    [
        (lambda request: None, False),
        (lambda request: request.acknowledge(), True),
        (lambda request: request.reject(requeue=False), True),
        (lambda request: request.reject(requeue=True), False),
        (lambda request: (request.acknowledge(), request.reject(requeue=True)), True),
        (lambda request: (request.reject(requeue=True), request.acknowledge()), False),
    ],
    ids=["unacknowledged", "acknowledged", "rejected", "requeued", "acknowledged-first", "requeued-first"],
)
def test_a_message_is_delivered_for_good_as_celery_decided(
    decide: Callable[[Any], object], for_good: bool
) -> None:
    app = Celery(set_as_current=False)

    @app.task(name="t", shared=False)
    def task() -> None: ...

    carried_out: list[str] = []  # by the event loop, later: the message (a mock) is not touched here
    request = LockedRequest(
        TaskMessage("t", "id-1"),
        app=app,
        task=task,
        on_ack=lambda *_: carried_out.append("ack"),
        on_reject=lambda *_: carried_out.append("reject"),
    )
    decide(request)
    assert request._delivered_for_good() == for_good
    request._retried_instead = True  # a retry was sent in its stead (task_retry_on_worker_lost)
    assert not request._delivered_for_good()
    app.close()
