"""``calexec bench server`` with its load generator out of process (issue 28): the report's
shape per level and side, where the load generator ran, bad flags, and the load generator's
own refusals. Tiny sizes; no timing threshold: benchmarks report numbers, tests don't."""

from __future__ import annotations

import json
import math

import pytest

from calexec.drivers.tools.bench import loadgen
from calexec.drivers.tools.bench import server_overhead as bench_server


def test_thread_loadgen_without_streaming(capsys):
    assert bench_server.main(["bench", "server", "--json", "--requests", "2", "--max-tokens",
                              "2", "--decode-us", "0", "--concurrency", "3",
                              "--loadgen", "thread", "--no-stream"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["loadgen"], report["stream"], report["levels"]) == ("thread", False, [3])
    assert report["requests"] == 2 and set(k for k in report if k.startswith("c")) == {"c3"}
    level = report["c3"]
    assert "server_stream" not in level and "stream_throughput_ratio" not in level
    for side in ("direct", "server", "server_no_ahead", "server_always_prearm",
                 "server_no_bursts", "server_thread_waits", "http_floor"):
        assert set(level[side]) == {"req_per_s", "p50_ms", "p99_ms"}
        assert all(math.isfinite(v) and v > 0 for v in level[side].values())
        assert level[side]["p50_ms"] <= level[side]["p99_ms"]
    assert level["throughput_ratio"] == pytest.approx(
        level["server"]["req_per_s"] / level["direct"]["req_per_s"], abs=0.002)
    floor, direct = level["http_floor"]["req_per_s"], level["direct"]["req_per_s"]
    assert level["http_floor_ratio_bound"] == pytest.approx(floor / (floor + direct), abs=0.002)
    assert level["prearm_policy_throughput_ratio"] == pytest.approx(
        level["server"]["req_per_s"] / level["server_always_prearm"]["req_per_s"], abs=0.002)
    assert level["burst_throughput_ratio"] == pytest.approx(
        level["server"]["req_per_s"] / level["server_no_bursts"]["req_per_s"], abs=0.002)
    assert level["inline_throughput_ratio"] == pytest.approx(
        level["server_no_bursts"]["req_per_s"] / level["server_thread_waits"]["req_per_s"],
        abs=0.002)


def test_default_levels_are_1_8_64():
    assert bench_server.DEFAULT_LEVELS == (1, 8, 64)
    assert bench_server.concurrency_levels("8, 1,8") == [8, 1]


@pytest.mark.parametrize(("argv", "named"), [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "1,x"], "'x'"),
    (["--concurrency", "1000"], "1000"),
    (["--loadgen", "elsewhere"], "elsewhere"),
    (["--requests", "0"], "--requests"),
])
def test_bad_flags_exit_2_naming_them(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_server.main(["bench", "server", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err


def test_loadgen_refuses_a_non_loopback_url(capsys):
    # refused before any client exists: nothing is sent anywhere
    assert loadgen.main(["--url", "http://example.invalid:8000", "--requests", "1",
                         "--concurrency", "1", "--max-tokens", "1"]) == 1
    assert "loopback" in capsys.readouterr().err


def test_loadgen_bad_argument_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        loadgen.main(["--url", "http://127.0.0.1:1", "--requests", "0", "--concurrency", "1",
                      "--max-tokens", "1"])
    assert exc.value.code == 2
    assert "--requests" in capsys.readouterr().err


def test_loadgen_reports_a_failed_request(capsys):
    # port 1 on loopback: nothing listens, the connection is refused at once
    assert loadgen.main(["--url", "http://127.0.0.1:1", "--requests", "2", "--concurrency",
                         "2", "--max-tokens", "1"]) == 1
    assert "request(s) failed" in capsys.readouterr().err
