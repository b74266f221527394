"""AsyncRedisSemaphore: ``RedisSemaphore`` for asyncio, on a ``redis.asyncio.Redis``.

Same permits, scripts and guarantees as ``semaphore.RedisSemaphore``, so sync
and async holders of one name count together; the hold is ``AsyncRedisLock``'s
(its watchdog task, its cancellation timeline), over ``AsyncPermits``.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio

from ._durations import Duration, to_ms
from ._permit_scripts import ACQUIRE_PERMIT, RELEASE_PERMIT
from ._scripts import RENEW
from .aio import AsyncOneKey, AsyncRedisLock, call_noting_resend
from .attempt import Attempt, owns
from .semaphore import PermitBook, permit_limit

__all__ = ["AsyncPermits", "AsyncRedisSemaphore"]


class AsyncRedisSemaphore(AsyncRedisLock):
    """``RedisSemaphore`` for asyncio: the same arguments, semantics and permits; methods are
    coroutines, as ``AsyncRedisLock``'s (``locked()``: whether all ``limit`` permits are held).
    Use the object on one event loop."""

    key: AsyncPermits

    def __init__(
        self,
        client: redis.asyncio.Redis,
        name: str | bytes,
        limit: int,
        ttl: Duration = 30.0,
        *,
        watchdog: bool = True,
        fair: bool = False,
        timeout: Duration | None = None,
        holder: str | None = None,
    ) -> None:
        super().__init__(client, name, ttl, watchdog=watchdog, fair=fair, timeout=timeout, holder=holder)
        self.limit = permit_limit(limit)
        self.key = AsyncPermits(client, PermitBook(self.name, self.limit), self.wake_prefix)

    def __repr__(self) -> str:
        return f"<AsyncRedisSemaphore {self.name!r} limit={self.limit} ttl={self.ttl} held={self.hold_count}>"


class AsyncPermits(AsyncOneKey):
    """Where an ``AsyncRedisSemaphore``'s permits live; the asyncio twin of ``semaphore.Permits``."""

    def __init__(self, client: redis.asyncio.Redis, book: PermitBook, wake_prefix: str) -> None:
        super().__init__(client, book.name, wake_prefix)
        self.book = book

    def lease_key(self, token: str) -> str:
        return self.book.held[token]

    async def acquire(self, attempt: Attempt, mode: str) -> Any:
        args: list[str | int] = [attempt.member, mode, self.book.limit]
        reply = await ACQUIRE_PERMIT.call_async(self.client, [self.name], args)
        return self.book.granted(attempt.token, reply)

    async def sleep(self, attempt: Attempt) -> Any:
        return self.book.granted(attempt.token, await super().sleep(attempt))

    async def free(self, token: str, member: str = "") -> bool:
        args: list[str | int] = [token, member, self.book.limit]
        released, resent = await call_noting_resend(self.client, RELEASE_PERMIT, [self.name], args)
        self.book.held.pop(token, None)
        return bool(int(released) or resent)

    async def extend(self, token: str, ttl: float) -> bool:
        key = self.book.key_of(token)
        return key is not None and not await RENEW.call_async(self.client, [key], [to_ms(ttl), token])

    async def locked(self) -> bool:
        return int(await self.client.exists(*self.book.keys)) == self.book.limit

    async def owned(self, token: str | None) -> bool:
        key = self.book.key_of(token)
        return key is not None and owns(await self.client.get(key), token)
