"""Task signature -> lock key.

A call's key is ``{prefix}:{task name}:{digest}``, the digest being the
SHA-256 (or, with ``redislock_key_secret``, the HMAC-SHA-256) of the canonical
JSON of its arguments: bound to the signature of the task's ``run`` (defaults
applied, a bound ``self`` dropped), as a worker receives them through
Celery's JSON serializer (datetime, UUID, Decimal, bytes... keep their type; a
tuple arrives as a list, a dict key as a string), with dict keys sorted. So
``f(1, b=2)``, ``f(1, 2)``, ``f(a=1, b=2)`` and ``f(1)`` (``b=2`` being the
default) share one key, the key is the same before and after the message's
trip through the broker, two calls share a key only if the worker receives
equal arguments (``1``, ``1.0`` and ``True`` differ), and no argument value
appears in a key name.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import inspect
import json
import json.encoder
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from kombu.utils.json import JSONEncoder

from .exceptions import LockKeyError

__all__ = ["LockOn", "call_digest", "leader_key", "lock_key", "slot_key"]

#: ``None`` (every argument), parameter names (only those), or a callable
#: ``(*args, **kwargs) -> JSON-able value``.
LockOn = Sequence[str] | Callable[..., Any] | None


def _signature(run: Callable[..., Any]) -> tuple[inspect.Signature, tuple[str, ...] | None]:
    """``inspect.signature(run)`` (a bound method drops its ``self``) and, when every parameter
    can be passed by position, their names; computed once per function."""
    function = getattr(run, "__func__", None)
    if function is None:
        return _function_signature(run, False)
    return _function_signature(function, True)


@functools.lru_cache(maxsize=1024)
def _function_signature(
    function: Callable[..., Any], bound: bool
) -> tuple[inspect.Signature, tuple[str, ...] | None]:
    signature = inspect.signature(function)
    if bound:
        parameters = list(signature.parameters.values())[1:]
        signature = signature.replace(parameters=parameters)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if all(parameter.kind in positional for parameter in signature.parameters.values()):
        return signature, tuple(signature.parameters)
    return signature, None


#: The encoder of the canonical text (sorted keys, no spaces), built once: it keeps no state between calls.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
#: Its C encoder, made once instead of per call as ``encode`` does (saves ~1 µs a key, measured); no
#: circular check (``markers=None``): what it encodes is a tree (``_delivered``, or decoded JSON).
#: ``None`` where the json C extension is missing.
_C_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)  # untyped in typeshed
_CANONICAL_C = (
    None
    if _C_MAKE_ENCODER is None
    else _C_MAKE_ENCODER(  # markers, default, encoder, indent, separators, sort_keys, skipkeys, allow_nan
        None, _CANONICAL_JSON.default, json.encoder.encode_basestring, None, ":", ",", True, False, True
    )
)
#: The keys of kombu's JSON envelope for a non-JSON type: ``{"__type__": "datetime", "__value__": ...}``.
_ENVELOPE = frozenset({"__type__", "__value__"})


def _canonical(value: Any) -> str:
    """The canonical JSON of ``value`` as a worker receives it: encoded by Celery's JSON
    encoder, decoded (a tuple is a list, a dict key a string; envelopes left encoded, as
    kombu's decoder and encoder invert each other) and encoded again with sorted keys.
    A value already in its delivered form (``_delivered``) is encoded once: the same text."""
    return _encode(value, _delivered(value))


def _encode(value: Any, delivered: bool) -> str:
    """``_canonical(value)``, told whether ``value`` is ``_delivered`` (a caller that needs to know
    anyway walks the value once)."""
    if not delivered:
        value = json.loads(json.dumps(value, cls=JSONEncoder, ensure_ascii=False, allow_nan=True))
    if _CANONICAL_C is None:
        return _CANONICAL_JSON.encode(value)
    return "".join(_CANONICAL_C(value, 0))


#: The types JSON delivers as they were sent (``bool`` and ``None`` included; not subclasses).
_SCALARS = frozenset({str, int, float, bool, type(None)})
#: The one type of dict key JSON delivers as it was sent.
_TEXT = frozenset({str})


def _delivered(value: Any) -> bool:
    """Whether a worker receives ``value`` as it is (dicts with string keys, lists, tuples
    and ``_SCALARS``, each container reached once: no cycle, no shared part), so that one
    encoding gives its canonical JSON. Anything else (other types, an int dict key, a dict
    shaped like kombu's envelope) takes the round trip."""
    if type(value) is dict and _SCALARS.issuperset(map(type, value.values())):  # flat, as most calls: no walk
        return _TEXT.issuperset(map(type, value)) and value.keys() != _ENVELOPE
    pending, seen = [value], set()
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        if id(item) in seen:
            return False
        seen.add(id(item))
        if kind is dict:
            if item.keys() == _ENVELOPE or not all(type(key) is str for key in item):
                return False
            pending.extend(item.values())
        elif kind is list or kind is tuple:
            pending.extend(item)
        else:
            return False
    return True


def _envelope_lookalike(value: Any) -> bool:
    """Whether ``value`` is or holds a plain dict shaped like kombu's envelope, which a worker
    receives decoded as another type (or cannot decode): keyed as sent, it would not key alike."""
    pending = [value]  # a loop, not recursion: any depth the encoder accepted
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if item.keys() == _ENVELOPE:
                return True
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return False


def _keyed_value(
    task_name: str, run: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], lock_on: LockOn
) -> Any:
    """What the key stands for: the bound arguments, the named ones, or the callable's value. The
    callable's exception is ``LockKeyError``'s cause, but for a soft time limit landing in it (an
    ``Exception`` too), which propagates as itself."""
    if callable(lock_on):
        try:
            return lock_on(*args, **kwargs)
        except SoftTimeLimitExceeded:
            raise
        except Exception as exc:
            raise LockKeyError(task_name, "lock_on", f"(the callable) raised {exc!r}") from exc
    signature, names = _signature(run)
    if names is not None and not kwargs and len(args) == len(names):
        arguments = dict(zip(names, args, strict=True))  # as binding gives: every parameter by position
    else:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise LockKeyError(task_name, "*", f"list does not match the task's signature: {exc}") from None
        bound.apply_defaults()
        arguments = bound.arguments
    if lock_on is None:
        return arguments
    missing = [name for name in lock_on if name not in arguments]
    if missing:
        raise LockKeyError(task_name, missing[0], "named in lock_on is not a parameter of the task")
    return {name: arguments[name] for name in lock_on}


def call_digest(
    task_name: str,
    run: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    lock_on: LockOn = None,
    secret: bytes | None = None,
) -> str:
    """Hex digest of a call's canonical arguments: SHA-256, or HMAC-SHA-256 under ``secret``.

    ``LockKeyError`` names what cannot be keyed, also ``args`` that are no list or tuple (a str
    would be keyed as its characters) and ``kwargs`` that are no mapping, which Celery refuses.
    """
    if not isinstance(args, (list, tuple)):
        raise LockKeyError(task_name, "*", f"list: args must be a list or tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise LockKeyError(task_name, "*", f"list: kwargs must be a mapping, got {type(kwargs).__name__}")
    value = _keyed_value(task_name, run, args, kwargs or {}, lock_on)
    parts: Mapping[str, Any] = {"lock_on": value} if callable(lock_on) else value  # name -> its value
    delivered = _delivered(value)
    try:
        text = _encode(value, delivered)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        culprit = next((name for name, part in parts.items() if not _encodable(part)), "*")
        if not callable(lock_on) and isinstance(parts.get(culprit), dict):  # **kwargs: name the keyword
            var_keyword = _signature(run)[0].parameters.get(culprit)
            if var_keyword is not None and var_keyword.kind is inspect.Parameter.VAR_KEYWORD:
                inner = parts[culprit]
                culprit = next((name for name, part in inner.items() if not _encodable(part)), culprit)
        raise LockKeyError(
            task_name,
            culprit,
            f"cannot be encoded by Celery's JSON serializer ({exc}); "
            "pass JSON-able values or choose the key with lock_on",
        ) from None
    # A delivered value holds no envelope look-alike (``_delivered`` refuses one): no second walk.
    lookalike = None
    if not delivered:
        lookalike = next((name for name, part in parts.items() if _envelope_lookalike(part)), None)
    if lookalike is not None:
        raise LockKeyError(
            task_name,
            lookalike,
            "is or holds a dict shaped like kombu's JSON envelope ({'__type__': ..., '__value__': ...}), "
            "which Celery's JSON delivers as another type; rename its keys or choose the key with lock_on",
        )
    data = text.encode("utf-8", "surrogatepass")
    if secret is None:
        return hashlib.sha256(data).hexdigest()
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def _encodable(value: Any) -> bool:
    try:
        _canonical(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def lock_key(prefix: str, task_name: str, digest: str) -> str:
    return f"{prefix}:{task_name}:{digest}"


def slot_key(prefix: str, entry: str, slot: str) -> str:
    """The marker of one beat schedule slot: ``{prefix}:slot:{entry name}:{slot id}``."""
    return f"{slot_markers(prefix)}{entry}:{slot}"


def slot_markers(prefix: str) -> str:
    """What every beat slot marker under ``prefix`` starts with (markers are not locks)."""
    return f"{prefix}:slot:"


def leader_key(prefix: str) -> str:
    """The beat leader lock: ``{prefix}:beat-leader``."""
    return f"{prefix}:beat-leader"
