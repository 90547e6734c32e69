"""`kvserve serve --replicas N`: N engines as one Ray Serve application, behind one set of OpenAI routes.

Two deployments:
- `EngineReplica` (N replicas): one LLMEngine with KV events on, and the very app of
  server/app.py (`build_app`: validation, errors, streaming, usage, /metrics) run in-process;
  a request arrives as an `HTTPCall` and its ASGI messages go back as a stream.
- `Ingress` (1 replica, Serve's HTTP entry): reads the body, tokenizes the prompt for routing
  only, and sends the call through a handle whose request router is `KVRouter`
  (distributed/serve_router.py: prefix-aware, least-loaded or round-robin from the replicas' KV
  events). It adds nothing to the answer but the `x-kvserve-replica` header, which names the
  replica that served it; a request carrying that header goes to that replica only. `/metrics`
  joins every replica's metrics with a `replica` label; `/v1/replicas` shows the router's view.

A replica that dies mid-answer ends its streams with an error event and `[DONE]` (plain answers:
503); new requests go to the others and the router forgets its blocks.

Disaggregated (`--disaggregate P:D`): P replicas of a second engine deployment, `kvserve-prefill`,
run with a KV connector as producers, the D engine replicas as consumers. The ingress sends each
completion or chat request first to a prefill replica as a one-token request asking for a remote
decode (server/disagg.py `prefill_body`), then, with the `kv_transfer_params` it answered, to a
decode replica, which receives the prompt's blocks and prefills only the last partial block; the
decode replica's answer is relayed. Each deployment has its own router.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass, field

from kvserve.distributed.serve_router import RouteInfo, router_key, routers
from kvserve.server.app import APIError, tenant_salt
from kvserve.server.disagg import prefill_body

log = logging.getLogger("kvserve.server")

REPLICA_HEADER = "x-kvserve-replica"
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
STATS_PERIOD_S = 0.5     # how often each replica reports its KV usage to the router
ENGINE_DEPLOYMENT = "kvserve-engine"
PREFILL_DEPLOYMENT = "kvserve-prefill"
PREFILL_HEADER = "x-kvserve-prefill-replica"
HOP_HEADERS = {b"host", b"content-length", b"transfer-encoding", b"connection"}


@dataclass
class HTTPCall:
    """One HTTP request as the ingress hands it to an engine replica."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    route: RouteInfo = field(default_factory=RouteInfo)


def free_port(host: str) -> int:
    """A TCP port free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- an engine replica ------------------------------------------------------------------


class EngineReplica:
    """One engine and kvserve's app, served to the ingress through Ray Serve (one replica each)."""

    async def __init__(self, engine_kwargs: dict, app_kwargs: dict, events_host: str | None = None):
        from ray import serve

        from kvserve.llm import LLM
        from kvserve.server.app import build_app

        self.name = serve.get_replica_context().replica_id.unique_id
        self.node = host = events_host or _node_ip()
        engine_kwargs = {**engine_kwargs, "kv_events": f"tcp://{host}:{free_port(host)}",
                         "kv_events_replay": f"tcp://{host}:{free_port(host)}",
                         "kv_events_allow_remote": True,    # the router reads them from the cluster's nodes
                         **connector_on(engine_kwargs.get("kv_transfer_config"), host)}
        self.llm = await asyncio.to_thread(LLM, **engine_kwargs)
        app_kwargs = dict(app_kwargs)
        metrics_names = app_kwargs.pop("metrics_names", None)
        self.app = build_app(self.llm.engine, **app_kwargs)
        self.state = self.app.state.kvserve
        if metrics_names == "vllm":
            self.state.metrics.export_vllm_names()
        add_replica_routes(self.app)
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()
        log.info("replica %s ready (KV events on %s)", self.name, engine_kwargs["kv_events"])

    def record_replica_metadata(self) -> dict:
        """Where this replica's KV events are, and how it hashes blocks (read once by the router)."""
        from kvserve.distributed.router import hit_groups
        kv, events = self.llm.engine.kv, self.llm.engine.kv_events
        return {"node": self.node, "kv_events": events.endpoint, "kv_events_replay": events.replay_endpoint,
                "namespace": kv.namespace.hex(), "block_size": kv.block_size, "hash_algo": kv.hash_algo,
                "hit_groups": list(hit_groups(kv))}

    async def record_routing_stats(self) -> dict:
        """This replica's KV usage (the router adds Serve's own count of its requests)."""
        metrics = await self.state.async_engine.get_metrics()
        return {"kv_usage": float(metrics.get("kv_cache_usage_perc", 0.0))}

    async def check_health(self) -> None:
        """Serve restarts a replica whose engine stopped."""
        if not self.state.async_engine.is_running:
            raise RuntimeError(f"replica {self.name}: the engine is not running: {self.state.async_engine.error}")

    async def handle(self, call: HTTPCall):
        """Run one HTTP call through kvserve's app: yields the response head, then body chunks."""
        if call.route.replica is not None and call.route.replica != self.name:
            yield {"status": 503, "headers": [(b"content-type", b"application/json")]}
            yield _error_body(f"replica {call.route.replica} is not serving (gone or restarted)")
            return
        async for item in run_asgi(self.app, call, self.name):
            yield item

    async def __del__(self):
        if getattr(self, "lifespan", None) is not None:  # start-up got that far
            await self.lifespan.__aexit__(None, None, None)


def connector_on(transfer: dict | None, host: str) -> dict:
    """A TcpConnector producer serves its blocks on this replica's node address (unless told where)."""
    if not transfer or transfer.get("kv_connector") != "TcpConnector" or "kv_ip" in transfer:
        return {}
    return {"kv_transfer_config": {**transfer, "kv_ip": host}}


def add_replica_routes(app) -> None:
    """A replica's own extra route: the block hashes its prefix cache holds (to check the index)."""
    state = app.state.kvserve

    @app.get("/v1/kv/cached")
    async def cached_blocks():
        return await state.async_engine.call(_cached_hashes)


def _cached_hashes(engine) -> dict:
    """The block hashes findable in the pool (every KV group's blocks share one pool)."""
    return {"hashes": sorted(h.hex() for h in engine.kv.pool.cached)}


async def run_asgi(app, call: HTTPCall, name: str):
    """Drive an ASGI app with one request; yield {'status', 'headers'} then the body chunks.

    Closing the generator early (the client went away) tells the app the client disconnected."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
             "root_path": "", "query_string": call.query, "headers": call.headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    pending_body = [call.body]

    async def receive():
        if pending_body:
            return {"type": "http.request", "body": pending_body.pop(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", [])) + [(REPLICA_HEADER.encode(), name.encode())]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=5)
            task.cancel()


# ---- the ingress ------------------------------------------------------------------------


class Ingress:
    """Serve's HTTP entry: routes each request to an engine replica and relays its answer."""

    def __init__(self, engines, model: str | None, routing: str = "prefix", cache_isolation: str = "salt",
                 api_keys: list[str] | None = None, max_body_bytes: int = 2 << 20, admin_api_key: str | None = None,
                 prefill=None):
        from kvserve.engine.builder import load_tokenizer
        from kvserve.model.loader import resolve_model_path
        from kvserve.server.app import ApiKeyMiddleware

        self.engines = engines.options(stream=True)
        self.prefill = prefill.options(stream=True) if prefill is not None else None  # disaggregated
        self.handles = [h for h in (self.engines, self.prefill) if h is not None]
        self.routing = routing
        self.tokenizer = load_tokenizer(resolve_model_path(model))
        self.cache_isolation, self.api_keys = cache_isolation, list(api_keys or [])
        self.max_body_bytes = max_body_bytes
        # the replicas' own rules for the operator routes (/metrics, and /v1/replicas here)
        self.keys = ApiKeyMiddleware(None, self.api_keys, admin_api_key, cache_isolation)

    async def __call__(self, request):
        """Any route: /metrics and /v1/replicas here, everything else on one replica."""
        from starlette.responses import JSONResponse, Response

        path = _path(request)
        try:
            if path in ("/v1/replicas", "/metrics"):
                self._check_operator(request)
            if path == "/v1/replicas":
                return JSONResponse(await self.replicas(request.query_params.get("hashes") == "true"))
            call = await self._call(request)
            if path == "/metrics" and call.route.replica is None:
                text, status = await self.metrics(call)
                return Response(text, status_code=status, media_type="text/plain; version=0.0.4")
            if self.prefill is not None and call.route.token_ids is not None:
                return await self.disaggregated(call)
            return await self.forward(call)
        except APIError as exc:
            return exc.response()

    async def _call(self, request) -> HTTPCall:
        body = await _read_body(request, self.max_body_bytes)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in HOP_HEADERS]
        call = HTTPCall(request.method, _path(request), request.url.query.encode(), headers, body)
        call.route = RouteInfo(replica=request.headers.get(REPLICA_HEADER))
        if request.method == "POST" and call.path in ROUTED_PATHS and call.route.replica is None:
            call.route = await asyncio.to_thread(self.route_info, call)
        call.route.policy = self.routing
        return call

    def route_info(self, call: HTTPCall) -> RouteInfo:
        """The prompt's token ids and cache salt as the replica will see them (None when unreadable:
        the replica then answers the error)."""
        from kvserve.server import inputs
        from kvserve.server import protocol as P
        try:
            data = json.loads(call.body)
            if call.path == "/v1/chat/completions":
                req = P.ChatCompletionRequest.model_validate(data)
                ids = inputs.chat_token_ids(self.tokenizer, req.conversation(), req.add_generation_prompt,
                                            None, 1 << 30)["prompt_token_ids"]
            else:
                req = P.CompletionRequest.model_validate(data)
                ids = inputs.prompt_token_ids(self.tokenizer, req.prompts()[0], None, 1 << 30)["prompt_token_ids"]
        except Exception:
            return RouteInfo()
        return RouteInfo(token_ids=list(ids), salt=self._salt(call, req.cache_salt))

    def _salt(self, call: HTTPCall, salt: str | None) -> str | None:
        """The cache salt app.py's `isolate` gives the request."""
        if self.cache_isolation != "api-key":
            return salt if self.cache_isolation == "salt" else None
        token = dict(call.headers).get(b"authorization", b"").partition(b" ")[2].strip().decode()
        tenant = tenant_salt(token)
        return tenant if salt is None else f"{tenant}/{salt}"

    def _check_operator(self, request) -> None:
        """/v1/replicas and /metrics show every tenant's traffic: the admin key, as on one server."""
        err = self.keys.operator_error(request.scope)
        if err is not None:
            raise err

    async def disaggregated(self, call: HTTPCall):
        """Prefill on a prefill replica (one token, its KV saved), then decode on an engine replica
        that receives that KV; the decode replica's answer is relayed."""
        from starlette.responses import Response
        body = json.loads(call.body)
        first = HTTPCall(call.method, call.path, call.query, call.headers, json.dumps(prefill_body(body)).encode(),
                         RouteInfo(call.route.token_ids, call.route.salt, policy=call.route.policy))
        status, answer, prefill_replica = await self.collect(first, self.prefill)
        if status != 200:   # a bad request: the replica's own answer says why; a lost one: 503
            return Response(answer or _error_body("the prefill replica failed: retry", "replica_failed"),
                            status_code=status, media_type="application/json")
        params = json.loads(answer).get("kv_transfer_params")
        if params is None:
            raise APIError(502, "the prefill replica returned no kv_transfer_params (is its KV connector a "
                                "producer?)", type="service_unavailable", code="prefill_failed")
        call.body = json.dumps({**body, "kv_transfer_params": params}).encode()
        return await self.forward(call, {PREFILL_HEADER: prefill_replica})

    async def forward(self, call: HTTPCall, extra_headers: dict | None = None):
        """Send the call to a replica and relay its answer; a replica lost on the way ends it cleanly."""
        from starlette.responses import StreamingResponse

        gen = self.engines.handle.remote(call)
        try:
            head = await gen.__anext__()
        except Exception as exc:
            gen.cancel()
            return _lost(exc).response()
        headers = {k.decode(): v.decode() for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
        headers.update(extra_headers or {})
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_relay(gen, sse), status_code=head["status"], headers=headers)

    async def metrics(self, call: HTTPCall) -> tuple[str, int]:
        """Every replica's /metrics, each sample labelled with its replica."""
        texts = {}
        for handle in self.handles:
            for name in sorted((await self.router_status(handle))["replicas"]):
                one = HTTPCall(call.method, call.path, call.query, call.headers, b"", RouteInfo(replica=name))
                status, body, _ = await self.collect(one, handle)
                if status == 401:
                    return body.decode(), 401
                if status == 200:
                    texts[name] = body.decode()
        return merge_metrics(texts), 200

    async def collect(self, call: HTTPCall, handle=None) -> tuple[int, bytes, str]:
        """A whole (non-streamed) answer from a replica of `handle`'s deployment (the engines by
        default): its status, body and the replica's name."""
        gen = (handle or self.engines).handle.remote(call)
        try:
            head, body = None, b""
            async for item in gen:
                if head is None:
                    head = item
                else:
                    body += item
            name = dict(head["headers"]).get(REPLICA_HEADER.encode(), b"").decode()
            return head["status"], body, name
        except Exception as exc:
            log.warning("replica %s did not answer %s: %r", call.route.replica, call.path, exc)
            return 503, b"", ""

    async def replica_names(self) -> list[str]:
        """The live engine replicas, by name."""
        return sorted((await self.replicas())["replicas"])

    async def replicas(self, hashes: bool = False) -> dict:
        """The routers' view: each replica's load and the blocks its index holds (a disaggregated
        application's prefill replicas under "prefill")."""
        out = await self.router_status(self.engines, hashes)
        if self.prefill is not None:
            out["prefill"] = await self.router_status(self.prefill, hashes)
        return out

    async def router_status(self, handle, hashes: bool = False) -> dict:
        """One deployment's router view (a first call through the handle makes its router)."""
        key = router_key(handle.app_name, handle.deployment_name)
        router = routers().get(key)
        if router is None or router.loop is None:
            await self.collect(HTTPCall("GET", "/health", route=RouteInfo(policy=self.routing)), handle)
            router = routers().get(key)
        if router is None:
            return {"policy": None, "replicas": {}}
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(router.status(hashes), router.loop))


def _path(request) -> str:
    """The request's path below the application's route prefix."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


async def _relay(gen, sse: bool):
    """The replica's body chunks; if the replica dies, an SSE error event and [DONE] (else the end)."""
    try:
        async for chunk in gen:
            yield chunk
    except Exception as exc:
        log.warning("replica lost mid-answer: %r", exc)
        if sse:
            lost = _lost(exc)
            yield b"data: " + _error_body(lost.message, lost.code) + b"\n\n"
            yield b"data: [DONE]\n\n"
    finally:
        gen.cancel()


def _lost(exc: BaseException) -> APIError:
    return APIError(503, f"the replica serving this request failed ({type(exc).__name__}); retry: another "
                         "replica will take it", type="service_unavailable", code="replica_failed")


def _error_body(message: str, code: str = "replica_unavailable") -> bytes:
    return json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None,
                                 "code": code}}).encode()


async def _read_body(request, max_bytes: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"request body exceeds {max_bytes} bytes (--max-body-bytes)",
                           code="request_too_large")
    return bytes(body)


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one: each family's HELP/TYPE once, every sample with a
    `replica` label."""
    families: dict[str, list[str]] = {}
    for name, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith("# "):
                family = line.split()[2] if len(line.split()) > 2 else family
                lines = families.setdefault(family, [])
                if line not in lines:
                    lines.append(line)
            elif line.strip():
                families.setdefault(family, []).append(_label(line, name))
    return "".join(line + "\n" for lines in families.values() for line in lines)


def _label(sample: str, replica: str) -> str:
    label = f'replica="{replica}"'
    name, brace, rest = sample.partition("{")
    if brace:
        return f"{name}{{{label},{rest}" if not rest.startswith("}") else f"{name}{{{label}{rest}"
    metric, _, value = sample.partition(" ")
    return f"{metric}{{{label}}} {value}"


def _node_ip() -> str:
    import ray
    return ray.util.get_node_ip_address()


# ---- deploying ----------------------------------------------------------------------------


def build_application(engine_kwargs: dict, app_kwargs: dict, *, replicas: int, routing: str = "prefix",
                      events_host: str | None = None, num_cpus: float = 0, max_ongoing_requests: int = 256,
                      disaggregate: tuple[int, int] | None = None, ingress_node: str | None = None):
    """The Ray Serve application: `replicas` engine replicas behind an ingress routed by KVRouter;
    with `disaggregate` (P, D), P prefill replicas and D decode replicas (`replicas` is ignored).
    `ingress_node`: the node address the ingress runs on (default: where Ray puts it)."""
    from ray import serve

    def engines(name: str, count: int, kwargs: dict):
        deployment = serve.deployment(EngineReplica, name=name, num_replicas=count,
                                      max_ongoing_requests=max_ongoing_requests,
                                      request_router_config=_router_config(routing),
                                      ray_actor_options={"num_cpus": num_cpus}, health_check_period_s=2)
        return deployment.bind(kwargs, app_kwargs, events_host)

    prefill = None
    if disaggregate is not None:
        producer, consumer = disaggregated_engines(engine_kwargs)
        prefill = engines(PREFILL_DEPLOYMENT, disaggregate[0], producer)
        engine_kwargs, replicas = consumer, disaggregate[1]
    api = {k: app_kwargs[k] for k in ("cache_isolation", "max_body_bytes", "admin_api_key") if k in app_kwargs}
    keys = app_kwargs.get("api_key") or []
    pin = {"resources": {f"node:{ingress_node}": 0.001}} if ingress_node else {}
    ingress = serve.deployment(Ingress, name="kvserve-ingress", ray_actor_options={"num_cpus": 0, **pin},
                               max_ongoing_requests=10_000)
    return ingress.bind(engines(ENGINE_DEPLOYMENT, replicas, engine_kwargs), engine_kwargs.get("model"),
                        routing, api_keys=[keys] if isinstance(keys, str) else keys, prefill=prefill, **api)


def _router_config(routing: str):
    from ray.serve.config import RequestRouterConfig
    return RequestRouterConfig(request_router_class="kvserve.distributed.serve_router.KVRouter",
                               request_router_kwargs={"policy": routing},
                               request_routing_stats_period_s=STATS_PERIOD_S)


def disaggregated_engines(engine_kwargs: dict) -> tuple[dict, dict]:
    """The prefill (kv_producer) and decode (kv_consumer) replicas' engine options: the given
    kv_transfer_config's connector (TcpConnector when none is given) with each side's role."""
    from kvserve.kv.connector import parse_kv_transfer_config
    given = engine_kwargs.get("kv_transfer_config") or {"kv_connector": "TcpConnector"}
    given = json.loads(given) if isinstance(given, str) else given
    transfer = {k: v for k, v in given.items() if k not in ("engine_id", "kv_role")}
    sides = [{**transfer, "kv_role": role} for role in ("kv_producer", "kv_consumer")]
    for side in sides:
        parse_kv_transfer_config(side)   # a bad connector is refused here, before any replica starts
    return tuple({**engine_kwargs, "kv_transfer_config": side} for side in sides)


def parse_disaggregate(value: str | None) -> tuple[int, int] | None:
    """`--disaggregate P:D` as (P, D); ValueError that says what to give."""
    if value is None:
        return None
    try:
        p, d = (int(x) for x in value.split(":"))
    except ValueError:
        raise ValueError(f"--disaggregate takes PREFILL:DECODE replica counts, e.g. 1:2, not {value!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"--disaggregate needs at least one prefill and one decode replica, got {value!r}")
    return p, d


def build_ingress(engines, model: str | None = None, routing: str = "prefix", name: str = "kvserve-ingress"):
    """One more entry (another routing policy, say) to the engine replicas of a running application;
    `engines` is their handle (`serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name)`)."""
    from ray import serve
    ingress = serve.deployment(Ingress, name=name, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    return ingress.bind(engines, model, routing)


def replica_app_kwargs(args, api_keys: list[str], admin_key: str | None) -> dict:
    """Each replica's build_app options from `kvserve serve` flags: the keys, the admin key and the
    request limits (each replica enforces its own: the limits hold per replica)."""
    return {"served_model_name": args.served_model_name, "api_key": api_keys, "admin_api_key": admin_key,
            "max_queue": args.max_queue, "max_body_bytes": args.max_body_bytes,
            "allow_special_tokens_in_content": args.allow_special_tokens_in_content,
            "cache_isolation": args.cache_isolation, "metrics_names": args.metrics_names,
            "tool_call_parser": args.tool_call_parser, "enable_auto_tool_choice": args.enable_auto_tool_choice,
            "max_request_tokens": args.max_request_tokens, "max_running_per_key": args.max_running_per_key,
            "max_concurrent_requests": args.max_concurrent_requests}


def serve_replicas(args, api_keys: list[str], admin_key: str | None = None) -> int:
    """`kvserve serve --replicas N`: start (or join) Ray, deploy, serve until SIGINT/SIGTERM."""
    import os
    import signal
    import threading

    from kvserve.engine_args import engine_kwargs
    from kvserve.extras import require

    ray = require("ray", "distributed", "kvserve serve --replicas")
    from ray import serve

    disaggregate = parse_disaggregate(args.disaggregate)
    if disaggregate is not None and args.replicas not in (None, sum(disaggregate)):
        raise ValueError(f"--replicas {args.replicas} with --disaggregate {args.disaggregate}: give --replicas "
                         f"{sum(disaggregate)} (prefill + decode) or leave it out")
    replicas = sum(disaggregate) if disaggregate else args.replicas
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app_kwargs = replica_app_kwargs(args, api_keys, admin_key)
    app = build_application(engine_kwargs(args), app_kwargs, replicas=replicas, routing=args.routing,
                            events_host=None if args.ray_address else "127.0.0.1",
                            num_cpus=args.replica_num_cpus, disaggregate=disaggregate,
                            ingress_node=_node_ip() if args.ray_address else None)
    serve.run(app, name="kvserve", route_prefix="/")
    log.info("serving %s on http://%s:%d (routing %s)", f"{disaggregate[0]} prefill + {disaggregate[1]} decode "
             "replicas" if disaggregate else f"{replicas} replicas", args.host, args.port, args.routing)
    stop = threading.Event()

    def on_signal(*_):
        if stop.is_set():
            os._exit(1)  # a second signal: leave at once
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    stop.wait()
    log.info("stopping the replicas")
    if args.ray_address:
        serve.delete("kvserve")  # the cluster goes on without this application
    ray.shutdown()  # a local Ray (a Ctrl-C reaches its processes too) stops with its replicas
    return 0
