"""The lock modes as data: what each ``lock_mode`` takes, keeps and frees, in one table.

Every decision that depends on the mode reads a field of its row
(``LockOptions.rules``), so adding a mode is adding a row here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["MODE_RULES", "QUEUED_SUFFIXES", "UNLOCKED", "ModeRules"]


@dataclass(frozen=True)
class ModeRules:
    """What one ``lock_mode`` does."""

    #: ``apply_async`` takes an enqueue lock, whose ticket (key and token) the message carries
    enqueue_lock: bool
    #: the run holds an execution lock (``{prefix}:{task}:{digest}``) while the body runs
    execution_lock: bool
    #: the enqueue lock is the execution lock (same key): the run adopts the message's hold
    adopts_ticket: bool
    #: a run that sends its retry, or its replacement of the same key, parks its hold for that
    #: message, which adopts it
    parks_for_retry: bool
    #: the run frees the message's enqueue lock once the message is dealt with here (run,
    #: skipped or failed); a busy retry republishes the message with its enqueue lock renewed
    frees_ticket: bool
    #: the lock stays ``lock_period`` after a run (needs ``lock_period``; an enqueue lock lives
    #: at least that long)
    settles: bool
    #: appended to the key of the enqueue lock when it is not the execution lock
    queued_suffix: str
    #: ``lock_busy`` when neither the task nor the app sets it
    default_busy: str

    def __post_init__(self) -> None:
        """Some fields follow from others: a row that contradicts them is a mistake in the table."""
        one_key = self.enqueue_lock and self.execution_lock and not self.queued_suffix
        rules = {
            "adopts_ticket: exactly when the enqueue lock is the execution lock": self.adopts_ticket
            == one_key,
            "frees_ticket: exactly when an enqueue lock is not adopted": (
                self.frees_ticket == (self.enqueue_lock and not self.adopts_ticket)
            ),
            "parks_for_retry: only with an adopted ticket": self.adopts_ticket or not self.parks_for_retry,
            "settles: only with an execution lock": self.execution_lock or not self.settles,
        }
        broken = [rule for rule, holds in rules.items() if not holds]
        if broken:
            raise ValueError(f"inconsistent mode rules {self}: {'; '.join(broken)}")


#: ``lock_mode`` -> its rules, in the order the docs list the modes.
# fmt: off
MODE_RULES: Mapping[str, ModeRules] = MappingProxyType({
    #                                       enqueue execution adopts parks  frees  settles suffix     busy
    "while_executing": ModeRules(           False,  True,     False, False, False, False, "",        "skip"),
    "until_executing": ModeRules(           True,   False,    False, False, True,  False, "",        "skip"),
    "until_executed": ModeRules(            True,   True,     True,  True,  False, False, "",        "skip"),
    "until_and_while_executing": ModeRules( True,   True,     False, False, True,  False, ":queued", "retry"),
    "until_expired": ModeRules(             True,   True,     True,  True,  False, True,  "",        "skip"),
})
# fmt: on

#: The rules of every task of an app with ``redislock_enabled = False``, whatever its mode: it
#: takes, keeps and frees nothing (``LockOptions.mode`` still names the mode it declares).
UNLOCKED = ModeRules(False, False, False, False, False, False, "", "skip")

#: The suffixes an enqueue lock's key may carry after the execution lock's key.
QUEUED_SUFFIXES = frozenset(rules.queued_suffix for rules in MODE_RULES.values() if rules.queued_suffix)
