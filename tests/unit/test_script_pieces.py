"""How a Lua script's source is assembled from the shared pieces (``_scripts._PIECES``).

Redis runs a script's whole text on every call, and every ``local function`` in it is a
closure made anew, so a script holds only the pieces it uses. What each script then does is
tested against a real server by the rest of the suite; here, that every name a source uses is
defined in it, before it is used, and that the common paths set up nothing they do not use.
"""

from __future__ import annotations

import re

import pytest

from celery_redislock import _permit_scripts, _scripts, _task_scripts, inventory
from celery_redislock._scripts import _ACQUIRE_FAST, _PIECE_NAMES, _RELEASE_FAST, Script
from celery_redislock._scripts import lua_code as code

SCRIPTS = {
    name: value
    for module in (_scripts, _task_scripts, _permit_scripts, inventory)
    for name, value in vars(module).items()
    if isinstance(value, Script)
}
PIECE_NAMES = frozenset().union(*_PIECE_NAMES.values())


def test_every_script_is_checked() -> None:
    assert {"ACQUIRE", "RELEASE", "RENEW", "ADOPT", "PARK", "ACQUIRE_PERMIT", "READ"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_name_a_script_uses_is_defined_before_its_first_use(name: str) -> None:
    text = code(SCRIPTS[name].source)
    for used in PIECE_NAMES:
        first_use = re.search(rf"\b{used}\b", text)
        if first_use is None:
            continue
        pieces = [code(piece) for piece, names in _PIECE_NAMES.items() if used in names]
        assert pieces[0] in text, f"{name} uses {used} and does not define it"
        assert text.index(pieces[0]) <= first_use.start(), f"{name} uses {used} before defining it"


#: The globals a script may call: Lua's own (the scripts' libraries are called as fields,
#: ``string.find``, ``redis.call``, ``cjson.encode``, and are not calls of a name here).
LUA_FUNCTIONS = frozenset({"tonumber", "tostring", "type", "ipairs", "pairs", "select", "unpack", "error"})
LUA_KEYWORDS = frozenset(
    {"and", "or", "not", "if", "elseif", "while", "until", "return", "function", "local", "in"}
)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_function_a_script_calls_is_defined_in_it_or_lua_s_own(name: str) -> None:
    """Redis refuses a script's call of an undefined global only when the call runs (a path
    the suite may not reach): a name called must be a ``local function`` of the script."""
    text = code(SCRIPTS[name].source)
    for call in re.finditer(r"(?<![.:\w])([A-Za-z_]\w*)\s*\(", text):
        called = call.group(1)
        if called in LUA_KEYWORDS | LUA_FUNCTIONS:
            continue
        definition = re.search(rf"^\s*local function {called}\b", text, re.M)
        assert definition is not None, f"{name} calls {called}, which it does not define"
        assert definition.start() < call.start(), f"{name} calls {called} before defining it"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_script_defines_only_the_pieces_it_uses(name: str) -> None:
    source = SCRIPTS[name].source
    for piece, names in _PIECE_NAMES.items():
        if piece not in source:
            continue
        rest = code(source.replace(piece, ""))
        assert any(re.search(rf"\b{n}\b", rest) for n in names), f"{name} defines {sorted(names)} unused"


def test_the_common_paths_make_no_closure_they_do_not_use() -> None:
    acquire = _scripts.ACQUIRE.source
    before_slow_path = acquire[: acquire.index(_ACQUIRE_FAST) + len(_ACQUIRE_FAST)]
    assert "local function" not in before_slow_path  # a free lock taken: no closure made

    release = _scripts.RELEASE.source
    before_slow_path = release[: release.index(_RELEASE_FAST)]
    assert re.findall(r"^local function (\w+)", before_slow_path, re.M) == ["companion_prefix"]
    # a release by a caller that never waited names the waiter queue, no other companion
    assert re.findall(r"^local (\w+) = prefix", before_slow_path, re.M) == ["queue"]

    assert re.findall(r"^local function (\w+)", _scripts.RENEW.source, re.M) == ["owns"]


def test_a_piece_brings_the_pieces_it_uses() -> None:
    script = Script("wake_next(0, 0, 0)")
    defined = set(re.findall(r"^local (?:function )?([\w, ]+)", script.source, re.M))
    assert defined == {
        "lock ",
        "companion_prefix",
        "prefix ",
        "queue ",
        "deadlines ",
        "wake_prefix ",
        "hold",
        "member_fields",
        "evict",
        "wake",
        "wake_next",
    }


def test_a_name_used_after_an_escaped_quote_is_seen() -> None:
    """A quoted string ends where Lua ends it, not at an escaped quote within it."""
    script = Script("return 'it\\'s ' .. clock(redis.call('TIME')) .. \"a \\\" b\"")
    assert "local function clock" in script.source


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_no_script_writes_a_long_bracket(name: str) -> None:
    """``lua_code`` reads comments and strings of one line only: a ``--[[`` comment or a
    ``[[`` string spanning lines could hide a name from it (or show one that is not code)."""
    assert "[[" not in SCRIPTS[name].source
