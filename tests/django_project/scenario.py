"""``python -m tests.django_project.scenario``: ``delay_on_commit`` and ``apply_async_on_commit``
inside ``transaction.atomic()`` blocks that commit and roll back, printing (JSON) what Redis
holds at each point: the messages queued and the locks under the project's prefix, with their
TTL. It runs in a process of its own: Django is set up once per process, with one settings
module (``tests/test_beat_django.py`` sets up another)."""

import json
from typing import Any

import django
import redis
from django.conf import settings
from django.core.management import call_command
from django.db import transaction


class Rollback(Exception):
    """Raised in an atomic block to roll it back."""


def observe(client: redis.Redis) -> dict[str, Any]:
    locks = {key.decode(): client.pttl(key) for key in client.scan_iter(match=f"{settings.PREFIX}:*")}
    locks.pop(f"{settings.PREFIX}:shipped", None)
    return {"queued": client.llen(settings.CELERY_TASK_DEFAULT_QUEUE), "locks": locks}


def main() -> dict[str, Any]:
    django.setup()
    call_command("migrate", run_syncdb=True, verbosity=0)
    from celery.contrib.django.task import DjangoTask

    from celery_redislock import DuplicateTask
    from tests.django_project.orders.models import Order
    from tests.django_project.orders.tasks import plain, ship, ship_once

    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    seen: dict[str, Any] = {
        "plain is a DjangoTask": isinstance(plain, DjangoTask),
        "ship is a DjangoTask": isinstance(ship, DjangoTask),
    }
    with transaction.atomic():
        book = Order.objects.create(item="book")
        ship.delay_on_commit(book.pk)
        seen["inside"] = observe(client)
    seen["committed"] = observe(client)
    with transaction.atomic():  # the same order again: a duplicate of the queued message
        ship.delay_on_commit(book.pk)
    seen["duplicate committed"] = observe(client)
    try:
        with transaction.atomic():
            lamp = Order.objects.create(item="lamp")
            ship.apply_async_on_commit((lamp.pk,), countdown=0)
            raise Rollback
    except Rollback:
        pass
    seen["rolled back"] = observe(client)
    with transaction.atomic():  # a savepoint rolled back: only the outer block's call is sent
        pen = Order.objects.create(item="pen")
        try:
            with transaction.atomic():
                ship.delay_on_commit(Order.objects.create(item="ink").pk)
                raise Rollback
        except Rollback:
            pass
        ship.delay_on_commit(pen.pk)
    seen["savepoint rolled back"] = observe(client)
    ship.delay_on_commit(Order.objects.create(item="cup").pk)  # autocommit: sent at once
    seen["autocommit"] = observe(client)
    with transaction.atomic():
        ship_once.delay_on_commit(book.pk)
    try:  # its duplicate raises at the commit, which stands; the callbacks after it do not run
        with transaction.atomic():
            mug = Order.objects.create(item="mug")
            ship_once.delay_on_commit(book.pk)
            ship.delay_on_commit(mug.pk)
        seen["raised at commit"] = None
    except DuplicateTask:
        seen["raised at commit"] = {"committed": Order.objects.filter(pk=mug.pk).exists(), **observe(client)}
    client.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(main()))
