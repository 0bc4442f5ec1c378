"""docs/server.md's request-parameter table, its last column written from what the tests send
(issue 27): for each row (the fields named in its first cell, in backticks), the tests whose
requests carry one of those fields, found by reading the test sources (``ast``, nothing is
imported or run). ``tests/test_param_table.py`` fails when the table in the docs differs from
what this writes, or when a field of the ``openai`` SDK's request types has no row.

    python -m calexec.drivers.tools.param_table            # rewrite the column in docs/server.md
    python -m calexec.drivers.tools.param_table --check    # exit 1 if it is stale

Test files whose source never says "completions" are not read. A test "sends" a field when
its body names it: a keyword argument of an SDK call (``client.completions.create(n=2)``: any
call of an attribute named ``create``), of a client's constructor (``ChatOpenAI(max_tokens=4)``,
``OpenAI``, ``OpenAILike``; less the client's own options: ``timeout``, ``api_key``, ...) or of
``dict(...)``; a
string key of a dict literal (a JSON body, ``extra_body``); or a string of a
``@pytest.mark.parametrize`` whose argument names include ``field``; a module-level constant
the test or its parametrize names (a shared body, a list of fields) is read as if written
there. That is what the test source shows, not what went over the wire:
a field a helper adds is not seen, and a dict key that is not a request field but spells one
is counted. The column says how many tests send the field and names the first three.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

#: where the table starts (its header row, the last column written here)
HEADER_PREFIX = "| parameter | endpoints | calexec | vLLM | llama-server |"
PROOF_TITLE = "tests sending it"
HEADER = f"{HEADER_PREFIX} {PROOF_TITLE} |"
#: calls whose keyword arguments are request fields: the SDK's ``create``, the clients'
#: constructors, ``dict(...)``; less the keywords that configure the client, not the body
CLIENT_CALLS = frozenset({"create", "ChatOpenAI", "OpenAI", "OpenAILike", "dict"})
CLIENT_OPTIONS = frozenset({"timeout", "max_retries", "api_key", "base_url", "api_base",
                            "extra_body", "extra_headers", "extra_query", "stream_usage",
                            "is_chat_model", "context_window"})
#: a test file is read only if it talks to the completions endpoints (its source says so)
ENDPOINT_MARK = "completions"
SHOWN = 3
FIELD = re.compile(r"`([a-z_][a-z0-9_]*)`")


def row_fields(row: str) -> list[str]:
    """The fields a table row names: the backticked identifiers of its first cell."""
    cells = row.split("|")
    return FIELD.findall(cells[1]) if len(cells) > 2 else []


def _strings(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value


def _parametrized(decorator: ast.expr, constants: dict[str, ast.expr]) -> Iterator[str]:
    """Strings of ``@pytest.mark.parametrize(NAMES, VALUES)`` when NAMES include "field"."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == "parametrize" and len(decorator.args) >= 2):
        return
    names = " ".join(_strings(decorator.args[0]))
    if "field" not in names:
        return
    for value in _strings(_resolved(decorator.args[1], constants)):
        yield value.rsplit(":", 1)[-1]  # "chat:echo": a field of the chat endpoint


def _resolved(node: ast.expr, constants: dict[str, ast.expr]) -> ast.expr:
    """``node`` with the module-level constants it names put in place (one level), as a list:
    ``VLLM_REFUSED + [...]`` reads the list ``VLLM_REFUSED`` holds."""
    named = [constants[sub.id] for sub in ast.walk(node)
             if isinstance(sub, ast.Name) and sub.id in constants]
    return ast.List(elts=[node, *named], ctx=ast.Load())


def _sent(function: ast.FunctionDef, constants: dict[str, ast.expr]) -> set[str]:
    names: set[str] = set()
    for decorator in function.decorator_list:
        names.update(_parametrized(decorator, constants))
    for node in ast.walk(_resolved(function, constants)):  # type: ignore[arg-type]
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else ""
            if called in CLIENT_CALLS:
                names.update(k.arg for k in node.keywords
                             if k.arg and (called == "dict" or k.arg not in CLIENT_OPTIONS))
        elif isinstance(node, ast.Dict):
            names.update(k.value for k in node.keys
                         if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return names


def tests_sending(tests_dir: Path, fields: set[str]) -> dict[str, list[str]]:
    """field -> the ids (``file::test``) of the tests that send it, sorted."""
    found: dict[str, list[str]] = {field: [] for field in fields}
    for path in sorted(tests_dir.glob("test_*.py")):
        source = path.read_text(encoding="utf-8")
        if ENDPOINT_MARK not in source:
            continue
        tree = ast.parse(source, str(path))
        constants = {target.id: node.value for node in tree.body
                     if isinstance(node, ast.Assign) for target in node.targets
                     if isinstance(target, ast.Name)}
        functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
        for klass in (node for node in tree.body if isinstance(node, ast.ClassDef)):
            functions += [node for node in klass.body if isinstance(node, ast.FunctionDef)]
        for function in functions:
            if not function.name.startswith("test_"):
                continue
            for field in _sent(function, constants) & fields:
                found[field].append(f"{path.name}::{function.name}")
    return {field: sorted(ids) for field, ids in found.items()}


def proof_cell(fields: list[str], sending: dict[str, list[str]]) -> str:
    if not fields:
        return "-"
    ids = sorted({test for field in fields for test in sending.get(field, [])})
    if not ids:
        return "**none**"
    shown = ", ".join(f"`{test}`" for test in ids[:SHOWN])
    cell = f"{len(ids)}: {shown}" + (", ..." if len(ids) > SHOWN else "")
    unsent = [field for field in fields if not sending.get(field)]
    if unsent:
        cell += "; **none** for " + ", ".join(f"`{field}`" for field in unsent)
    return cell


def table_span(lines: list[str]) -> tuple[int, int]:
    """Indices [start, end) of the table's lines (header to the last row)."""
    start = next((i for i, line in enumerate(lines) if line.startswith(HEADER_PREFIX)), None)
    if start is None:
        raise ValueError(f"no parameter table: no line starts with {HEADER_PREFIX!r}")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def render(doc: str, tests_dir: Path) -> str:
    """``doc`` with the table's last column written from ``tests_dir``."""
    lines = doc.split("\n")
    start, end = table_span(lines)
    cut = [_without_proof(row) for row in lines[start + 2:end]]
    seen: dict[str, int] = {}
    for i, row in enumerate(cut):  # a row pasted twice reads as two rules for its fields
        first = seen.setdefault(row, i)
        if first != i:
            raise ValueError(f"the table's rows {first + 1} and {i + 1} are the same row "
                             f"({row[:60]}...): keep one")
    fields = {field for row in cut for field in row_fields(row)}
    sending = tests_sending(tests_dir, fields)
    body = [f"{row} {proof_cell(row_fields(row), sending)} |" for row in cut]
    table = [HEADER, "| --- | --- | --- | --- | --- | --- |", *body]
    return "\n".join(lines[:start] + table + lines[end:])


def _without_proof(row: str) -> str:
    """A row as the five hand-written cells (its generated sixth cell dropped)."""
    cells = _cells(row)
    return "| " + " | ".join(cells[:5]) + " |"


def _cells(row: str) -> list[str]:
    """The cells of a Markdown table row; a ``|`` inside backticks belongs to its cell."""
    cells, current, quoted = [], "", False
    for char in row.strip()[1:]:
        if char == "`":
            quoted = not quoted
        if char == "|" and not quoted:
            cells.append(current.strip())
            current = ""
        else:
            current += char
    return cells


def documented_fields(doc: str) -> set[str]:
    """Every field the table names."""
    lines = doc.split("\n")
    start, end = table_span(lines)
    return {field for row in lines[start + 2:end] for field in row_fields(row)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calexec.drivers.tools.param_table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=".", help="the repository (default: .)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/server.md's table is stale, write nothing")
    args = parser.parse_args(argv)
    root = Path(args.root)
    doc_path, tests_dir = root / "docs" / "server.md", root / "tests"
    if not doc_path.is_file() or not tests_dir.is_dir():
        print(f"--root={args.root!r}: needs docs/server.md and tests/ under it",
              file=sys.stderr)
        return 2
    doc = doc_path.read_text(encoding="utf-8")
    try:
        fresh = render(doc, tests_dir)
    except ValueError as exc:
        print(f"{doc_path}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if fresh != doc:
            print(f"{doc_path}: the parameter table is stale: run "
                  "python -m calexec.drivers.tools.param_table", file=sys.stderr)
            return 1
        return 0
    doc_path.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
