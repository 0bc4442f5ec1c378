"""Stop 59 (toolkit): the inspector's and the switch check's messages show values as JSON
(what an HTTP client wrote and reads), a chart name with CSS/HTML-special characters on the
live page, and a newcomer's own charts (an elevator door, a vending machine) through the
toolkit as docs/framework.md tells it."""

from __future__ import annotations

import html.parser
import re

import pytest

pytest.importorskip("starlette", reason="the inspector's ASGI app needs the [server] extra")
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from statemachine import State, StateMachine  # noqa: E402

from calexec.contracts.manifest import default_manifest_path, load_manifest  # noqa: E402
from calexec.machines import switch_check  # noqa: E402
from calexec.machines.compiled import compiled  # noqa: E402
from calexec.machines.inspector import AppOptions, Inspector, inspector_app, page  # noqa: E402


class Door(StateMachine):
    closed = State(initial=True)
    opening = State()
    open = State()
    start = closed.to(opening)
    opened = opening.to(open)
    close = open.to(closed)


def _svg(chart, active):
    return f"<svg>{chart.name} {active}</svg>"


@pytest.fixture
def door_app():
    inspector = Inspector()
    inspector.register(Door, counts=lambda: {"closed": 1}, count_instances=False,
                       name="lift/door")
    inspector.register(Door, counts=lambda: {"Closed": 1}, count_instances=False,
                       name="typo")
    inspector.register(Door, counts=lambda: {"open": "two"}, count_instances=False,
                       name="nan")
    run = compiled(Door).run(object())
    inspector.paths.follow("r1", run)
    app = Starlette(routes=[Mount("/charts", inspector_app(inspector, AppOptions(svg=_svg)))])
    with TestClient(app) as client:
        yield client
    inspector.close()


@pytest.mark.parametrize("path, status, message", [
    ("/charts/lift/dor.svg", 404,
     'chart="lift/dor" is not one of ["lift/door", "nan", "typo"]'),
    ("/charts/lift/door.svg?active=Nope", 400,
     'active="Nope": not a state of "lift/door" (its states, by id: closed, opening, open)'),
    ("/charts/runs/r2", 404, 'run_id="r2": not followed (or older than the last 100 runs)'),
    ("/charts/runs/r1?format=xml", 400, 'format="xml": must be json or html, given once'),
    ("/charts/runs/r1?format=json&format=html", 400,
     'format="json": must be json or html, given once'),
])
def test_the_inspectors_refusals_show_the_value_as_json(door_app, path, status, message):
    """Found at stop 59: the inspector (mounted by the server at /debug/statecharts) named a
    value as Python prints it (``active='Nope'``, ``is not one of ['lift/door']``), where its
    user reads JSON over HTTP (and every other message of the server says ``"Nope"``). The
    value is now shown as JSON (``contracts.fields.shown``)."""
    answer = door_app.get(path)
    assert answer.status_code == status, answer.text
    assert answer.json() == {"error": message}


def test_the_live_json_errors_show_the_apps_answer_as_json(door_app):
    """live.json's errors of the app's ``counts=`` function named the state and count as
    Python prints them (``'Closed'``, ``'open'='two'``): JSON now, as the page reads them."""
    charts = door_app.get("/charts/live.json").json()["charts"]
    assert charts["typo"]["error"] == (
        'typo: the counts= function given to register answered a state the chart does not '
        'have: "Closed" (its states, by id: closed, opening, open); "Closed" is the name of '
        'state closed: answer its id, closed')
    assert charts["nan"]["error"] == (
        'nan: the counts= function given to register answered a count that is no integer: '
        '"open"="two"')


@pytest.mark.parametrize("path, reason, said", [
    ("/no/such/dir/m.calbin", "not_found", '"/no/such/dir/m.calbin": no such file'),
    ("/", "not_a_file", '"/": not a regular file'),
    ("", "path_required", '"": a calbin file path'),
    ("it's.calbin", "not_found", "\"it's.calbin\": no such file"),
])
def test_the_switch_checks_refusal_shows_the_path_as_json(path, reason, said):
    """Found at stop 59: ``check_calbin`` (``POST /admin/reload``'s check) named the path
    as Python prints it, ``calbin='m.calbin': ...`` (``calbin="it's"`` in Python's other
    quotes); the HTTP client wrote it as JSON, and reads it so: ``calbin="m.calbin"``."""
    manifest = load_manifest(default_manifest_path())
    checked = switch_check.check_calbin(object(), manifest, path)
    assert checked.code == f"calbin.{reason}", checked
    assert (checked.message or "").startswith(f"calbin={said}"), checked.message


class _Sections(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.charts: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "section":
            self.charts += [value or "" for key, value in attrs if key == "data-chart"]


@pytest.mark.parametrize("name", ['lift "A"', "it's", "a]b\\c", "<x>&y"])
def test_a_chart_name_with_css_or_html_special_characters_is_found_by_the_page(name):
    """Found at stop 59: the page's script found a chart's section with the selector
    ``'section[data-chart="' + chart + '"]'``: a chart registered as ``lift "A"`` (or with
    a backslash) made an invalid selector, ``querySelector`` threw a SyntaxError and no chart
    of the page was painted again ("update failed"). The script now compares each section's
    ``data-chart`` with the name (no selector is built from a name or a state), and the
    attribute holds the name exactly (HTML-escaped)."""
    inspector = Inspector()
    inspector.register(Door, counts=lambda: {"closed": 1}, count_instances=False, name=name)
    text = page({name: "<svg></svg>"}, inspector.live(), "/live.json")
    inspector.close()
    sections = _Sections()
    sections.feed(text)
    assert sections.charts == [name]
    script = text.split("<script>", 1)[1]
    # no CSS selector is built by concatenating a value into it
    assert not re.search(r"""querySelector(All)?\([^)]*\+""", script), script
    assert "dataset.chart === chart" in script


def test_the_explorer_reaches_a_schedule_of_two_preemptions_between_two_threads():
    """Found at stop 59: two threads, each taking a lock twice; the bug shows only in
    ``a1 b1 a2`` (a preempted after its first block, then b after its first). PCT with
    ``depth=3`` (two change points) reaches it when the later change point gives the lower
    priority: Burckhardt et al. give change point ``k_i`` priority ``i`` for change points
    drawn in random order. calexec's ``PCTChooser`` gave them in time order (the first victim
    always the lowest), so the second victim always ran on: ``a1 b1 a2 b2`` and ``b1 a1 b2 a2``
    were never scheduled, by any seed. The priorities now follow the draw's order."""
    from calexec.drivers.tools.interleave import explore_threads, replay_threads

    def scenario(clock):
        lock = clock.lock()
        log: list[str] = []

        def worker(name: str) -> None:
            for step in (1, 2):
                with lock:
                    log.append(f"{name}{step}")

        clock.start_thread(lambda: worker("a"), "a")
        clock.start_thread(lambda: worker("b"), "b")
        return lambda: log[:3] not in (["a1", "b1", "a2"], ["b1", "a1", "b2"]) or \
            f"two preemptions: {' '.join(log)}"

    found = explore_threads(scenario, seeds=range(300), depth=3, length=8)
    assert found.failure is not None, found
    assert "two preemptions" in found.failure.message
    again = replay_threads(scenario, found.failure.choices)
    assert again is not None and again.message == found.failure.message
