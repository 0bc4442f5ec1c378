"""Small gaps found by stop 67's probes, closed at stop 67 (docs/traceability.md, "Found at stop
67 (gaps)")."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from statemachine import State, StateMachine

from calexec.contracts.status import Status
from calexec.drivers.calrt.runtime import CalRT
from calexec.machines.chart_contracts import ContractViolation, enable_contracts, invariant
from calexec.machines.chartref import load_chart
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.faults import RecordingFaultSink
from executor_harness import MANIFEST, arm, deadline, decode, fired, greedy, settle, write_calbin

PRET = '''
from statemachine import State, StateChart


class Prêt(StateChart):
    rangé = State(initial=True)
    perdu = State(final=True)

    perdre = rangé.to(perdu)
'''


def test_a_non_ascii_class_name_is_found_whatever_the_locale_decoded_it_as(tmp_path):
    """``pret:Prêt`` decoded under an ASCII locale (surrogateescape: 'Pr\\udcc3\\udcaat') was
    "module 'pret' has no attribute": the class part is now taken as its UTF-8 bytes."""
    (tmp_path / "pret.py").write_text(PRET, encoding="utf-8")
    escaped = "pret:" + "Prêt".encode().decode("ascii", "surrogateescape")
    assert load_chart(escaped, str(tmp_path)).__name__ == "Prêt"


def test_charts_paths_of_a_non_ascii_class_runs_under_an_ascii_locale(tmp_path):
    """``LC_ALL=C PYTHONUTF8=0 calexec charts paths pret:Prêt`` was exit 2, "has no
    attribute 'Pr\\udcc3\\udcaat'" (every chart command: they share ``load_chart``)."""
    (tmp_path / "pret.py").write_text(PRET, encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    code = ("import sys; from calexec.cli import main\n"
            "assert sys.getfilesystemencoding() == 'ascii', sys.getfilesystemencoding()\n"
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "charts", "paths", "pret:Prêt"],
                          cwd=tmp_path, env=env, capture_output=True, timeout=120)
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 0, err
    assert b"perdre" in done.stdout, done.stdout


class Bare(StateMachine):
    """A chart that declares no contract."""

    off = State(initial=True)
    on = State()
    flip = off.to(on) | on.to(off)


class Checked(StateMachine):
    """A chart whose invariant every run breaks on entering ``on``."""

    off = State(initial=True)
    on = State()
    flip = off.to(on) | on.to(off)

    @invariant("on")
    def never_on(model: object) -> bool:
        return False


def test_enable_contracts_of_a_chart_declaring_none_is_refused_naming_it() -> None:
    """``enable_contracts(Bare)`` of a chart with no contract returned a monitor that checked
    nothing, silently (docs/framework.md "Contracts on a chart"); it is now a ``ValueError``
    naming the chart, as ``--chart-contracts`` and the explorer's ``charts`` refuse it, and a
    refusal leaves no chart given with it enabled."""
    with pytest.raises(ValueError, match=r"^enable_contracts\(Bare\): Bare declares no "
                                         r"contracts, so none would be checked \(declare them"):
        enable_contracts(Bare)
    with pytest.raises(ValueError, match="Bare declares no contracts"):
        enable_contracts(Checked, Bare)
    Checked().send("flip")  # (Checked was not enabled by the refused call: no violation)
    monitor = enable_contracts()  # no chart: a monitor checking nothing, as the explorer asks
    monitor.disable()
    monitor = enable_contracts(Checked)  # the control: a chart with a contract is checked
    try:
        with pytest.raises(ContractViolation, match="never_on"):
            Checked().send("flip")
    finally:
        monitor.disable()


class _WithoutFusedPostprocess:
    """``CalRT`` without its fused native logits postprocess: the runtime protocol's switch
    (``logits_postprocessor`` is optional; a runtime without it gets the numpy path)."""

    def __init__(self, runtime: CalRT) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> object:
        if name == "logits_postprocessor":
            raise AttributeError(name)
        return getattr(self._runtime, name)


PROMPT = [11, 22, 33, 44, 55, 66, 77]


def _fi10(calbin: str, runtime: object, point: str) -> Status:
    ex = DeviceExecutor(runtime, MANIFEST, ExecutorConfig(calbin_path=calbin),  # type: ignore[arg-type]
                        fault_sink=RecordingFaultSink())
    assert ex.start().ok
    try:
        # (the switch took: a runtime without it, the numpy path)
        assert (ex.completion.fused_logits is None) == isinstance(runtime, _WithoutFusedPostprocess)
        greedy(ex, 1, PROMPT, 0)
        arm(ex, point)
        out = np.full(151936 + 64, 7.0, dtype=np.float32)
        res = ex.enqueue(decode(1, 5, len(PROMPT)), logits_out=out).wait_until(deadline())
        settle(ex)
        assert fired(ex, point) == 1
        assert np.all(out[151936:] == 7.0)  # no write past the slice
        assert isinstance(res, Status), res
        assert ex.kvc.seqs[1].unknown_reason == res.code
        return res
    finally:
        ex.shutdown(grace=5.0)


@pytest.mark.parametrize("point", ["OUTPUT_NAN", "OUTPUT_INF"])
def test_fi10_on_the_numpy_path_fails_the_job_as_the_fused_pass_does(tmp_path, point):
    """FI10 (spec §12) where the runtime offers no fused native postprocess: the executor's
    numpy path. Dropping its ``bf16_all_finite`` check passed every FI10 test (they ran the
    fused pass), and its message did not name the index the fused pass's names. The job now
    fails ``internal.output_not_finite`` with the same message on both paths."""
    calbin = write_calbin(tmp_path)
    fused = _fi10(calbin, CalRT.load(), point)
    numpy = _fi10(calbin, _WithoutFusedPostprocess(CalRT.load()), point)
    assert numpy.code == fused.code == "internal.output_not_finite", (numpy, fused)
    assert "at index" in fused.message
    assert numpy.message == fused.message
