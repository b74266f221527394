"""``celery -A proj redislock ...``: see the app's locks, and free them by hand.

Installed through Celery's ``celery.commands`` entry point:

* ``list [--task NAME] [--json]``: the locks held under the app's prefix
  (found with SCAN, never KEYS): task, holder task id, attempt, state
  (``queued``: an enqueue lock whose message waits; ``running``; ``kept``: an
  ``until_expired`` lock through its period after its run), the task's
  ``lock_mode``, the node and pid that took it, TTL left and fence;
* ``show KEY``: one lock, and how many wait for it;
* ``stats [--json] [--limit N]``: a summary of every lock under the prefix
  (``celery_redislock.stats``): held locks per task, waiters, the oldest holds,
  renewals late, orphan enqueue locks, beat leader and slot markers;
* ``release KEY`` or ``release --task NAME --args JSON --kwargs JSON``: free a
  lock whoever holds it (the key of a call is computed as the worker does);
* ``purge --task NAME``: free every lock of one task, after a confirmation
  (``--yes`` skips it). Nothing frees every lock at once.

``release`` and ``purge`` exit with status 1 when a lock they read was not freed.

A forced release runs the owner-checked release script with the token and the
fence just read from the lock: it frees exactly the hold that was read (a hold
taken over meanwhile, or kept for its period by a later run, is left alone and
reported) and wakes the next waiter, as the owner's release would. It is logged
(WARNING, ``celery_redislock.inventory``) with the key and the holder. The holder's
watchdog finds the lock gone within one renewal interval and handles the loss per
``lock_on_lost``: a task goes on running unlocked unless that is ``"raise"`` or
``"terminate"``.
"""

from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass
from typing import Any

import click
import redis
from kombu.utils import json as kombu_json

from ._permit_scripts import MAX_LIMIT
from .attempt import is_utf8
from .config import AppSettings, LockOptions, app_settings, bound_options
from .connection import Client, client_for
from .exceptions import LockConfigurationError, RedisLockError
from .inventory import HeldLock, force_release, held_locks, read_lock, read_locks
from .modes import QUEUED_SUFFIXES
from .semaphore import PermitBook
from .stats import ORPHAN_AGE, summary
from .task import LockedTask, task_lock_key

#: The inventory names stay importable from here, as in 0.1.0 (they live in ``inventory``).
__all__ = ["HeldLock", "force_release", "held_locks", "read_lock", "redislock"]


class _Group(click.Group):
    """Turns Redis and configuration errors into a one-line error and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (redis.RedisError, RedisLockError) as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


def _utf8(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A key or a task name: UTF-8 text, as every key of the package is. A command line's bytes
    that are not UTF-8 reach Python as lone surrogates, which no key can hold."""
    if value is not None and not is_utf8(value):
        raise click.BadParameter(f"{value!r} is not UTF-8", ctx, param)
    return value


@dataclass
class _Context:
    app: Any
    client: Client
    url: str
    settings: AppSettings

    @property
    def prefix(self) -> str:
        return self.settings.prefix

    @functools.cached_property
    def locked_tasks(self) -> dict[str, LockedTask]:
        """The app's LockedTasks by name (with its ``imports`` and ``include`` imported)."""
        self.app.loader.import_default_modules()
        return {name: task for name, task in self.app.tasks.items() if isinstance(task, LockedTask)}

    @functools.cached_property
    def options(self) -> dict[str, LockOptions]:
        """The resolved options of the app's LockedTasks, by name."""
        found = {name: bound_options(task) for name, task in self.locked_tasks.items()}
        return {name: options for name, options in found.items() if options is not None}

    def rows(self, locks: list[HeldLock]) -> list[dict[str, Any]]:
        """``locks`` as ``list --json`` prints them, each with its task's ``lock_mode``."""
        modes = {name: options.mode for name, options in self.options.items()}
        return [lock.as_dict(modes.get(lock.task or "")) for lock in locks]

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
    return _Context(app=app, client=client, url=url, settings=app_settings(app))


_COLUMNS = ("task", "task_id", "attempt", "state", "mode", "node", "pid", "ttl", "fence", "key")
#: Columns in seconds.
_SECONDS = frozenset({"ttl", "age", "lease"})


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column in _SECONDS:
        return f"{value:.1f}s"
    return str(value)


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...] = _COLUMNS) -> str:
    """``rows`` as aligned ``columns``, under a header; the last column is not padded."""
    cells = [[column.upper().replace("_", " ") for column in columns]]
    cells += [[_cell(column, row[column]) for column in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(width) for cell, width in zip(line, widths, strict=False)), line[-1]])
        for line in cells
    )


@click.group(name="redislock", cls=_Group)
def redislock() -> None:
    """Inspect and free celery-redislock locks."""


@redislock.command(name="list")
@click.option("--task", "task_name", callback=_utf8, metavar="NAME", help="Only this task's locks.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@click.pass_context
def list_locks(ctx: click.Context, task_name: str | None, as_json: bool) -> None:
    """List the locks held under the app's prefix."""
    context = _context(ctx)
    locks = held_locks(context.client, context.prefix) if task_name is None else context.task_locks(task_name)
    rows = context.rows(locks)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif rows:
        click.echo(_table(rows))
    else:
        whose = "" if task_name is None else f" by task {task_name!r}"
        click.echo(f"no locks held{whose} under prefix {context.prefix!r} in Redis at {context.url}")


@redislock.command()
@click.argument("key", callback=_utf8)
@click.pass_context
def show(ctx: click.Context, key: str) -> None:
    """Show the lock at KEY and how many wait for it."""
    context = _context(ctx)
    lock = _existing(context, key)
    [fields] = context.rows([lock])
    width = max(len(name) for name in fields)
    for name, value in fields.items():
        click.echo(f"{name.ljust(width)}  {_cell(name, value)}")


def _existing(context: _Context, key: str) -> HeldLock:
    lock = read_lock(context.client, key, context.prefix)
    if lock is not None:
        return lock
    if context.client.exists(key):
        raise click.ClickException(f"key {key!r} holds no lock (not a celery-redislock lock value)")
    permits = _permits_held(context, key)
    if permits:  # a semaphore's name (a call of a task with a lock_limit above 1): its holds
        raise click.ClickException(f"no lock at key {key!r}; its permits are held: {', '.join(permits)}")
    raise click.ClickException(f"no lock at key {key!r} in Redis at {context.url} (free, or never taken)")


def _permits_held(context: _Context, name: str) -> list[str]:
    """The keys of the permits held of the semaphore ``name`` (none for a name no semaphore can have)."""
    try:
        keys = PermitBook(name, MAX_LIMIT).keys
    except LockConfigurationError:
        return []
    return [lock.key for lock in read_locks(context.client, keys, context.prefix)]


def _json_option(option: str, text: str, kind: type) -> Any:
    """The value of a JSON ``option`` as a worker receives a message's: kombu's ``loads``, which
    turns its ``{"__type__": ..., "__value__": ...}`` envelopes back into what was sent (a
    datetime, a UUID, a Decimal), so that a call keys as its run does."""
    try:
        value = kombu_json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint=option) from None
    # an envelope's value its type refuses (Decimal, UUID, bytes: each raises its own), or
    # nesting too deep to read
    except (ArithmeticError, TypeError, AttributeError, RecursionError) as exc:
        raise click.BadParameter(f"not valid JSON: {type(exc).__name__}: {exc}", param_hint=option) from None
    if not isinstance(value, kind):
        expected = "a JSON list" if kind is list else "a JSON object"
        raise click.BadParameter(f"must be {expected}, got {text!r}", param_hint=option)
    return value


def _released(context: _Context, lock: HeldLock, why: str) -> bool:
    """Force-release ``lock`` and say what happened."""
    options = context.options.get(lock.task or "")  # a task's permit: its lock_limit, as its runs have it
    if force_release(context.client, lock, why, None if options is None else options.limit):
        click.echo(f"released {lock.key} (held by {lock.holder}, fence {lock.fence})")
        return True
    now = read_lock(context.client, lock.key, context.prefix)
    now_held = f"now held by {now.holder}" if now is not None else "now free"
    click.echo(f"not released {lock.key}: it changed hands since it was read ({now_held})", err=True)
    return False


@redislock.command()
@click.argument("key", callback=_utf8, required=False)
@click.option(
    "--task", "task_name", callback=_utf8, metavar="NAME", help="Release the lock of a call of this task..."
)
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
    # every permit a limit could have given out (a worker's may differ, or have been lowered since)
    permits = PermitBook(call_key, MAX_LIMIT).keys
    keys = [call_key, *(call_key + suffix for suffix in sorted(QUEUED_SUFFIXES)), *permits]
    held = read_locks(context.client, keys, context.prefix)
    if not held:
        call = f"{task_name}(*{args!r}, **{kwargs!r})"
        raise click.ClickException(f"no lock held for {call}: {call_key} is free")
    why = f"by hand, celery redislock release --task {task_name}"
    released = [_released(context, lock, why) for lock in held]
    if not all(released):
        ctx.exit(1)


@redislock.command()
@click.option(
    "--task", "task_name", callback=_utf8, metavar="NAME", required=True, help="Whose locks to free."
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def purge(ctx: click.Context, task_name: str, yes: bool) -> None:
    """Free every lock of one task, whoever holds them."""
    context = _context(ctx)
    locks = context.task_locks(task_name)
    if not locks:
        click.echo(f"no locks held by task {task_name!r}")
        return
    click.echo(_table(context.rows(locks)))
    if not yes:
        click.confirm(f"Release these {len(locks)} lock(s) of task {task_name!r}?", abort=True)
    why = f"by hand, celery redislock purge --task {task_name}"
    freed = sum(_released(context, lock, why) for lock in locks)
    click.echo(f"released {freed} of {len(locks)} lock(s) of task {task_name!r}")
    if freed < len(locks):
        ctx.exit(1)


#: ``stats``' lists of locks: (JSON key, title, columns).
_SECTIONS = (
    ("waited_for", "waited for, most waiters first", ("waiters", "kind", "task", "task_id", "age", "key")),
    ("oldest", "oldest holds", ("age", "kind", "task", "task_id", "node", "pid", "ttl", "key")),
    (
        "expiring",
        "expiring: under a third of the lease left, renewals late",
        ("ttl", "lease", "task", "task_id", "node", "pid", "key"),
    ),
    (
        "orphans",
        f"orphans: enqueue locks older than {ORPHAN_AGE / 3600:g}h",
        ("age", "task", "task_id", "ttl", "key"),
    ),
)


@redislock.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of tables.")
@click.option(
    "--limit", default=10, show_default=True, metavar="N", help="Locks listed per section (0: all)."
)
@click.pass_context
def stats(ctx: click.Context, as_json: bool, limit: int) -> None:
    """Summarise the locks under the app's prefix, from Redis alone."""
    if limit < 0:
        raise click.BadParameter(f"must be 0 (all) or more, got {limit}", param_hint="--limit")
    context = _context(ctx)
    found = {"redis": context.url, **summary(context.client, context.settings, context.options, limit)}
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    held = found["held"]
    click.echo(
        f"locks under prefix {found['prefix']!r} in Redis at {context.url}: "
        f"{held['execution']} execution, {held['enqueue']} enqueue, {held['leader']} beat leader, "
        f"{held['other']} other; {held['waiters']} waiting"
    )
    if found["tasks"]:
        click.echo("\n" + _table(found["tasks"], ("task", "mode", "execution", "enqueue", "waiters")))
    for name, title, columns in _SECTIONS:
        section = found[name]
        shown = f"{len(section['locks'])} of {section['count']}" if section["count"] else "none"
        click.echo(f"\n{title} ({shown})")
        if section["locks"]:
            click.echo(_table(section["locks"], columns))
    _echo_beat(found["beat"])


def _echo_beat(beat: dict[str, Any]) -> None:
    leader = beat["leader"]
    led = "no leader" if leader is None else f"leader {leader['holder']} (ttl {_cell('ttl', leader['ttl'])})"
    click.echo(f"\nbeat: {led}; {beat['markers']} slot markers")
    if beat["entries"]:
        click.echo(_table(beat["entries"], ("entry", "markers", "slot", "ttl", "holder")))
