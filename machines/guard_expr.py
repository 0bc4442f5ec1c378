"""Guard expressions as paths set them: python-statemachine's boolean guard expressions
(``cond="has_items and not blocked"``; ``!``, ``^`` and ``v`` as it reads them) over the names
a model answers.

A path does not set an expression as one opaque guard (no model method is named ``"a and not
b"``): it sets the names inside it, which a ``paths.GuardTable`` model answers and
python-statemachine combines as the expression says. ``alternatives(text, value)`` are the
ways to give ``text`` the outcome ``value`` (each a set of name outcomes; a name not set
answers True, as ``GuardTable`` answers it), ``holds`` evaluates it under outcomes, ``names``
lists its names.

Only ``and``, ``or``, ``not``, names and constants are such expressions. A comparison
(``load > 3``), a call (``In('busy')``) or anything else python-statemachine evaluates on
values a path does not set is refused: ``UnsettableGuard`` says why, and the caller names the
guard and its transition.

``canonical`` and ``callable_name`` are how a guard is named where one word must stand for it
(a guard mutant's id) or where python-statemachine has only ``<lambda>`` for it (a callable).
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
from collections.abc import Mapping

from statemachine.spec_parser import replace_operators

#: bound on the ways to set one expression (``(a or b) and (c or d) and ...`` doubles them)
MAX_ALTERNATIVES = 256

#: one way to give an expression an outcome: (name, outcome) pairs, each name once
Alternative = tuple[tuple[str, bool], ...]


class UnsettableGuard(ValueError):
    """A guard expression whose outcome no setting of names decides; the message is the
    reason (the caller prefixes the guard and its transition)."""


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> ast.expr:
    """``text`` as an expression of names, constants, ``and``, ``or`` and ``not``."""
    if text.isidentifier():
        return ast.Name(id=text, ctx=ast.Load())
    try:
        tree = ast.parse(replace_operators(text), mode="eval").body
    except SyntaxError as err:
        raise UnsettableGuard(f"not a boolean expression ({err.msg})") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            raise UnsettableGuard("a comparison: its outcome depends on values a path does not "
                                  "set, only on the names of guards")
        if isinstance(node, ast.Call):
            raise UnsettableGuard("a call (such as In(...)): its outcome depends on what a path "
                                  "does not set")
        if not isinstance(node, (ast.BoolOp, ast.UnaryOp, ast.Name, ast.Constant,
                                 ast.And, ast.Or, ast.Not, ast.Load)):
            raise UnsettableGuard(f"{type(node).__name__} is not and/or/not over names")
        if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.Not):
            raise UnsettableGuard(f"{type(node.op).__name__} is not and/or/not over names")
    return tree


def names(text: str) -> tuple[str, ...]:
    """The names ``text`` reads, in order, each once."""
    return tuple(dict.fromkeys(n.id for n in ast.walk(_parse(text)) if isinstance(n, ast.Name)))


def holds(text: str, outcomes: Mapping[str, bool]) -> bool:
    """``text``'s outcome where each name answers ``outcomes`` (True when not there)."""
    if text.isidentifier():
        return outcomes.get(text, True)
    return _holds(_parse(text), outcomes)


def _holds(node: ast.expr, outcomes: Mapping[str, bool]) -> bool:
    if isinstance(node, ast.Name):
        return outcomes.get(node.id, True)
    if isinstance(node, ast.Constant):
        return bool(node.value)
    if isinstance(node, ast.UnaryOp):
        return not _holds(node.operand, outcomes)
    if isinstance(node, ast.BoolOp):
        values = (_holds(value, outcomes) for value in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    raise UnsettableGuard(f"{type(node).__name__} is not and/or/not over names")


@functools.lru_cache(maxsize=4096)
def alternatives(text: str, value: bool) -> tuple[Alternative, ...]:
    """The ways to give ``text`` the outcome ``value``, simplest first: each sets some names,
    and any setting that includes one of them gives ``text`` that outcome. Empty when no
    setting does (``"a and not a"`` for True)."""
    if text.isidentifier():
        return (((text, value),),)
    found = _alternatives(_parse(text), value)
    if len(found) > MAX_ALTERNATIVES:
        raise UnsettableGuard(f"more than {MAX_ALTERNATIVES} ways to set it")
    return tuple(tuple(way.items()) for way in found)


def _alternatives(node: ast.expr, value: bool) -> list[dict[str, bool]]:
    if isinstance(node, ast.Name):
        return [{node.id: value}]
    if isinstance(node, ast.Constant):
        return [{}] if bool(node.value) == value else []
    if isinstance(node, ast.UnaryOp):
        return _alternatives(node.operand, not value)
    if not isinstance(node, ast.BoolOp):
        raise UnsettableGuard(f"{type(node).__name__} is not and/or/not over names")
    every = isinstance(node.op, ast.And) == value  # each operand must have ``value``
    if not every:  # any one operand with ``value`` decides
        found: list[dict[str, bool]] = []
        for operand in node.values:
            found += [way for way in _alternatives(operand, value) if way not in found]
            if len(found) > MAX_ALTERNATIVES:
                break
        return found
    ways: list[dict[str, bool]] = [{}]
    for operand in node.values:
        merged: list[dict[str, bool]] = []
        for way in ways:
            for more in _alternatives(operand, value):
                if all(way.get(name, outcome) == outcome for name, outcome in more.items()):
                    both = {**way, **more}
                    if both not in merged:
                        merged.append(both)
        ways = merged[:MAX_ALTERNATIVES + 1]
    return ways


@functools.lru_cache(maxsize=4096)
def shown(text: str, expected: bool = True) -> tuple[str, ...]:
    """``text`` (a ``cond`` when ``expected``, an ``unless`` otherwise) in the toolkit's one
    notation, the one ``charts paths`` writes a step's outcomes in and every tool draws and
    names a guard by: each of the conditions that must all hold, ``!name`` for a name that must
    not (``cond="has_job and not toner_empty"`` -> ``("has_job", "!toner_empty")``, drawn
    ``[has_job, !toner_empty]``; ``unless="a or b"`` -> ``("!a", "!b")``), a disjunction as
    ``a or b`` (parenthesized inside another operator). Text that is no expression over names
    (a comparison, a call) is kept as written, ``!(...)`` for an ``unless``."""
    if text.isidentifier():
        return (text if expected else f"!{text}",)
    try:
        node = _parse(text)
    except UnsettableGuard:
        return (text if expected else f"!({text})",)
    if not expected:
        node = ast.UnaryOp(op=ast.Not(), operand=node)
    return tuple(_show(part, nested=False) for part in _conjuncts(node))


def _conjuncts(node: ast.expr) -> list[ast.expr]:
    """The operands that must all hold for ``node`` to hold (``not (a or b)``: ``not a``,
    ``not b``), double negations dropped."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        return [part for value in node.values for part in _conjuncts(value)]
    if isinstance(node, ast.UnaryOp):
        inner = node.operand
        if isinstance(inner, ast.UnaryOp):
            return _conjuncts(inner.operand)
        if isinstance(inner, ast.BoolOp) and isinstance(inner.op, ast.Or):
            return [part for value in inner.values
                    for part in _conjuncts(ast.UnaryOp(op=ast.Not(), operand=value))]
    return [node]


def _show(node: ast.expr, nested: bool) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant):
        return str(bool(node.value)).lower()
    if isinstance(node, ast.UnaryOp):
        inner = node.operand
        if isinstance(inner, ast.UnaryOp):
            return _show(inner.operand, nested)
        return f"!{_show(inner, nested=True)}"
    if not isinstance(node, ast.BoolOp):  # _parse admits nothing else
        return ast.unparse(node)
    word = " and " if isinstance(node.op, ast.And) else " or "
    text = word.join(_show(value, nested=True) for value in node.values)
    return f"({text})" if nested else text


def canonical(text: str, expected: bool = True) -> str:
    """``text`` (a ``cond`` when ``expected``, an ``unless`` otherwise) as one stable word of
    the toolkit's notation, how a guard mutant's id names it: the conditions ``shown`` draws,
    joined by ``,`` (``cond="has_job and not  toner_empty"`` -> ``has_job,!toner_empty``), so
    the id does not change with the spacing or the spelling of the text (``not``/``!``,
    ``and``/``^``, redundant parentheses); an ``unless`` is ``!name`` or ``!(...)`` round the
    ``cond`` it would be (``unless="a or b"`` -> ``!(a or b)``), and a ``cond`` whose word
    starts with ``!`` is parenthesized (``(!motor_hot)``), so the two never read alike. Text
    that is no expression over names (a comparison, a call) is Python's own unparsing of it
    (``load>3`` -> ``load > 3``)."""
    if text.isidentifier():
        word = text
    elif _parses(text):
        word = ",".join(shown(text))
    else:
        word = _unparsed(text)
    if not expected:
        return f"!{word}" if word.isidentifier() else f"!({word})"
    return f"({word})" if word.startswith("!") else word


def _parses(text: str) -> bool:
    try:
        _parse(text)
    except UnsettableGuard:
        return False
    return True


def _unparsed(text: str) -> str:
    """``text`` as Python unparses it (python-statemachine's operators replaced), or as
    written when it is no Python expression."""
    try:
        return ast.unparse(ast.parse(replace_operators(text), mode="eval").body)
    except (SyntaxError, ValueError):
        return text.strip()


def callable_name(func: object) -> str:
    """How every tool names a guard declared as a callable (``cond=coin_ok``, ``cond=lambda
    ...``): drawn on its edge, in a guard mutant's id, in a refusal. A function by its name
    (``coin_ok``); a lambda by its source text as Python unparses it (``lambda order:
    order.total > 100``: python-statemachine names every lambda ``<lambda>``, which tells a
    reviewer nothing and two lambdas apart by nothing); a lambda whose source ``inspect``
    cannot read (made by ``exec``) by where it was made, ``lambda at <string>:3``; any other
    callable object by its type's name. Never an address: the name is the same in every
    process."""
    name = getattr(func, "__name__", None)
    if isinstance(name, str) and name and name != "<lambda>":
        return name
    code = getattr(func, "__code__", None)
    if name == "<lambda>" and code is not None:
        return _lambda_text(code) or (
            f"lambda at {os.path.basename(code.co_filename)}:{code.co_firstlineno}")
    return type(func).__name__


@functools.lru_cache(maxsize=1024)
def _lambda_text(code: object) -> str | None:
    """The source of the lambda whose code object is ``code``, unparsed, or None when its
    file cannot be read or holds no single lambda the code's positions point into."""
    filename = getattr(code, "co_filename", "")
    first = getattr(code, "co_firstlineno", 0)
    tree = _module_tree(filename)
    if tree is None:
        return None
    found = [node for node in ast.walk(tree)
             if isinstance(node, ast.Lambda) and node.lineno == first]
    if len(found) > 1:  # several lambdas on one line: the one whose body holds the code's
        # (an instruction of no span, the code's RESUME at column 0, points at no lambda)
        positions = [(line, col) for line, end, col, end_col in code.co_positions()  # type: ignore[attr-defined]
                     if None not in (line, end, col, end_col) and (line, col) != (end, end_col)]
        found = [node for node in found if positions and all(
            (node.body.lineno, node.body.col_offset) <= position
            <= (node.body.end_lineno or node.body.lineno, node.body.end_col_offset or 0)
            for position in positions)]
    return ast.unparse(found[0]) if len(found) == 1 else None


def _module_tree(filename: str) -> ast.Module | None:
    """The syntax tree of ``filename``'s source as ``linecache`` reads it now (a file
    rewritten since it was cached is read again), or None."""
    linecache.checkcache(filename)
    lines = linecache.getlines(filename)
    return _parsed_module("".join(lines)) if lines else None


@functools.lru_cache(maxsize=64)
def _parsed_module(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None
