"""`kvserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Registered on the main CLI by kvserve.cli._register_tools (`kvserve serve` or
`python -m kvserve.cli serve`); its flags for the engine come from kvserve/engine_args.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal

from kvserve.server import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_QUEUE,
)

log = logging.getLogger("kvserve.server")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def byte_size(value: str) -> int:
    """argparse type: '2MiB', '512KiB', '1048576' -> bytes (kvserve.config.parse_bytes)."""
    from kvserve.config import parse_bytes
    return parse_bytes(value)


def register(subparsers) -> None:
    """Add the `serve` subcommand."""
    from kvserve.engine_args import add_engine_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics",
                              description="Serve the model over an OpenAI-compatible HTTP API.")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health; repeat for "
                        "several keys (tenants) (default: $KVSERVE_API_KEY, else no key)")
    p.add_argument("--admin-api-key", default=None, metavar="KEY",
                   help="the key /metrics, /v1/kv/state, /v1/kv/stream and the dashboard's data need; tenant "
                        "keys get 403 there (default: $KVSERVE_ADMIN_API_KEY, else none: under "
                        "--cache-isolation api-key those routes are then closed to tenant keys, otherwise "
                        "any --api-key opens them)")
    p.add_argument("--cache-isolation", default="salt", choices=["none", "salt", "api-key"],
                   help="who may share prefix-cache blocks: salt (default) = requests with the same "
                        "cache_salt (none given: all such requests); api-key = only requests made with the "
                        "same API key; none = everyone, and a request's cache_salt is refused "
                        "(docs/SERVING.md)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the model's)")
    p.add_argument("--metrics-names", default="kvserve", choices=["kvserve", "vllm"],
                   help="vllm: /metrics also exports every metric vLLM has under its vllm: name (same "
                        "labels), so dashboards built for vLLM work (default: kvserve: names only)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="waiting requests allowed before new ones get 429 with Retry-After "
                        "(a batch of more prompts than this gets 400)")
    p.add_argument("--max-body-bytes", type=byte_size, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted (413 beyond), e.g. 2MiB")
    p.add_argument("--max-request-tokens", type=int, default=None, metavar="N",
                   help="most tokens one request may ask to generate, prompts x n x max_tokens (no max_tokens: "
                        "the room left in the context); 400 beyond (default: max_model_len x max_num_seqs, "
                        "0: no limit)")
    p.add_argument("--max-running-per-key", type=int, default=None, metavar="N",
                   help="most sequences (prompts x n) one API key has in the engine, running or queued there; "
                        "its further requests wait their turn in the server, up to --max-queue sequences, "
                        "then 429 (default: --max-num-seqs, 0: no limit; needs --api-key)")
    p.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT_REQUESTS, metavar="N",
                   help="HTTP requests in flight before new ones get 503 with Retry-After; /health is never "
                        "refused (0: no limit)")
    p.add_argument("--request-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="SECONDS",
                   help="a request's line and headers must arrive within this long of the connection opening "
                        "(or of the previous response on a keep-alive connection); 408 and close otherwise")
    p.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT, metavar="SECONDS",
                   help="a request's whole body must arrive within this long of its headers; 408 and close "
                        "otherwise")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "json"],
                   help="how tool_choice 'auto' reads the model's calls: hermes (<tool_call>{...}</tool_call> "
                        "blocks) or json (the whole reply is a call object or an array of them)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let requests use tool_choice 'auto' (with --tool-call-parser); 'required' and "
                        "named functions work without it (a grammar forces the call)")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="parse special-token text in chat messages (<|im_end|>, ...) as control tokens; "
                        "only for trusted callers (default: encoded as plain text)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take to finish before they are aborted")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="append the KV state stream (one JSON snapshot per line, at most 4 a second while "
                        "something changes) to FILE; the dashboard at /dashboard replays it")
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engines as a Ray Serve application behind one router (docs/DISTRIBUTED.md; "
                        "needs pip install 'kvserve[distributed]'); default: one engine, no Ray")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: the Ray cluster to join (e.g. ray://head:10001 or auto); default: "
                        "a local Ray on this machine")
    p.add_argument("--disaggregate", default=None, metavar="P:D",
                   help="serve P prefill and D decode replicas (Ray Serve, as --replicas P+D): each request "
                        "prefills on a prefill replica, whose KV a decode replica receives through a KV "
                        "connector (TcpConnector unless --kv-transfer-config names another)")
    p.add_argument("--replica-num-cpus", type=float, default=0, metavar="N",
                   help="with --replicas: CPUs each engine replica asks of Ray (1 on a cluster of 1-CPU "
                        "nodes places one replica per node); default 0")
    p.add_argument("--routing", default="prefix", choices=["prefix", "round-robin", "least-loaded"],
                   help="with --replicas: prefix = the replica holding most of the prompt's prefix, weighed "
                        "against its load; least-loaded; round-robin")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    """Listen at once, load the model on a worker thread (/health answers 503 meanwhile), then serve
    until SIGTERM/SIGINT; exits 0 after a graceful shutdown."""
    import uvicorn

    from kvserve.config import EngineConfig
    from kvserve.engine.options import engine_options
    from kvserve.engine_args import engine_kwargs, make_llm
    from kvserve.model.loader import resolve_model_path
    from kvserve.server.app import build_app, check_admin_key, check_cache_isolation
    from kvserve.server.connections import (
        raise_open_files_limit,
        read_timeout_protocol,
        redact_access_log,
    )
    from kvserve.server.loading import LoadingApp
    from kvserve.startup import phase, seconds_since_launch

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes | json)")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    check_limits(args)
    api_keys, admin_key = api_keys_of(args), admin_key_of(args)
    check_cache_isolation(args.cache_isolation, api_keys)
    check_admin_key(admin_key, api_keys)
    if args.replicas is not None or args.disaggregate is not None:
        from kvserve.server.replicas import serve_replicas
        return serve_replicas(args, api_keys, admin_key)
    log.info("start-up: import %.2f s", seconds_since_launch())
    engine_options(EngineConfig(**engine_kwargs(args)))   # bad flags fail now, with exit status 2
    with phase("model resolve"):
        resolve_model_path(args.model)

    def build():
        engine = make_llm(args).engine
        app = build_app(engine, served_model_name=args.served_model_name, api_key=api_keys,
                        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                        cache_isolation=args.cache_isolation, record=args.record,
                        tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                        admin_api_key=admin_key, max_request_tokens=args.max_request_tokens,
                        max_running_per_key=args.max_running_per_key,
                        max_concurrent_requests=args.max_concurrent_requests)
        if args.metrics_names == "vllm":
            app.state.kvserve.metrics.export_vllm_names()
        log.info("serving %s on http://%s:%d (api key %s, admin key %s, prefix-cache isolation %s)",
                 app.state.kvserve.model_name, args.host, args.port,
                 f"required, {len(api_keys)} key(s)" if api_keys else "off", "set" if admin_key else "none",
                 args.cache_isolation)
        return app

    raise_open_files_limit()
    loading = LoadingApp(build)
    config = uvicorn.Config(loading, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.no_access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5,
                            http=read_timeout_protocol(args.request_header_timeout, args.request_body_timeout))
    redact_access_log()
    log.info("listening on http://%s:%d while the model loads (/health answers 503 until it is ready)",
             args.host, args.port)
    return serve(loading, config, args.shutdown_timeout)


def check_limits(args) -> None:
    """ValueError naming the first negative limit or non-positive timeout."""
    for flag in ("max_request_tokens", "max_running_per_key", "max_concurrent_requests"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0 (0: no limit), got {value}")
    for flag in ("request_header_timeout", "request_body_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")


def admin_key_of(args) -> str | None:
    """--admin-api-key, else $KVSERVE_ADMIN_API_KEY, else None."""
    if args.admin_api_key is not None:
        return args.admin_api_key
    return os.environ.get("KVSERVE_ADMIN_API_KEY") or None


def api_keys_of(args) -> list[str]:
    """The keys given with --api-key (empty ones refused), else $KVSERVE_API_KEY, else none."""
    if args.api_key is None:
        env = os.environ.get("KVSERVE_API_KEY")
        return [env] if env else []
    if any(not k for k in args.api_key):
        raise ValueError("--api-key must not be empty: give the key, e.g. --api-key sk-tenant-a")
    return list(dict.fromkeys(args.api_key))


def serve(app, config, shutdown_timeout: float) -> int:
    """Run `app` (a LoadingApp) until a signal (exit status 0) or until its model fails to load or its
    engine fails for good (status 1)."""
    server = graceful_server(config, on_signal=lambda: app.begin_drain(shutdown_timeout),
                             failed=lambda: app.error is not None)
    server.run()
    if app.error is not None:
        log.error("the engine failed (%r): exiting with status 1 so a supervisor restarts the server", app.error)
        return 1
    return 0


def graceful_server(config, on_signal, failed=lambda: False):
    """A uvicorn.Server that calls `on_signal()` on SIGTERM/SIGINT, then exits normally (0), and that
    stops by itself once `failed()` is true (checked on each of uvicorn's 0.1 s ticks).

    uvicorn re-raises the captured signal after its own graceful shutdown, which would end the
    process with status 143 instead of 0; this server does not.
    """
    import uvicorn

    class GracefulServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def on_tick(self, counter: int) -> bool:
            return await super().on_tick(counter) or failed()

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                log.info("received signal %d: taking no new requests, draining", sig)
                on_signal()
            super().handle_exit(sig, frame)

    return GracefulServer(config)
