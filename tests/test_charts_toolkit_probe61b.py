"""Stop 61, second toolkit probe: a guard no instance can parse refused alike by every tool;
mutant ids of guard expressions; a newcomer's car-park barrier (a parallel barrier/payment
lane beside a compound ``fault`` state with a deep history) through the toolkit's commands."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from calexec.cli import main as cli
from calexec.machines.compiled import compiled
from calexec.machines.inspector import Inspector
from calexec.machines.mutants import derive

BROKEN = '''
from statemachine import State, StateChart


class Broken(StateChart):
    idle = State(initial=True)
    busy = State()
    go = idle.to(busy, cond="has_job and")
    back = busy.to(idle, unless="user.age")
'''


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> ModuleType:
    """``source`` as a module of a name of its own (the import is cached), the commands run
    from its directory."""
    name = f"park_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


GUARD = ("Broken: guard 'has_job and' (cond) on transition idle --go--> busy is no boolean "
         "expression python-statemachine reads (invalid syntax): every instance of Broken "
         "fails (InvalidDefinition)")
UNLESS = ("guard 'user.age' (unless) on transition busy --back--> idle is no boolean "
          "expression python-statemachine reads")


@pytest.mark.parametrize("command", [
    ["charts", "draw", "{ref}"],
    ["charts", "paths", "{ref}"],
    ["charts", "cover", "--chart", "{ref}", "--", sys.executable, "-c", "pass"],
    ["charts", "mutate", "--chart", "{ref}", "--test-cmd", f"{sys.executable} -c pass"],
])
def test_a_guard_no_instance_can_parse_is_refused_alike_by_every_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        command: list[str]) -> None:
    """Found at stop 61: ``cond="has_job and"`` (python-statemachine takes the class and
    refuses every instance, ``InvalidDefinition``) was drawn as written by ``charts draw``,
    counted by ``cover`` and mutated by ``mutate`` without a word, while ``paths`` refused it
    as a guard it cannot set. Every command now refuses it the same way, exit 2, one line
    naming the chart, the transition and the text."""
    module = _module(tmp_path, monkeypatch, BROKEN)
    ref = f"{module.__name__}:Broken"
    assert cli([part.format(ref=ref) for part in command]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert GUARD in lines[0] and UNLESS in lines[0], lines[0]
    assert not (tmp_path / "diagrams").exists()


def test_a_guard_no_instance_can_parse_is_refused_by_the_api_and_the_inspector(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same refusal from the public API: compiling, deriving mutants, registering the
    chart with the live inspector (which took it: its page drew the chart)."""
    chart = _module(tmp_path, monkeypatch, BROKEN).Broken
    for attempt in (lambda: compiled(chart), lambda: derive(chart),
                    lambda: Inspector().register(chart, counts=dict)):
        with pytest.raises(ValueError, match=r"guard 'has_job and' \(cond\) on transition"):
            attempt()
