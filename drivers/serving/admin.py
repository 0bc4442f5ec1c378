"""Admin endpoints of the reference server (bearer token, ``ServerConfig.admin_token``):
``POST /admin/drain?grace=S`` and ``POST /admin/reload`` (model switch, §9.2), with the
checks a calbin path passes before the lifecycle moves."""

from __future__ import annotations

import hmac
import json
import math
import os
import stat
from typing import Any

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.serving import wire
from calexec.drivers.serving.error_bodies import body_timeout, error_response, invalid
from calexec.drivers.serving.service import CompletionService, ServerConfig

#: longest ``/admin/reload`` path accepted (Linux PATH_MAX)
MAX_PATH_CHARS = 4096


def calbin_path_refusal(path: Any, max_bytes: int) -> str | None:
    """Why ``path`` cannot be a calbin to load (None: it can), checked before the lifecycle
    moves and without opening it: a string, no NUL, at most ``MAX_PATH_CHARS``, an existing
    regular file (``os.stat`` + ``S_ISREG``: a FIFO, a device such as /dev/zero or a directory
    is refused without blocking on it), non-empty, at most ``max_bytes``, readable."""
    if not isinstance(path, str) or not path:
        return f"calbin={path!r}: a calbin file path (a non-empty string) is required"
    shown = repr(path[:200])
    if "\x00" in path:
        return f"calbin={shown}: the path contains a NUL character"
    if len(path) > MAX_PATH_CHARS:
        return f"calbin={shown}...: the path is longer than {MAX_PATH_CHARS} characters"
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return f"calbin={shown}: no such file"
    except (OSError, ValueError) as err:
        return f"calbin={shown}: cannot stat the file ({err})"
    if not stat.S_ISREG(info.st_mode):
        return f"calbin={shown}: not a regular file (mode {stat.filemode(info.st_mode)})"
    if info.st_size == 0:
        return f"calbin={shown}: the file is empty"
    if info.st_size > max_bytes:
        return f"calbin={shown}: {info.st_size} bytes > max_calbin_bytes={max_bytes}"
    if not os.access(path, os.R_OK):
        return f"calbin={shown}: the file is not readable by the server"
    return None



def admin_refusal(request: Request, config: ServerConfig) -> JSONResponse | None:
    """None when ``request`` carries the admin bearer token (constant-time compare), else the
    401/403 answer."""
    header = request.headers.get("authorization", "")
    if config.admin_token is None:
        return error_response(Status.failure("admin.disabled", Category.INVALID_REQUEST,
                                             Phase.VALIDATE, "no admin token is configured"),
                              http_status=403)
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return error_response(Status.failure("admin.unauthenticated", Category.INVALID_REQUEST,
                                             Phase.VALIDATE, "Authorization: Bearer <token> "
                                             "required"), http_status=401)
    if not hmac.compare_digest(token.encode("utf-8"), config.admin_token.encode("utf-8")):
        return error_response(Status.failure("admin.forbidden", Category.INVALID_REQUEST,
                                             Phase.VALIDATE, "admin token does not match"),
                              http_status=403)
    return None



def add_admin_routes(app: FastAPI, service: CompletionService) -> None:
    """``/admin/drain`` and ``/admin/reload`` on ``app``."""
    executor, config = service.executor, service.config
    retry = config.retry_after_s

    @app.post("/admin/drain")
    async def admin_drain(request: Request) -> Response:
        refused = admin_refusal(request, config)
        if refused is not None:
            return refused
        raw_grace = request.query_params.get("grace", "30")
        try:
            grace = float(raw_grace)
        except ValueError:
            grace = math.nan
        if not (math.isfinite(grace) and 0 <= grace <= config.max_drain_grace_s):
            return error_response(invalid(f"grace={raw_grace[:64]!r}: must be a finite number "
                                           f"of seconds in [0, {config.max_drain_grace_s:g}]"),
                                  "grace")
        started = service.drain_grace is None
        service.start_drain(grace)  # idempotent: a drain under way keeps its own grace
        return JSONResponse({"draining": True, "grace": service.drain_grace,
                             "started": started}, status_code=202)

    @app.post("/admin/reload")
    async def admin_reload(request: Request) -> Response:
        """Model switch through the lifecycle (§9.2): body {"calbin": PATH}. The new calbin
        serves only after its golden passes; otherwise the previous one serves again."""
        refused = admin_refusal(request, config)
        if refused is not None:
            return refused
        media = wire.non_json_media(request)
        if media is not None:
            return error_response(invalid(f"content-type {media!r}: the body must be JSON "
                                          "(application/json)"), None, http_status=415)
        try:
            raw = await wire.read_body(request, config.max_body_bytes, config.body_timeout_s)
        except wire.ClientGone as gone:
            return error_response(Status.cancelled(Phase.VALIDATE, str(gone)), None,
                                  http_status=499)
        except wire.BodyTimeout as late:
            return error_response(body_timeout(str(late), config.body_timeout_s), None,
                                  http_status=408, headers=wire.CLOSE)
        if raw is None:
            return error_response(invalid(f"request body exceeds max_body_bytes="
                                          f"{config.max_body_bytes}"), None, http_status=413,
                                  headers=wire.CLOSE)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        path = body.get("calbin") if isinstance(body, dict) else None
        refusal = calbin_path_refusal(path, config.max_calbin_bytes)
        if refusal is not None or not isinstance(path, str):  # (no refusal: a str)
            return error_response(invalid(refusal or f"calbin={path!r}"), "calbin")
        # the lifecycle moves only when it can: not while draining, recovering or unhealthy
        reasons = ["server is draining"] if service.draining else service.health()
        if reasons:
            return error_response(Status.unavailable(
                Phase.RECOVERY, f"reload refused, lifecycle unchanged: {'; '.join(reasons)}"),
                "calbin", retry_after=retry)
        status = await to_thread.run_sync(executor.switch_model, path)
        if not status.ok:
            return error_response(status, "calbin")
        gen = executor.gen  # the switch succeeded: the new generation
        return JSONResponse({"reloaded": True, "calbin": path,
                             "generation": None if gen is None else gen.id,
                             "lifecycle": executor.state})
