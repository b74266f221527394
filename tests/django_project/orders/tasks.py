"""The project's tasks, declared as a Django project declares them (``shared_task``)."""

from typing import Any

import redis
from celery import shared_task
from django.conf import settings

from celery_redislock import LockedTask

from .models import Order


@shared_task(base=LockedTask, bind=True, lock_mode="until_executed")
def ship(self: Any, order_id: int) -> str:
    """Reads the order (committed before its message was sent) and records its item in
    ``{prefix}:shipped``."""
    item: str = Order.objects.get(pk=order_id).item
    with redis.Redis.from_url(settings.CELERY_BROKER_URL) as client:
        client.rpush(f"{settings.PREFIX}:shipped", item)
        client.pexpire(f"{settings.PREFIX}:shipped", 600_000)
    return item


@shared_task(base=LockedTask, lock_mode="until_executed", lock_duplicate="raise")
def ship_once(order_id: int) -> None:
    """Never run: its duplicate raises ``DuplicateTask`` at the commit that sends it."""


@shared_task
def plain() -> None:
    """A task of the fixup's class (``DjangoTask``), for comparison."""
