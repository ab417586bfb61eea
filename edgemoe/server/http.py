"""What wraps the routes of `edgemoe.server.app`: the API-key guard, the error handlers that give every failure its
API's error body (OpenAI's, or Anthropic's on /v1/messages), and the uvicorn server that announces itself once the
model is ready and drains on a signal."""

from __future__ import annotations

import secrets
import sys
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from edgemoe.server import anthropic
from edgemoe.server.engine_loop import EngineLoop
from edgemoe.server.metrics import Metrics
from edgemoe.server.protocol import RequestError, error_body


class ApiKeyGuard:
    """With an API key set, every route but /health needs `Authorization: Bearer KEY` or `x-api-key: KEY` (the
    Anthropic clients' header), checked before the body is read, and before routing, so unknown paths do not reveal
    themselves either."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        if secrets.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key):
            return await self.app(scope, receive, send)
        message = "missing or wrong API key: send the header Authorization: Bearer KEY (or x-api-key: KEY)"
        body = error_body(message, code="invalid_api_key")
        if anthropic.is_anthropic(scope["path"]):
            body = anthropic.error_body(401, message)
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        self.metrics.errors.labels("401").inc()
        await response(scope, receive, send)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def reply(request: Request, status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.errors.labels(str(status)).inc()
        if anthropic.is_anthropic(request.url.path):
            body = anthropic.error_body(status, body["error"]["message"])
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return reply(request, exc.status, exc.body(), exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return reply(request, exc.status_code, error_body(message, code=code), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err["loc"]) or None
        return reply(request, 400, error_body(f"{param}: {err['msg']}", param=param, code="invalid_value"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return reply(request, 500, error_body("internal server error", "server_error", code="internal_error"))


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: print the URL once the model is ready; on SIGINT/SIGTERM refuse new requests (503), let
    those in flight finish for up to `grace_s`, then end the rest with an error. A second signal skips the wait."""

    def __init__(
        self, config: uvicorn.Config, engine_loop: EngineLoop, url: str, model_id: str, grace_s: float
    ) -> None:
        super().__init__(config)
        self.engine_loop, self.url, self.model_id, self.grace_s = engine_loop, url, model_id, grace_s
        self.signals = 0
        self.announced = False
        self.deadline: float | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        # A signal handler runs between two bytecodes of the event loop thread: taking a lock here could
        # deadlock, so it only counts, and on_tick (a coroutine on the loop, every 0.1 s) acts on it.
        self.signals += 1
        if self.signals > 2:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if not self.announced and self.started and self.engine_loop.ready:
            self.announced = True
            print(f"edgemoe: serving {self.model_id} at {self.url}/v1 (Ctrl-C to stop)", flush=True)
        if self.engine_loop.error:
            self.should_exit = True
        if self.signals:
            self._drain()
        return await super().on_tick(counter)

    def _drain(self) -> None:
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.grace_s
            self.engine_loop.begin_drain()
            if self.engine_loop.live:
                print(
                    f"edgemoe: shutting down: finishing {self.engine_loop.live} sequences in flight "
                    "(Ctrl-C again to stop now)",
                    file=sys.stderr,
                    flush=True,
                )
        if self.signals > 1 or self.engine_loop.live == 0 or now > self.deadline:
            self.engine_loop.stop()
            self.should_exit = True
