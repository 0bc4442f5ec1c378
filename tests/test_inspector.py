"""The live inspector for any app (issue 26, machines/inspector.py): a user's chart (the order
workflow of examples/charts/) registered with its runs, mounted in a Starlette app beside the
app's own routes; live counts per state, per-edge rates from compiled runs and
python-statemachine instances alike, the path of one followed run; and the NPU server
mounting the same app at /debug/statecharts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the inspector's ASGI app needs the [server] extra")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import PlainTextResponse  # noqa: E402
from starlette.routing import Mount, Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from calexec.machines.compiled import compiled  # noqa: E402
from calexec.machines.inspector import Inspector, inspector_app  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "charts"


@pytest.fixture
def shop(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from order_workflow import Order, OrderWorkflow

    now = [1000.0]
    inspector = Inspector(window_s=60.0, clock=lambda: now[0])
    orders: list[object] = []
    inspector.register(OrderWorkflow, runs=lambda: orders)
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("the shop")),
                            Mount("/charts", inspector_app(inspector))])
    yield app, inspector, orders, now, Order, OrderWorkflow
    inspector.close()


def test_counts_rates_and_one_path_of_a_user_chart(shop):
    app, inspector, orders, now, Order, OrderWorkflow = shop
    paid = Order(items=["book"], authorized=True, stock=1)
    real = OrderWorkflow(paid)  # a python-statemachine instance
    inspector.paths.follow("o1", real)
    for event in ("place", "pay"):
        real.send(event)
    run = compiled(OrderWorkflow).run(Order(items=["pen"]))  # a compiled run
    inspector.paths.follow("o2", run)
    run.send("place")
    with pytest.raises(Exception):  # noqa: B017 - refused: no authorization
        run.send("pay")
    orders += [real, run, OrderWorkflow(Order())]
    now[0] += 30.0  # the transitions above happened within these 30 s
    with TestClient(app) as client:
        assert client.get("/").text == "the shop"
        live = client.get("/charts/live.json").json()
        chart = live["charts"]["OrderWorkflow"]
        assert chart["counts"] == {"cart": 1, "placed": 1, "paid": 1, "shipped": 0,
                                   "delivered": 0, "cancelled": 0}
        ids = {(t.source, t.event): t.id for t in compiled(OrderWorkflow).transitions}
        # 2 places (one per run kind) and 1 pay in the last minute (the 30 s since the
        # inspector began): 2 and 1 per minute
        assert chart["per_minute"][ids[("cart", "place")]] == pytest.approx(2.0)
        assert chart["per_minute"][ids[("placed", "pay")]] == pytest.approx(1.0)
        assert chart["per_minute"][ids[("paid", "ship")]] == 0.0
        one = client.get("/charts/runs/o1?format=json").json()
        assert one["state"] == "paid" and [(s["event"], s["from"], s["to"])
                                           for s in one["trail"]] == [
            ("place", "cart", "placed"), ("pay", "placed", "paid")]
        two = client.get("/charts/runs/o2?format=json").json()
        assert two["trail"][-1]["to"] is None
        assert two["trail"][-1]["refused_by"] == ["payment_authorized"]
        assert client.get("/charts/runs/nope").status_code == 404
        assert client.get("/charts/Nope.svg").status_code == 404


@pytest.mark.requires_tool("dot")
def test_the_page_draws_the_chart_and_polls_under_its_mount(shop):
    app, inspector, orders, _, Order, OrderWorkflow = shop
    orders.append(OrderWorkflow(Order()))
    run = compiled(OrderWorkflow).run(Order(items=["book"]))
    inspector.paths.follow("o9", run)
    run.send("place")
    with TestClient(app) as client:
        drawn = client.get("/charts/runs/o9")
        assert drawn.status_code == 200 and "OrderWorkflow run o9: placed" in drawn.text
        assert drawn.text.count('stroke="red"') >= 1  # the path's edge drawn
        page = client.get("/charts/")
        assert page.status_code == 200 and page.text.count("<svg") == 1
        assert "data-chart='OrderWorkflow'" in page.text
        assert '"/charts/live.json"' in page.text  # the script polls under the mount point
        svg = client.get("/charts/OrderWorkflow.svg")
        assert svg.headers["content-type"].startswith("image/svg+xml")
        assert 'id="s_cart"' in svg.text
        path = client.get("/charts/runs/none-such")
        assert path.status_code == 404


def test_without_graphviz_drawing_is_a_503_naming_it_and_the_data_still_answers(
        shop, tmp_path, monkeypatch):
    app, *_ = shop
    monkeypatch.setenv("PATH", str(tmp_path))
    with TestClient(app) as client:
        r = client.get("/charts/OrderWorkflow.svg")
        assert r.status_code == 503 and "graphviz" in r.json()["error"]
        assert client.get("/charts/live.json").status_code == 200


def test_registration_is_checked():
    from statemachine import State, StateMachine

    class Lamp(StateMachine):
        off = State(initial=True)
        on = State()
        flip = off.to(on) | on.to(off)

    inspector = Inspector()
    with pytest.raises(ValueError, match="exactly one of runs="):
        inspector.register(Lamp)
    inspector.register(Lamp, counts=lambda: {"off": 1, "on": 0}, count_instances=False)
    with pytest.raises(ValueError, match="'Lamp' is already registered"):
        inspector.register(Lamp, counts=dict)
    with pytest.raises(TypeError, match="expected a compiled run .ChartRun, StatechartRun. or a python-statemachine"):
        inspector.paths.follow("x", object())



def test_a_chart_registered_late_has_no_rate_from_its_past(monkeypatch):
    """Transitions a chart's runs took before it was registered (earlier in the process) are
    not a rate: seen when the NPU server's tests ran after thousands of jobs of other tests."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from order_workflow import Order, OrderWorkflow

    now = [10.0]
    inspector = Inspector(window_s=60.0, clock=lambda: now[0])
    shared = compiled(OrderWorkflow)
    place = next(t for t in shared.transitions if t.event == "place")
    for _ in range(5):  # before registration
        shared.run(Order(items=["pen"])).send("place")
    now[0] = 20.0
    inspector.register(OrderWorkflow, counts=dict, count_instances=False)
    now[0] = 40.0
    assert inspector.rates.per_minute()["OrderWorkflow"][place.id] == 0.0
    shared.run(Order(items=["pen"])).send("place")  # one after it: counted
    now[0] = 50.0  # 1 in the last minute (the 40 s since the first sample)
    assert inspector.rates.per_minute()["OrderWorkflow"][place.id] == pytest.approx(1.0)


def test_a_hierarchical_chart_counts_every_active_state_and_follows_one_run(monkeypatch):
    """A general run (compound and parallel states): a run counts in each state of its
    configuration, and its path is followed like a flat run's (found following
    docs/framework.md with a chart of my own: ``follow`` refused a ``StatechartRun``)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from traffic_light import Junction, TrafficLight

    inspector = Inspector()
    runs: list[object] = []
    inspector.register(TrafficLight, runs=lambda: runs, count_instances=False)
    run = compiled(TrafficLight).run(Junction())
    runs.append(run)
    inspector.paths.follow("t1", run)
    before = set(run.configuration)
    counts = inspector.live()["charts"]["TrafficLight"]["counts"]
    assert {s for s, n in counts.items() if n == 1} == before
    event = next(t.event for t in compiled(TrafficLight).transitions
                 if t.source in before and t.event != "done_state")
    run.send(event)
    record = inspector.paths.record("t1")
    assert record is not None and record["trail"], record
    assert record["trail"][0]["event"] == event
    assert record["state"] == ",".join(run.configuration)
    inspector.close()


def test_an_eventless_transition_of_an_instance_is_counted_and_followed():
    """python-statemachine calls listeners with ``event=None`` for an eventless transition;
    the inspector's listeners looked it up as ``"None"``: its rate stayed 0 and a followed
    instance's path stopped before it."""
    from statemachine import State, StateChart

    class Kettle(StateChart):
        cold = State(initial=True)
        boiling = State()
        whistling = State(final=True)
        heat = cold.to(boiling)
        boiling.to(whistling)  # eventless: as soon as it boils

    inspector = Inspector()
    inspector.register(Kettle, counts=lambda: {})
    kettle = Kettle()
    inspector.paths.follow("k1", kettle)
    kettle.send("heat")
    eventless = next(t.id for t in compiled(Kettle).transitions if t.event == "")
    assert inspector.live()["charts"]["Kettle"]["per_minute"][eventless] > 0
    record = inspector.paths.record("k1")
    assert record is not None
    assert [(s["from"], s["to"]) for s in record["trail"]] == [
        ("cold", "boiling"), ("boiling", "whistling")]
    inspector.close()


def test_a_run_id_with_a_slash_is_served(shop):
    """``follow("shop/order-7", run)`` was accepted, but ``/charts/runs/shop/order-7``
    answered 404 (the route took one path segment), so the run's path could not be seen."""
    app, inspector, orders, now, Order, OrderWorkflow = shop
    run = compiled(OrderWorkflow).run(Order(items=["pen"]))
    inspector.paths.follow("shop/order-7", run)
    run.send("place")
    with TestClient(app) as client:
        answer = client.get("/charts/runs/shop/order-7?format=json")
        assert answer.status_code == 200, answer.text
        assert answer.json()["run_id"] == "shop/order-7"
        assert answer.json()["trail"][0]["to"] == "placed"


def test_a_chart_name_with_a_slash_is_served(monkeypatch):
    """``register(OrderWorkflow, name="shop/orders")`` was accepted and drawn on the page, but
    its own drawing, ``/charts/shop/orders.svg`` (the name as the path says it) or
    ``/charts/shop%2Forders.svg``, answered a plain 404 ``Not Found`` (the route took one path
    segment), as run ids with a slash did."""
    from calexec.machines.inspector import AppOptions

    monkeypatch.syspath_prepend(str(EXAMPLES))
    from order_workflow import OrderWorkflow

    inspector = Inspector()
    inspector.register(OrderWorkflow, counts=lambda: {"cart": 1}, name="shop/orders")
    drawn = []

    def svg(chart, active):
        drawn.append((chart.name, active))
        return "<svg>orders</svg>"

    app = Starlette(routes=[Mount("/charts", inspector_app(inspector, AppOptions(svg=svg)))])
    with TestClient(app) as client:
        for path in ("/charts/shop/orders.svg", "/charts/shop%2Forders.svg"):
            answer = client.get(path)
            assert answer.status_code == 200, (path, answer.text)
            assert answer.text == "<svg>orders</svg>"
            assert answer.headers["content-type"].startswith("image/svg+xml")
        missing = client.get("/charts/shop/other.svg")
        assert missing.status_code == 404
        assert missing.json() == {"error": 'chart="shop/other" is not one of ["shop/orders"]'}
    assert drawn == [("OrderWorkflow", "cart")] * 2
    inspector.close()


def test_a_followed_hierarchical_instance_names_its_configuration(monkeypatch):
    """A python-statemachine instance of a hierarchical chart has several active states: its
    record's ``state`` was None and its page was headed ``TrafficLight run t1: None``, where
    a compiled run of the same chart says ``operating,cars,green,...``."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from traffic_light import Junction, TrafficLight

    inspector = Inspector()
    light = TrafficLight(Junction())
    inspector.paths.follow("t1", light)
    light.send("power_on")
    run = compiled(TrafficLight).run(Junction())
    run.send("power_on")
    record = inspector.paths.record("t1")
    assert record is not None and record["state"] == run.state, record
    inspector.close()


def test_states_with_their_own_values_are_counted_and_named_by_id():
    """``State(value=1)``: an instance's ``configuration_values`` are the values, not the
    ids the chart's counts are keyed by, so its runs were counted nowhere and its state was
    named ``'1'``."""
    from statemachine import State, StateMachine

    class Ticket(StateMachine):
        new = State(initial=True, value=1)
        done = State(final=True, value=2)
        close = new.to(done)

    inspector = Inspector()
    ticket = Ticket()
    inspector.register(Ticket, runs=lambda: [ticket])
    inspector.paths.follow("t1", ticket)
    assert inspector.live()["charts"]["Ticket"]["counts"] == {"new": 1, "done": 0}
    ticket.send("close")
    assert inspector.live()["charts"]["Ticket"]["counts"] == {"new": 0, "done": 1}
    record = inspector.paths.record("t1")
    assert record is not None and record["state"] == "done", record
    inspector.close()


def test_runs_counts_and_active_that_are_not_callables_are_refused_by_name():
    """``register(Chart, runs=shop.workflows)`` (the list, not a function returning it) was
    accepted; the page then answered 500 at every poll (``'list' object is not callable``)."""
    from statemachine import State, StateMachine

    class Fan(StateMachine):
        off = State(initial=True)
        on = State()
        flip = off.to(on) | on.to(off)

    inspector = Inspector()
    fans = [Fan()]
    for given in ({"runs": fans}, {"counts": {"off": 1}},
                  {"runs": lambda: fans, "active": "off"}):
        field, value = next((k, v) for k, v in given.items() if not callable(v))
        with pytest.raises(TypeError) as refused:
            inspector.register(Fan, **given, count_instances=False)
        assert str(refused.value).startswith(
            f"register(Fan): {field}={value!r:.60}: expected a function returning "), refused.value
    assert inspector.charts == {}
    app = Starlette(routes=[Mount("/charts", inspector_app(inspector))])
    inspector.register(Fan, runs=lambda: fans, count_instances=False)
    with TestClient(app) as client:
        assert client.get("/charts/live.json").json()["charts"]["Fan"]["counts"] == {
            "off": 1, "on": 0}


def test_a_runs_function_that_raises_is_named_and_the_rest_still_answers(monkeypatch):
    """An app's ``runs=`` that raises (its store is down) or ``counts=`` answering a count that
    is no integer (or a ``status=`` that raises): ``live.json``, the page and every chart's drawing answered a bare 500
    (the other charts too), the page's own poll failing with them. The failing chart's
    counts are empty and its ``error`` names what raised; everything else answers."""
    from calexec.machines.inspector import AppOptions

    monkeypatch.syspath_prepend(str(EXAMPLES))
    from order_workflow import Order, OrderWorkflow
    from traffic_light import TrafficLight

    def store_down() -> list[object]:
        raise ConnectionError("orders database unreachable")

    def status() -> dict[str, object]:
        raise KeyError("queue")

    inspector = Inspector(status=status)
    inspector.register(OrderWorkflow, runs=store_down)
    inspector.register(TrafficLight, counts=lambda: {"off": "many"})
    working = OrderWorkflow(Order(items=["pen"]))
    inspector.register(OrderWorkflow, runs=lambda: [working], name="working")
    svg = AppOptions(svg=lambda chart, active: f"<svg>{chart.name} {active}</svg>")
    app = Starlette(routes=[Mount("/charts", inspector_app(inspector, svg))])
    with TestClient(app) as client:
        live = client.get("/charts/live.json")
        assert live.status_code == 200, live.text
        charts = live.json()["charts"]
        assert live.json()["status"] == {
            "error": "the status function given to Inspector raised KeyError: 'queue'"}
        assert charts["OrderWorkflow"]["counts"] == {}
        assert charts["OrderWorkflow"]["error"] == (
            "OrderWorkflow: the runs= or counts= function given to register raised "
            "ConnectionError: orders database unreachable")
        assert charts["TrafficLight"]["error"] == (  # it answered: it raised nothing
            "TrafficLight: the counts= function given to register answered a count that is "
            'no integer: "off"="many"')
        assert charts["working"]["counts"]["cart"] == 1 and "error" not in charts["working"]
        assert client.get("/charts/").status_code == 200
        assert client.get("/charts/OrderWorkflow.svg").text == "<svg>OrderWorkflow None</svg>"
        assert client.get("/charts/working.svg").text == "<svg>OrderWorkflow cart</svg>"
    inspector.close()


@pytest.mark.parametrize(("answered", "named"), [
    ({"Green": 2}, 'answered a state the chart does not have: "Green" (its states, by id: '),
    ({"green": -1}, 'answered a count below 0: "green"=-1'),
])
def test_counts_for_a_state_the_chart_lacks_or_below_zero_are_named(monkeypatch, answered,
                                                                     named):
    """A ``counts=`` keyed by a state's name or value (``"Green"``) instead of its id, or by a
    typo, was shown as given in ``live.json`` and drawn nowhere: the page showed no run in
    any state, without a word; a negative count was painted as given. Named as a count that
    is no integer is."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from traffic_light import TrafficLight

    inspector = Inspector()
    inspector.register(TrafficLight, counts=lambda: answered)
    chart = inspector.live()["charts"]["TrafficLight"]
    assert chart["counts"] == {}
    assert chart["error"].startswith(
        f"TrafficLight: the counts= function given to register {named}"), chart["error"]
    inspector.close()


def test_a_rate_just_after_the_first_sample_is_not_extrapolated_from_milliseconds(monkeypatch):
    """One transition 2 ms after the inspector's first sample read 30,000 per minute (the
    count over 2 ms, times 60 s): the live page showed a burst that never was (until stop 64
    it then read 60, as per second: see the test below)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from order_workflow import Order, OrderWorkflow

    now = [100.0]
    inspector = Inspector(window_s=60.0, clock=lambda: now[0])
    inspector.register(OrderWorkflow, counts=dict, count_instances=False)
    place = next(t for t in compiled(OrderWorkflow).transitions if t.event == "place")
    compiled(OrderWorkflow).run(Order(items=["pen"])).send("place")
    now[0] += 0.002
    assert inspector.rates.per_minute()["OrderWorkflow"][place.id] == pytest.approx(1.0)
    now[0] += 29.998  # one in the last minute
    assert inspector.rates.per_minute()["OrderWorkflow"][place.id] == pytest.approx(1.0)


def test_one_transition_reads_one_per_minute_for_the_whole_window(monkeypatch):
    """One transition seconds after ``register`` read 60 per minute at the next poll (the
    count per second since the first sample, times 60), then 30, 20, 12 ... as the page polled
    on with nothing taken: a rate falling from a burst that never was. Nothing was counted
    before the first sample, so the count over the last minute is that one transition: 1 per
    minute at every poll within the window (the page polls each second), then 0."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from order_workflow import Order, OrderWorkflow

    now = [500.0]
    inspector = Inspector(window_s=60.0, clock=lambda: now[0])
    inspector.register(OrderWorkflow, counts=dict, count_instances=False)
    place = next(t for t in compiled(OrderWorkflow).transitions if t.event == "place")
    now[0] += 0.3
    compiled(OrderWorkflow).run(Order(items=["pen"])).send("place")
    seen = []
    for _ in range(58):  # one poll a second, as the page does
        now[0] += 1.0
        seen.append(inspector.rates.per_minute()["OrderWorkflow"][place.id])
    assert seen == [1.0] * 58
    now[0] += 4.0  # the transition is older than the window (and its samples) now
    assert inspector.rates.per_minute()["OrderWorkflow"][place.id] == 0.0
    inspector.close()


def test_an_active_state_the_chart_does_not_have_is_named_not_drawn():
    """``/Lamp.svg?active=nope`` was answered 200 with the chart as if no query were given
    (every query key was ignored, ``?active=on`` too), and an ``active=`` function answering
    a state the chart does not have (its name, ``On``, for its id) failed that chart's
    drawing and the page of every chart with a bare 500. ``?active=STATE`` now highlights
    that state, one the chart does not have is a 400 naming it and the chart's states; the
    function's unknown state highlights nothing and ``live.json`` names it."""
    from statemachine import State, StateMachine

    from calexec.machines.diagrams import render_chart_dot
    from calexec.machines.inspector import AppOptions

    class Lamp(StateMachine):
        off = State("Off", initial=True)
        on = State("On")
        flip = off.to(on) | on.to(off)

    def svg(chart, active):
        render_chart_dot(chart, active)  # what render_chart_svg lays out: refuses 'On'
        return f"<svg>{chart.name} {active}</svg>"

    inspector = Inspector()
    inspector.register(Lamp, counts=lambda: {"off": 2, "on": 1})
    inspector.register(Lamp, counts=lambda: {"off": 2, "on": 1}, active=lambda: "On",
                       name="typo")
    app = Starlette(routes=[Mount("/charts", inspector_app(inspector, AppOptions(svg=svg)))])
    with TestClient(app) as client:
        assert client.get("/charts/Lamp.svg").text == "<svg>Lamp off</svg>"
        assert client.get("/charts/Lamp.svg?active=on").text == "<svg>Lamp on</svg>"
        for query, error in [
                ("active=nope", 'active="nope": not a state of "Lamp" (its states, by id: '
                                "off, on)"),
                ("activ=on", "activ: unknown parameter ({chart}.svg?active=STATE)"),
                # (until stop 62 "given more than once": a configuration is several states)
                ("active=on&active=off", 'active="on,off": "off" and "on" are never active at '
                                         "once: a run is in one child of the chart and of "
                                         "each compound state, in every region of a parallel "
                                         "state")]:
            answer = client.get(f"/charts/Lamp.svg?{query}")
            assert answer.status_code == 400, (query, answer.text)
            assert answer.json() == {"error": error}, query
        typo = client.get("/charts/typo.svg")
        assert typo.status_code == 200 and typo.text == "<svg>Lamp None</svg>", typo.text
        assert client.get("/charts/").status_code == 200
        live = client.get("/charts/live.json").json()["charts"]
        assert live["typo"]["error"] == (
            "typo: the active= function given to register answered a state the chart does "
            'not have: "On" (its states, by id: off, on); "On" is the name of state on: answer '
            'its id, on')
        assert live["typo"]["counts"] == {"off": 2, "on": 1} and "error" not in live["Lamp"]
    inspector.close()


def test_a_parameter_given_empty_is_taken_as_not_given_on_every_route():
    """Found at stop 58: ``/Lamp.svg?active=`` (what a link built from an empty field or a
    JS ``null`` sends, or ``?active`` alone) was a 400, ``active='': not a state``, and
    ``runs/{id}?format=`` a 400, ``format='': must be json or html``, where a user means "not
    given". Every route now takes a known parameter given empty as not given (the busiest
    state highlighted, the page answered), drops it before counting repeats
    (``?active=&active=on`` highlights ``on``), ignores a bare ``?=`` or ``&``, and still
    refuses an unknown key, empty or not, naming it."""
    from statemachine import State, StateMachine

    from calexec.machines.inspector import AppOptions

    class Lamp(StateMachine):
        off = State(initial=True)
        on = State()
        flip = off.to(on) | on.to(off)

    inspector = Inspector()
    inspector.register(Lamp, counts=lambda: {"off": 1, "on": 3}, count_instances=False)
    run = compiled(Lamp).run(object())
    inspector.paths.follow("r1", run)
    run.send("flip")
    app = Starlette(routes=[Mount("/charts", inspector_app(
        inspector, AppOptions(svg=lambda chart, active: f"<svg>{chart.name} {active}</svg>")))])
    with TestClient(app) as client:
        for query in ["active=", "active", "active=%20", "active=&active=", "=", "&", "active=&"]:
            answer = client.get(f"/charts/Lamp.svg?{query}")
            assert answer.status_code == 200, (query, answer.text)
            assert answer.text == "<svg>Lamp on</svg>", query  # the busiest, as with no query
        both = client.get("/charts/Lamp.svg?active=&active=off")
        assert both.status_code == 200 and both.text == "<svg>Lamp off</svg>", both.text
        drawn = shutil.which("dot") is not None  # (the run's HTML page draws with graphviz)
        for query in ["format=", "format", "format=&format=", "="]:
            page = client.get(f"/charts/runs/r1?{query}")
            if not drawn:  # the HTML page, as with no query: it needs dot, not a 400
                assert page.status_code == 503 and "graphviz" in page.text, (query, page.text)
                continue
            assert page.status_code == 200, (query, page.text[:300])
            assert page.headers["content-type"].startswith("text/html"), query
        data = client.get("/charts/runs/r1?format=&format=json")
        assert data.status_code == 200 and data.json()["state"] == "on", data.text[:300]
        for route in ["/charts/", "/charts/live.json"]:
            answer = client.get(f"{route}?=")
            assert answer.status_code == 200, (route, answer.text[:300])
        for url, error in [
                ("/charts/live.json?run=", "run: unknown parameter (live.json takes no query "
                                           "parameter)"),
                ("/charts/Lamp.svg?activ=", "activ: unknown parameter ({chart}.svg?active="
                                            "STATE)"),
                ("/charts/runs/r1?fromat=", "fromat: unknown parameter (runs/{run_id}?format="
                                            "json|html)")]:
            answer = client.get(url)
            assert answer.status_code == 400, (url, answer.text)
            assert answer.json() == {"error": error}, url
    inspector.close()


@pytest.mark.requires_tool("chromium", "dot")
def test_a_status_key_named_like_the_pages_own_elements_shows_in_the_browser(monkeypatch,
                                                                           tmp_path):
    """``Inspector(status=...)``'s keys were the ids of the status line's fields: a key
    ``status`` (the status paragraph's own id) had the page's script write its value over
    the whole status line (every other field and the ``updated`` clock gone), then fail at
    each poll (``updated`` no longer there), so the page stopped counting its updates; a key
    ``updated`` took the clock's place. A field is now found by its key (``data-status``):
    every value shows, refreshed, and the page updates itself."""
    import re

    from calexec.drivers.tools.live_screenshots import chromium_capture
    from test_server_support import LiveServer

    monkeypatch.syspath_prepend(str(EXAMPLES))
    from order_workflow import Order, OrderWorkflow

    polls = [0]

    def status():
        polls[0] += 1
        return {"status": "open", "updated": "by the shop", "orders": polls[0]}
    inspector = Inspector(status=status)
    orders = [OrderWorkflow(Order())]
    inspector.register(OrderWorkflow, runs=lambda: orders)
    try:
        with LiveServer(inspector_app(inspector)) as server:
            done = chromium_capture(f"{server.url}/", str(tmp_path))
    finally:
        inspector.close()
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    fields = dict(re.findall(r'<b data-status="([^"]+)">([^<]*)</b>', dom))
    assert fields.keys() == {"status", "updated", "orders"}, dom[:3000]
    assert fields["status"] == "open" and fields["updated"] == "by the shop"
    assert int(fields["orders"]) >= 2  # refreshed by the page's polls, past the first
    updates = re.search(r'<body[^>]*data-updates="(\d+)"', dom)
    assert updates and int(updates.group(1)) >= 2, "the page did not refresh itself"
    clock = re.search(r'<b id="updated">([^<]*)</b>', dom)
    assert clock and clock.group(1) not in ("never", "by the shop"), clock


@pytest.mark.requires_tool("chromium", "dot")
def test_the_page_names_an_error_answer_of_live_json(monkeypatch, tmp_path):
    """Once ``live.json`` answered an error (the app draining: a 503 with a JSON body), the
    page's line read ``update failed: TypeError: Cannot convert undefined or null to object``
    (the error body read as data), naming neither the answer nor its status; it now names
    the URL, the status and the body, and keeps the last counts it drew."""
    import re

    from starlette.responses import JSONResponse

    from calexec.drivers.tools.live_screenshots import chromium_capture
    from test_server_support import LiveServer

    monkeypatch.syspath_prepend(str(EXAMPLES))
    from order_workflow import Order, OrderWorkflow

    inspector = Inspector()
    orders = [OrderWorkflow(Order())]
    inspector.register(OrderWorkflow, runs=lambda: orders)
    answered = [0]
    inner = inspector_app(inspector)

    async def draining(scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith("/live.json"):
            answered[0] += 1
            if answered[0] > 1:  # the first poll answers; then the app drains
                reply = JSONResponse({"error": {"message": "draining"}}, status_code=503)
                await reply(scope, receive, send)
                return
        await inner(scope, receive, send)
    try:
        with LiveServer(draining) as server:
            done = chromium_capture(f"{server.url}/", str(tmp_path))
    finally:
        inspector.close()
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert answered[0] >= 2
    clock = re.search(r'<b id="updated">([^<]*)</b>', dom)
    assert clock and clock.group(1).startswith(
        'update failed: Error: /live.json answered HTTP 503: {"error":{"message":"draining"}}'), \
        clock
    assert re.search(r'<g id="s_cart" class="node"[^>]*data-count="1"', dom), "counts kept"


@pytest.mark.requires_tool("dot")
@pytest.mark.parametrize("window, says", [(60.0, "60 s"), (0.5, "0.5 s"), (90.6, "90.6 s"),
                                          (3600, "3600 s")])
def test_the_legend_names_the_rate_window_as_given(monkeypatch, window, says):
    """The page's legend wrote the rate window with ``:.0f``: ``Inspector(window_s=0.5)`` read
    "per minute over the last 0 s", 90.6 s read 91 s."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from order_workflow import OrderWorkflow

    inspector = Inspector(window_s=window)
    inspector.register(OrderWorkflow, counts=dict, count_instances=False)
    try:
        page = TestClient(inspector_app(inspector)).get("/")
    finally:
        inspector.close()
    assert page.status_code == 200, page.text
    assert f"per minute over the last {says} (every run" in page.text
