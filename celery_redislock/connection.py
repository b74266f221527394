"""The Redis client an app's locks use: one connection pool per app per process."""

from __future__ import annotations

import logging
import os
from typing import Any

import redis
from kombu.utils.url import maybe_sanitize_url

from .config import URL_SCHEMES, app_settings

__all__ = ["DEFAULT_URL", "client_for", "lock_url"]

logger = logging.getLogger(__name__)

DEFAULT_URL = "redis://localhost:6379/0"
#: Seconds to connect and to wait for a reply; a blocked waiter's BLPOP sets its own.
SOCKET_TIMEOUT = 5.0


def _first_broker_url(app: Any) -> str | None:
    url = app.conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    if isinstance(url, str):
        url = url.split(";")[0].strip()
    return url if isinstance(url, str) else None


def lock_url(app: Any) -> tuple[str, str]:
    """(URL, where it came from): ``redislock_url``, else a Redis broker URL, else the default."""
    configured = app_settings(app).url
    if configured is not None:
        return configured, "redislock_url"
    broker = _first_broker_url(app)
    if broker is not None and broker.partition("://")[0] in URL_SCHEMES:
        return broker, "broker_url"
    return DEFAULT_URL, "default"


def client_for(app: Any) -> tuple[redis.Redis, str]:
    """The app's lock client in this process, and its URL with the password masked.

    Created on first use (and again in a forked child, which must not share
    its parent's sockets); the URL is logged once per process.
    """
    cached = getattr(app, "_redislock_client", None)
    if cached is not None and cached[0] == os.getpid():
        return cached[1], cached[2]
    url, source = lock_url(app)
    options: dict[str, Any] = {"socket_connect_timeout": SOCKET_TIMEOUT, "socket_timeout": SOCKET_TIMEOUT}
    ssl = app.conf.get("broker_use_ssl")
    if source == "broker_url" and url.startswith("rediss://") and isinstance(ssl, dict):
        options.update(ssl)
    client = redis.Redis.from_url(url, **options)
    safe_url = str(maybe_sanitize_url(url))
    app._redislock_client = (os.getpid(), client, safe_url)
    logger.info("celery-redislock: locks in Redis at %s (from %s)", safe_url, source)
    return client, safe_url
