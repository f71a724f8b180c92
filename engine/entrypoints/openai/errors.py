"""OpenAI-style errors: every fault is answered with `{"error": {"message", "type", "param", "code"}}`.

- 400: malformed HTTP (answered by the connection guard, connection.py), malformed JSON or JSON nested deeper
  than `MAX_JSON_DEPTH`, a bad parameter (the error's `param` names it; values the sampler cannot compute too),
  a prompt that cannot fit, more sequences (`n` x prompts) than the waiting queue could ever hold.
- 401: `--api-key` set and neither `Authorization: Bearer <key>` nor the login cookie sent (auth.py).
- 404: unknown model name. 408: request headers or body not received in time (connection.py).
- 413: request body over `max_body_bytes`. 431: request headers too large.
- 499 (counted in /metrics, never seen by the client): the client closed the connection first.
- 500 `engine_error`: an engine step raised on this request's rows (it alone failed; the others ran on).
- 503 + `Retry-After`: no engine right now, or its waiting queue (`EngineConfig.max_waiting_requests`)
  is full now (only when waiting can help). A request is accepted whole or not at all (all `n` choices of all prompts), so nothing
  accepted is dropped.
- 504: the request ran past `request_timeout`; it is aborted in the engine (in a stream: an error
  event, then `data: [DONE]`).
"""
from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)

# pydantic-core's JSON parser refuses deeper nesting ("recursion limit exceeded")
MAX_JSON_DEPTH = 200
CLIENT_CLOSED = 499         # nginx's status for a request whose client went away before the response

_PARAM_RE = re.compile(r"^(?:SamplingParams\.)?([A-Za-z_][\w.]*):\s*(.*)$", re.S)


class APIError(Exception):
    """An error that becomes an OpenAI-style JSON error response."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------------------------------------ 400
def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field."""
    errs = e.errors(include_url=False)
    if not errs:
        return APIError("invalid request body")
    err = errs[0]
    if err.get("type") == "json_invalid":
        if "recursion limit" in str(err.get("msg", "")):
            return APIError(f"request body: JSON nested too deep (at most {MAX_JSON_DEPTH} levels of arrays and "
                            "objects)", code="json_too_deep")
        return APIError(f"malformed JSON body: {err.get('msg', '')}".rstrip(": "), code="invalid_json")
    if not err.get("loc"):
        return APIError("request body: must be a JSON object", code="invalid_body")
    param = _loc(err["loc"])
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err.get("type") == "extra_forbidden":
        return APIError(f"{param}: is not supported by this server", param=param, code="unsupported")
    if err.get("type") == "missing":
        return APIError(f"{param}: is required", param=param, code="missing_field")
    got = err.get("input")
    tail = "" if isinstance(got, dict) else f" (got {_short(got)})"
    return APIError(f"{param}: {msg}{tail}", param=param, code="invalid_value")


def value_error(e: ValueError, rename: dict[str, str]) -> APIError:
    """An engine ValueError (`"field: message"`) as a 400 naming the request's parameter."""
    msg = str(e)
    m = _PARAM_RE.match(msg)
    if not m:
        return APIError(msg)
    param = rename.get(m.group(1), m.group(1))
    return APIError(f"{param}: {m.group(2)}", param=param, code="invalid_value")


# ------------------------------------------------------------------------------------------ 401
def unauthorized() -> JSONResponse:
    return JSONResponse(error_body("Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                   "authentication_error", None, "invalid_api_key"),
                        401, headers={"WWW-Authenticate": "Bearer"})


# ------------------------------------------------------------------------------------------ 503 / 504
def engine_unavailable(retry_after_s: int, cause: Exception | None = None) -> APIError:
    why = f" ({cause})" if cause is not None else ""
    return APIError(f"the engine is not available right now{why}; retry shortly", 503, "server_error",
                    code="engine_unavailable", headers={"Retry-After": str(retry_after_s)})


def engine_stopped(cause: BaseException, retry_after_s: int) -> APIError:
    return APIError(f"the engine was stopped while serving this request: {cause}", 503, "server_error",
                    code="engine_stopped", headers={"Retry-After": str(retry_after_s)})


def server_overloaded(max_waiting_requests: int | None, retry_after_s: int, detail: str) -> APIError:
    return APIError(f"The server is overloaded: the engine's waiting queue is full "
                    f"(max_waiting_requests={max_waiting_requests}); retry after {retry_after_s} s. [{detail}]",
                    503, "server_overloaded", code="queue_full", headers={"Retry-After": str(retry_after_s)})


def request_timeout(timeout: float) -> APIError:
    return APIError(f"request timed out after {timeout:g} s and was aborted (server request_timeout)", 504,
                    "timeout_error", code="request_timeout")


# ------------------------------------------------------------------------------------------ responses
def client_closed() -> JSONResponse:
    return JSONResponse(error_body("client closed the connection before the response", "client_closed_request",
                                   None, CLIENT_CLOSED), CLIENT_CLOSED)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, headers=e.headers)


def guarded(handler):
    """Route wrapper: APIError -> its OpenAI-style response; anything else -> a logged 500. Kept per route
    (not app-wide exception handlers) so an app shared with the Gradio UI keeps its own error pages."""
    async def route(request: Request):
        try:
            return await handler(request)
        except APIError as e:
            return error_response(e)
        except ClientDisconnect:          # the client left while its body was read: no one to answer
            return client_closed()
        except Exception as e:  # noqa: BLE001
            log.exception("unhandled error on %s", request.url.path)
            return JSONResponse(error_body(f"internal server error: {type(e).__name__}: {e}", "server_error",
                                           None, 500), 500)
    route.__name__ = handler.__name__
    return route


async def http_exception_handler(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) as OpenAI-style bodies (standalone apps only)."""
    kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", kind, None,
                                   e.status_code), e.status_code, headers=getattr(e, "headers", None))
