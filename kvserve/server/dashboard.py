"""Routes of the KV-cache dashboard: `/v1/kv/state` (JSON), `/v1/kv/stream` (server-sent events) and
the page at `/dashboard` (static files shipped in kvserve/server/static/, no build step).

The page and its files carry no data, so they load without a key (a browser cannot send a header
when it opens a URL); the page asks for the key in a form, never in its address, and sends it as a
bearer header to the two data routes, which the API-key middleware guards as operator routes (the
admin key when the server has one).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from kvserve.server.kv_state import StateHub, encode

STATIC_DIR = Path(__file__).with_name("static")
PAGE = "/dashboard"
KEEPALIVE_SECONDS = 15.0


def is_public(path: str) -> bool:
    """The page and its static files: served without the API key."""
    return path == PAGE or path.startswith(PAGE + "/static/")


def add_dashboard_routes(app: FastAPI, hub: StateHub) -> None:
    """Add the state routes and the page to `app`."""
    app.state.kv_hub = hub

    @app.get("/v1/kv/state")
    async def kv_state():
        return await hub.state()

    @app.get("/v1/kv/stream")
    async def kv_stream():
        return StreamingResponse(_events(hub), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get(PAGE)
    async def dashboard():
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount(PAGE + "/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")


async def _events(hub: StateHub):
    """The current state (with history) at once, then each new snapshot; a comment keeps it alive."""
    queue = hub.subscribe()
    try:
        yield _sse(encode(await hub.state()))
        while True:
            try:
                text = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
            except asyncio.TimeoutError:
                yield ": keepalive\n\n"
                continue
            yield _sse(text)
    finally:
        hub.unsubscribe(queue)


def _sse(text: str) -> str:
    return f"data: {text}\n\n"
