"""Debug endpoints of the reference server: live job counts, one job's path on its chart
(admin), and the live statecharts page with each chart as SVG (the generic inspector,
machines/inspector.py, mounted at ``/debug/statecharts``: drivers/serving/live_charts.py)."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from calexec.contracts.errors import Category
from calexec.contracts.fields import shown
from calexec.contracts.status import Phase, Status
from calexec.drivers.serving.admin import admin_refusal, query_refusal
from calexec.drivers.serving.error_bodies import error_response, invalid, route_error
from calexec.drivers.serving.live_charts import COUNTED, LABELS, path_page, server_inspector
from calexec.drivers.serving.service import OperatorBusy, RouteService
from calexec.machines.compiled import CHARTS
from calexec.machines.diagrams import GraphvizError, render_chart_svg
from calexec.machines.inspector import AppOptions, inspector_app

#: a job id in a path: ASCII digits only, at most 18 (a job counter never gets longer)
JOB_ID = re.compile(r"[0-9]{1,18}")
#: the query parameters of ``/debug/jobs/{id}``, and the values its ``format`` takes
JOB_PARAMS = ("format",)
JOB_FORMATS = ("html", "json")


@functools.lru_cache(maxsize=64)
def chart_svg_cached(chart: str, active: str | None) -> str:
    return render_chart_svg(CHARTS[chart], active)


def no_graphviz(err: GraphvizError, route: str) -> Response:
    """503 naming why a chart cannot be drawn (graphviz's ``dot`` absent or failing) and what
    serves the same data without it; never a 500 with a traceback."""
    return error_response(Status.failure(
        "debug.graphviz_unavailable", Category.UNAVAILABLE, Phase.VALIDATE,
        f"{route} draws the charts with graphviz, which is not available here: {err}; "
        "/debug/statecharts/live.json and /debug/jobs/{id}?format=json need no graphviz"))


def inspector_error(request: Request, status: int, message: str | None,
                    headers: Mapping[str, str]) -> Response:
    """An error of the mounted inspector as every other error of the server (OpenAI shape):
    a path or method no route takes (``message`` None: 404 / 405 + ``Allow``, as
    ``error_bodies.route_error``), an unknown chart or run (404 ``not_found`` naming it), a
    query it does not take (400 ``request.invalid`` naming it)."""
    if message is None:
        return route_error(request.method, request.url.path, status, dict(headers))
    code = "request.not_found" if status == 404 else "request.invalid"
    return error_response(Status.failure(code, Category.INVALID_REQUEST, Phase.VALIDATE,
                                         message), None, http_status=status,
                          headers=dict(headers) or None)


def add_debug_routes(app: FastAPI, owner: RouteService) -> None:
    """The ``/debug/...`` routes on ``app``."""
    config = owner.service.config

    @app.get("/debug/jobs")
    async def debug_jobs(request: Request) -> Response:
        """Live job counts; it takes no query parameter (``?limt=5``: a 400 naming it, as
        every ``/admin`` and ``/debug`` route answers one it does not take)."""
        service = owner.service
        unknown = query_refusal(request, (), "GET /debug/jobs takes no query parameter; "
                                "one job's path: GET /debug/jobs/{id}")
        if unknown is not None:
            return unknown
        return JSONResponse({"lifecycle": service.executor.state,
                             "jobs": service.live_job_counts()})

    @app.get("/debug/jobs/{job_id}")
    async def debug_job(job_id: str, request: Request) -> Response:
        """The path of one job (admin): taken transitions and refusing guards, on the chart.
        ``?format=json`` for the data. A failed request's error body names its ``job_id``."""
        service = owner.service
        refused = admin_refusal(request, config)
        if refused is not None:
            return refused
        if not JOB_ID.fullmatch(job_id):  # str.isdigit() takes "²", which int() refuses
            # (a 19-digit id is a decimal integer too: the message says what is taken)
            return error_response(invalid(f"job_id={shown(job_id, 40)}: must be a job id, 1 to 18 "
                                          "ASCII digits"), "job_id")
        unknown = query_refusal(request, JOB_PARAMS, "GET /debug/jobs/{id}?format=json|html")
        if unknown is not None:
            return unknown
        # a value given empty or blank (``?format=``, a client's null left out) is not given,
        # as on every route of the inspector mounted beside it
        given = [value for value in request.query_params.getlist("format") if value.strip()]
        if len(given) > 1:  # (which one was meant is the client's)
            return error_response(invalid(f"format={shown(given[0], 64)}: given {len(given)} "
                                          "times in the query, give it once"), "format")
        view = given[0] if given else "html"
        if view not in JOB_FORMATS:  # (`format=JSON` answered the HTML page)
            return error_response(invalid(f"format={shown(view, 64)}: must be one of "
                                          f"{', '.join(JOB_FORMATS)}"), "format")
        wanted = int(job_id)
        record = service.executor.job_trail(wanted)
        if record is None:  # a 404's code, as every other 404 (it was `request.invalid`, a 400's)
            return error_response(Status.failure(
                "request.not_found", Category.INVALID_REQUEST, Phase.VALIDATE,
                f"job_id={wanted}: unknown, still running, or older than the last "
                f"{service.executor.config.job_trails_kept} jobs"), "job_id", http_status=404)
        if view == "json":
            return JSONResponse(record)
        try:
            svg_page = await service.operator_call(f"GET /debug/jobs/{wanted}: its drawing",
                                                   path_page, record)
        except GraphvizError as err:
            return no_graphviz(err, "/debug/jobs/{id}")
        if isinstance(svg_page, OperatorBusy):  # (?format=json needs no turn)
            return error_response(svg_page.status, "job_id",
                                  retry_after=service.config.retry_after_s)
        return HTMLResponse(svg_page)

    @app.get("/debug/statecharts")
    async def statecharts_page(request: Request) -> Response:
        """The mounted page is ``/debug/statecharts/``: a redirect there by a relative
        Location (the router's own slash redirect is off: it named the client's Host)."""
        unknown = query_refusal(request, (), "GET /debug/statecharts/ takes no query "
                                "parameter")
        if unknown is not None:  # (the redirect dropped it: as if honoured)
            return unknown
        return RedirectResponse("statecharts/", status_code=307)

    # the live statecharts page: the generic inspector, mounted as any app would mount it
    served = owner.service  # (held by the mounted page, the app's: no route function)
    inspector = server_inspector(served.executor, served.live_job_counts)
    page = inspector_app(inspector, AppOptions(
        svg=lambda chart, active: chart_svg_cached(chart.name, active),
        graphviz_error=no_graphviz, error=inspector_error, title="calexec statecharts",
        labels=LABELS, counted=COUNTED,
        # the lifecycle chart first (the operator's question: is it Ready?), then the rest
        order=lambda names: sorted(names, key=lambda name: name != "lifecycle")))
    page.router.redirect_slashes = False  # "/debug/statecharts/live.json/": a 404, as above
    app.mount("/debug/statecharts", page)
