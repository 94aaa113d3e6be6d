"""The HTTP front end of `minisgl-run serve`: FastAPI on uvicorn, in its own process. This module
assembles it: `create_app` (the lifespan, the guards, the error handlers, the operational routes
`/health`, `/metrics`, `/flush_cache`, and the API surfaces) and `serve` (uvicorn with the guarded
connections and a graceful shutdown). What the front end does and its modules: docs/server.md
("Processes").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException

from minisgl.server import adapters, native, openai_api
from minisgl.server.connections import connection_cap, loop_exception_handler, protocol_class
from minisgl.server.errors import APIError, error_body, short
from minisgl.server.guards import Guard, error_response, why_unavailable
from minisgl.server.replicas import become_subreaper
from minisgl.server.state import ServerState

logger = logging.getLogger(__name__)


def create_app(state: ServerState) -> FastAPI:
    """The app over `state`: its lifespan starts and stops the scheduler client and the tokenizers;
    the guard middleware, the error handlers (404 and 405 as OpenAI error bodies), `/health`,
    `/metrics`, `/flush_cache`, then the OpenAI API's routes and SGLang's."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        asyncio.get_running_loop().set_exception_handler(loop_exception_handler)
        await state.start()
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="minisgl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(Guard, server=state.server)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        where = f"{request.method} {short(request.url.path, 100)}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if exc.status_code == 404:
            message = f"Invalid URL ({where}): no such route (the API's routes: docs/server.md)"
        elif exc.status_code == 405:
            message = f"Invalid method ({where}): allowed: {(exc.headers or {}).get('Allow', '?')}"
        else:
            message = str(exc.detail)
        return error_response(APIError(message, status=exc.status_code, code=code), exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:  # a bug: logged by uvicorn
        error = APIError(f"internal server error ({type(exc).__name__})", status=500, type="server_error")
        return error_response(error)

    @app.get("/health")
    async def health() -> Response:
        unavailable = why_unavailable(state)
        replicas = {} if state.client is None else state.client.status()  # --dp: the replicas' states
        if unavailable is None:
            return JSONResponse({"status": "ok", **replicas})
        failed = state.client is not None and state.client.failed is not None
        restarting = failed and getattr(state.client, "restarting", False)
        status = (
            "restarting"
            if restarting
            else "failed"
            if failed
            else "starting"
            if not state.ready
            else "shutting down"
        )
        body = {**replicas, "status": status, **error_body(unavailable)}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        # with restarts, the front end's series and the restart counts while no engine serves
        if not state.ready or (
            state.client.failed is not None and not getattr(state.client, "restarting", False)
        ):
            return error_response(why_unavailable(state))
        text = await state.client.metrics() + generate_latest(state.registry).decode()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if not state.ready or state.client.failed is not None:
            return error_response(why_unavailable(state))
        pages = await state.client.flush_cache()
        return JSONResponse({"freed_pages": pages})

    openai_api.add_routes(app, state)
    adapters.add_routes(app, state)  # LoRA adapters loaded and unloaded while serving
    native.add_routes(app, state)  # SGLang's native API and what its router asks workers for
    return app


# ------------------------------------------------------------------------------------------------ serving


class _Server(uvicorn.Server):
    """uvicorn, with minisgl's graceful shutdown: on SIGINT/SIGTERM new requests get 503 while running
    ones finish within `shutdown_grace_s`; the rest are aborted; then the server exits (a second signal
    exits at once)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        state.on_failure = self._engine_failed

    def _engine_failed(self) -> None:
        """The engine could not start or died: open requests got their errors; the server exits 1
        after a moment (so their streams can send them), for a supervisor to restart it."""
        self.exit_code = 1
        asyncio.get_event_loop().call_later(0.5, setattr, self, "should_exit", True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or not self.state.ready:
            super().handle_exit(sig, frame)
            return
        self.state.draining = True
        logger.info("signal %d: draining (%d requests in flight)", sig, self.state.outstanding)
        asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.server.shutdown_grace_s
        while self.state.outstanding > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.outstanding > 0:
            logger.info("aborting %d requests still running", self.state.outstanding)
            self.state.client.abort_all()
            await asyncio.sleep(0.5)  # let their streams send the abort and end
        self.should_exit = True


def serve(explicit: dict[str, Any], config: str | None) -> None:
    """Runs the server until SIGINT/SIGTERM (`minisgl-run serve`)."""
    from minisgl.settings import EngineSettings

    settings = EngineSettings.load(config, **explicit)
    state = ServerState(settings, explicit, config)
    server = state.server
    app = create_app(state)
    uv_config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        http=protocol_class(server, connection_cap(server.max_connections)),
        ws="none",
        timeout_keep_alive=server.idle_timeout_s,  # type: ignore[arg-type]  (a float works)
        log_level="warning",
        timeout_graceful_shutdown=max(1, int(server.shutdown_grace_s) + 5),
        lifespan="on",
    )
    logger.info("starting at http://%s:%d (the engine loads in the background)", server.host, server.port)
    runner = _Server(uv_config, state)
    become_subreaper()  # a dead scheduler's ranks and workers are reaped here
    runner.run()
    if runner.exit_code or state.client is None or state.client.failed is not None:
        reason = "it did not start" if state.client is None else state.client.failed
        raise SystemExit(f"minisgl-run serve: the engine failed ({reason})")
