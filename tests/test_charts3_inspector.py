"""The live inspector on a newcomer's hierarchical chart (stop 46, charts3): the media player
of ``tests/data/charts3/`` (history states, a parallel state in a compound inside a parallel
root), followed as a compiled run and as a python-statemachine instance."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the inspector's ASGI app needs the [server] extra")
from starlette.testclient import TestClient  # noqa: E402

from calexec.machines.chartref import load_chart  # noqa: E402
from calexec.machines.compiled import compiled  # noqa: E402
from calexec.machines.diagrams import render_path_svg  # noqa: E402
from calexec.machines.inspector import Inspector, inspector_app  # noqa: E402

FIXTURES = Path(__file__).parent / "data" / "charts3"
RESUMED = ["play", "plug", "tick", "restart", "pause", "resume"]  # the last one: to H*


def _media() -> object:
    load_chart("media_player:MediaPlayer", cwd=str(FIXTURES))
    return importlib.import_module("media_player")


def _inspected() -> tuple[Any, Inspector, Any, Any]:
    """The media player registered with a new ``Inspector`` whose runs are a compiled run
    and a python-statemachine instance of it: ``(chart, inspector, run, instance)``."""
    media = _media()
    chart = media.MediaPlayer  # type: ignore[attr-defined]
    inspector = Inspector()
    runs: list[object] = []
    inspector.register(chart, runs=lambda: runs)
    run = compiled(chart).run(media.Player())  # type: ignore[attr-defined]
    machine = chart(model=media.Player())  # type: ignore[attr-defined]
    runs += [run, machine]
    return chart, inspector, run, machine


@pytest.mark.requires_tool("dot")
def test_the_path_of_a_run_that_resumed_a_history_state_is_drawn(tmp_path: Path) -> None:
    """A run whose last transition went to a history state (``paused --resume--> hist``) made
    the path page fill the history pseudo-state, which is no state: ``ValueError: active_state=
    'hist' is not one of ...`` and a 500. The compound the history belongs to is filled."""
    chart, inspector, run, machine = _inspected()
    inspector.paths.follow("compiled", run)
    inspector.paths.follow("instance", machine)
    for event in RESUMED:
        run.send(event)
        machine.send(event)
    with TestClient(inspector_app(inspector)) as client:
        for run_id in ("compiled", "instance"):
            page = client.get(f"/runs/{run_id}")
            assert page.status_code == 200, page.text[:300]
            data = client.get(f"/runs/{run_id}?format=json").json()
            # (since stop 61: the states the deep history re-entered, the history as ``via``)
            assert (data["trail"][-1]["to"], data["trail"][-1]["via"]) == (
                "track,decoder,buffering,output,speakers", "hist")
            assert data["state"] == ",".join(run.configuration)
        counts = client.get("/live.json").json()["charts"]["MediaPlayer"]["counts"]
    assert counts["playing"] == 2 and counts["headphones"] == 0 and counts["paused"] == 0
    svg = render_path_svg(chart, [{"event": "play", "from": "stopped", "to": "playing"},
                                  {"event": "pause", "from": "playing", "to": "paused"},
                                  {"event": "resume", "from": "paused", "to": "hist"}])
    assert 'id="s_hist"' in svg


def test_a_path_step_to_a_target_the_chart_does_not_have_is_named() -> None:
    media = _media()
    with pytest.raises(ValueError, match="is not a declared transition"):
        render_path_svg(media.MediaPlayer,  # type: ignore[attr-defined]
                        [{"event": "resume", "from": "paused", "to": "nowhere"}])


@pytest.mark.parametrize("query, named", [
    ('format=JSON', 'format="JSON"'),
    ('format=xml', 'format="xml"'),
    ('format=json&format=html', 'format="json"'),
    ("fromat=json", "fromat: unknown parameter"),
])
def test_a_run_pages_query_it_does_not_take_is_a_400_naming_it(query: str, named: str) -> None:
    """Found at stop 52: ``/runs/{id}?format=JSON`` (or ``xml``, ``format`` twice, a
    mistyped key) answered the drawn page, 200, as if honoured, as the server's
    ``/debug/jobs/{id}`` did. It is a 400 naming the parameter; ``format=json`` is still the
    run's steps."""
    media = _media()
    chart = media.MediaPlayer  # type: ignore[attr-defined]
    inspector = Inspector()
    runs: list[object] = []
    inspector.register(chart, runs=lambda: runs)
    run = compiled(chart).run(media.Player())  # type: ignore[attr-defined]
    runs.append(run)
    inspector.paths.follow("r1", run)
    run.send("play")
    with TestClient(inspector_app(inspector)) as client:
        refused = client.get(f"/runs/r1?{query}")
        data = client.get("/runs/r1?format=json")
    assert refused.status_code == 400, refused.text[:300]
    assert named in refused.json()["error"], refused.text[:300]
    assert data.status_code == 200 and data.json()["trail"][-1]["to"] == "playing", data.text


@pytest.mark.requires_tool("chromium", "dot")
def test_the_page_counts_compound_and_parallel_states_too(tmp_path: Path) -> None:
    """Stop 64: the page painted a count beside every leaf state only: a compound or
    parallel state's box (a graphviz cluster) carried no ``s_<id>`` id, so ``playing`` (2
    runs in it) showed no count, though ``live.json`` had it. Each box now carries its
    state's id and its count, as a leaf's node does."""
    import re

    import httpx

    from calexec.drivers.tools.live_screenshots import chromium_capture
    from test_server_support import LiveServer

    chart, inspector, run, machine = _inspected()
    for event in RESUMED[:3]:
        run.send(event)
        machine.send(event)
    boxes = [s.id for s in chart.states_map.values() if s.states]
    assert "playing" in boxes and len(boxes) >= 3, boxes
    try:
        with LiveServer(inspector_app(inspector)) as server:
            counts = httpx.get(f"{server.url}/live.json").json()["charts"]["MediaPlayer"][
                "counts"]
            done = chromium_capture(f"{server.url}/", str(tmp_path))
    finally:
        inspector.close()
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert counts["playing"] == 2
    for state in boxes:  # every box: its group found by id, painted with live.json's count
        found = re.search(rf'<g id="s_{state}" class="cluster"[^>]*data-count="(\d+)"', dom)
        assert found, (state, re.findall(r'<g id="[^"]*" class="cluster"[^>]*>', dom))
        assert int(found.group(1)) == counts[state], state
        badge = re.search(rf'<g id="s_{state}" class="cluster".*?</g>', dom, re.S)
        assert badge and 'class="live-count"' in badge.group(0), state
