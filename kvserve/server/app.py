"""The OpenAI-compatible HTTP app: routes, server-sent events, errors, limits, metrics.

`build_app(engine)` wraps an LLMEngine in an AsyncEngine (one background thread steps it) and
returns a FastAPI app. Bodies are read and validated here, by hand, so every bad input gets a
400 in OpenAI's error shape ({"error": {"message", "type", "param", "code"}}), never a 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import kvserve
from kvserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from kvserve.engine.engine import LLMEngine
from kvserve.kv.connector import KVLoadError
from kvserve.outputs import CompletionOutput, DeltaCollector, RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.server import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_QUEUE,
    inputs,
)
from kvserve.server import protocol as P
from kvserve.server.connections import redact_access_log
from kvserve.server.dashboard import add_dashboard_routes, is_public
from kvserve.server.errors import APIError
from kvserve.server.kv_state import KVStateTracker, StateHub
from kvserve.server.limits import ConcurrencyLimit, KeyShares, Lease, check_request_tokens
from kvserve.server.metrics import ServerMetrics
from kvserve.server.tools import TOOL_CALL_PARSERS, ToolPlan, ToolStream, check_tools

log = logging.getLogger("kvserve.server")

DISCONNECT_POLL_SECONDS = 0.25
CACHE_ISOLATION = ("none", "salt", "api-key")  # docs/SERVING.md "Prefix-cache isolation"
TENANT_SCOPE_KEY = "kvserve.tenant_salt"       # set by ApiKeyMiddleware: the salt of the key used


_PARAMS = set(P.CompletionRequest.model_fields) | set(P.ChatCompletionRequest.model_fields)


def bad_request(exc: ValueError) -> APIError:
    """A 400 for a ValueError from validation; names the parameter when the message starts with it."""
    msg = str(exc)
    code = "context_length_exceeded" if "max_model_len" in msg else None
    first = re.match(r"^(\w+)", msg)
    param = first.group(1) if first and first.group(1) in _PARAMS else None
    return APIError(400, msg, param=param, code=code)


@dataclass
class ServerState:
    """What the routes share."""

    engine: LLMEngine
    async_engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    max_body_bytes: int
    special_in_content: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: dict[int, str] = field(default_factory=dict)
    # tokenizing and chat templates run here, one at a time, never on the engine thread
    tokenize_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenize"))
    byte_limit: int | None = None
    cache_isolation: str = "salt"
    tool_call_parser: str | None = None   # --tool-call-parser: how tool_choice 'auto' output is read
    auto_tool_choice: bool = False        # --enable-auto-tool-choice
    max_request_tokens: int | None = None  # prompts x n x max_tokens of one request (None: no limit)
    shares: KeyShares = field(default_factory=lambda: KeyShares(None, None))  # each key's share of the engine

    async def tokenize(self, fn, *args):
        """fn(*args) on the tokenize thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def decode_token(self, token_id: int) -> str:
        """The text of one token (cached)."""
        text = self.token_text.get(token_id)
        if text is None:
            tok = self.engine.tokenizer
            text = tok.decode([token_id], skip_special_tokens=False) if tok is not None else ""
            self.token_text[token_id] = text
        return text


def tenant_salt(api_key: str) -> str:
    """The cache salt of one API key's tenant: a hash of the key (the key itself is never kept in it)."""
    return "tenant:" + hashlib.sha256(b"kvserve cache tenant\0" + api_key.encode()).hexdigest()


OPERATOR_ROUTES = ("/metrics", "/v1/kv/state", "/v1/kv/stream")  # every tenant's requests show there


class ApiKeyMiddleware:
    """Who may call what. Tenant keys (`--api-key`) open the API; the operator routes (/metrics and
    the KV state, which show every tenant's requests) need the admin key when there is one, and are
    closed to tenant keys under api-key isolation without one; /health and the dashboard page's files
    are open. A request that passes with a key carries that key's tenant salt in
    scope[TENANT_SCOPE_KEY] (its identity for cache isolation and the key's share of the engine)."""

    def __init__(self, app, api_keys: list[str], admin_key: str | None = None, cache_isolation: str = "salt"):
        self.app = app
        self.keys = [(k.encode(), tenant_salt(k), False) for k in api_keys]
        if admin_key:
            self.keys.append((admin_key.encode(), tenant_salt(admin_key), True))
        self.has_admin = bool(admin_key)
        self.has_tenants = bool(api_keys)
        self.isolated = cache_isolation == "api-key"

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path == "/health" or is_public(path):
            return await self.app(scope, receive, send)
        salt, admin = self._match(scope)
        err = self._operator_error(salt, admin) if path in OPERATOR_ROUTES else self._tenant_error(salt)
        if err is not None:
            return await err.response()(scope, receive, send)
        if salt is not None:
            scope[TENANT_SCOPE_KEY] = salt
        await self.app(scope, receive, send)

    def operator_error(self, scope) -> APIError | None:
        """The error an operator route answers this request with, or None when its key may open it."""
        return self._operator_error(*self._match(scope))

    def _match(self, scope) -> tuple[str | None, bool]:
        """(tenant salt, is the admin key) of the request's bearer token; (None, False) for none."""
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        token = token.strip()
        found: tuple[str | None, bool] = (None, False)
        for key, salt, admin in self.keys:  # every key is compared, so timing does not tell which matched
            if hmac.compare_digest(token, key) and scheme.lower() == b"bearer":
                found = (salt, admin)
        return found

    def _tenant_error(self, salt: str | None) -> APIError | None:
        if salt is None and self.has_tenants:
            return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                            type="authentication_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None

    def _operator_error(self, salt: str | None, admin: bool) -> APIError | None:
        if admin:
            return None
        if not self.has_admin and not self.isolated:
            return self._tenant_error(salt)
        if salt is None and (self.has_admin or self.has_tenants):
            return APIError(401, "this route needs the admin key (--admin-api-key): send 'Authorization: "
                                 "Bearer <admin key>'", type="authentication_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        why = ("it needs the admin key (--admin-api-key)" if self.has_admin else
               "tenants are kept apart (--cache-isolation api-key): start the server with --admin-api-key "
               "and use that key")
        return APIError(403, f"this route shows every tenant's requests, so a tenant key cannot open it: {why}",
                        type="permission_error", code="admin_key_required")


def build_app(engine: LLMEngine, *, served_model_name: str | None = None,
              api_key: str | list[str] | None = None, max_queue: int | None = DEFAULT_MAX_QUEUE,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              allow_special_tokens_in_content: bool = False, cache_isolation: str = "salt",
              record: str | None = None, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, admin_api_key: str | None = None,
              max_request_tokens: int | None = None, max_running_per_key: int | None = None,
              max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS) -> FastAPI:
    """A FastAPI app serving `engine`; the engine thread starts and stops with the app.

    `api_key`: one key or several (each a tenant under cache_isolation='api-key').
    `allow_special_tokens_in_content`: parse special-token text in chat messages as control
    tokens (trusted callers only); by default it is encoded as plain text.
    `cache_isolation`: none | salt | api-key, who shares prefix-cache blocks (docs/SERVING.md).
    `record`: append every KV state snapshot to this JSON-lines file (the dashboard replays it).
    `tool_call_parser` (hermes | json) and `enable_auto_tool_choice`: tool_choice 'auto' reads the
    model's calls out of its output with that parser (server/tools.py).
    `admin_api_key`: the key /metrics and the KV state routes need (ApiKeyMiddleware).
    Limits (server/limits.py; None: the default, 0: none): `max_request_tokens` (default
    max_model_len x max_num_seqs), `max_running_per_key` (default max_num_seqs),
    `max_concurrent_requests`.
    """
    api_keys = [api_key] if isinstance(api_key, str) else [k for k in api_key or [] if k]
    check_cache_isolation(cache_isolation, api_keys)
    check_admin_key(admin_api_key, api_keys)
    redact_access_log()
    name = served_model_name or engine.model_config.name
    metrics = ServerMetrics(name, engine.max_model_len)
    tracker = KVStateTracker(engine, name)
    aengine = AsyncEngine(engine, max_queue=max_queue,
                          on_finished=lambda rec: (metrics.observe_finished(rec), tracker.observe_finished(rec)))
    hub = StateHub(tracker, aengine.call, record=record)
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {list(TOOL_CALL_PARSERS)}, got {tool_call_parser!r}")
    state = ServerState(engine, aengine, metrics, name, max_body_bytes, allow_special_tokens_in_content,
                        cache_isolation=cache_isolation, tool_call_parser=tool_call_parser,
                        auto_tool_choice=enable_auto_tool_choice,
                        max_request_tokens=_limit(max_request_tokens, engine.max_model_len * engine.config.max_num_seqs),
                        shares=KeyShares(_limit(max_running_per_key, engine.config.max_num_seqs), max_queue))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.byte_limit = await state.tokenize(inputs.prompt_byte_limit, engine.tokenizer, engine.max_model_len)
        if engine.tokenizer is not None:
            engine.tokenizer.preload()   # transformers' tokenizer for chat templates, off the first request
        aengine.start()
        hub.start()
        yield
        await hub.stop()
        await aengine.shutdown()
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(engine.close)  # pending KV tier writes reach disk / Redis (SIGTERM too)

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvserve = state
    app.add_middleware(ApiKeyMiddleware, api_keys=api_keys, admin_key=admin_api_key, cache_isolation=cache_isolation)
    _add_error_handlers(app)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    _add_token_routes(app, state)
    add_dashboard_routes(app, hub)
    app.add_middleware(ConcurrencyLimit, limit=max_concurrent_requests or None)
    app.add_middleware(RequestIdMiddleware)
    return app


def _limit(value: int | None, default: int) -> int | None:
    """A limit option: None gives `default`, 0 turns it off."""
    if value is not None and value < 0:
        raise ValueError(f"a limit must be >= 0 (0: none), got {value}")
    return default if value is None else value or None


def check_admin_key(admin_key: str | None, api_keys: list[str]) -> None:
    """ValueError for an empty admin key or one that is also a tenant key."""
    if admin_key is None:
        return
    if not admin_key:
        raise ValueError("--admin-api-key must not be empty: give the key, e.g. --admin-api-key sk-admin")
    if admin_key in api_keys:
        raise ValueError("--admin-api-key must differ from every --api-key: a tenant holding it would see "
                         "every tenant's requests")


class RequestIdMiddleware:
    """A request's X-Request-Id header comes back on its response (client-side tracing)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        rid = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None) \
            if scope["type"] == "http" else None
        if rid is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)
        await self.app(scope, receive, send_with_id)


def check_cache_isolation(mode: str, api_keys: list[str]) -> None:
    """Raise ValueError for an unknown mode, or api-key isolation without API keys."""
    if mode not in CACHE_ISOLATION:
        raise ValueError(f"cache isolation must be one of {CACHE_ISOLATION}, got {mode!r}")
    if mode == "api-key" and not api_keys:
        raise ValueError("--cache-isolation api-key needs at least one --api-key (give one per tenant)")


def isolate(state: ServerState, request: Request, params: SamplingParams) -> SamplingParams:
    """`params` with the cache salt the isolation mode gives this request (docs/SERVING.md)."""
    mode, salt = state.cache_isolation, params.cache_salt
    if mode == "none" and salt is not None:
        raise ValueError("cache_salt is not honoured by this server (--cache-isolation none: one prefix cache "
                         "for every request); leave it out, or ask the operator for --cache-isolation salt")
    if mode == "api-key":
        tenant = request.scope[TENANT_SCOPE_KEY]
        return dataclasses.replace(params, cache_salt=tenant if salt is None else f"{tenant}/{salt}")
    return params


def output_kind(params: SamplingParams) -> SamplingParams:
    """The server asks the engine for DELTA outputs (what is new each step, so a step's cost does not
    grow with the output); a plain response adds them up (DeltaCollector)."""
    return dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        return APIError(503, str(exc), type="service_unavailable", code="unavailable").response()

    @app.exception_handler(RequestFailedError)
    async def _request_failed(request: Request, exc: RequestFailedError):
        return APIError(500, str(exc), type="server_error", code="request_failed").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return APIError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal server error: {exc!r}", type="server_error").response()


# ---- request parsing ------------------------------------------------------------------


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, max_bytes: int):
    """The request body as JSON, refusing bodies over `max_bytes` (413) and bad JSON (400)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"request body is {length} bytes; the limit is {max_bytes} (--max-body-bytes)",
                       code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise APIError(413, f"request body exceeds {max_bytes} bytes (--max-body-bytes)",
                               code="request_too_large")
    except ClientDisconnect:  # gone, or closed by the body read deadline: no one reads the answer
        raise APIError(400, "the client closed the connection before its body arrived",
                       code="client_closed_request") from None
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply to parse: send a flatter JSON object",
                       code="invalid_json") from None


def parse_model(cls: type[BaseModel], data) -> BaseModel:
    """Validate a JSON value into a request model; a 400 naming the first bad field."""
    try:
        return cls.model_validate(data)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply: send a flatter JSON object") from None
    except ValidationError as exc:
        errors = exc.errors()
        parts = []
        for e in errors[:3]:
            where = ".".join(str(x) for x in e["loc"]) or "body"
            parts.append(f"{where}: {e['msg']}")
        param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise APIError(400, "invalid request: " + "; ".join(parts) + more, param=param) from None


def check_model(state: ServerState, model: str | None) -> None:
    """400 unless `model` is absent or names the served model."""
    if model is not None and model != state.model_name:
        raise APIError(400, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


@dataclass
class Admitted:
    """A request's streams in the engine and its place in its key's share (given back by `close`)."""

    streams: list[RequestStream]
    lease: Lease

    def close(self) -> None:
        for s in self.streams:
            s.close()   # aborts requests still running: the client went away
        self.lease.release()


async def add_requests(state: ServerState, request: Request, prompts: list[dict], params: SamplingParams,
                       request_ids: list[str]) -> Admitted:
    """Queue tokenized requests on the engine once they fit the request token limit and their key's
    share, turning refusals into HTTP errors."""
    check_request_tokens([len(p["prompt_token_ids"]) for p in prompts], params, state.engine.max_model_len,
                         state.max_request_tokens)
    key = request.scope.get(TENANT_SCOPE_KEY)
    try:
        lease = await _unless_disconnected(request, state.shares.acquire(key, len(prompts), params.n))
        try:
            streams = await state.async_engine.add_batch(prompts, params, request_ids)
        except BaseException:
            lease.release()
            raise
    except ValueError as exc:
        raise bad_request(exc) from None
    except QueueFullError as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(exc.retry_after)}) from None
    except (EngineDrainingError, EngineDeadError) as exc:
        raise APIError(503, str(exc), type="service_unavailable", code="unavailable") from None
    except KVLoadError as exc:
        raise APIError(503, str(exc), type="service_unavailable", code="kv_load_failed") from None
    return Admitted(streams, lease)


async def _unless_disconnected(request: Request, awaitable):
    """The result of `awaitable`; a 499 (and `awaitable` cancelled) if the client goes away first."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected", code="client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future) -> None:
    """Mark a cancelled future's outcome as seen (asyncio logs '... exception was never retrieved')."""
    if not future.cancelled():
        future.exception()


# ---- routes ---------------------------------------------------------------------------


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /version, /v1/models, /metrics."""
    aengine = state.async_engine

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not aengine.is_running:
            return APIError(503, f"engine is not running: {aengine.error}", type="service_unavailable").response()
        if aengine.draining:
            return APIError(503, "shutting down", type="service_unavailable").response()
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": kvserve.__version__}

    @app.get("/v1/models")
    async def models():
        card = P.ModelCard(id=state.model_name, created=state.created, root=state.engine.model_path,
                           max_model_len=state.engine.max_model_len)
        return P.ModelList(data=[card]).model_dump()

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            snapshot = await aengine.get_metrics()
        except EngineDeadError:
            snapshot = {}
        if "num_requests_waiting" in snapshot:  # waiting for a slot: in the engine's queue or for their key's share
            snapshot["num_requests_waiting"] += state.shares.num_waiting_requests
        return Response(state.metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)


async def _body(state: ServerState, request: Request, model):
    """The request's JSON body as `model`, for this server's model (400 / 404 otherwise)."""
    req = parse_model(model, await read_json(request, state.max_body_bytes))
    check_model(state, req.model)
    return req


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/completions and /v1/chat/completions: streamed (server-sent events) or whole."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _body(state, request, P.CompletionRequest)
        try:
            params, prompts = isolate(state, request, req.sampling_params()), req.prompts()
            state.async_engine.check_batch_size(len(prompts), params.n)
            prompts = await state.tokenize(_completion_prompts, state, prompts)
            await state.tokenize(state.engine.structured.precompile, params.structured_outputs)
        except ValueError as exc:
            raise bad_request(exc) from None
        rid = P.random_id("cmpl")
        params = output_kind(params)
        admitted = await add_requests(state, request, prompts, params, [f"{rid}-{i}" for i in range(len(prompts))])
        if req.stream:
            return EventStreamResponse(_events(CompletionChunks(state, params, rid, req.echo), admitted.streams,
                                               req.include_usage), admitted)
        finals = await _collect(request, admitted)
        return _completion_response(state, params, rid, finals, req.echo).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _body(state, request, P.ChatCompletionRequest)
        try:
            plan = req.tool_plan(state.tool_call_parser, state.auto_tool_choice)
            conversation, params = req.conversation(), isolate(state, request, req.sampling_params(plan))
            state.async_engine.check_batch_size(1, params.n)
            prompt = await state.tokenize(
                inputs.chat_token_ids, state.engine.tokenizer, conversation, req.add_generation_prompt,
                state.byte_limit, state.engine.max_model_len, state.special_in_content, plan.offered)
            await state.tokenize(state.engine.structured.precompile, params.structured_outputs)
        except ValueError as exc:
            raise bad_request(exc) from None
        rid = P.random_id("chatcmpl")
        params = output_kind(params)
        admitted = await add_requests(state, request, [prompt], params, [rid])
        if req.stream:
            return EventStreamResponse(_events(ChatChunks(state, params, rid, plan), admitted.streams,
                                               req.include_usage), admitted)
        final = (await _collect(request, admitted))[0]
        return _chat_response(state, params, rid, final, plan).model_dump()


def _add_token_routes(app: FastAPI, state: ServerState) -> None:
    """/tokenize and /detokenize, in vLLM's shapes."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await _body(state, request, P.TokenizeRequest)
        try:
            ids = await state.tokenize(_tokenize, state, req)
        except ValueError as exc:
            raise bad_request(exc) from None
        strs = [state.decode_token(t) for t in ids] if req.return_token_strs else None
        return P.TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids,
                                  token_strs=strs).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await _body(state, request, P.DetokenizeRequest)
        vocab = state.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(ValueError(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})"))
        text = await state.tokenize(lambda: state.engine.tokenizer.decode(req.tokens, skip_special_tokens=False))
        return P.DetokenizeResponse(prompt=text).model_dump()


def _tokenize(state: ServerState, req: P.TokenizeRequest) -> list[int]:
    """The token ids a prompt or a conversation gives (on the tokenize thread)."""
    conversation, tok = req.conversation(), state.engine.tokenizer
    if tok is None:
        raise ValueError("this model ships no tokenizer: there is no text to tokenize")
    if conversation is None:
        inputs.check_text("prompt", req.prompt, state.byte_limit, state.engine.max_model_len)
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    tools = check_tools(req.tools)
    return inputs.chat_token_ids(tok, conversation, req.add_generation_prompt, state.byte_limit,
                                 state.engine.max_model_len, state.special_in_content, tools)["prompt_token_ids"]


def _completion_prompts(state: ServerState, prompts: list) -> list[dict]:
    """Each prompt checked and tokenized (on the tokenize thread)."""
    tok, limit, max_len = state.engine.tokenizer, state.byte_limit, state.engine.max_model_len
    return [inputs.prompt_token_ids(tok, p, limit, max_len) for p in prompts]


# ---- non-streamed responses -----------------------------------------------------------


async def _collect(request: Request, admitted: Admitted) -> list[RequestOutput]:
    """Wait for every stream's final output; abort them all if the client goes away."""
    async def last(stream: RequestStream) -> RequestOutput:
        collected = DeltaCollector()
        async for out in stream:
            collected.add(out)
        return collected.result()

    try:
        return await _unless_disconnected(request, asyncio.gather(*(last(s) for s in admitted.streams)))
    finally:
        admitted.close()


def _usage(outputs: list[RequestOutput], streamed: list[StreamedChoice] | None = None) -> P.UsageInfo:
    """Token counts of finished requests (of their streamed choices: DELTA outputs carry only the end)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    if streamed is None:
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    else:
        completion = sum(d.tokens for d in streamed)
    cached = sum(o.num_cached_tokens for o in outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


def _completion_response(state: ServerState, params: SamplingParams, rid: str,
                         finals: list[RequestOutput], echo: bool = False) -> P.CompletionResponse:
    choices = []
    for i, out in enumerate(finals):
        for c in out.outputs:
            echoed, logprobs = _echoed(state, out, params, echo)
            if params.logprobs is not None:
                logprobs = _completion_logprobs(state, c, 0, len(c.token_ids), params.logprobs, len(echoed),
                                                logprobs)
            choices.append(P.CompletionChoice(index=i * params.n + c.index, text=echoed + c.text, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    choices.sort(key=lambda ch: ch.index)
    return P.CompletionResponse(id=rid, model=state.model_name, choices=choices, usage=_usage(finals),
                                kv_transfer_params=finals[0].kv_transfer_params if finals else None)


def _chat_response(state: ServerState, params: SamplingParams, rid: str,
                   final: RequestOutput, plan: ToolPlan) -> P.ChatCompletionResponse:
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        logprobs = None
        if params.logprobs is not None:
            logprobs = _chat_logprobs(state, c, 0, len(c.token_ids), params.logprobs)
        content, calls = plan.parse(c.text)
        message = P.ChatResponseMessage(content=content, tool_calls=[call.as_openai() for call in calls])
        choices.append(P.ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                    finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                                    stop_reason=c.stop_reason))
    return P.ChatCompletionResponse(id=rid, model=state.model_name, choices=choices, usage=_usage([final]),
                                    kv_transfer_params=final.kv_transfer_params)


def _top(entry: dict, k: int) -> list[tuple[int, float]]:
    ranked = sorted(((lp.rank or 0, tok, lp.logprob) for tok, lp in entry.items()), key=lambda x: x[0])
    return [(tok, lp) for rank, tok, lp in ranked if 1 <= rank <= k]


def _echoed(state: ServerState, out: RequestOutput, params: SamplingParams,
            echo: bool) -> tuple[str, P.CompletionLogprobs | None]:
    """echo: the prompt's text, and with logprobs the prompt tokens' entries (the first one null)."""
    if not echo:
        return "", None
    text = out.prompt if out.prompt is not None else state.engine.tokenizer.decode(out.prompt_token_ids)
    if params.logprobs is None:
        return text, None
    lp, offset = P.CompletionLogprobs(), 0
    for tok, entry in zip(out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids)):
        piece = state.decode_token(tok)
        lp.tokens.append(piece)
        lp.token_logprobs.append(entry[tok].logprob if entry is not None and tok in entry else None)
        lp.top_logprobs.append(None if entry is None else
                               {state.decode_token(t): v for t, v in _top(entry, params.logprobs)})
        lp.text_offset.append(offset)
        offset += len(piece)
    return text, lp


def _completion_logprobs(state: ServerState, c: CompletionOutput, start: int, end: int, k: int,
                         offset: int, out: P.CompletionLogprobs | None = None) -> P.CompletionLogprobs:
    out = out if out is not None else P.CompletionLogprobs()
    entries = c.logprobs or []
    for i in range(start, min(end, len(entries))):
        tok = c.token_ids[i]
        text = state.decode_token(tok)
        out.tokens.append(text)
        out.token_logprobs.append(entries[i][tok].logprob if tok in entries[i] else None)
        out.top_logprobs.append({state.decode_token(t): lp for t, lp in _top(entries[i], k)})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _chat_logprobs(state: ServerState, c: CompletionOutput, start: int, end: int, k: int) -> P.ChatLogprobs:
    content = []
    entries = c.logprobs or []
    for i in range(start, min(end, len(entries))):
        tok = c.token_ids[i]
        text = state.decode_token(tok)
        lp = entries[i][tok].logprob if tok in entries[i] else float("-inf")
        tops = [P.TopLogprob(token=state.decode_token(t), logprob=v, bytes=list(state.decode_token(t).encode()))
                for t, v in _top(entries[i], k)]
        content.append(P.TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()), top_logprobs=tops))
    return P.ChatLogprobs(content=content)


# ---- streamed responses ---------------------------------------------------------------


class StreamedChoice:
    """What one streamed choice has sent: the engine's DELTA outputs carry only what is new (and hold
    back the start of a possible stop string), so the chunks add up to the non-streamed text."""

    def __init__(self):
        self.offset = 0      # characters sent so far (completions' logprobs text_offset)
        self.tokens = 0      # tokens sent so far (the usage chunk)
        self.done = False
        self.echoed = False  # completions with echo: the prompt went out with the first chunk


class EventStreamResponse(StreamingResponse):
    """Server-sent events; however the response ends (done, client gone), its requests end too."""

    def __init__(self, events: AsyncIterator[str], admitted: Admitted):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.admitted = admitted

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admitted.close()


def _event(model: BaseModel | dict) -> str:
    data = model.model_dump_json() if isinstance(model, BaseModel) else json.dumps(model)
    return f"data: {data}\n\n"


def _error_event(exc: BaseException) -> str:
    err = P.ErrorResponse(error=P.ErrorInfo(message=str(exc), type="server_error"))
    return _event(err)


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.next()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].next())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        for s in streams:
            s.close()


class CompletionChunks:
    """How /v1/completions streams: text choices with the completions logprobs format (with `echo`,
    each choice's first chunk starts with the prompt)."""

    def __init__(self, state: ServerState, params: SamplingParams, rid: str, echo: bool = False):
        self.state, self.params, self.rid, self.created = state, params, rid, int(time.time())
        self.echo = echo

    def opening(self) -> list:
        return []

    def choice(self, index: int, c: CompletionOutput, d: StreamedChoice, out: RequestOutput) -> P.CompletionChoice | None:
        echoed, logprobs = _echoed(self.state, out, self.params, self.echo and not d.echoed)
        d.echoed = True
        if self.params.logprobs is not None:
            logprobs = _completion_logprobs(self.state, c, 0, len(c.token_ids), self.params.logprobs,
                                            d.offset + len(echoed), logprobs)
            d.offset += sum(len(t) for t in logprobs.tokens)
        if not (echoed or c.text or d.done or (logprobs is not None and logprobs.tokens)):
            return None
        return P.CompletionChoice(index=index, text=echoed + c.text, logprobs=logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def chunk(self, choices: list, usage: P.UsageInfo | None = None) -> str:
        return _event(P.CompletionResponse(id=self.rid, created=self.created, model=self.state.model_name,
                                           choices=choices, usage=usage))


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's: 'tool_calls' when a reply that stopped by itself made calls."""
    return "tool_calls" if called and reason == "stop" else reason


class ChatChunks(CompletionChunks):
    """How /v1/chat/completions streams: a first chunk naming the role, then content deltas, and each
    tool call whole once its text is complete (the plan's ToolStream per choice)."""

    def __init__(self, state: ServerState, params: SamplingParams, rid: str, plan: ToolPlan):
        super().__init__(state, params, rid)
        self.plan = plan
        self.tools: dict[int, ToolStream] = {}

    def opening(self) -> list:
        return [P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                for i in range(self.params.n)]

    def choice(self, index: int, c: CompletionOutput, d: StreamedChoice, out: RequestOutput) -> P.ChatStreamChoice | None:
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = _chat_logprobs(self.state, c, 0, len(c.token_ids), self.params.logprobs)
        tools = self.tools.setdefault(index, self.plan.stream())
        content, calls = tools.feed(c.text)
        if d.done:
            rest, more = tools.finish()
            content, calls = content + rest, calls + more
        if not (content or calls or d.done or (logprobs is not None and logprobs.content)):
            return None
        deltas = [call.as_openai(index=tools.sent_calls + k) for k, call in enumerate(calls)] or None
        tools.sent_calls += len(calls)
        delta = P.DeltaMessage(content=content or None, tool_calls=deltas)
        return P.ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                  finish_reason=_finish_reason(c.finish_reason, tools.sent_calls > 0),
                                  stop_reason=c.stop_reason)

    def chunk(self, choices: list, usage: P.UsageInfo | None = None) -> str:
        return _event(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.state.model_name,
                                            choices=choices, usage=usage))


async def _events(chunks: CompletionChunks, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events for the requests of one response, in `chunks`' format: the engine's delta
    outputs as choices (choice i * n + j for request i's sequence j), the usage, then [DONE]; an
    engine failure ends the stream with an error event."""
    n = chunks.params.n
    deltas: dict[int, StreamedChoice] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        opening = chunks.opening()
        if opening:
            yield chunks.chunk(opening)
        async for i, out in _merge(streams):
            choices = []
            for c in out.outputs:
                d = deltas.setdefault(i * n + c.index, StreamedChoice())
                if d.done:
                    continue
                d.done, d.tokens = c.finish_reason is not None, d.tokens + len(c.token_ids)
                choice = chunks.choice(i * n + c.index, c, d, out)
                if choice is not None:
                    choices.append(choice)
            if out.finished:
                finals[i] = out
            if choices:
                yield chunks.chunk(choices)
        if include_usage and finals:
            yield chunks.chunk([], _usage([finals[i] for i in sorted(finals)], list(deltas.values())))
    except (EngineDeadError, RequestFailedError) as exc:
        yield _error_event(exc)
    finally:
        for stream in streams:
            stream.close()
    yield "data: [DONE]\n\n"
