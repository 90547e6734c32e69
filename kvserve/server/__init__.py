"""kvserve.server: the OpenAI-compatible HTTP server (`kvserve serve`), see docs/SERVING.md.

Import `kvserve.server.app.build_app` for the FastAPI app; this package module stays light so
the command line can register `serve` without importing torch or FastAPI.
"""

DEFAULT_MAX_QUEUE = 256          # waiting requests before 429
DEFAULT_MAX_BODY_BYTES = 2 << 20  # 2 MiB
