"""Spec §9.1 / issue 13: the reset an executor may use on an external runtime library.

With ``--runtime-lib`` (or ``$CALEXEC_CALRT_LIB``) the reset kind comes from ``--reset-kind``
or from a ``calexec conform`` report's verdicts; with neither it is ``none``, so a device fault
that needs a reset ends the lifecycle Failed and ``calexec serve`` exits 3 for its supervisor.
The bundled emulator keeps its known-safe ``reset``.

The "external" library is the bundled emulator built as ``libcalrt_emu.so`` and dlopen'ed, as
a vendor shim would be; its emulator controls inject the device fault."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.types import TaskKind
from calexec.drivers.calrt.runtime import ENV_LIB, Fault, FaultMode
from calexec.drivers.device_spec import DeviceSpec, DeviceSpecError
from calexec.drivers.synthetic import calbin
from calexec.drivers.tools.conform import runner
from calexec.drivers.tools.conform.experiment_rig import build_emulator_lib
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from test_server_support import wait_for

#: a device config under which no reset of the emulator aborts the jobs on the device
UNSAFE_RESETS = "reset_ccu_scope=2;reset_config_scope=4;reset_scope=6"


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> str:
    return build_emulator_lib(str(tmp_path_factory.mktemp("ext-lib")))


@pytest.fixture(scope="module")
def reports(lib, tmp_path_factory) -> dict[str, str]:
    """Real conformance reports of the external library: its resets proven safe, and (under
    UNSAFE_RESETS) none proven."""
    out = {}
    for name, config in (("safe", ""), ("unsafe", UNSAFE_RESETS)):
        run = runner.run(lib, config=config, quick=True, only=("reset",))
        out[name] = str(tmp_path_factory.mktemp(f"report-{name}"))
        runner.write_report(run, out[name])
    return out


# ---- resolution --------------------------------------------------------------------------------
def test_bundled_emulator_keeps_its_known_safe_reset(monkeypatch):
    monkeypatch.delenv(ENV_LIB, raising=False)
    kind, why = DeviceSpec().reset()
    assert kind == "reset" and "bundled" in why
    assert DeviceSpec().recovery(max_recoveries=3).reset_kind == "reset"


def test_external_library_without_flag_or_report_gets_none(lib, monkeypatch):
    monkeypatch.delenv(ENV_LIB, raising=False)
    kind, why = DeviceSpec(runtime_lib=lib).reset()
    assert kind == "none" and "§9.1" in why
    monkeypatch.setenv(ENV_LIB, lib)  # the environment variable is an external library too
    assert DeviceSpec().reset()[0] == "none"
    assert DeviceSpec().recovery().reset_kind == "none"


@pytest.mark.parametrize("kind", ["reset", "reset_ccu", "reset_configuration", "none"])
def test_explicit_reset_kind_wins(lib, kind):
    assert DeviceSpec(runtime_lib=lib, reset_kind=kind).reset() == (kind, f"--reset-kind={kind}")


def test_conform_report_verdicts_give_the_reset_kind(lib, reports):
    kind, why = DeviceSpec(runtime_lib=lib, conform_report=reports["safe"]).reset()
    assert kind == "reset_ccu" and "conformance.json" in why  # the weakest one proven safe
    file = f"{reports['unsafe']}/conformance.json"
    assert DeviceSpec(runtime_lib=lib, conform_report=file).reset()[0] == "none"


def test_unusable_reports_are_refused_naming_the_file(lib, tmp_path, reports):
    (tmp_path / "conformance.json").write_text("{not json")
    with pytest.raises(DeviceSpecError, match="invalid JSON"):
        DeviceSpec(runtime_lib=lib, conform_report=str(tmp_path)).reset()
    (tmp_path / "conformance.json").write_text(json.dumps({"runtime": "x"}))
    with pytest.raises(DeviceSpecError, match="no 'questions' list"):
        DeviceSpec(runtime_lib=lib, conform_report=str(tmp_path)).reset()
    bundled = json.loads(open(f"{reports['safe']}/conformance.json").read())
    bundled["bundled"] = True
    (tmp_path / "conformance.json").write_text(json.dumps(bundled))
    with pytest.raises(DeviceSpecError, match="of the bundled emulator"):
        DeviceSpec(runtime_lib=lib, conform_report=str(tmp_path)).reset()
    with pytest.raises(DeviceSpecError, match="not both"):
        DeviceSpec(runtime_lib=lib, reset_kind="reset", conform_report=reports["safe"]).check()


# ---- the executor: a fault that needs a reset -------------------------------------------------
def _fault_once(spec: DeviceSpec, tmp_path) -> DeviceExecutor:
    """Start an executor of ``spec``, then make its next job end with a CCU exception (a
    device fault whose recovery needs a reset) and wait until the recovery has decided."""
    path = spec.calbin(str(tmp_path))
    ex = DeviceExecutor(spec.runtime(), spec.manifest(),
                        ExecutorConfig(calbin_path=path, recovery=spec.recovery()))
    status = ex.start()
    assert status.ok, status
    assert ex.device.emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0) == 0
    request = InferenceRequest(seq_id=1, kind=TaskKind.PREFILL_IDS,
                               tokens=np.array([5, 6, 7], dtype=np.int32),
                               positions=np.arange(3, dtype=np.int32), past_len=0,
                               deadline=time.monotonic() + 10.0)
    ex.enqueue(request).wait_until(request.deadline)
    wait_for(lambda: ex.recoveries, timeout=20, what="the recovery after the CCU exception")
    return ex


def test_external_library_without_a_known_reset_ends_failed(lib, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_LIB, raising=False)
    ex = _fault_once(DeviceSpec(runtime_lib=lib), tmp_path)
    try:
        assert ex.config.recovery.reset_kind == "none"
        assert ex.state == "Failed"
        assert ex.recoveries[-1]["status"] == "recovery.no_safe_reset"
    finally:
        ex.shutdown(5.0)


@pytest.mark.parametrize("source", ["flag", "report"])
def test_external_library_with_a_known_reset_recovers(lib, reports, tmp_path, source,
                                                      monkeypatch):
    monkeypatch.delenv(ENV_LIB, raising=False)
    spec = (DeviceSpec(runtime_lib=lib, reset_kind="reset") if source == "flag" else
            DeviceSpec(runtime_lib=lib, conform_report=reports["safe"]))
    ex = _fault_once(spec, tmp_path)
    try:
        wait_for(lambda: ex.state == "Ready" and ex.gen is not None and ex.gen.id == 2,
                 timeout=20, what="Ready on generation 2")
        assert ex.recoveries[-1]["ok"] and ex.recoveries[-1]["reset_kind"] == spec.reset()[0]
    finally:
        ex.shutdown(5.0)


def test_bundled_emulator_recovers_with_its_reset(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_LIB, raising=False)
    ex = _fault_once(DeviceSpec(), tmp_path)
    try:
        wait_for(lambda: ex.state == "Ready" and ex.gen is not None and ex.gen.id == 2,
                 timeout=20, what="Ready on generation 2")
        assert ex.recoveries[-1]["reset_kind"] == "reset"
    finally:
        ex.shutdown(5.0)


# ---- calexec serve: exits for its supervisor when the lifecycle is Failed ---------------------
FAULT_AFTER_START = """
import calexec.serve as serve
from calexec.drivers.calrt.runtime import Fault, FaultMode

class FaultAfterStart(serve.DeviceExecutor):
    def start(self):
        status = super().start()
        if status.ok:  # the --once sample request's first job ends with a CCU exception
            assert self.device.emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0) == 0
        return status

serve.DeviceExecutor = FaultAfterStart
"""


def serve_once(*flags: str) -> subprocess.CompletedProcess:
    code = (f"{FAULT_AFTER_START}\nimport sys\nfrom calexec.cli import main\n"
            f"sys.exit(main({['serve', '--once', '--grace', '5', *flags]!r}))")
    env = {k: v for k, v in __import__("os").environ.items() if k != ENV_LIB}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_serve_exits_3_when_an_unknown_reset_leaves_the_lifecycle_failed(lib):
    done = serve_once("--runtime-lib", lib)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert "executor ended Failed" in done.stderr and "no_safe_reset" in done.stderr


@pytest.mark.parametrize("flags", [["--reset-kind", "reset_ccu"], ["--conform-report", "safe"],
                                   []])
def test_serve_recovers_with_a_known_reset(lib, reports, flags):
    """The sample request's first job faults; the device recovers with the known reset and
    the request resumes on the new generation (issue 16: it used to fail, exit 4): exit 0."""
    flags = [reports.get(f, f) for f in flags]
    done = serve_once(*(["--runtime-lib", lib] if flags else []), *flags)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "DONE_CCU_EXCEPTION" in done.stderr and "reset_rebuild" in done.stderr
    assert "executor ended" not in done.stderr and "drained: executor Stopped" in done.stdout


def test_serve_with_an_unsafe_report_exits_3(lib, reports):
    done = serve_once("--runtime-lib", lib, "--conform-report", reports["unsafe"])
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])


def test_calbin_written_for_the_spec_is_the_synthetic_one(tmp_path):
    path = DeviceSpec().calbin(str(tmp_path))
    assert calbin.read(path).seed == calbin.DEFAULT_SEED
    assert DeviceSpec(calbin_path="/x.calbin").calbin(str(tmp_path)) == "/x.calbin"
