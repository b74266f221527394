"""Exceptions: one root, keyword fields, readable messages, rebuilt from their args."""

from __future__ import annotations

import pickle

import pytest

from celery_redislock import (
    DuplicateTask,
    LockConfigurationError,
    LockKeyError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    RedisLockError,
)

EXAMPLES = [
    LockNotAcquired("k", holder="h", ttl=1.5),
    DuplicateTask("k", existing_task_id="abc"),
    LockNotOwned("k"),
    LockLost("k"),
    LockConfigurationError("ttl must be > 0"),
    LockKeyError("tasks.add", "x", "is not JSON-serialisable"),
]


@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda exc: type(exc).__name__)
def test_rebuilt_from_args_and_pickle(exc: RedisLockError) -> None:
    assert isinstance(exc, RedisLockError)
    for copy in (type(exc)(*exc.args), pickle.loads(pickle.dumps(exc))):
        assert type(copy) is type(exc)
        assert copy.args == exc.args
        assert str(copy) == str(exc)
        assert vars(copy) == vars(exc)


def test_messages_name_the_key_and_fields() -> None:
    assert (
        str(LockNotAcquired("jobs:1", "worker-7", 2.0))
        == "lock 'jobs:1' is busy held by 'worker-7' for 2.000s more"
    )
    assert "'abc'" in str(DuplicateTask("k", "abc")) and DuplicateTask("k", "abc").existing_task_id == "abc"
    assert isinstance(DuplicateTask("k"), LockNotAcquired)
    assert "'jobs:1'" in str(LockNotOwned("jobs:1")) and "'jobs:1'" in str(LockLost("jobs:1"))
    err = LockKeyError("tasks.add", "when", "is not JSON-serialisable")
    assert (err.task, err.argument) == ("tasks.add", "when")
    assert "tasks.add" in str(err) and "'when'" in str(err)
    assert isinstance(LockConfigurationError("x"), ValueError)
