"""What the server does about connections themselves: read deadlines, the open-files limit, and
access-log lines that never carry a key (docs/SERVING.md "Limits and failure handling").

uvicorn's keep-alive timer runs only between requests, and any byte stops it: a client that sends
headers or a body slowly, or nothing at all, holds its connection (and a file descriptor) forever.
`read_timeout_protocol` returns uvicorn's own HTTP protocol class with two deadlines per request,
whole-request rather than per read, so dripping a byte at a time does not extend them: the head
(request line and headers) within `header_timeout` seconds of the connection opening or the last
response ending, the body within `body_timeout` seconds of the head. Past a deadline the client
gets a 408 and the connection is closed.
"""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger("kvserve.server")

HEADERS, BODY = "headers", "body"
NOFILE_WHEN_UNLIMITED = 65536   # soft limit asked for when the hard one is unlimited
_SECRET_QUERY = re.compile(r"(?i)([?&;](?:api[_-]?key|key|access_token|token)=)[^&;#\s\"]*")


def read_timeout_protocol(header_timeout: float | None, body_timeout: float | None, base: type | None = None):
    """uvicorn's HTTP protocol (`base`, default its auto choice: httptools, else h11) with deadlines
    for a request's head and body; pass it as uvicorn.Config(http=...)."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base

    class ReadTimeoutProtocol(base):
        """A connection whose requests must arrive within their deadlines."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._seen = None            # the request whose head was last seen
            self._timer = None
            self._waiting_for = None
            self._arm(HEADERS)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._progress()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._progress()
            idle = self.cycle is None or self.cycle.response_complete
            if self._timer is None and idle and not self.transport.is_closing():
                self._arm(HEADERS)       # the next request on this keep-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _progress(self) -> None:
            cycle = self.cycle
            if cycle is None:
                return
            if cycle is not self._seen:                  # a new request's head is complete
                self._seen = cycle
                self._disarm()
                if cycle.more_body:
                    self._arm(BODY)
            elif self._waiting_for == BODY and not cycle.more_body:
                self._disarm()

        def _arm(self, what: str) -> None:
            seconds = header_timeout if what == HEADERS else body_timeout
            if seconds is not None:
                self._waiting_for = what
                self._timer = self.loop.call_later(seconds, self._expired, what, seconds)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._waiting_for = None

        def _expired(self, what: str, seconds: float) -> None:
            self._timer = self._waiting_for = None
            if self.transport.is_closing():
                return
            if what == HEADERS or not self.cycle.response_started:
                self.transport.write(timeout_response(what, seconds))
            self.transport.close()

    return ReadTimeoutProtocol


def timeout_response(what: str, seconds: float) -> bytes:
    """A whole HTTP/1.1 408 response (OpenAI's error shape) that closes the connection."""
    flag = "--request-header-timeout" if what == HEADERS else "--request-body-timeout"
    body = json.dumps({"error": {
        "message": f"the request {what} did not arrive within {seconds:g} s ({flag}); the connection is closed",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise the soft limit on open files to the hard one (each connection holds a descriptor);
    (old, new), or None when it could not or need not change. Logged either way."""
    try:
        import resource
    except ImportError:    # not on this platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NOFILE_WHEN_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft >= target:
        log.info("open files limit: %d (the hard limit)", soft)
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("open files limit stays %d: raising it to %d failed (%s)", soft, target, exc)
        return None
    log.info("open files limit raised from %d to %d", soft, target)
    return soft, target


def redact_query(text: str) -> str:
    """`text` with the values of key=, api_key=, token= ... query parameters replaced."""
    return _SECRET_QUERY.sub(r"\1REDACTED", text)


class RedactKeys(logging.Filter):
    """Redacts key-carrying query values in a log record's string arguments (uvicorn's access log
    passes the path with its query string as one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a for a in record.args)
        return True


def redact_access_log(name: str = "uvicorn.access") -> None:
    """Install RedactKeys on logger `name` (once)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactKeys) for f in logger.filters):
        logger.addFilter(RedactKeys())
