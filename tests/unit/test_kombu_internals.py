"""The kombu internals the package reads: ``LockedRequest._delivered_for_good`` reads a message's
private ``_state`` to tell a message acknowledged for good (its enqueue lock freed when its pool
child dies) from one rejected, which may be a requeue (kombu marks ``reject(requeue=True)``
``REJECTED`` too), or left for redelivery (its lock kept)."""

from __future__ import annotations

from typing import Any
from unittest.mock import Mock

import pytest
from kombu.message import Message

from celery_redislock.request import LockedRequest


@pytest.mark.parametrize(
    ("settle", "state"),
    [
        (lambda message: None, "RECEIVED"),
        (lambda message: message.ack(), "ACK"),
        (lambda message: message.reject(requeue=False), "REJECTED"),
        (lambda message: message.reject(requeue=True), "REJECTED"),
    ],
    ids=["unacknowledged", "acknowledged", "rejected", "requeued"],
)
def test_a_messages_state_says_whether_it_comes_back(settle: object, state: str) -> None:
    message: Any = Message(body="", channel=Mock(), delivery_tag="1")
    settle(message)  # type: ignore[operator]
    assert message._state == state
    request = Mock(message=message, _retried_instead=False)
    assert LockedRequest._delivered_for_good(request) == (state == "ACK")
    request._retried_instead = True  # a retry was sent in its stead (task_retry_on_worker_lost)
    assert not LockedRequest._delivered_for_good(request)
