"""`kvserve proxy`: disaggregated prefill and decode in front of kvserve servers with KV connectors.

Each completion or chat request runs twice: on a prefill server (a kv_producer) as a one-token,
non-streamed request with `kv_transfer_params={"do_remote_decode": true}`, whose answer names
where the prompt's KV blocks wait; then, with those params, on a decode server (a kv_consumer),
which receives the blocks, prefills only the last partial block and decodes. The decode server's
answer (streamed or not) is relayed as it comes. Each step goes to the server of its kind with the
fewest requests in flight. Other routes go to the first decode server.

    kvserve proxy --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 8000
"""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

log = logging.getLogger("kvserve.server")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


@dataclass
class Upstream:
    """One server and the requests the proxy has in flight on it."""

    url: str
    in_flight: int = 0


@dataclass
class Pool:
    """Servers of one kind; `pick` takes the least busy (the first of equals)."""

    servers: list[Upstream] = field(default_factory=list)

    def pick(self) -> Upstream:
        return min(self.servers, key=lambda s: s.in_flight)


def prefill_body(body: dict) -> dict:
    """The request as its prefill step: one token, not streamed, asking for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens", "n")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def build_proxy(prefill: list[str], decode: list[str], timeout: float = 600.0):
    """The proxy's ASGI app over the given server URLs."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    if not prefill or not decode:
        raise ValueError("kvserve proxy needs at least one --prefill and one --decode server")
    pools = {"prefill": Pool([Upstream(u.rstrip("/")) for u in prefill]),
             "decode": Pool([Upstream(u.rstrip("/")) for u in decode])}
    client = httpx.AsyncClient(timeout=timeout)

    def headers_of(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}

    async def relay(server: Upstream, method: str, path: str, headers: dict, content: bytes):
        server.in_flight += 1
        try:
            upstream = await client.send(client.build_request(method, server.url + path, headers=headers,
                                                              content=content), stream=True)
        except BaseException:
            server.in_flight -= 1
            raise

        async def body():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                server.in_flight -= 1
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=kept)

    async def generation(request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            return await relay(pools["decode"].pick(), "POST", request.url.path, headers_of(request), raw)
        headers = headers_of(request)
        server = pools["prefill"].pick()
        server.in_flight += 1
        try:
            first = await client.post(server.url + request.url.path, headers=headers, json=prefill_body(body))
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"prefill server {server.url} failed: {e}",
                                           "type": "service_unavailable", "code": "prefill_failed"}}, 502)
        finally:
            server.in_flight -= 1
        if first.status_code != 200:   # a bad request: the prefill server's own answer says why
            return Response(first.content, status_code=first.status_code, media_type="application/json")
        params = first.json().get("kv_transfer_params")
        if params is None:
            return JSONResponse({"error": {"message": f"prefill server {server.url} returned no kv_transfer_params: "
                                           "start it with --kv-transfer-config and kv_role kv_producer or kv_both",
                                           "type": "service_unavailable", "code": "prefill_failed"}}, 502)
        content = json.dumps({**body, "kv_transfer_params": params}).encode()
        return await relay(pools["decode"].pick(), "POST", request.url.path, headers, content)

    async def other(request: Request):
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return await relay(pools["decode"].servers[0], request.method, path, headers_of(request), await request.body())

    routes = [Route(p, generation, methods=["POST"]) for p in GENERATION_PATHS]
    routes.append(Route("/{path:path}", other, methods=["GET", "POST"]))
    @asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()
    return Starlette(routes=routes, lifespan=lifespan)


def register(sub) -> None:
    """The `kvserve proxy` subcommand."""
    p = sub.add_parser("proxy", help="disaggregated prefill/decode in front of kvserve servers with KV connectors")
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill server (kv_producer or kv_both), repeatable")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode server (kv_consumer or kv_both), repeatable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=cmd_proxy)


def cmd_proxy(args) -> int:
    import uvicorn
    app = build_proxy(args.prefill, args.decode)
    log.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
