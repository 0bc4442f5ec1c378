"""Stop 72 (faults): seeded fault schedules under load, faults during a model switch, and the
soak's own checks.

1. The soak's and the chaos soak's token checks took any answer that ended early with
   ``finish_reason: "stop"`` as right, whatever its last token: a server that ended a request
   after its first tokens (a resume that lost its place, a burst cut short) and said ``stop``
   passed every check with 0 wrong tokens. The chaos check took even an answer with no
   ``finish_reason`` at all. An answer ends right only with its ``max_tokens`` tokens and
   ``length``, or with the end token last and ``stop`` (the synthetic model's traffic asks for
   no stop string, stop token or grammar).

Bundled emulator, seeded fault plans; every wait bounded; no timing threshold.
"""

from __future__ import annotations

import json
import threading

import pytest

import needs

needs.module("httpx", "server")  # the chaos and soak checks are the [server] tools'
from calexec.drivers.serving.byte_tokenizer import END_TOKEN_ID  # noqa: E402
from calexec.drivers.tools import answers, chaos  # noqa: E402
from calexec.drivers.tools.bench import soak  # noqa: E402
from executor_harness import until  # noqa: E402

PROMPT = (1, 2, 3)


def _plain(tokens: list[int], finish: str | None, max_tokens: int) -> chaos.Record:
    rec = chaos.Record("plain", list(PROMPT), max_tokens, 4.0)
    rec.start, rec.end, rec.code = 100.0, 100.1, 200
    rec.body = {"choices": [{"token_ids": tokens, "finish_reason": finish}]}
    return rec


def _stream(tokens: list[int], finish: str | None, max_tokens: int) -> chaos.Record:
    rec = chaos.Record("stream", list(PROMPT), max_tokens, 4.0)
    rec.start, rec.end, rec.code = 100.0, 100.1, 200
    rec.events = [f"data: {json.dumps({'choices': [{'token_ids': [t], 'finish_reason': None}]})}"
                  for t in tokens[:-1]]
    rec.events.append(f"data: {json.dumps({'choices': [{'token_ids': tokens[-1:], 'finish_reason': finish}]})}")
    rec.events.append("data: [DONE]")
    return rec


@pytest.mark.parametrize("shape", [_plain, _stream])
@pytest.mark.parametrize("finish", ["stop", None])
def test_the_chaos_check_counts_an_answer_cut_short_as_wrong(shape, finish):
    """Two of six oracle tokens and ``stop`` (the second token is no end token): wrong. On the
    old code no wrong token was counted (``stop`` took any length; a plain answer was judged
    on its length only when it said ``length``)."""
    oracle = list(chaos.oracle_tokens(PROMPT, 6))
    assert END_TOKEN_ID not in oracle  # (the cut is no real end)
    problems: list[str] = []
    wrong: list[str] = []
    chaos.check_record(shape(oracle[:2], finish, 6), 0.5, 0.1, problems, wrong)
    assert len(wrong) == 1 and not problems, (wrong, problems)


@pytest.mark.parametrize("shape", [_plain, _stream])
def test_the_chaos_check_takes_a_whole_answer_and_one_ended_by_the_end_token(shape):
    oracle = list(chaos.oracle_tokens(PROMPT, 6))
    problems: list[str] = []
    wrong: list[str] = []
    chaos.check_record(shape(oracle, "length", 6), 0.5, 0.1, problems, wrong)
    assert not wrong and not problems, (wrong, problems)
    assert answers.answer_wrong(oracle, "length", oracle, 6) is False
    # an answer the end token ended: what the oracle gives up to it, that token last
    ended = [*oracle[:2], END_TOKEN_ID]
    assert answers.answer_wrong(ended, "stop", ended, 6) is False


@pytest.mark.parametrize("tokens,finish,why", [
    (2, "stop", "cut short, its last token no end token"),
    (2, "length", "length before max_tokens"),
    (6, None, "no finish_reason"),
    (0, "stop", "no token at all"),
])
def test_the_soak_counts_an_answer_that_ends_wrongly_as_wrong(tokens, finish, why):
    oracle = list(chaos.oracle_tokens(PROMPT, 6))
    assert answers.answer_wrong(oracle[:tokens], finish, oracle, 6) is True, why


# ---- 2. a prefill the lifecycle refused before it ran spends no resume ---------------------------


class SwitchesUnderPrefills:
    """A started executor seen through its public surface, whose next ``refusals`` prefills
    are each enqueued during a model switch (to the calbin it serves) that another thread
    started just before: the executor refuses them, ``device lifecycle is Draining; not
    admitting``, as it refuses a request that reaches it a moment after an operator's reload
    began. The switch's golden run is slowed (the emulator's decode latency) so that it is
    still under way when the prefill reaches the executor."""

    def __init__(self, executor, refusals: int) -> None:
        from calexec.drivers.calrt.runtime import bundled_emulator

        self._executor = executor
        self._emu = bundled_emulator(executor.device)
        self.refusals = refusals
        self.switches: list[threading.Thread] = []
        self.answers: list = []

    def enqueue(self, request, *args, **kwargs):
        if self.refusals > 0 and request.kind.name.startswith("PREFILL"):
            self.refusals -= 1
            self._emu.set_latency(decode_us=300_000)  # the switch's golden: seconds
            path = self._executor.gen.calbin_path
            switch = threading.Thread(target=lambda: self.answers.append(
                self._executor.switch_model(path)), name="test-probe72-switch")
            self.switches.append(switch)
            switch.start()
            until(lambda: self._executor.state != "Ready", 30, "the switch's drain")
            try:
                return self._executor.enqueue(request, *args, **kwargs)
            finally:
                self._emu.set_latency(decode_us=0)
        return self._executor.enqueue(request, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._executor, name)


def test_prefills_refused_by_model_switches_before_they_ran_spend_no_resume(tmp_path):
    """``max_resumes=1``, and two model switches refuse the request's prefill, then its
    re-prefill, before either reached the device (``Draining; not admitting``): nothing was
    lost, the request waits for Ready as one sent a moment later would, and gets its tokens.
    On the old code each refusal spent a resume: the second exhausted the budget, 503
    ``lifecycle.unavailable`` (a reload every second under load and a fault beside it:
    ``calexec_resume_budget_exhausted_total`` 26 of 560 requests)."""
    import httpx

    from calexec.drivers.serving.server import ServerConfig, create_app
    from test_server_support import LiveServer, started_executor

    executor = started_executor(tmp_path)
    proxy = SwitchesUnderPrefills(executor, refusals=2)
    app = create_app(proxy, ServerConfig(max_resumes=1))
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": list(PROMPT), "max_tokens": 4,
                                                   "timeout": 30})
            for switch in proxy.switches:
                switch.join(30)
            assert [s.ok for s in proxy.answers] == [True, True], proxy.answers
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == list(chaos.oracle_tokens(PROMPT, 4))
            assert proxy.refusals == 0
            metrics = app.state.service.metrics.registry
            assert not metrics.get_sample_value("calexec_resume_budget_exhausted_total")
    finally:
        for switch in proxy.switches:
            switch.join(30)
        executor.shutdown(5.0)


# ---- 3. the soak's documented errors are the fault's own -----------------------------------------


def test_only_the_faults_own_error_is_documented_in_its_window():
    """An unknown CSR fails the request that met it with ``calrt.csr_failed``; any other
    error in its window (a transport error, a 500 of another code) is beyond the budget. On
    the old code every error in the window of a fault not resumed from was documented, one
    per firing, whatever it was: a defect whose error came while an unknown CSR or a slice
    failure was armed passed the ``client_errors`` check."""
    windows = [{"kind": "unknown_csr", "armed": 10.0, "ended": 11.0, "fired": 1},
               {"kind": "slice_fail", "armed": 20.0, "ended": 21.0, "fired": 2}]
    errors = [(10.1, 10.2, "transport ReadTimeout"),
              (10.3, 10.4, "SSE error calrt.csr_failed"),
              (20.1, 20.2, "HTTP 500 internal.slot_dropped"),
              (20.3, 20.4, "HTTP 500 calrt.slice_failed")]
    documented, beyond = soak.classify_errors(errors, windows)
    assert documented == {"unknown_csr": 1, "slice_fail": 1}
    assert beyond == {"transport ReadTimeout": 1, "HTTP 500 internal.slot_dropped": 1}


# ---- 4. the recovery records an executor keeps are bounded ---------------------------------------


def test_the_recovery_records_are_bounded_and_the_counts_are_not(tmp_path, monkeypatch):
    """Every recovery and model switch appended a record to ``executor.recoveries`` for the
    life of the process (the fault controller's own ``decisions`` keep the last 1000), and
    each metrics scrape walked all of them: a server on a flaky device (up to 5 recoveries a
    minute before its escalation stops it), or one reloaded on a schedule, grew without
    bound. The newest ``RECOVERY_RECORDS_KEPT`` are kept; ``snapshot()["recoveries"]`` and the
    server's switch and recovery counters still count every one."""
    import httpx

    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.machines import device_lifecycle
    from test_server_support import LiveServer, started_executor

    monkeypatch.setattr(device_lifecycle, "RECOVERY_RECORDS_KEPT", 3, raising=False)
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token=chaos.TOKEN))
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            for _ in range(5):
                r = http.post("/admin/reload", json={"calbin": executor.gen.calbin_path},
                              headers=chaos.AUTH)
                assert r.status_code == 200, r.text
            assert len(executor.recoveries) == 3
            assert [r["to_generation"] for r in executor.recoveries] == [4, 5, 6]
            assert executor.snapshot()["recoveries"] == 5
            metrics = http.get("/metrics").text
            assert 'calexec_model_switches_total{outcome="ok"} 5.0' in metrics, [
                line for line in metrics.splitlines() if "switch" in line]
    finally:
        executor.shutdown(5.0)
