"""``calexec diagrams``: deterministic DOT, SVG tied to its DOT, and the staleness check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from calexec.machines import diagrams
from calexec.machines.compiled import CHARTS

REPO_DIAGRAMS = Path(__file__).resolve().parent.parent / "diagrams"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):  # its users are marked requires_tool("dot"): SVG rendering
    out = tmp_path_factory.mktemp("diagrams")
    assert diagrams.main(["diagrams", "--out", str(out)]) == 0
    return out


@pytest.mark.requires_tool("dot")
def test_render_then_check_passes(rendered):
    assert sorted(p.name for p in rendered.iterdir()) == sorted(
        f"{name}.{ext}" for name in CHARTS for ext in ("dot", "svg")
    )
    assert diagrams.main(["diagrams", "--out", str(rendered), "--check"]) == 0


def test_dot_is_deterministic_and_complete():
    for name, chart in CHARTS.items():
        dot = diagrams.render_chart_dot(name)
        assert dot == diagrams.render_chart_dot(name)
        assert not re.search(r"_\d{6,}", dot), "object ids leaked into the DOT"
        for state in chart.states:
            assert re.search(rf"^{state} \[", dot, re.M), state


@pytest.mark.requires_tool("dot")
def test_modified_dot_fails_check(rendered, tmp_path, capsys):
    for path in rendered.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    dot = tmp_path / "job.dot"
    dot.write_text(dot.read_text().replace("Succeeded", "Succeded", 1))
    assert diagrams.main(["diagrams", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "job.dot: differs" in err and "fix: calexec diagrams --out" in err


@pytest.mark.requires_tool("dot")
def test_svg_missing_or_from_another_dot_fails_check(rendered, tmp_path, capsys):
    for path in rendered.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "kv_txn.svg").unlink()
    (tmp_path / "lifecycle.svg").write_text((tmp_path / "job.svg").read_text())
    assert diagrams.main(["diagrams", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "kv_txn.svg: missing" in err and "lifecycle.svg: not rendered" in err
    assert err.count("stale: ") == 2  # the untouched charts are not reported


@pytest.mark.requires_tool("dot")
def test_live_view_highlights_the_active_state():
    svg = diagrams.render_chart_svg("job", active_state="Submitted")
    assert svg.startswith("<?xml") and "calexec-dot-sha256" in svg
    active = diagrams.render_chart_dot("job", active_state="Submitted")
    assert re.search(r"^Submitted \[.*fillcolor=turquoise", active, re.M)
    assert not re.search(r"^Created \[.*fillcolor=turquoise", active, re.M)
    with pytest.raises(ValueError, match="active_state='Nowhere'"):
        diagrams.render_chart_dot("job", active_state="Nowhere")
    with pytest.raises(ValueError, match="chart_name='nope'"):
        diagrams.render_chart_svg("nope")


def test_committed_diagrams_are_current():
    assert diagrams.stale_files(REPO_DIAGRAMS) == [], "run: calexec diagrams"
