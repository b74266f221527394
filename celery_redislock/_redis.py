"""Commands with a deadline of their own, whatever the client's socket_timeout."""

from __future__ import annotations

from typing import Any

import redis
import redis.cluster


def node_client(client: redis.Redis | redis.cluster.RedisCluster, key: str) -> redis.Redis:
    """The plain client that serves ``key``: ``client`` itself, or its Cluster node."""
    if isinstance(client, redis.cluster.RedisCluster):
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        return node.redis_connection  # type: ignore[no-any-return]
    return client


def call_with_timeout(client: redis.Redis, timeout: float, *command: str | int) -> Any:
    """Send ``command`` and wait at most ``timeout`` seconds for the reply to start.

    The wait is a ``select`` on the socket, so it neither polls nor depends on
    ``socket_timeout`` (which may be None: wait forever). No reply in time
    raises ``redis.TimeoutError``; the connection is then dropped, as is any
    connection whose exchange was interrupted, since a late reply would
    otherwise be read by its next user.
    """
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_command(*command)  # type: ignore[no-untyped-call]
        if not connection.can_read(timeout):
            raise redis.exceptions.TimeoutError(f"no reply to {command[0]} within {timeout:.3f}s")
        return connection.read_response()
    except redis.exceptions.ResponseError:
        raise  # a complete error reply: the connection is clean
    except BaseException:
        connection.disconnect()  # type: ignore[no-untyped-call]
        raise
    finally:
        pool.release(connection)
