"""``drivers/tools/bench/hostload.py`` (issue 28): what the host did beside a benchmark, from
``/proc/stat`` and ``/proc/loadavg`` (fake files here: the arithmetic, not this host), and
its place in the reports of ``bench overhead`` and ``bench server``. No timing figure."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from calexec.drivers.tools.bench import hostload


def _stat(path: Path, user: int, idle: int, steal: int, iowait: int = 0) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {user} 0 0 {idle} {iowait} 0 0 {steal} 0 0\n"
                    f"cpu0 {user} 0 0 {idle} {iowait} 0 0 {steal} 0 0\nintr 1 2 3\n")


def test_steal_busy_and_others_are_shares_of_the_span(tmp_path):
    stat, load, idle_driver = tmp_path / "stat", tmp_path / "loadavg", tmp_path / "driver"
    _stat(stat, user=1000, idle=5000, steal=100, iowait=50)
    load.write_text("0.50 0.40 0.30 1/100 4242\n")
    idle_driver.write_text("none\n")
    meter = hostload.HostMeter(stat, load, idle_driver, cpus=2).start()
    # over the span: 600 ticks running, 300 idle, 50 waiting for I/O, 50 stolen (of 1000)
    _stat(stat, user=1600, idle=5300, steal=150, iowait=100)
    load.write_text("1.25 0.40 0.30 1/100 4242\n")
    got = meter.report()
    assert got["available"] is True
    assert got["steal_pct"] == 5.0 and got["busy_pct"] == 60.0
    assert 0.0 <= got["own_busy_pct"] and got["others_busy_pct"] == round(
        max(0.0, 60.0 - got["own_busy_pct"]), 1)
    assert (got["loadavg_start"], got["loadavg_end"]) == (0.5, 1.25)
    assert got["cpuidle_driver"] == "none" and got["cpus"] == 2


def test_an_old_kernel_without_a_steal_column_counts_none_stolen(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 0 90\n")
    meter = hostload.HostMeter(stat, tmp_path / "none", tmp_path / "none", cpus=1).start()
    stat.write_text("cpu  20 0 0 100\n")
    got = meter.report()
    assert got["available"] and got["steal_pct"] == 0.0 and got["busy_pct"] == 50.0
    assert got["loadavg_start"] is None and got["cpuidle_driver"] is None


def test_no_proc_says_why_instead_of_a_figure(tmp_path):
    missing = tmp_path / "missing"
    got = hostload.HostMeter(missing, missing, missing).start().report()
    assert got["available"] is False and str(missing) in got["reason"]
    assert "steal_pct" not in got


def test_garbage_or_no_time_passed_is_not_a_figure(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  x y z\n")
    assert hostload.read_cpu_ticks(stat) is None
    _stat(stat, user=1, idle=1, steal=0)
    meter = hostload.HostMeter(stat, tmp_path / "l", tmp_path / "d").start()
    got = meter.report()  # the same ticks: no CPU time passed
    assert got["available"] is False and "no CPU time" in got["reason"]


def _pid(proc: Path, pid: int, ppid: int, ticks: int, comm: str = "bench (x) y") -> None:
    """A fake ``proc/pid/stat``: ``ticks`` of user time (a comm with spaces and parentheses,
    as a real one may have)."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(
        f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0 1 0 1 1 1\n")


def _span(tmp_path: Path, steal: int, user: int = 0, own: int = 0) -> dict:
    """A report over 1,000 ticks: ``steal`` stolen, ``user`` running (``own`` of them the
    benchmark's process tree's: its root, pid 100, and a child of it), the rest idle."""
    stat, proc = tmp_path / "stat", tmp_path / "proc"
    _stat(stat, user=0, idle=0, steal=0)
    _pid(proc, 100, 1, 0)
    _pid(proc, 101, 100, 0)
    meter = hostload.HostMeter(stat, tmp_path / "l", tmp_path / "d", cpus=2, proc=proc,
                               pid=100).start()
    _stat(stat, user=user, idle=1000 - steal - user, steal=steal)
    _pid(proc, 101, 100, own)
    return meter.report()


def test_a_span_with_cpu_stolen_is_not_quiet_and_the_benches_say_so(tmp_path):
    """A ratio from a span whose CPU the hypervisor took (13-20 % at stop 42) moved more with
    the steal than with the change it measured; the report says whether the span was quiet,
    and the benches print why not on stderr (``noise_line``)."""
    quiet = _span(tmp_path, steal=10)  # 1 %: at the bound's side
    assert quiet["quiet"] is True and quiet["noise"] is None
    assert hostload.noise_line(quiet) is None
    stolen = _span(tmp_path, steal=130)
    assert stolen["quiet"] is False and stolen["noise"] == "steal 13 % > 2 %"
    line = hostload.noise_line(stolen)
    assert line is not None and "not a quiet host (steal 13 % > 2 %" in line
    assert "not a gate figure" in line


def test_other_processes_make_a_span_noisy_the_benchmarks_own_do_not(tmp_path):
    """Other processes' CPU (a test suite beside the run) is noise; the CPU of the processes
    the benchmark started (its process tree: ``bench server``'s load generator, the C floor)
    is its own. Until stop 63 ``bench server`` could not tell them apart and counted no other
    process at all."""
    busy = _span(tmp_path, steal=0, user=400)  # 40 % busy, none of it the benchmark's
    assert busy["quiet"] is False and busy["noise"].startswith("other processes 40 %")
    assert busy["others_busy_pct"] == 40.0 and busy["own_busy_pct"] == 0.0
    mine = _span(tmp_path, steal=0, user=400, own=400)  # all of it the benchmark's child's
    assert mine["quiet"] is True and mine["others_busy_pct"] == 0.0
    assert mine["own_busy_pct"] == 40.0 and mine["own_processes"] == 2
    both = _span(tmp_path, steal=300, user=400, own=100)
    assert both["noise"] == "steal 30 % > 2 %; other processes 30 % > 5 %"


def test_the_process_tree_is_the_root_and_its_descendants_only(tmp_path):
    proc = tmp_path / "proc"
    _pid(proc, 100, 1, 5)  # the root
    _pid(proc, 101, 100, 7)  # its child
    _pid(proc, 102, 101, 11, comm="cc1) S 100 (")  # a grandchild; a comm meant to mislead
    _pid(proc, 200, 1, 1000)  # someone else's
    _pid(proc, 201, 200, 1000)
    (proc / "self").mkdir()  # (not a pid)
    assert hostload.read_tree_ticks(100, proc) == (23, 3)
    assert hostload.read_tree_ticks(101, proc) == (18, 2)
    assert hostload.read_tree_ticks(999, proc) is None
    assert hostload.read_tree_ticks(100, tmp_path / "none") is None


#: burns ``argv[3]`` s of its own CPU (0: until ``argv[1]`` exists), at most 60 s of wall
#: time, then writes the CPU it used to ``argv[2]``
BURNER = """
import os, sys, time
stop, done, cpu = sys.argv[1], sys.argv[2], float(sys.argv[3])
end = time.monotonic() + 60.0
while time.monotonic() < end and not os.path.exists(stop) and (
        cpu <= 0 or time.process_time() < cpu):
    sum(range(1000))
with open(done + ".tmp", "w") as f:
    f.write(str(time.process_time()))
os.replace(done + ".tmp", done)
"""


def _burner_args(tmp_path: Path, cpu_s: float) -> tuple[list[str], Path, Path]:
    stop, done = tmp_path / "stop", tmp_path / "done"
    return [sys.executable, "-c", BURNER, str(stop), str(done), str(cpu_s)], stop, done


def _start_stranger(tmp_path: Path, cpu_s: float) -> tuple[Path, Path]:
    """A CPU burner that is NOT in this process's tree: started by a short-lived middle
    process that exits at once, so the burner is re-parented away from this one."""
    argv, stop, done = _burner_args(tmp_path, cpu_s)
    subprocess.run([sys.executable, "-c",
                    "import subprocess, sys; subprocess.Popen(sys.argv[1:], "
                    "start_new_session=True)", *argv], check=True, timeout=60)
    return stop, done


def _wait_for(path: Path) -> float:
    for _ in range(1200):  # (bounded: 60 s; the burner stops itself by then)
        if path.exists():
            return float(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def test_a_process_outside_the_benchmark_burning_cpu_is_others_not_its_own(tmp_path):
    meter = hostload.HostMeter().start()
    _stop, done = _start_stranger(tmp_path, 0.3)
    burned = _wait_for(done)
    got = meter.report()
    assert burned >= 0.3
    assert got["quiet"] is False and got["others_busy_pct"] > 0
    assert "other processes" in got["noise"]
    assert got["own_cpu_s"] < burned  # the burner's CPU is not the benchmark's


def test_the_benchmarks_own_child_burning_cpu_is_its_own_share(tmp_path):
    """A child of the benchmark (as its load generator is) is counted in ``own_cpu_s`` while
    it runs and after it was waited for, so it is never the others'."""
    argv, _stop, done = _burner_args(tmp_path, 0.3)
    meter = hostload.HostMeter().start()
    child = subprocess.Popen(argv)
    try:
        burned = _wait_for(done)
        live = meter.report()  # the child may still be running: counted from /proc/<pid>
    finally:
        child.wait(timeout=60)
    reaped = meter.report()  # waited for: counted in this process's cutime
    assert burned >= 0.3
    # (whole ticks of 1/CLK_TCK s each: the child's last tick may not be in the first figure)
    assert live["own_cpu_s"] >= burned - 0.05 and reaped["own_cpu_s"] >= burned - 0.05
    assert "process tree" in reaped["own_scope"]


def test_bench_server_counts_other_work_beside_its_load_generator(tmp_path, capsys):
    """The stop-63 defect: ``bench server`` (load generator in a process of its own) said
    ``host.quiet: true`` while another process burned a core beside it, because it did not
    count other processes at all (it could not tell them from its load generator)."""
    from calexec.drivers.tools.bench import server_overhead as bench_server

    stop, done = _start_stranger(tmp_path, 0.0)  # burns until told to stop (60 s at most)
    try:
        assert bench_server.main(["bench", "server", "--json", "--requests", "2",
                                  "--max-tokens", "2", "--decode-us", "0", "--concurrency",
                                  "1", "--rounds", "1", "--no-stream"]) == 0
    finally:
        stop.write_text("")
        _wait_for(done)
    out, err = capsys.readouterr()
    host = json.loads(out)["host"]
    assert host["quiet"] is False and host["others_busy_pct"] > 0
    assert "other processes" in host["noise"] and "not a quiet host" in err


def test_an_unknown_host_load_is_said_too(tmp_path):
    missing = tmp_path / "missing"
    line = hostload.noise_line(hostload.HostMeter(missing, missing, missing).start().report())
    assert line is not None and "host load unknown" in line and str(missing) in line


def test_gate_verdicts_say_they_are_one_runs_and_whether_the_host_counts():
    """``bench overhead``'s ``gate_met`` is one run's verdict; the project's rule takes two
    consecutive runs on a quiet 2-core host. Until stop 63 the report printed "met" from a
    loaded host or another core count without a word: now ``gate_scope`` and a stderr line
    say what the verdict is worth."""
    quiet = {"available": True, "quiet": True}
    scope, line = hostload.gate_scope(quiet, 2)
    assert scope["runs"] == 1 and scope["counts_toward_gate"] is True and line is None
    assert "two consecutive runs" in scope["rule"] and scope["gate_cpus"] == 2
    scope, line = hostload.gate_scope(quiet, 8)  # a faster host's verdict is not the gate's
    assert scope["counts_toward_gate"] is False and "8 cores" in line
    scope, line = hostload.gate_scope({"available": True, "quiet": False}, 2)
    assert scope["counts_toward_gate"] is False and scope["host_quiet"] is False
    assert "not quiet" in line and "does not count toward a gate" in line
    scope, line = hostload.gate_scope({"available": False, "reason": "no /proc"}, 2)
    assert scope["host_quiet"] is None and "unknown" in line
