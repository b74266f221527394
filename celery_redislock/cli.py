"""``celery -A proj redislock ...``: see the app's locks, and free them by hand.

Installed through Celery's ``celery.commands`` entry point:

* ``list [--task NAME] [--json]``: the locks held under the app's prefix
  (found with SCAN, never KEYS): task, holder task id, attempt, state
  (``queued``: an enqueue lock whose message waits; ``running``), the task's
  ``lock_mode``, the node and pid that took it, TTL left and fence;
* ``show KEY``: one lock, and how many wait for it;
* ``release KEY`` or ``release --task NAME --args JSON --kwargs JSON``: free a
  lock whoever holds it (the key of a call is computed as the worker does);
* ``purge --task NAME``: free every lock of one task, after a confirmation
  (``--yes`` skips it). Nothing frees every lock at once.

A forced release runs the owner-checked release script with the token just
read from the lock: it frees exactly the hold that was read (a hold taken over
meanwhile is left alone and reported) and wakes the next waiter, as the
owner's release would. It is logged (WARNING, ``celery_redislock.cli``) with
the key and the holder. The holder's watchdog finds the lock gone within one
renewal interval and handles the loss per ``lock_on_lost``: a task goes on
running unlocked unless that is ``"raise"`` or ``"terminate"``.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import click
import redis

from .config import app_settings
from .connection import Client, client_for
from .exceptions import RedisLockError
from .lock import companion_key
from .modes import QUEUED_SUFFIXES
from .protocol import parse_holder, parse_value, text
from .task import LockedTask, free_ticket, task_lock_key

__all__ = ["HeldLock", "force_release", "held_locks", "read_lock", "redislock"]

logger = logging.getLogger(__name__)

#: What follows ``{prefix}:`` in a task's lock key; a queued suffix (``:queued``) marks an
#: enqueue lock that is not the execution lock (``until_and_while_executing``).
_TASK_KEY = re.compile(
    r"(.+):[0-9a-f]{64}(?:" + "|".join(map(re.escape, sorted(QUEUED_SUFFIXES))) + ")?", re.DOTALL
)
#: The default holder of a ``RedisLock``: ``"<host>:<pid>"``.
_HOST_PID = re.compile(r"(.+):(\d+)", re.DOTALL)
#: Keys read per round trip while listing.
_BATCH = 500


@dataclass(frozen=True)
class HeldLock:
    """A lock as read from Redis; ``None`` where the holder does not say."""

    key: str
    #: the task whose key this is (``None`` for a key outside the prefix or of another shape)
    task: str | None
    task_id: str | None
    #: retries of the task so far when it took the lock
    attempt: int | None
    #: ``queued`` (an enqueue lock whose message waits) or ``running`` (taken by a run; an
    #: ``until_expired`` lock stays ``running`` through its period after the run)
    state: str | None
    node: str | None
    pid: int | None
    #: seconds left (``None``: no TTL, which this package never leaves)
    ttl: float | None
    fence: int
    #: the holder description as stored
    holder: str
    token: str = field(repr=False)

    def as_dict(self, mode: str | None) -> dict[str, Any]:
        """The fields shown by ``list --json``, with the task's ``lock_mode``."""
        return {
            "key": self.key,
            "task": self.task,
            "task_id": self.task_id,
            "attempt": self.attempt,
            "state": self.state,
            "mode": mode,
            "node": self.node,
            "pid": self.pid,
            "ttl": self.ttl,
            "fence": self.fence,
            "holder": self.holder,
        }


def _parse(key: str, value: object, pttl: object, prefix: str) -> HeldLock | None:
    """The lock at ``key`` from its value and PTTL; ``None`` if the value is not a lock."""
    lock = parse_value(value)
    if lock is None or not isinstance(pttl, int) or pttl == -2:
        return None
    token, fence, holder = lock
    task = None
    if key.startswith(prefix + ":"):
        task_match = _TASK_KEY.fullmatch(key[len(prefix) + 1 :])
        task = task_match.group(1) if task_match else None
    fields = parse_holder(holder)
    node, pid = fields.get("node"), fields.get("pid")
    if not fields:
        host_pid = _HOST_PID.fullmatch(holder)
        node, pid = host_pid.groups() if host_pid else (None, None)
    return HeldLock(
        key=key,
        task=task,
        task_id=fields.get("task"),
        attempt=int(fields["try"]) if fields.get("try", "").isdigit() else None,
        state=fields.get("state"),
        node=node,
        pid=int(pid) if pid and pid.isdigit() else None,
        ttl=None if pttl < 0 else pttl / 1000,
        fence=int(fence),
        holder=holder,
        token=token,
    )


def _read(client: Client, keys: Sequence[str], prefix: str) -> list[HeldLock]:
    """The locks among ``keys`` (GET and PTTL of each, in one round trip)."""
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.get(key)
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)  # GET of a key of another type fails: not a lock
    found = []
    for key, value, pttl in zip(keys, replies[::2], replies[1::2], strict=True):
        lock = _parse(key, value, pttl, prefix)
        if lock is not None:
            found.append(lock)
    return found


def read_lock(client: Client, key: str, prefix: str) -> HeldLock | None:
    """The lock at ``key`` (``None`` if the key is missing or holds no lock)."""
    found = _read(client, [key], prefix)
    return found[0] if found else None


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def held_locks(client: Client, prefix: str, task: str | None = None) -> list[HeldLock]:
    """Every lock under ``{prefix}:`` (only ``task``'s, if given), sorted by key.

    Keys are found with SCAN, so a large keyspace is walked without blocking
    Redis; a lock taken or freed during the walk may be missed or included.
    Companion keys (a lock's waiter queue and wake lists) are not locks.
    """
    pattern = _glob_escape(f"{prefix}:{task}:" if task is not None else f"{prefix}:") + "*"
    found: list[HeldLock] = []
    for batch in _batches(client.scan_iter(match=pattern, count=1000), _BATCH):
        found.extend(_read(client, batch, prefix))
    if task is not None:
        found = [lock for lock in found if lock.task == task]
    return sorted(found, key=lambda lock: lock.key)


def _batches(keys: Iterator[Any], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for key in keys:
        batch.append(text(key))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def force_release(client: Client, lock: HeldLock, why: str) -> bool:
    """Free the hold ``lock`` describes, whoever holds it; whether it was freed.

    ``False`` when that hold is gone or was taken over since it was read:
    Redis is then unchanged. Logged at WARNING, naming ``why``.
    """
    released = free_ticket(client, (lock.key, lock.token))
    if released:
        logger.warning(
            "lock %s force-released (%s); it was held by %s, fence %d", lock.key, why, lock.holder, lock.fence
        )
    return released


# -- the commands --------------------------------------------------------------


class _Group(click.Group):
    """Turns Redis and configuration errors into a one-line error and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (redis.RedisError, RedisLockError) as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


@dataclass
class _Context:
    app: Any
    client: Client
    url: str
    prefix: str

    @functools.cached_property
    def locked_tasks(self) -> dict[str, LockedTask]:
        """The app's LockedTasks by name (with its ``imports`` and ``include`` imported)."""
        self.app.loader.import_default_modules()
        return {name: task for name, task in self.app.tasks.items() if isinstance(task, LockedTask)}

    def mode(self, task: str | None) -> str | None:
        """``task``'s ``lock_mode``, if the app has that LockedTask."""
        options = getattr(self.locked_tasks.get(task or ""), "lock_options", None)
        return None if options is None else str(options.mode)

    def unknown_task(self, name: str) -> click.ClickException:
        known = sorted(self.locked_tasks)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"its LockedTasks: {', '.join(known) or 'none'}"
        return click.ClickException(
            f"unknown task {name!r}: app {self.app.main!r} has no such LockedTask; {hint}"
        )

    def task_locks(self, name: str) -> list[HeldLock]:
        """``name``'s locks; an error for a name that is neither a LockedTask nor has locks."""
        locks = held_locks(self.client, self.prefix, name)
        if not locks and name not in self.locked_tasks:
            raise self.unknown_task(name)
        return locks


def _context(ctx: click.Context) -> _Context:
    app = ctx.find_root().obj.app
    client, url = client_for(app)
    return _Context(app=app, client=client, url=url, prefix=app_settings(app).prefix)


_COLUMNS = ("task", "task_id", "attempt", "state", "mode", "node", "pid", "ttl", "fence", "key")


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "ttl":
        return f"{value:.1f}s"
    return str(value)


def _table(rows: list[dict[str, Any]]) -> str:
    cells = [[column.upper().replace("_", " ") for column in _COLUMNS]]
    cells += [[_cell(column, row[column]) for column in _COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(width) for cell, width in zip(line, widths, strict=False)), line[-1]])
        for line in cells
    )


@click.group(name="redislock", cls=_Group)
def redislock() -> None:
    """Inspect and free celery-redislock locks."""


@redislock.command(name="list")
@click.option("--task", "task_name", metavar="NAME", help="Only this task's locks.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.pass_context
def list_locks(ctx: click.Context, task_name: str | None, as_json: bool) -> None:
    """List the locks held under the app's prefix."""
    context = _context(ctx)
    locks = context.task_locks(task_name) if task_name else held_locks(context.client, context.prefix)
    rows = [lock.as_dict(context.mode(lock.task)) for lock in locks]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif rows:
        click.echo(_table(rows))
    else:
        whose = f" by task {task_name!r}" if task_name else ""
        click.echo(f"no locks held{whose} under prefix {context.prefix!r} in Redis at {context.url}")


@redislock.command()
@click.argument("key")
@click.pass_context
def show(ctx: click.Context, key: str) -> None:
    """Show the lock at KEY and how many wait for it."""
    context = _context(ctx)
    lock = _existing(context, key)
    waiting = context.client.zcard(companion_key(key, "queue"))
    fields = {**lock.as_dict(context.mode(lock.task)), "waiters": waiting}
    width = max(len(name) for name in fields)
    for name, value in fields.items():
        click.echo(f"{name.ljust(width)}  {_cell(name, value)}")


def _existing(context: _Context, key: str) -> HeldLock:
    lock = read_lock(context.client, key, context.prefix)
    if lock is not None:
        return lock
    if context.client.exists(key):
        raise click.ClickException(f"key {key!r} holds no lock (not a celery-redislock lock value)")
    raise click.ClickException(f"no lock at key {key!r} in Redis at {context.url} (free, or never taken)")


def _json_option(option: str, text: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint=option) from None
    if not isinstance(value, kind):
        expected = "a JSON list" if kind is list else "a JSON object"
        raise click.BadParameter(f"must be {expected}, got {text!r}", param_hint=option)
    return value


def _released(context: _Context, lock: HeldLock, why: str) -> bool:
    """Force-release ``lock`` and say what happened."""
    if force_release(context.client, lock, why):
        click.echo(f"released {lock.key} (held by {lock.holder}, fence {lock.fence})")
        return True
    now = read_lock(context.client, lock.key, context.prefix)
    now_held = f"now held by {now.holder}" if now is not None else "now free"
    click.echo(f"not released {lock.key}: it changed hands while being released ({now_held})", err=True)
    return False


@redislock.command()
@click.argument("key", required=False)
@click.option("--task", "task_name", metavar="NAME", help="Release the lock of a call of this task...")
@click.option("--args", "args_json", metavar="JSON", help="...with these positional arguments (a list).")
@click.option("--kwargs", "kwargs_json", metavar="JSON", help="...and keyword arguments (an object).")
@click.pass_context
def release(
    ctx: click.Context, key: str | None, task_name: str | None, args_json: str | None, kwargs_json: str | None
) -> None:
    """Free the lock at KEY, or the lock of a call, whoever holds it."""
    if (key is None) == (task_name is None):
        raise click.UsageError("give a KEY or --task NAME (with --args/--kwargs), not both")
    if key is not None and (args_json is not None or kwargs_json is not None):
        raise click.UsageError("--args and --kwargs go with --task, not with a KEY")
    context = _context(ctx)
    if key is not None:
        if not _released(context, _existing(context, key), "by hand, celery redislock release KEY"):
            ctx.exit(1)
        return
    assert task_name is not None
    task = context.locked_tasks.get(task_name)
    if task is None:
        raise context.unknown_task(task_name)
    args = _json_option("--args", args_json or "[]", list)
    kwargs = _json_option("--kwargs", kwargs_json or "{}", dict)
    call_key = task_lock_key(task, args, kwargs)
    held = _read(context.client, [call_key, call_key + ":queued"], context.prefix)
    if not held:
        call = f"{task_name}(*{args!r}, **{kwargs!r})"
        raise click.ClickException(f"no lock held for {call}: {call_key} is free")
    why = f"by hand, celery redislock release --task {task_name}"
    released = [_released(context, lock, why) for lock in held]
    if not all(released):
        ctx.exit(1)


@redislock.command()
@click.option("--task", "task_name", metavar="NAME", required=True, help="Whose locks to free.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def purge(ctx: click.Context, task_name: str, yes: bool) -> None:
    """Free every lock of one task, whoever holds them."""
    context = _context(ctx)
    locks = context.task_locks(task_name)
    if not locks:
        click.echo(f"no locks held by task {task_name!r}")
        return
    click.echo(_table([lock.as_dict(context.mode(lock.task)) for lock in locks]))
    if not yes:
        click.confirm(f"Release these {len(locks)} lock(s) of task {task_name!r}?", abort=True)
    why = f"by hand, celery redislock purge --task {task_name}"
    freed = sum(_released(context, lock, why) for lock in locks)
    click.echo(f"released {freed} of {len(locks)} lock(s) of task {task_name!r}")
