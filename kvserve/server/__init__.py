"""kvserve.server: the OpenAI-compatible HTTP server (`kvserve serve`), see docs/SERVING.md.

Import `kvserve.server.app.build_app` for the FastAPI app; this package module stays light so
the command line can register `serve` without importing torch or FastAPI.
"""

DEFAULT_MAX_QUEUE = 256          # waiting requests before 429
DEFAULT_MAX_BODY_BYTES = 2 << 20  # 2 MiB
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024  # HTTP requests in flight before 503 (/health aside)
DEFAULT_HEADER_TIMEOUT = 10.0     # seconds for a request's line and headers to arrive
DEFAULT_BODY_TIMEOUT = 30.0       # seconds for its body, from the end of its headers
