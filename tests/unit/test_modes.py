"""The mode table (``celery_redislock.modes``): its rows are consistent, and a row that
contradicts the rules that tie its fields together is refused when the table is built."""

from __future__ import annotations

import dataclasses

import pytest

from celery_redislock.config import MODES
from celery_redislock.modes import MODE_RULES, ModeRules


def test_the_table_has_a_row_for_each_documented_mode() -> None:
    assert set(MODE_RULES) == set(MODES)


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"adopts_ticket": False}, "adopts_ticket"),
        ({"queued_suffix": ":queued"}, "adopts_ticket"),
        ({"frees_ticket": True}, "frees_ticket"),
        (
            {"adopts_ticket": False, "frees_ticket": True, "parks_for_retry": True, "queued_suffix": ":q"},
            "parks",
        ),
        (
            {"execution_lock": False, "adopts_ticket": False, "frees_ticket": True, "parks_for_retry": False},
            "settles",
        ),
    ],
)
def test_a_row_contradicting_the_rules_is_refused_naming_the_rule(
    change: dict[str, object], rule: str
) -> None:
    """Built from ``until_expired``'s row (enqueue and execution lock on one key, parks, settles),
    each change breaks one rule, which the error names."""
    with pytest.raises(ValueError, match=rule):
        dataclasses.replace(MODE_RULES["until_expired"], **change)  # type: ignore[arg-type]


def test_every_row_of_the_table_passes_the_rules() -> None:
    for rules in MODE_RULES.values():
        assert dataclasses.replace(rules) == rules  # built again, checked again
    assert isinstance(MODE_RULES["while_executing"], ModeRules)
