"""Stop 44 (faultload): what the server says about itself (/metrics, /ready, /health,
Retry-After) held against what clients see while faults and bad clients happen.

Loopback servers only, on the bundled emulator; faults through the emulator's fault points
(seeded); every wait bounded; nothing asserts a duration.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402

from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_server_support import LiveServer, started_executor, wait_for  # noqa: E402


class BetweenGenerations:
    """A started executor seen through its public surface, which the test can make look like
    it is between two generations of a recovery (``hold()``): lifecycle ``Configuring`` and
    no ``generation``, as a real recovery is from the old generation's release until the new
    one is open (measured: some 130-170 ms per CCU recovery on the bundled emulator, every
    time). Everything else is the executor's own."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor
        self.held = False

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False

    @property
    def state(self) -> str:
        return "Configuring" if self.held else self._executor.state

    @property
    def generation(self) -> Any:
        return None if self.held else self._executor.generation

    def health(self) -> list[str]:
        return ["lifecycle is Configuring, not admitting"] if self.held else \
            self._executor.health()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)


@pytest.fixture(name="gap")
def gap_fixture(tmp_path):
    """``(proxy, service, url)``: a loopback server on a ``BetweenGenerations`` executor."""
    executor = started_executor(tmp_path)
    proxy = BetweenGenerations(executor)
    app = create_app(proxy, ServerConfig())
    try:
        with LiveServer(app) as server:
            yield proxy, app.state.service, server.url
    finally:
        proxy.release()
        executor.shutdown(5.0)


def _post_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    def post() -> None:
        out["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_a_structured_request_between_generations_waits_for_ready(gap):
    """A completion with ``response_format`` arriving while a recovery has released the old
    generation and not yet opened the new one waits for Ready as every other completion does
    (docs/server.md: new completions wait within their deadline), then gets its answer; it
    was answered 503 ``device lifecycle is Configuring`` at once, with /ready about to be 200."""
    proxy, service, url = gap
    proxy.hold()
    out: dict = {}
    thread = _post_in_thread(url, {"prompt": [5, 6, 7], "max_tokens": 4, "timeout": 20,
                                   "response_format": {"type": "json_object"}}, out)
    wait_for(lambda: service.admission.waiting == 1 or "response" in out, 10,
             "the request waiting (or answered)")
    assert "response" not in out, out["response"].text
    proxy.release()
    thread.join(30)
    assert out["response"].status_code == 200, out["response"].text


def test_a_logit_bias_outside_the_vocabulary_is_refused_between_generations(gap):
    """A ``logit_bias`` key outside the vocabulary is a 400 naming ``logit_bias`` whatever the
    lifecycle: between two generations it was taken unchecked (no vocabulary to check it
    against), waited for Ready and got a 200."""
    proxy, service, url = gap
    proxy.hold()
    out: dict = {}
    thread = _post_in_thread(url, {"prompt": [5, 6, 7], "max_tokens": 2, "timeout": 20,
                                   "logit_bias": {"999999": 1}}, out)
    wait_for(lambda: "response" in out or service.admission.waiting == 1, 10,
             "the request answered (or waiting)")
    proxy.release()
    thread.join(30)
    response = out["response"]
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias"


def test_models_report_the_context_length_between_generations(gap):
    """``/v1/models`` (``max_model_len``) and ``/tokenizer_info`` (``model_max_length``) say
    the served context length during a recovery too (the generation served before it): they
    said null between two generations."""
    proxy, _, url = gap
    before = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    proxy.hold()
    during = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    info = httpx.get(f"{url}/tokenizer_info", timeout=10).json()["model_max_length"]
    assert isinstance(before, int) and during == before and info == before


def test_a_choice_cancelled_by_its_sibling_failure_is_not_a_client_cancellation(tmp_path):
    """``n=2``: one choice fails (an artifact fault: not resumed), the request answers its
    500 and its other choice is cancelled. No client left, so nothing is counted under
    ``request.cancelled`` (docs/server.md: 499, the client is gone), which operators read as
    clients giving up: the sibling was counted there, one per failed request of several
    choices. It has a code of its own, ``request.choice_cancelled``."""
    from calexec.drivers.calrt.runtime import Fault, FaultMode
    from test_server_support import metric_value

    # decode jobs of 20 ms: the sibling is still decoding when the first choice fails
    executor = started_executor(tmp_path, "decode_us=20000")
    emu = executor.device.emu
    app = create_app(executor, ServerConfig())
    service = app.state.service
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            assert emu.set_fault(Fault.UNKNOWN_CSR, FaultMode.NTH, 1, 0, 0) == 0
            response = http.post("/v1/completions", json={"prompt": [5, 6, 7], "n": 2,
                                                          "max_tokens": 8})
            assert response.status_code == 500, response.text
            assert response.json()["error"]["code"] == "calrt.csr_failed"
            wait_for(lambda: service.active == 0, 10, "both choices finished")
            metrics = http.get("/metrics").text
        failures = {code: metric_value(metrics, "calexec_request_failures_total",
                                       {"code": code})
                    for code in ("calrt.csr_failed", "request.cancelled",
                                 "request.choice_cancelled")}
        assert failures == {"calrt.csr_failed": 1, "request.cancelled": None,
                            "request.choice_cancelled": 1}, failures
    finally:
        executor.shutdown(5.0)
