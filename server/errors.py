"""One error shape for every failure: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.base import (BackendMissing, Cancelled, ContextLengthExceeded, DeviceOutOfMemory,
                          EngineError)
from engines.runtime.kv import KVPoolTooSmall

log = logging.getLogger("duet.server")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


ECHO_CHARS = 64


def echo(text: str) -> str:
    """A short prefix of user input, for an error message: never the whole of a large value."""
    text = str(text)
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}... ({len(text)} characters)"


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model '{echo(model)}' does not exist; GET /v1/models lists the models served",
        param="model", code="model_not_found",
    )


# Where each task's models are served, for the error that sends a request to the right route.
TASK_ROUTES = {
    "generate": "/v1/chat/completions, /v1/completions and /v1/classifications (zero-shot)",
    "classify": "/v1/classifications",
    "embed": "/v1/embeddings",
}


def wrong_task(model: str, task: str, wanted: tuple[str, ...]) -> APIError:
    """A model used on a route of another task: 400 naming its task and where it is served."""
    kinds = " or ".join(f"'{w}'" for w in wanted)
    return bad_request(
        f"model '{model}' has task '{task}' and is served on {TASK_ROUTES.get(task, '?')}; "
        f"this route needs a task {kinds} model", param="model")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down and stopped this request before it ended",
                    type="server_error", code="server_shutting_down",
                    headers={"Connection": "close"})


def queue_full(label: str, waiting: int, retry_after_s: int) -> APIError:
    return APIError(
        429,
        f"the {label} engine is busy: {waiting} requests are already waiting (the limit is "
        f"DUET_MAX_QUEUE); retry in {retry_after_s} s",
        type="rate_limit_error", code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def request_timed_out(limit_s: float) -> APIError:
    return APIError(
        504, f"the request took longer than the server's time limit of {limit_s:g} s "
        "(DUET_REQUEST_TIMEOUT_S), queueing included, and was stopped",
        type="timeout_error", code="request_timeout",
    )


def from_engine_error(exc: EngineError, prompt_param: str = "messages") -> APIError:
    if isinstance(exc, ContextLengthExceeded):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, BackendMissing):
        return APIError(400, str(exc), param="engine", code="engine_unavailable")
    if isinstance(exc, KVPoolTooSmall):  # it would wait for ever: the pool is never that free
        return APIError(400, str(exc), param="max_tokens", code="kv_cache_too_small")
    if isinstance(exc, DeviceOutOfMemory):
        return APIError(503, str(exc), type="server_error", code="out_of_memory")
    return APIError(503, str(exc), type="server_error", code="model_unavailable")


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "literal"}


def _param_from_loc(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'.

    pydantic puts union member and validator names in the location; they are not fields."""
    out = ""
    for part in loc:
        if part in ("body", "query", "path", "header"):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        part = str(part)
        if "[" in part or "-" in part or part in _TYPE_TAGS or part[:1].isupper():
            continue
        out += ("." if out else "") + part
    return out or None


# Validation error types raised by our own validators that become the error's code.
_OWN_CODES = {"unsupported_parameter"}
# Errors that say what is wrong with a value, preferred over the "not a string" of the other
# members of a union (content may be a string or a list of parts: a bad list is not a string).
_SPECIFIC = _OWN_CODES | {"invalid_text"}


_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                 413: "request_too_large", 415: "unsupported_media_type"}


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True  # FastAPI parses a body without a content type as JSON
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def not_json(content_type: str) -> APIError:
    return APIError(
        415, f"the request body must be JSON, sent with 'Content-Type: application/json'; this "
        f"one came as '{echo(content_type)}'", code="unsupported_media_type")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errors = exc.errors()
    if not errors:
        return "Invalid request", None, "invalid_value"
    first = next((e for e in errors if e.get("type") in _SPECIFIC), errors[0])
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON", None, "invalid_value"
    code = first["type"] if first.get("type") in _OWN_CODES else "invalid_value"
    param = _param_from_loc(tuple(first.get("loc", ()))) or (first.get("ctx") or {}).get("name")
    msg = first.get("msg", "Invalid value")
    # pydantic's messages do not name the field; our own (PydanticCustomError) begin with it.
    if param and code == "invalid_value" and not msg.startswith((f"{param}:", f"{param} ")):
        msg = f"{param}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return msg, param, code


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        content_type = request.headers.get("content-type")
        errors = exc.errors()
        if errors and tuple(errors[0].get("loc", ())) == ("body",) and not _is_json(content_type):
            return not_json(content_type or "").response()  # the body was never read as JSON
        message, param, code = _validation_message(exc)
        return APIError(400, message, param=param, code=code).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 400:  # FastAPI could not read the body at all (e.g. not UTF-8)
            message = "the request body could not be read as JSON text (is it UTF-8?)"
        elif exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            # The router's own answer: say which route, as OpenAI's "Invalid URL (POST /v1/x)".
            route = f"{request.method} {echo(request.url.path)}"
            message = (f"duet has no route {route}: see GET /v1/models and docs/api.md for "
                       "what it serves" if exc.status_code == 404 else
                       f"{route} is not allowed here; allowed: {exc.headers.get('Allow', '?')}"
                       if exc.headers else f"{route} is not allowed here")
        code = _STATUS_CODES.get(exc.status_code, "invalid_value")
        return APIError(exc.status_code, message, type=kind, code=code,
                        headers=exc.headers).response()

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError):
        return from_engine_error(exc).response()

    @app.exception_handler(Cancelled)
    async def _cancelled(_: Request, exc: Cancelled):
        return shutting_down().response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()
