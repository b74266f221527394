"""The wire format: what the package writes to Redis and to Celery messages, read back in one place.

* A lock is one string: ``"<token>:<fence>:<holder>"`` (``LockValue``), where
  the token is the owner's 128-bit random token (32 hex digits), the fence is
  the fencing token of the hold (decimal) and the holder a free-form
  description of the owner. Ownership is the token prefix. A run's hold that a
  copy of its message, delivered again, watches carries the copy's token after
  the owner's (``"<token><copy's token>:<fence>:<holder>"``, ``_task_scripts``'
  ``WATCH``), read as the same hold. A hold kept for the rest of its
  ``lock_period`` once its run is over is owned by no token (``KEPT_TOKEN``,
  ``LockValue.kept``), its fence and holder kept. The Lua side of the
  same format is in ``_scripts``' shared pieces (``owns``, ``fence_of``, ``holder_of``,
  ``hold``).
* A task's lock names its holder with ``holder_for`` (fields ``task``, ``try``,
  ``state``, ``node``, ``pid``); a ``RedisLock`` by default as ``"<host>:<pid>"``.
* A message carries its enqueue lock (its *ticket*: key and token) in the
  ``redislock`` header, marked ``fresh`` where its send took it (not a hold a run
  parked for the message), and the beat slot it was sent for in ``redislock_beat``;
  its ``countdown``/``eta`` and ``expires`` are read as Celery's worker reads them
  (``message_delay``, ``seconds_until``), and its arguments as its run receives them
  (``received_arguments``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, NamedTuple
from urllib.parse import quote, unquote

from celery.exceptions import SoftTimeLimitExceeded
from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu import serialization

__all__ = [
    "BEAT_HEADER",
    "FRESH",
    "HEADER",
    "KEPT_TOKEN",
    "REPUBLISH",
    "LockValue",
    "canvas_member",
    "continues",
    "held_attempt",
    "holder_for",
    "message_continues_hold",
    "message_delay",
    "message_ticket",
    "parse_holder",
    "parse_value",
    "received_arguments",
    "replaced_nesting",
    "request_continues_hold",
    "request_slot",
    "request_ticket",
    "seconds_until",
    "sent_attempt",
    "slot_republished",
    "text",
]

#: The message header carrying a task's enqueue lock (key and token) to the worker.
HEADER = "redislock"
#: The field of a ``redislock`` header (``true``) marking its ticket as the enqueue lock its
#: message's send took (``enqueue``), which no run held: never a hold a run parked for the message
#: (``execution.send_continuation``, ``lost_retry``), whose header has no such field.
FRESH = "fresh"
#: The message header naming the beat slot a message was sent for (``celery_redislock.beat``):
#: ``entry``, ``slot`` (its id), ``key`` (its marker), ``token``, ``ttl`` (ms, of a new
#: marker), ``beat`` (the sender) and ``claimed`` (whether the sender claimed the slot); on a
#: message a busy lock's retry queued again, ``again`` (how many times: ``slot_republished``).
BEAT_HEADER = "redislock_beat"
#: The ``apply_async`` option (popped there, never sent) of a busy retry's republish
#: (``busy._retry``): the same message queued again, never refused as a duplicate.
REPUBLISH = "lock_republish"
#: Characters a holder field keeps as they are; others (space, ``=``, ``%``, non-ASCII) are %-encoded.
_FIELD_SAFE = "!\"#$&'()*+,-./:;<>?@[\\]^_`{|}~"
#: A field every character of which ``quote`` keeps (ASCII letters, digits, ``_.-~``, ``_FIELD_SAFE``).
_KEPT = re.compile(f"[A-Za-z0-9_.~{re.escape(_FIELD_SAFE)}-]*")
#: The token of a hold kept for the rest of its period, its run over (``_task_scripts``' ``SETTLE``,
#: a let-go): all zeros, which no random token is.
KEPT_TOKEN = "0" * 32
#: A lock value (a copy's token after the owner's, where one watches the hold, is skipped).
_VALUE = re.compile(r"([0-9a-f]{32})(?:[0-9a-f]{32})?:(\d+):(.*)", re.DOTALL)


def text(value: Any) -> str:
    """A Redis reply (bytes, or str from a ``decode_responses`` client) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


class LockValue(NamedTuple):
    """A lock as stored: the owner's token, the hold's fence and the holder's description."""

    token: str
    fence: int
    holder: str

    @property
    def kept(self) -> bool:
        """Whether the hold is kept for the rest of its period, the run that had it over."""
        return self.token == KEPT_TOKEN


def parse_value(value: object) -> LockValue | None:
    """The lock stored as ``value`` (a GET reply); ``None`` for a missing key or another kind of value."""
    if not isinstance(value, (bytes, str)):
        return None
    match = _VALUE.fullmatch(text(value))
    if match is None:
        return None
    token, fence, holder = match.groups()
    return LockValue(token, int(fence), holder)


def holder_for(
    task_id: str | None,
    retries: int,
    node: str,
    pid: int,
    state: str = "running",
    replaced: int = 0,
    period_ms: int = 0,
) -> str:
    """How a task's lock names its holder: task id, attempt (retries so far), ``queued`` or
    ``running``, and the node and process that queued or run it; for the run of a message that
    replaces another of its task id (``task.replace()``), how deep (``rep``, ``replaced``); for a
    hold parked for such a message or a retry by a run whose mode keeps it for a period after
    the run, that period in ms (``period``, ``period_ms``), by which a worker that does not know
    the task lets go of it as the run would have (``DECLINE``).

    Fields are separated by spaces; the task id and node are %-encoded where they hold a
    space, ``=``, ``%`` or a non-ASCII character, so that any task id reads back whole.
    """
    holder = f"task={_field(task_id or '-')} try={retries} state={state} node={_field(node)} pid={pid}"
    if replaced:
        holder += f" rep={replaced}"
    return f"{holder} period={period_ms}" if period_ms else holder


def replaced_nesting(request: Any) -> int:
    """How many runs of its task id the message of ``request`` replaced (``task.replace()``:
    Celery's ``replaced_task_nesting``), 0 for one that replaces none."""
    return int(getattr(request, "replaced_task_nesting", None) or 0)


def sent_attempt(options: Mapping[str, Any]) -> tuple[int, int]:
    """(retries so far, replacement depth) of a message sent with ``options`` (or received with
    these fields: a worker's ``request_dict``): the attempt its holders name (``try``, ``rep``).
    A message of a task id is later than another when it is a replacement deeper, or as deep
    and a later retry."""
    return int(options.get("retries") or 0), int(options.get("replaced_task_nesting") or 0)


def continues(request: Any) -> bool:
    """Whether the message of ``request`` continues a run of its task id: a retry (``self.retry``,
    autoretry) or a replacement (``task.replace()``), for which that run parks its hold, in the
    modes that keep the lock, rather than one sent by a new call."""
    return bool(getattr(request, "retries", None) or replaced_nesting(request))


def request_continues_hold(request: Any) -> bool:
    """Whether the ticket the message of ``request`` carries may be the hold of the run it
    continues (``continues``), parked for it or to be parked, in the modes that park one: not a
    ticket marked ``fresh``, the enqueue lock its send took afresh (a retry or replacement with
    other arguments, ``enqueue.enqueue_retry``), which no run held. A ticket sent unmarked (by a
    version before the mark) is read as such a hold, as it was then."""
    headers = getattr(request, "headers", None)
    fresh = _fresh(headers.get(HEADER) if headers else None) or _fresh(getattr(request, HEADER, None))
    return continues(request) and not fresh


def message_continues_hold(headers: Mapping[str, Any] | None) -> bool:
    """``request_continues_hold`` for a message's ``headers`` (or a worker's ``request_dict``)."""
    fields = headers or {}
    return any(sent_attempt(fields)) and not _fresh(fields.get(HEADER))


def _fresh(ticket: Any) -> bool:
    """Whether a ``redislock`` header is marked ``fresh`` (``FRESH``)."""
    return isinstance(ticket, Mapping) and ticket.get(FRESH) is True


def _field(value: str) -> str:
    """``value`` as a holder field: as it is when every character is kept (a uuid, a host name)."""
    return value if type(value) is str and _KEPT.fullmatch(value) else quote(value, safe=_FIELD_SAFE)


def parse_holder(holder: str | None) -> dict[str, str]:
    """The fields of a holder written by ``holder_for``, decoded (empty for another kind of holder)."""
    if holder is None or not holder.startswith("task="):
        return {}
    fields = (field.partition("=") for field in holder.split(" "))
    return {name: unquote(value) for name, _, value in fields}


def held_attempt(holder: Mapping[str, str]) -> tuple[int, int]:
    """Which message of its task id the run a holder (``parse_holder``'s) names ran, as (replacement
    depth, retries): a message is later than another when it replaced one more run, or as many
    and is a later retry."""
    return int(holder.get("rep") or 0), int(holder.get("try") or 0)


def message_ticket(headers: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(key, token) of the enqueue lock a message carries in its ``redislock`` header, if any."""
    return _ticket(headers.get(HEADER) if headers else None)


def request_ticket(request: Any) -> tuple[str, str] | None:
    """The enqueue lock a request's message carries (in ``request.headers`` or, for a
    request built from the raw message headers, as its ``redislock`` attribute)."""
    return message_ticket(getattr(request, "headers", None)) or _ticket(getattr(request, HEADER, None))


def _ticket(ticket: Any) -> tuple[str, str] | None:
    """A ``redislock`` header's (key, token), if it is one."""
    if (
        isinstance(ticket, Mapping)
        and isinstance(ticket.get("key"), str)
        and isinstance(ticket.get("token"), str)
    ):
        return ticket["key"], ticket["token"]
    return None


def request_slot(request: Any) -> dict[str, Any] | None:
    """The beat slot a request's message was sent for (its ``redislock_beat`` header), if any."""
    slot = (getattr(request, "headers", None) or {}).get(BEAT_HEADER) or getattr(request, BEAT_HEADER, None)
    if (
        isinstance(slot, Mapping)
        and all(isinstance(slot.get(field), str) for field in ("entry", "slot", "key", "token"))
        and isinstance(slot.get("ttl"), int)
    ):
        return dict(slot)
    return None


def slot_republished(slot: Mapping[str, Any]) -> int:
    """How many times a busy lock's retry (``lock_busy="retry"``) queued again the message of a
    beat slot (``request_slot``'s): its ``again`` field, 0 when absent."""
    again = slot.get("again")
    return again if isinstance(again, int) and not isinstance(again, bool) else 0


def canvas_member(options: Mapping[str, Any]) -> bool:
    """Whether a message sent with ``options`` is a member of a group or chord, or of a chain (its
    head, sent with the rest of the chain, or a member the worker sends as the previous one
    ends, ``chain=[]`` for the last): the canvas holds the result of its last member, frozen
    before anything is sent, so a member not sent leaves it waiting forever. (A retry's
    ``chain`` is ``None`` outside a chain.)"""
    return bool(options.get("group_id") or options.get("chord")) or options.get("chain") is not None


def message_delay(options: Mapping[str, Any]) -> float:
    """Seconds until a message sent with ``options`` (``countdown``/``eta``) may run. As Celery
    reads them: a ``countdown`` of 0 leaves the ``eta``, if any, to say (``if countdown:``)."""
    if options.get("countdown"):
        return max(float(options["countdown"]), 0.0)
    if options.get("eta") is not None:
        return max(seconds_until(options["eta"]), 0.0)
    return 0.0


def seconds_until(when: Any) -> float:
    """``when`` (seconds from now, a datetime or an ISO 8601 string) as seconds from now.

    Read as Celery's worker reads a message's ``eta``/``expires``: a string with its parser
    (``maybe_iso8601``: ``dateutil``'s ``isoparse``, which takes more than
    ``datetime.fromisoformat``, e.g. ``T24:00``), a naive time as UTC, whatever the process's
    local time zone or the app's ``timezone``.
    """
    if isinstance(when, (int, float)):
        return float(when)
    moment = maybe_iso8601(when) if isinstance(when, str) else when
    if moment is None:  # an empty string
        raise ValueError(f"{when!r} is no time")
    moment = maybe_make_aware(moment)
    return (moment - datetime.now(timezone.utc)).total_seconds()


def received_arguments(
    task: Any, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """``args`` and ``kwargs`` as the run of a message sent with ``options`` receives them: through
    the message's serializer (Celery's JSON delivers a tuple as a list, an int dict key as a
    string), so that a ``lock_on`` callable, called with them at ``apply_async`` and with what
    it received in the worker, keys alike. As they are where the serializer cannot take them:
    the send fails the same way, with Celery's error. A soft time limit landing meanwhile (an
    ``Exception`` too, which kombu wraps in its ``EncodeError``) propagates as itself."""
    serializer = options.get("serializer") or task.serializer or task.app.conf.task_serializer
    try:
        content_type, encoding, data = serialization.dumps((list(args), dict(kwargs)), serializer)
        received = serialization.loads(data, content_type, encoding, accept=[content_type])
    except SoftTimeLimitExceeded:
        raise
    except Exception as exc:  # EncodeError, an unknown serializer, wrong shapes: Celery's to report
        if isinstance(exc.__context__, SoftTimeLimitExceeded):  # landed in the serializer, which wrapped it
            raise exc.__context__ from None
        return args, kwargs
    return received[0], received[1]
