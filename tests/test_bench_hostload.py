"""``drivers/tools/bench/hostload.py`` (issue 28): what the host did beside a benchmark, from
``/proc/stat`` and ``/proc/loadavg`` (fake files here: the arithmetic, not this host), and
its place in the reports of ``bench overhead`` and ``bench server``. No timing figure."""

from __future__ import annotations

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


def _span(tmp_path: Path, steal: int, others_expected: bool = False, user: int = 0) -> dict:
    """A report over 1,000 ticks: ``steal`` stolen, ``user`` running, the rest idle."""
    stat = tmp_path / "stat"
    _stat(stat, user=0, idle=0, steal=0)
    meter = hostload.HostMeter(stat, tmp_path / "l", tmp_path / "d", cpus=2,
                               others_expected=others_expected).start()
    time.sleep(0.2)  # (a span long enough that this process's own share is about none)
    _stat(stat, user=user, idle=1000 - steal - user, steal=steal)
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


def test_other_processes_make_a_span_noisy_unless_the_bench_runs_them(tmp_path):
    """Other processes' CPU (a test suite beside the run) is noise, except where the benchmark
    runs its own (``bench server``'s out-of-process load generator)."""
    busy = _span(tmp_path, steal=0, user=400)  # 40 % busy, this process used ~none of it
    assert busy["quiet"] is False and busy["noise"].startswith("other processes ")
    assert _span(tmp_path, steal=0, user=400, others_expected=True)["quiet"] is True
    both = _span(tmp_path, steal=300, user=400)
    assert both["noise"].startswith("steal 30 % > 2 %; other processes ")


def test_an_unknown_host_load_is_said_too(tmp_path):
    missing = tmp_path / "missing"
    line = hostload.noise_line(hostload.HostMeter(missing, missing, missing).start().report())
    assert line is not None and "host load unknown" in line and str(missing) in line
