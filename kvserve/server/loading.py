"""The server while its model loads: it listens at once and answers every request with 503
`{"error": {"code": 503, "message": "Loading model", ...}}` (llama-server's answer) until the engine
and its app are built on a worker thread; from then on the app answers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from kvserve.startup import seconds_since_launch

log = logging.getLogger("kvserve.server")

LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


class LoadingApp:
    """An ASGI app that builds the real one (`build()`, run on a worker thread once the server
    listens) and hands every request to it once built; 503 "Loading model" before that.

    `error`: why the server cannot serve (the build failed, or the engine stopped); the server
    watches it and exits when it is set (server/cli.py `serve`)."""

    def __init__(self, build: Callable[[], object]):
        self.build = build
        self.app = None
        self._load_error: BaseException | None = None
        self._lifespan = None
        self._task: asyncio.Task | None = None

    @property
    def error(self) -> BaseException | None:
        if self._load_error is not None:
            return self._load_error
        return self.app.state.kvserve.async_engine.error if self.app is not None else None

    def begin_drain(self, grace_seconds: float) -> None:
        """Refuse new requests and abort running ones after `grace_seconds` (nothing to do while loading)."""
        if self.app is not None:
            self.app.state.kvserve.async_engine.begin_drain(grace_seconds)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._serve_lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            return await _send_json(send, 503, LOADING)
        await send({"type": "websocket.close", "code": 1013})   # try again later

    async def _serve_lifespan(self, receive, send):
        await receive()                                  # lifespan.startup
        self._task = asyncio.create_task(self._load())
        await send({"type": "lifespan.startup.complete"})
        await receive()                                  # lifespan.shutdown
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)
        await send({"type": "lifespan.shutdown.complete"})

    async def _load(self) -> None:
        try:
            app = await asyncio.to_thread(self.build)
            lifespan = app.router.lifespan_context(app)
            await lifespan.__aenter__()
        except Exception as exc:
            log.error("loading the model failed (%s: %s): exiting", type(exc).__name__, exc)
            self._load_error = exc
            return
        self._lifespan = lifespan
        self.app = app
        log.info("start-up: server ready %.2f s after launch", seconds_since_launch())


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
