"""``calexec bench server`` with its load generator out of process (issue 28): the report's
shape per level and side, where the load generator ran, bad flags, and the load generator's
own refusals. Tiny sizes; no timing threshold: benchmarks report numbers, tests don't."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from calexec.drivers.tools.bench import loadgen
from calexec.drivers.tools.bench import server_overhead as bench_server


def test_thread_loadgen_without_streaming(capsys):
    assert bench_server.main(["bench", "server", "--json", "--requests", "2", "--max-tokens",
                              "2", "--decode-us", "0", "--concurrency", "3",
                              "--loadgen", "thread", "--no-stream"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["loadgen"], report["stream"], report["levels"]) == ("thread", False, [3])
    assert report["loadgen_client"] == "stdlib"
    assert report["requests"] == 2 and {k for k in report if re.fullmatch(r"c\d+", k)} == {"c3"}
    level = report["c3"]
    assert "server_stream" not in level and "stream_throughput_ratio" not in level
    for side in ("direct", "server", "server_no_ahead", "server_always_prearm",
                 "server_no_bursts", "server_thread_waits", "http_floor"):
        # the compared sides also carry their CPU per request (this process's), in all and
        # per thread role (Linux: /proc), with the threads that ended inside their blocks
        cpu = ({"cpu_ms_per_request", "cpu_ms_per_request_by_thread", "threads_ended"}
               if side in ("direct", "server") else set())
        assert set(level[side]) == {"req_per_s", "p50_ms", "p99_ms", *cpu}
        assert all(math.isfinite(v) and v > 0 for k, v in level[side].items()
                   if k not in ("cpu_ms_per_request_by_thread", "threads_ended"))
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
    assert level["cpu_per_request_ratio"] == pytest.approx(
        level["server"]["cpu_ms_per_request"] / level["direct"]["cpu_ms_per_request"],
        abs=0.002)
    # per thread role: the direct side's load workers (told by themselves: they end with
    # their block), the executor's threads and the emulator's engines on both sides, the
    # server's event loop on the server's (whose thread may also run a little during a
    # direct block: its timers); the difference names where the server's extra goes
    direct, server = (level[side]["cpu_ms_per_request_by_thread"] for side in ("direct",
                                                                               "server"))
    assert {"bench-load", "calexec-submitter", "calexec-completion", "calrt-emu-e0"} <= set(
        direct)
    assert {"uvicorn-server", "calexec-submitter", "calrt-emu-e0"} <= set(server)
    assert "bench-load" not in server  # its workers exist only in the direct side's blocks
    extra = level["server_minus_direct_cpu_ms_by_thread"]
    assert set(extra) == set(direct) | set(server)
    assert extra["bench-load"] == -direct["bench-load"]
    assert extra["uvicorn-server"] == round(server["uvicorn-server"]
                                            - direct.get("uvicorn-server", 0.0), 3)
    assert list(extra.values()) == sorted(extra.values(), reverse=True)
    assert "load generator" in report["process_cpu_scope"]  # its threads run in this process
    assert report["native_relay"] is False and report["relay_submitted"] == 0


def test_native_relay_runs_both_sides_on_the_relay_executor(capsys):
    """``--native-relay``: the executor both sides use runs its submitter on the relay, and
    at a 2 ms decode the server's fired steps went to infer() from it (the report says how
    many). Figures are reported, never asserted."""
    assert bench_server.main(["bench", "server", "--json", "--requests", "2", "--max-tokens",
                              "4", "--decode-us", "2000", "--concurrency", "1",
                              "--loadgen", "thread", "--no-stream", "--rounds", "1",
                              "--native-relay"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["native_relay"] is True and report["relay_submitted"] >= 1


def test_interleaved_rounds_and_the_serving_process_policy_in_the_report(capsys):
    import sys

    before = sys.getswitchinterval()
    assert bench_server.main(["bench", "server", "--json", "--requests", "12", "--max-tokens",
                              "2", "--decode-us", "0", "--concurrency", "1,2", "--rounds", "3",
                              "--gil-switch-us", "700"]) == 0
    assert sys.getswitchinterval() == before  # restored after the run
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["rounds"] == 3 and report["gil_switch_interval_us"] == 700
    assert isinstance(report["mmap_threshold_pinned"], bool)
    assert isinstance(report["cpu_model"], str) and report["cpu_model"]
    assert report["host"]["available"] is False or {
        "steal_pct", "busy_pct", "others_busy_pct", "quiet", "noise"} <= report["host"].keys()
    # c=1: 3 rounds of 4 requests; c=2: blocks of 4 would hold fewer than 4 requests per
    # client, so the level runs 12 // (4 * 2) = 1 round
    assert (report["c1"]["rounds"], report["c2"]["rounds"]) == (3, 1)
    for name in ("c1", "c2"):
        level = report[name]
        ratios = level["round_throughput_ratios"]
        assert len(ratios) == level["rounds"] and all(r > 0 for r in ratios)
        assert {"ttft_p50_ms", "ttft_p99_ms"} <= level["server_stream"].keys()
        assert level["stream_cpu_per_request_ratio"] == pytest.approx(
            level["server_stream"]["cpu_ms_per_request"]
            / level["direct"]["cpu_ms_per_request"], abs=0.002)
        # the streamed burst's own side, interleaved too: stream_bursts off
        unburst = level["server_stream_no_bursts"]
        assert level["stream_burst_throughput_ratio"] == pytest.approx(
            level["server_stream"]["req_per_s"] / unburst["req_per_s"], abs=0.002)
        assert level["stream_burst_cpu_ratio"] == pytest.approx(
            level["server_stream"]["cpu_ms_per_request"] / unburst["cpu_ms_per_request"],
            abs=0.002)
        # its other half runs in the API process: no CPU figure from this process
        assert "cpu_ms_per_request" not in level["api_process_floor"]
        assert level["throughput_ratio"] == pytest.approx(
            level["server"]["req_per_s"] / level["direct"]["req_per_s"], abs=0.002)
        # HTTP, one hand-off to a thread and back and the direct side's request, interleaved
        # with the others, its CPU in this process as the server's (stop 71)
        floor = level["handoff_floor"]
        assert level["handoff_floor_ratio"] == pytest.approx(
            floor["req_per_s"] / level["direct"]["req_per_s"], abs=0.002)
        assert level["handoff_floor_cpu_ratio"] == pytest.approx(
            floor["cpu_ms_per_request"] / level["direct"]["cpu_ms_per_request"], abs=0.002)
        assert "bench-handoff" in floor["cpu_ms_per_request_by_thread"]
        # the API process split's ceiling, interleaved with the others (api_floor.py)
        assert level["api_process_floor_ratio"] == pytest.approx(
            level["api_process_floor"]["req_per_s"] / level["direct"]["req_per_s"],
            abs=0.002)


def test_pooled_figures_are_over_every_block_not_a_mean_of_blocks():
    blocks = [{"elapsed_s": 1.0, "latencies_ms": [1.0, 2.0, 3.0]},
              {"elapsed_s": 3.0, "latencies_ms": [10.0]}]
    out = bench_server.pooled(blocks)
    assert out["req_per_s"] == 1.0  # 4 requests in 4 s (a mean of the blocks' rates: 1.67)
    assert out["p50_ms"] == 2.5 and "ttft_p50_ms" not in out
    streamed = [dict(b, ttft_ms=b["latencies_ms"]) for b in blocks]
    assert bench_server.pooled(streamed)["ttft_p50_ms"] == 2.5
    # a side whose blocks did not all stream has no time to the first token
    assert "ttft_p50_ms" not in bench_server.pooled([streamed[0], blocks[1]])
    # one block's rate is that block's (what round_throughput_ratios divides)
    assert bench_server.rate(blocks[:1]) == 3.0 and bench_server.rate(blocks[1:]) == 1 / 3
    # CPU per request: over every request each block served (its warm-up included)
    timed = [dict(blocks[0], cpu_s=0.5, served=5), dict(blocks[1], cpu_s=0.25, served=3)]
    assert bench_server.pooled(timed)["cpu_ms_per_request"] == 93.75  # 750 ms / 8
    assert "cpu_ms_per_request" not in bench_server.pooled([timed[0], blocks[1]])


def test_a_block_records_the_cpu_it_took_and_the_requests_it_served():
    def busy(size: int) -> dict:
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
        return {"elapsed_s": 1.0, "latencies_ms": [1.0] * size}

    got = bench_server.with_cpu(busy, 8)(4)
    assert got["served"] == 12 and got["latencies_ms"] == [1.0] * 4
    assert got["cpu_s"] >= 0.05  # the CPU the block burnt (a floor, not a timing bound)


@pytest.mark.parametrize(("requests", "concurrency", "rounds", "expected"), [
    (400, 1, 4, 4), (400, 8, 4, 4), (400, 64, 4, 1), (100, 8, 4, 3), (3, 1, 4, 1),
    (400, 1, 1, 1)])
def test_rounds_shrink_when_a_block_would_be_short(requests, concurrency, rounds, expected):
    got = bench_server.rounds_for(requests, concurrency, rounds)
    assert got == expected
    sizes = bench_server.split(requests, got)
    assert sum(sizes) == requests and max(sizes) - min(sizes) <= 1


def test_loadgen_raw_figures_can_be_pooled():
    from calexec.drivers.tools.bench.server_overhead import http_floor_app
    from calexec.drivers.tools.chaos import LiveServer

    with LiveServer(http_floor_app()) as live:
        plain = loadgen.run(live.url, 5, 2, 3)
        raw = loadgen.run(live.url, 5, 2, 3, stream=False, raw=True)
    assert "latencies_ms" not in plain and "elapsed_s" not in plain
    assert len(raw["latencies_ms"]) == 5 and raw["elapsed_s"] > 0
    assert bench_server.pooled([raw])["p50_ms"] == pytest.approx(raw["p50_ms"], abs=0.002)


def test_default_levels_are_1_8_64():
    assert bench_server.DEFAULT_LEVELS == (1, 8, 64)
    assert bench_server.concurrency_levels("8, 1,8") == [8, 1]


@pytest.mark.parametrize(("argv", "named"), [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "1,x"], "'x'"),
    (["--concurrency", "1000"], "1000"),
    (["--loadgen", "elsewhere"], "elsewhere"),
    (["--client", "curl"], "curl"),
    (["--requests", "0"], "--requests"),
    (["--rounds", "0"], "--rounds"),
    (["--gil-switch-us", "-1"], "--gil-switch-us: must be in 0..1000000, got -1"),
    (["--gil-switch-us", str(10 ** 21)], f"got {10 ** 21}"),  # (CPython wrapped it to 0)
])
def test_bad_flags_exit_2_naming_them(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_server.main(["bench", "server", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err


@pytest.mark.parametrize("max_tokens", ["40958", "99999999"])
def test_max_tokens_beyond_the_model_s_context_is_refused_before_any_request(max_tokens,
                                                                            capsys):
    # the 3-token prompt and them must fit max_seq=40960: more was every side's failure at its
    # first request (the API process floor's HTTP 500 naming step 2's past_len), exit 1
    code = bench_server.main(["bench", "server", "--max-tokens", max_tokens, "--requests", "1",
                              "--concurrency", "1", "--rounds", "1", "--decode-us", "0",
                              "--no-stream"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.splitlines()[-1] == (
        f"calexec bench server: --max-tokens={max_tokens}: at most 40957 (the model's context "
        "max_seq=40960 holds the bench's 3-token prompt and them)"), err


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


# ---- the load generator's clients (stdlib http.client by default, httpx to compare) --------

class _OneShotServer:
    """A loopback HTTP/1.1 server that answers each connection's first request with ``reply``
    (raw bytes) and then closes it without saying so (no ``Connection: close``): what a
    server closing an idle kept-alive connection looks like to the client's next request."""

    def __init__(self, reply: bytes) -> None:
        import socket
        import threading

        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)  # (accept polls: close() ends the thread at once)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(10)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(rest) < length:
                    rest += conn.recv(65536)
                conn.sendall(self.reply)

    def close(self) -> None:
        self.stop = True
        self.sock.close()
        self.thread.join(10)


def _reply(status: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_loadgen_reconnects_when_the_server_closed_a_kept_alive_connection():
    # the stdlib client's own retry (httpx, kept to compare, does not retry: whether its
    # second request fails depends on whether the server's FIN came before it)
    server = _OneShotServer(_reply("200 OK", b'{"choices": []}'))
    try:
        report = loadgen.run(server.url, 3, 1, 1, client="stdlib")
    finally:
        server.close()
    assert set(report) == {"req_per_s", "p50_ms", "p99_ms"}
    assert server.connections == 3  # each request after the first on a new connection


@pytest.mark.parametrize("client", loadgen.CLIENTS)
@pytest.mark.parametrize(("reply", "named"), [
    (_reply("200 OK", b"not json"), "without a JSON body with choices"),
    (_reply("200 OK", b'{"error": 1}'), "without a JSON body with choices"),
    (_reply("503 Service Unavailable", b'{"error": 1}'), "HTTP 503"),
])
def test_loadgen_refuses_a_wrong_answer(client, reply, named):
    server = _OneShotServer(reply)
    try:
        with pytest.raises(loadgen.LoadError, match=named):
            loadgen.run(server.url, 1, 1, 1, client=client)
    finally:
        server.close()


@pytest.mark.parametrize("client", loadgen.CLIENTS)
@pytest.mark.parametrize(("events", "named"), [
    (b'data: {"choices": []}\n\n', "without data: \\[DONE\\]"),
    (b"data: {oops\n\ndata: [DONE]\n\n", "not JSON"),
])
def test_loadgen_refuses_a_wrong_stream(client, events, named):
    head = ("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            f"Content-Length: {len(events)}\r\n\r\n").encode()
    server = _OneShotServer(head + events)
    try:
        with pytest.raises(loadgen.LoadError, match=named):
            loadgen.run(server.url, 1, 1, 1, stream=True, client=client)
    finally:
        server.close()


def test_loadgen_refuses_an_unknown_client_and_a_bad_url():
    with pytest.raises(loadgen.LoadError, match="'curl'"):
        loadgen.run("http://127.0.0.1:1", 1, 1, 1, client="curl")
    with pytest.raises(loadgen.LoadError, match="loopback"):
        loadgen.run("https://127.0.0.1:1", 1, 1, 1)
    with pytest.raises(loadgen.LoadError, match="127.0.0.1:x"):
        loadgen.run("http://127.0.0.1:x", 1, 1, 1)


def test_httpx_client_side_has_the_same_shape(capsys):
    assert bench_server.main(["bench", "server", "--json", "--requests", "2", "--max-tokens",
                              "2", "--decode-us", "0", "--concurrency", "1",
                              "--loadgen", "thread", "--client", "httpx"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["loadgen_client"] == "httpx"
    assert set(report["c1"]["server_stream"]) == {"req_per_s", "p50_ms", "p99_ms",
                                                  "ttft_p50_ms", "ttft_p99_ms",
                                                  "cpu_ms_per_request",
                                                  "cpu_ms_per_request_by_thread",
                                                  "threads_ended"}
