"""Keys: equivalent calls share one, different values differ, values never show."""

from __future__ import annotations

import datetime
import decimal
import hashlib
import hmac
import json
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


any_dict_keys = st.text() | st.integers() | st.floats(allow_nan=False) | st.booleans() | st.none()
delivered_differently = st.recursive(
    celery_values,
    lambda inner: st.lists(inner, max_size=3).map(tuple) | st.dictionaries(any_dict_keys, inner, max_size=3),
    max_leaves=8,
)


@given(delivered_differently)
def test_a_value_keys_as_the_worker_receives_it(a: Any) -> None:
    """Celery's JSON delivers a tuple as a list and a dict key as a string ({10: x, 9: y} as
    {"10": x, "9": y}), so a call keys alike before and after the broker; today int keys
    sorted as ints gave the enqueue another key than the worker, and mixed keys were refused."""
    [delivered] = loads(dumps([a]))
    assert call_digest("t", f, (a,)) == call_digest("t", f, (delivered,))


def test_dict_keys_are_keyed_as_delivered() -> None:
    """Not injective where Celery is not: the worker receives {"1": x} for {1: x}."""
    assert call_digest("t", f, ({10: "a", 9: "b"},)) == call_digest("t", f, ({"9": "b", "10": "a"},))
    assert call_digest("t", f, ({1: "a", "b": 2},)) == call_digest("t", f, ({"1": "a", "b": 2},))
    assert call_digest("t", f, ((1, (2,)),)) == call_digest("t", f, ([1, [2]],))


def test_one_one_point_zero_and_true_are_different_keys() -> None:
    """As they stay different through the broker (and as dict keys: "1", "1.0", "true")."""
    values = [1, 1.0, True, "1", decimal.Decimal("1"), [1], {1: 0}, {1.0: 0}, {True: 0}]
    assert len({call_digest("t", f, (value,)) for value in values}) == len(values)
    assert len({call_digest("t", f, loads(dumps([value]))) for value in values}) == len(values)


@pytest.mark.parametrize(
    "value",
    [
        {"__type__": "datetime", "__value__": "2026-01-02T03:04:05"},
        {"__type__": "base64", "__value__": "YWI="},
        {"__type__": "nope", "__value__": 1},
        [1, {"x": {"__value__": 1, "__type__": "bytes"}}],
    ],
)
def test_a_dict_shaped_like_a_kombu_envelope_is_refused(value: Any) -> None:
    """A plain {"__type__": ..., "__value__": ...} reaches the worker as a datetime, bytes, or
    a message that cannot be decoded: it was keyed like the real datetime (or unlike its own
    delivery); now it is refused, naming the argument."""
    with pytest.raises(LockKeyError, match="shaped like kombu's JSON envelope") as info:
        call_digest("tasks.t", f, (1,), {"c": value})
    assert info.value.argument == "c"
    with pytest.raises(LockKeyError, match="shaped like kombu's JSON envelope") as info:
        call_digest("tasks.t", f, (1,), lock_on=lambda *args, **kwargs: value)
    assert info.value.argument == "lock_on"


def test_an_envelope_with_more_keys_and_parameters_so_named_are_keyed() -> None:
    def g(__type__: Any, __value__: Any) -> None:
        """Parameters are not a dict that travels."""

    assert call_digest("t", f, ({"__type__": 1, "__value__": 2, "x": 3},))
    assert call_digest("t", g, (1, 2)) != call_digest("t", g, (1, 3))


def g(a: Any, b: Any = 2) -> None:
    """A task body keyed by ``{"a": a, "b": b}``."""


def test_the_digest_is_the_sha256_or_hmac_of_the_canonical_json() -> None:
    """The key format: a call keeps its key across releases (and a secret changes every key)."""
    text = json.dumps({"a": [1, "é"], "b": 2}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert call_digest("t", g, ((1, "é"),)) == hashlib.sha256(text.encode()).hexdigest()
    secret = b"k" * 32
    keyed = hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()
    assert call_digest("t", g, ((1, "é"),), secret=secret) == keyed
    assert call_digest("t", g, (), {"a": [1, "é"]}, secret=secret) == keyed
    assert call_digest("t", g, ((1, "é"),), secret=b"other") != keyed


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
