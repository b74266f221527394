"""A holder's fields are %-encoded exactly as ``quote`` encodes them, whether or not a field
takes the fast path (every character kept), and read back whole."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from celery_redislock.protocol import _FIELD_SAFE, holder_for, parse_holder


@pytest.mark.parametrize("code", range(0x250))
def test_every_character_is_encoded_as_quote_encodes_it(code: int) -> None:
    field = f"id{chr(code)}x"
    holder = holder_for(field, 0, field, 1)
    assert holder.split(" ")[0] == f"task={quote(field, safe=_FIELD_SAFE)}"
    assert parse_holder(holder)["task"] == field
    assert parse_holder(holder)["node"] == field


def test_a_uuid_and_a_host_name_are_kept_as_they_are() -> None:
    holder = holder_for("3f2c9a1e-0b7d-4c1e-9a55-1d2e3f4a5b6c", 2, "celery@host-1.example", 7, "queued")
    assert holder == (
        "task=3f2c9a1e-0b7d-4c1e-9a55-1d2e3f4a5b6c try=2 state=queued node=celery@host-1.example pid=7"
    )
