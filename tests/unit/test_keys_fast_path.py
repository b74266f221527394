"""Keys: the one-pass fast paths (a value already in delivered form, every parameter passed by
position) key exactly as the round trip through Celery's JSON and full binding do."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu.utils.json import JSONEncoder

from celery_redislock import keys
from celery_redislock.exceptions import LockKeyError
from celery_redislock.keys import call_digest

#: What a worker receives as sent: str-keyed dicts, lists, tuples, str/int/float/bool/None
#: (NaN, infinities, -0.0, lone surrogates and huge ints included).
delivered = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**30, max_value=10**40)
    | st.floats()
    | st.text()
    | st.sampled_from(["\ud800", "é\u2028", "\x00"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(st.text(), inner, max_size=3)
    ),
    max_leaves=10,
)
#: Values that take the round trip: int dict keys, other types, envelope look-alikes, nested.
not_delivered = st.recursive(
    delivered | st.datetimes() | st.binary(max_size=4) | st.just({"__type__": "x", "__value__": 1}),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.integers() | st.text(), inner, max_size=3),
    max_leaves=6,
)


def round_trip(value: Any) -> str:
    """The canonical JSON as the module defines it: Celery's JSON there and back, then sorted."""
    received = json.loads(json.dumps(value, cls=JSONEncoder, ensure_ascii=False, allow_nan=True))
    return json.dumps(received, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)


def outcome(make: Any, value: Any) -> Any:
    try:
        return make(value)
    except (TypeError, ValueError, RecursionError) as exc:
        return type(exc)


@given(delivered)
def test_a_delivered_value_takes_one_pass_to_the_same_text(value: Any) -> None:
    assert keys._delivered(value)
    assert outcome(keys._canonical, value) == outcome(round_trip, value)


@given(not_delivered)
def test_any_value_keys_as_its_round_trip(value: Any) -> None:
    assert outcome(keys._canonical, value) == outcome(round_trip, value)


@pytest.mark.parametrize(
    "value",
    [
        {1: "a"},
        [{"__type__": "x", "__value__": 1}],
        datetime.date(2024, 1, 1),
        True.__class__.__mro__,  # a tuple of types
        type("S", (str,), {})("subclass"),
    ],
)
def test_what_json_changes_or_refuses_is_not_taken_as_delivered(value: Any) -> None:
    assert not keys._delivered(value)


def test_shared_and_circular_containers_take_the_round_trip() -> None:
    part: list[Any] = [1]
    assert not keys._delivered([part, part])
    assert keys._canonical([part, part]) == "[[1],[1]]"
    loop: list[Any] = []
    loop.append(loop)
    assert not keys._delivered(loop)
    with pytest.raises(LockKeyError, match="cannot be encoded"):
        call_digest("t", lambda x: None, (loop,))


def positional(a: Any, b: Any = 2, /, c: Any = 3) -> None:
    """Every parameter can be passed by position."""


def mixed(a: Any, *rest: Any, c: Any = 3) -> None:
    """Not every parameter can be passed by position."""


@given(delivered, delivered, delivered)
def test_all_arguments_by_position_key_as_bound(a: Any, b: Any, c: Any) -> None:
    assert keys._signature(positional)[1] == ("a", "b", "c")
    assert keys._signature(mixed)[1] is None
    by_position = call_digest("t", positional, (a, b, c))
    assert by_position == call_digest("t", positional, (a, b), {"c": c})
    assert by_position == call_digest("t", positional, (a, b, c), lock_on=["a", "b", "c"])
    assert call_digest("t", positional, (a,)) == call_digest("t", positional, (a, 2, 3))


#: One level of arguments, as most calls bind them: scalars and a few other values, under str
#: keys, an int key or the envelope's keys.
flat_arguments = st.dictionaries(
    st.text(max_size=3) | st.integers() | st.sampled_from(["__type__", "__value__"]),
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.datetimes() | st.just(()),
    max_size=3,
)


@given(flat_arguments)
def test_a_flat_dict_is_judged_as_the_full_walk_judges_it(value: dict[Any, Any]) -> None:
    """``_delivered`` answers a dict of scalars without walking it: the same answer as the walk
    gives (reached here through a list, which the shortcut does not take)."""
    assert keys._delivered(value) == keys._delivered([value])
