"""The live statecharts page (issue 18): counts on every chart's nodes, transition rates on the
edges over the last minute, refreshed by the page itself; checked through live.json and in
headless Chromium (the DOM after the page's script ran)."""

from __future__ import annotations

import re
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.tools.live_screenshots import chromium_capture
from calexec.machines.compiled import CHARTS, JOB
from calexec.machines.inspector import Inspector
from test_server_support import LiveServer, started_executor


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    ex = started_executor(tmp_path_factory.mktemp("live"), "decode_us=2000")
    yield ex
    ex.shutdown(5.0)


class Guards:
    def __getattr__(self, name):
        return lambda: True


def test_rates_are_transitions_per_minute_over_the_window():
    now = [100.0]
    inspector = Inspector(window_s=60.0, clock=lambda: now[0])
    inspector.register(JOB, counts=dict, count_instances=False)
    rates = inspector.rates
    admit = next(t for t in JOB.transitions if t.event == "admit")
    for _ in range(3):
        JOB.run(Guards()).send("admit")
    now[0] = 130.0  # 3 admits in the last minute (the 30 s since the first sample)
    assert rates.per_minute()["job"][admit.id] == pytest.approx(3.0)
    now[0] = 250.0  # nothing new for two minutes: the window forgets them
    rates.per_minute()
    now[0] = 251.0
    assert rates.per_minute()["job"][admit.id] == 0.0


def test_live_json_counts_every_chart_and_rates_move_with_traffic(executor):
    from starlette.routing import Mount

    app = create_app(executor, ServerConfig())
    # the server mounts the generic inspector (machines/inspector.py) like any user would
    assert [r.path for r in app.routes if isinstance(r, Mount)] == ["/debug/statecharts"]
    with TestClient(app) as client:
        for i in range(3):
            r = client.post("/v1/completions", json={"prompt": [i + 1, 2], "max_tokens": 3})
            assert r.status_code == 200, r.text
        live = client.get("/debug/statecharts/live.json").json()
    assert set(live["charts"]) == set(CHARTS)
    for name, chart in CHARTS.items():
        assert set(live["charts"][name]["counts"]) == set(chart.states), name
        assert len(live["charts"][name]["per_minute"]) == len(chart.transitions), name
    assert live["charts"]["lifecycle"]["counts"]["Ready"] == 1
    assert live["status"]["lifecycle"] == "Ready"
    assert sum(live["charts"]["buffer_slot"]["counts"].values()) == len(executor.pool.slots)
    admit = next(t for t in JOB.transitions if t.event == "admit")
    assert live["charts"]["job"]["per_minute"][admit.id] > 0
    assert live["status"]["golden"] == "pinned" and live["status"]["disabled_features"] == []


def test_job_rates_count_the_clients_jobs_not_the_executors_own(executor):
    """Stop 64: under load the page showed the job chart's ``fail`` edge at 640/min against
    944 admits with no request failing: each stream's next step, armed and released unasked
    at the request's end (and each auto pre-arm guess, each golden job) counted in
    ``JOB.taken``. The page's job rates now count the clients' jobs: as many admits as
    deliveries, no ``fail`` for requests that all succeeded; the executor's own are apart."""
    def ids(event, source=None):
        return [t.id for t in JOB.transitions
                if t.event == event and (source is None or t.source == source)]

    admit, deliver, fail = ids("admit"), ids("deliver"), ids("fail")
    with TestClient(create_app(executor, ServerConfig())) as client:
        taken, apart = list(JOB.taken), executor.internal_job_transitions()
        for i in range(4):
            r = client.post("/v1/completions", json={"prompt": [i + 1, 2], "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4, r.text
        live = client.get("/debug/statecharts/live.json").json()["charts"]["job"]
    moved = [new - old for new, old in zip(JOB.taken, taken, strict=True)]
    jobs = sum(moved[i] for i in deliver)
    assert jobs >= 4  # every request's jobs delivered, none failed
    assert [sum(moved[i] for i in ids) for ids in (admit, fail)] == [jobs, 0], moved
    rates = live["per_minute"]
    assert sum(rates[i] for i in fail) == 0.0, rates
    assert sum(rates[i] for i in admit) == sum(rates[i] for i in deliver) > 0, rates
    # the executor's own: a stream's next step armed and released unasked, counted apart
    own = [new - old for new, old in zip(executor.internal_job_transitions(), apart,
                                         strict=True)]
    assert sum(own[i] for i in fail) == sum(own[i] for i in admit) >= 1, own
    assert sum(own[i] for i in deliver) == 0, own


@pytest.mark.requires_tool("chromium", "dot")
def test_page_refreshes_itself_in_headless_chromium_under_load(executor, tmp_path):
    """The DOM after 4 s of page time: every state of every chart carries a live count, every
    edge a rate, the page updated itself more than once, the job chart shows traffic."""
    stop = threading.Event()
    with LiveServer(create_app(executor, ServerConfig())) as server:
        def client(i):
            with httpx.Client(base_url=server.url, timeout=30) as http:
                while not stop.is_set():
                    http.post("/v1/completions", json={"prompt": [i + 1, 2, 3], "max_tokens": 8})
        threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        try:
            done = chromium_capture(f"{server.url}/debug/statecharts", str(tmp_path))
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    updates = re.search(r'<body[^>]*data-updates="(\d+)"', dom)
    assert updates and int(updates.group(1)) >= 2, "the page did not refresh itself"
    for name, chart in CHARTS.items():
        section = dom[dom.index(f'data-chart="{name}"'):]
        section = section[:section.index("</section>")]
        for state in chart.states:
            node = re.search(rf'<g id="s_{state}" class="node"[^>]*data-count="(\d+)"', section)
            assert node, (name, state)
        rates = re.findall(r'<g id="t_[\d_]+" class="edge"[^>]*data-rate="([\d.]+)"', section)
        assert rates and len(rates) == section.count('<g id="t_'), name
    ready = re.search(r'<g id="s_Ready" class="node"[^>]*data-count="(\d+)"', dom)
    assert ready.group(1) == "1"
    job = dom[dom.index('data-chart="job"'):]
    assert re.search(r'<g id="t_\d+" class="edge"[^>]*data-rate="[1-9][\d.]*"', job), \
        "no job transition rate under load"
    assert "live-count" in dom and "live-rate" in dom


# ---- the path of one job ------------------------------------------------------------------------
TOKEN = "path-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.requires_tool("dot")
def test_debug_job_path_of_a_failed_request_names_the_refusing_guard(executor):
    from executor_harness import arm

    # max_resumes=0: the request must fail (it would resume otherwise, issue 16)
    config = ServerConfig(admin_token=TOKEN, max_resumes=0)
    with TestClient(create_app(executor, config)) as client:
        arm(executor, "CCU_EXCEPTION")  # Wait succeeds, the device status is not DONE
        r = client.post("/v1/completions", json={"prompt": [4, 2], "max_tokens": 2})
        assert r.status_code >= 500, r.text
        job_id = r.json()["status"]["job_id"]  # the error body names the job
        assert isinstance(job_id, int)
        assert client.get(f"/debug/jobs/{job_id}").status_code == 401
        path = client.get(f"/debug/jobs/{job_id}?format=json", headers=AUTH).json()
        assert path["state"] == "Quarantined" and path["status"] == "device.ccu_exception"
        events = [(s["event"], s["from"], s["to"]) for s in path["trail"]]
        assert events[:4] == [("admit", "Created", "Admitted"),
                              ("begin_preparation", "Admitted", "Preparing"),
                              ("enqueue", "Preparing", "Queued"),
                              ("infer_accepted", "Queued", "Submitted")]
        assert events[4] == ("wait_returned", "Submitted", "Quarantined")
        page = client.get(f"/debug/jobs/{job_id}", headers=AUTH)
        # the [else] fallback names the guard of the alternative it passed over
        assert page.status_code == 200
        assert "Wait returned: [runtime_finished_cleanly] refused" in page.text
        assert page.text.count('stroke="red"') >= 5  # the path's edges drawn in red
        assert client.get("/debug/jobs/999999", headers=AUTH).status_code == 404
        assert client.get("/debug/jobs/abc", headers=AUTH).status_code == 400
        ok = client.post("/v1/completions", json={"prompt": [4, 2], "max_tokens": 1})
        assert ok.status_code == 200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seconds", "-1"], "argument --seconds: must be a number of seconds > 0 and at most 1e+06, got '-1'"),
        (["--seconds", "nan"], "argument --seconds: must be a number of seconds > 0 and at most 1e+06, got 'nan'"),
        (["--clients", "0"], "argument --clients: must be in 1..256, got 0"),
        (["--out", "/nonexistent-dir/live.png"], "--out='/nonexistent-dir/live.png': no directory"),
        (["--out", "{tmp}/live.png"], "needs headless Chromium: chromium is not on PATH"),
        # stop 38: a directory (or a read-only file) was found only by Chromium, after the load
        (["--out", "{tmp}"], "--out='{tmp}': cannot write it: Is a directory"),
    ],
    ids=["negative-seconds", "nan-seconds", "no-clients", "no-out-directory", "no-chromium",
         "out-is-a-directory"],
)
def test_diagrams_live_bad_input_is_one_line_exit_2_before_any_load(args, message, tmp_path,
                                                                      monkeypatch, capsys):
    """``calexec diagrams live --seconds -1`` started the executor and the server, then
    ended in ``internal error: ValueError: sleep length must be non-negative`` (exit 70), as
    did ``nan``; without Chromium the load ran first and the end was ``internal error:
    FileNotFoundError`` (exit 70)."""
    from calexec.cli import main as cli

    monkeypatch.setenv("PATH", str(tmp_path))  # no chromium here
    args = [a.format(tmp=tmp_path) for a in args]
    message = message.format(tmp=tmp_path)
    assert cli(["diagrams", "live", "--job-out", "", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
