"""``inventory.permit_of``: which keys are a semaphore's permits, and of which name (no I/O)."""

from __future__ import annotations

import pytest

from celery_redislock import LockConfigurationError
from celery_redislock.attempt import companion_key
from celery_redislock.inventory import permit_of, task_of

DIGEST = "ab" * 32


@pytest.mark.parametrize(
    "name", [f"redislock:app.task:{DIGEST}", "plain", "{locks}:app.task:" + DIGEST, "a{tag}b", "x"]
)
@pytest.mark.parametrize("number", [1, 7, 1000])
def test_a_permit_key_names_its_semaphore_and_number(name: str, number: int) -> None:
    assert permit_of(companion_key(name, f"permit:{number}")) == (name, number)


@pytest.mark.parametrize(
    "key",
    [
        f"redislock:app.task:{DIGEST}",  # a lock
        "a:permit:1",  # a name without a hash tag has its permits at {a}:permit:1
        "{a}:permit:0",  # permits are numbered from 1
        "{a}:permit:01",
        "{a}:permit:x",
        "{a}:queue",  # a waiter queue
        "{}:permit:1",  # no name
        "a}b:permit:1",  # a '}' without a hash tag: no permit can be named so
    ],
)
def test_other_keys_are_no_permit_keys(key: str) -> None:
    assert permit_of(key) is None


def test_a_name_that_is_a_hash_tag_alone_is_refused_so_a_permit_key_has_one_name() -> None:
    """``{x}``'s companions would be ``x``'s (``{x}:<suffix>``): such a name is refused."""
    with pytest.raises(LockConfigurationError, match=r"name '\{x\}' is a hash tag alone"):
        companion_key("{x}", "permit:1")
    assert companion_key("x", "permit:1") == "{x}:permit:1"
    assert companion_key("{x}:s", "permit:1") == "{x}:s:permit:1"
    assert permit_of("{x}:permit:1") == ("x", 1)


def test_a_permit_is_its_tasks() -> None:
    key = companion_key(f"redislock:app.task:{DIGEST}", "permit:2")
    assert task_of(key, "redislock") == "app.task"
    assert task_of(key, "other") is None
