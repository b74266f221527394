"""The tests' app (``tests.taskapp``) with its locks on a ``redislock_client`` instead of a URL,
for ``celery -A tests.client_app worker`` subprocesses (``tests/test_client_setting.py``).

``CLIENTAPP_KIND`` says what the setting holds: ``"instance"``, a client made
here at import, in the worker's main process, before the pool forks; or
``"callable"``, a function each process calls, which records the pid of the
process calling it in ``{prefix}:factory``. Before the fork, the main process
names two of the instance's connections ``parent-loan`` (the one its thread
keeps between exchanges, ``_redis.PooledConnection``) and ``parent-pool`` (one
left in the pool): a pool child that used either would be seen in the
server's ``CLIENT LIST``.
"""

from __future__ import annotations

import os
from typing import Any

import redis

from celery_redislock._redis import PooledConnection
from tests.taskapp import make_app

URL, PREFIX = os.environ["CLIENTAPP_URL"], os.environ["CLIENTAPP_PREFIX"]


def make_client(app: Any) -> redis.Redis:
    """The ``redislock_client`` callable: a client of its own for each process that calls it."""
    client = redis.Redis.from_url(URL, health_check_interval=10)
    client.rpush(f"{PREFIX}:factory", os.getpid())
    client.pexpire(f"{PREFIX}:factory", 600_000)
    return client


def parent_client() -> redis.Redis:
    """The ``redislock_client`` instance, with the two connections the pool children must not use."""
    client = redis.Redis.from_url(URL, health_check_interval=10)
    with PooledConnection(client) as connection:  # kept by this thread between exchanges
        connection.send_command("CLIENT", "SETNAME", "parent-loan")
        connection.read_response()
    client.client_setname("parent-pool")  # a connection that goes back to the pool
    return client


app = make_app(
    URL,
    PREFIX,
    os.environ["CLIENTAPP_QUEUE"],
    redislock_url=None,
    redislock_client=make_client if os.environ["CLIENTAPP_KIND"] == "callable" else parent_client(),
)
