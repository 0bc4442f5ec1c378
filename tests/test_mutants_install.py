"""A mutant named in the environment is applied however the test process imports its chart
(``calexec.machines.mutants.install_from_env``, run by the mutation runner's sitecustomize).

Found when the transition-coverage plugin became a pytest entry point: pytest then marks every
module of the calexec distribution for assertion rewriting, its import hook sits ahead of any
finder installed at start-up and claims those modules first, so a hook that waited for the
chart's import never ran: every mutant of CI's sample was reported "never applied".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHART = '''
from statemachine import State, StateMachine


class Door(StateMachine):
    closed = State(initial=True)
    opened = State(final=True)

    open = closed.to(opened, cond="unlocked")

    def unlocked(self) -> bool:
        return True
'''

# A finder inserted after start-up that claims the chart module first, as pytest's
# assertion-rewriting hook does for the modules of a distribution providing a plugin.
SCRIPT = '''
import importlib.abc, importlib.machinery, json, sys

from calexec.machines import mutants

mutants.install_from_env()


class Claim(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "door_chart":
            return importlib.machinery.PathFinder.find_spec(name, path)
        return None


sys.meta_path.insert(0, Claim())
import door_chart
from statemachine.exceptions import TransitionNotAllowed

door = door_chart.Door()
try:
    door.send("open")
    print(json.dumps(door.current_state.id))
except TransitionNotAllowed:
    print(json.dumps("refused"))
'''


def _run(tmp_path: Path, mutant: str | None) -> tuple[str, str]:
    (tmp_path / "door_chart.py").write_text(CHART)
    ack = tmp_path / "ack"
    env = {k: v for k, v in os.environ.items()
           if k not in ("CALEXEC_CHART_MUTANT", "CALEXEC_CHART_MUTANT_ACK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    if mutant is not None:
        env["CALEXEC_CHART_MUTANT"] = f"door_chart:Door@{mutant}"
        env["CALEXEC_CHART_MUTANT_ACK"] = str(ack)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1]), ack.read_text() if ack.exists() else ""


def test_unmutated_the_guarded_transition_is_taken(tmp_path):
    assert _run(tmp_path, None) == ("opened", "")


def test_a_mutant_is_applied_when_another_finder_claims_its_module_first(tmp_path):
    mutant = "guard-false:closed-open->opened:unlocked"
    state, ack = _run(tmp_path, mutant)
    assert ack.splitlines() == [f"door_chart:Door@{mutant}"]  # the runner's proof it ran
    assert state == "refused"  # and the chart really is the mutant
