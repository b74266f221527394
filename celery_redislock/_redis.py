"""Commands with a deadline of their own, whatever the client's socket_timeout."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterator
from typing import Any

import redis
import redis.cluster


def node_client(client: redis.Redis | redis.cluster.RedisCluster, key: str) -> redis.Redis:
    """The plain client that serves ``key``: ``client`` itself, or its Cluster node."""
    if isinstance(client, redis.cluster.RedisCluster):
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        return node.redis_connection  # type: ignore[no-any-return]
    return client


@contextlib.contextmanager
def pooled_connection(client: Any) -> Iterator[Any]:
    """A connection of the pool of ``client`` (a plain ``redis.Redis``) for one exchange, then put back.

    It is dropped unless the exchange ended cleanly (a reply, or a complete
    error reply): an exception between a send and its read (a timeout, a
    ``KeyboardInterrupt``, a Celery time limit) would otherwise leave a late
    reply for the connection's next user to read as its own.
    """
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        yield connection
    except redis.exceptions.ResponseError:
        raise  # a complete error reply: the connection is clean
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)


def call_with_timeout(client: redis.Redis, timeout: float, *command: str | int) -> Any:
    """Send ``command`` and wait at most ``timeout`` seconds for the reply to start.

    The wait is a ``select`` on the socket, so it neither polls nor depends on
    ``socket_timeout`` (which may be None: wait forever). No reply in time
    raises ``redis.TimeoutError`` (the connection is dropped, see ``pooled_connection``).
    """
    with pooled_connection(client) as connection:
        connection.send_command(*command)
        if not connection.can_read(timeout):
            raise redis.exceptions.TimeoutError(f"no reply to {command[0]} within {timeout:.3f}s")
        return connection.read_response()


async def call_with_timeout_async(client: Any, timeout: float, *command: str | int) -> Any:
    """``call_with_timeout`` for a ``redis.asyncio.Redis``: the reply must start within ``timeout``.

    The connection is dropped when the exchange did not end cleanly (no reply
    in time, cancelled, broken), so a late reply is never read by its next user.
    """
    pool = client.connection_pool
    connection = await pool.get_connection()
    try:
        await connection.send_command(*command)
        try:  # math.inf: no socket_timeout for this read; the deadline is wait_for's
            return await asyncio.wait_for(connection.read_response(timeout=math.inf), timeout)
        except asyncio.TimeoutError:
            raise redis.exceptions.TimeoutError(f"no reply to {command[0]} within {timeout:.3f}s") from None
    except redis.exceptions.ResponseError:
        raise  # a complete error reply: the connection is clean
    except BaseException:
        await connection.disconnect(nowait=True)
        raise
    finally:
        await pool.release(connection)
