"""Keys: equivalent calls share one, different values differ, values never show."""

from __future__ import annotations

import datetime
import decimal
import re
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu.utils.json import dumps, loads

from celery_redislock.exceptions import LockKeyError
from celery_redislock.keys import call_digest, lock_key


def f(a: Any, b: Any = 2, *rest: Any, c: Any = None, **extra: Any) -> None:
    """A task body with every kind of parameter."""


class WithSelf:
    def run(self, a: Any, b: Any = 2) -> None:
        """A bound run method: ``self`` is not an argument."""


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text() | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
celery_values = (
    json_values
    | st.datetimes()
    | st.dates()
    | st.uuids()
    | st.decimals(allow_nan=False, allow_infinity=False)
    | st.binary(max_size=8)
)


@given(json_values, json_values)
def test_equivalent_calls_share_a_key(a: Any, b: Any) -> None:
    forms = [
        call_digest("t", f, (a, b)),
        call_digest("t", f, (a,), {"b": b}),
        call_digest("t", f, (), {"a": a, "b": b}),
        call_digest("t", f, (), {"b": b, "a": a, "c": None}),
    ]
    assert len(set(forms)) == 1


@given(json_values)
def test_defaults_are_part_of_the_key(a: Any) -> None:
    assert call_digest("t", f, (a,)) == call_digest("t", f, (a, 2))
    assert call_digest("t", f, (a,)) != call_digest("t", f, (a, 3))


@given(celery_values, celery_values)
def test_different_values_give_different_keys(x: Any, y: Any) -> None:
    if dumps(x, sort_keys=True) == dumps(y, sort_keys=True):
        return  # equal once serialised (e.g. 1 and 1.0 are not; -0.0 and 0.0 are)
    assert call_digest("t", f, (x,)) != call_digest("t", f, (y,))


extra_names = st.text().map(lambda name: f"x_{name}")  # never one of f's own parameters


@given(celery_values, st.dictionaries(extra_names, celery_values, max_size=3))
def test_the_key_survives_the_broker_round_trip(a: Any, extra: dict[str, Any]) -> None:
    args, kwargs = loads(dumps([a, 1, 2])), loads(dumps(extra))  # tuple -> list, types kept
    assert call_digest("t", f, (a, 1, 2), extra) == call_digest("t", f, args, kwargs)


@given(st.text(min_size=4))
def test_key_names_never_contain_argument_values(secret: str) -> None:
    key = lock_key("redislock", "tasks.charge", call_digest("tasks.charge", f, (secret,)))
    assert re.fullmatch(r"redislock:tasks\.charge:[0-9a-f]{64}", key)


def test_bound_self_is_dropped() -> None:
    assert call_digest("t", WithSelf().run, (1,)) == call_digest("t", WithSelf().run, (), {"a": 1, "b": 2})


def test_lock_on_names_and_callable() -> None:
    by_user = ("a",)
    assert call_digest("t", f, (1, 5), lock_on=by_user) == call_digest("t", f, (1, 6), lock_on=by_user)
    assert call_digest("t", f, (1,), lock_on=by_user) != call_digest("t", f, (2,), lock_on=by_user)
    per_task = ()
    assert call_digest("t", f, (1,), lock_on=per_task) == call_digest("t", f, (2, 3), lock_on=per_task)

    def by_first_letter(a: str, *args: Any, **kwargs: Any) -> str:
        return a[0]

    assert call_digest("t", f, ("ab",), lock_on=by_first_letter) == call_digest(
        "t", f, ("ax", 9), lock_on=by_first_letter
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "lock_on", "argument", "reason"),
    [
        ((object(),), {}, None, "a", "cannot be encoded by Celery's JSON serializer"),
        ((1, {1, 2}), {}, None, "b", "cannot be encoded"),
        ((1,), {"c": [object()]}, None, "c", "cannot be encoded"),
        ((), {}, None, "*", "does not match the task's signature"),
        ((1,), {"zzz": 1, "a": 2}, None, "*", "does not match the task's signature"),
        ((1,), {}, ("nope",), "nope", "not a parameter of the task"),
        ((1,), {}, lambda *a, **k: 1 / 0, "lock_on", "raised ZeroDivisionError"),
        ((1,), {}, lambda *a, **k: object(), "lock_on", "cannot be encoded"),
    ],
)
def test_unkeyable_calls_name_the_argument(
    args: tuple[Any, ...], kwargs: dict[str, Any], lock_on: Any, argument: str, reason: str
) -> None:
    with pytest.raises(LockKeyError, match=re.escape(reason)) as info:
        call_digest("tasks.t", f, args, kwargs, lock_on)
    assert info.value.task == "tasks.t"
    assert info.value.argument == argument


def test_celery_json_types_are_keyable() -> None:
    values = [datetime.datetime(2026, 1, 2, 3, 4, 5), uuid.UUID(int=7), decimal.Decimal("1.10"), b"\xff\x00"]
    digests = {call_digest("t", f, (value,)) for value in values}
    assert len(digests) == len(values)
