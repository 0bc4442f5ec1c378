"""Error bodies of the reference server: a §8 Status rendered with ``Status.http_status`` in
the OpenAI shape ``{"error": {"message", "type", "code", "param"}}`` plus ``"status":
Status.to_dict()``; 429 and 503 carry ``Retry-After``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status

#: the request field a refusal by the executor is about (the error body's ``param``)
PARAM_OF_CODE = {"kv.exceeds_capacity": "max_tokens"}

ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error",
               499: "cancelled_error", 503: "unavailable_error", 504: "timeout_error"}


#: Status codes whose OpenAI error ``code`` is OpenAI's own name (``status.code`` keeps calexec's)
OPENAI_CODE = {"request.model_not_found": "model_not_found",
                "request.invalid_api_key": "invalid_api_key"}


def error_response(status: Status, param: str | None = None, retry_after: int = 1,
                   http_status: int | None = None) -> JSONResponse:
    """The JSON error body of a failure Status (OpenAI shape + calexec's status dict)."""
    code = status.http_status if http_status is None else http_status
    body = {"error": error_body(status, param, code), "status": status.to_dict()}
    headers = {"Retry-After": str(retry_after)} if code in (429, 503) else None
    return JSONResponse(body, status_code=code, headers=headers)


def error_body(status: Status, param: str | None = None,
               http_status: int | None = None) -> dict[str, Any]:
    """The OpenAI-shaped ``error`` object of a failure (also the SSE error event's)."""
    code = status.http_status if http_status is None else http_status
    return {"message": status.message or status.code,
            "type": ERROR_TYPE.get(code, "server_error"),
            "code": OPENAI_CODE.get(status.code, status.code), "param": param}


def invalid(message: str) -> Status:
    """A 400 INVALID_REQUEST failure naming what was wrong."""
    return Status.failure("request.invalid", Category.INVALID_REQUEST, Phase.VALIDATE, message)
