"""What one client may ask of the server: tokens per request, a key's share of the engine, requests
in flight (docs/SERVING.md "Limits and failure handling").

- `check_request_tokens`: prompts x n x max_tokens of one request against `--max-request-tokens`.
- `KeyShares`: each API key's sequences in the engine (running or queued there) stay within
  `--max-running-per-key`; a request past its key's share waits in the server, first come first
  served per key, and a key's waiting sequences stay within `--max-queue` (429 past it).
- `ConcurrencyLimit`: HTTP requests in flight (/health aside) within `--max-concurrent-requests`,
  a 503 with Retry-After past it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from kvserve.engine.async_engine import QueueFullError
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError


def request_tokens(prompt_lens: list[int], params: SamplingParams, max_model_len: int) -> int:
    """The most tokens a request may generate: per prompt, n x max_tokens (no max_tokens: the room
    the prompt leaves in the context)."""
    def each(prompt_len: int) -> int:
        return params.max_tokens if params.max_tokens is not None else max(0, max_model_len - prompt_len)
    return sum(params.n * each(p) for p in prompt_lens)


def check_request_tokens(prompt_lens: list[int], params: SamplingParams, max_model_len: int,
                         limit: int | None) -> None:
    """400 naming --max-request-tokens when the request may generate more tokens than `limit`."""
    if limit is None:
        return
    total = request_tokens(prompt_lens, params, max_model_len)
    if total <= limit:
        return
    each = f"max_tokens={params.max_tokens}" if params.max_tokens is not None else "the room left in each context"
    raise APIError(400, f"this request may generate up to {total} tokens ({len(prompt_lens)} prompt(s) x "
                        f"n={params.n} x {each}), more than --max-request-tokens {limit} allows: lower "
                        "max_tokens or n, or split it into several requests",
                   param="max_tokens", code="request_tokens_exceeded")


class Lease:
    """A request's place in its key's share; `release()` (idempotent) gives it back."""

    def __init__(self, shares: KeyShares | None = None, key: str | None = None, need: int = 0):
        self.shares, self.key, self.need = shares, key, need

    def release(self) -> None:
        if self.shares is not None:
            shares, self.shares = self.shares, None
            shares.give_back(self.key, self.need)


@dataclass
class _Waiter:
    need: int          # sequences: prompts x n
    prompts: int
    granted: asyncio.Future


class KeyShares:
    """Each key's sequences in the engine, at most `limit` (None: no limit); a request larger than
    `limit` runs only when its key has nothing else in the engine. Requests past the share wait
    in order; a key's waiting sequences stay within `max_waiting`. Event-loop only."""

    def __init__(self, limit: int | None, max_waiting: int | None):
        self.limit, self.max_waiting = limit, max_waiting
        self.held: dict[str, int] = {}                    # key -> its sequences in the engine
        self.queues: dict[str, deque[_Waiter]] = {}

    @property
    def num_waiting_requests(self) -> int:
        """Engine requests (prompts) waiting here for their key's share."""
        return sum(w.prompts for q in self.queues.values() for w in q)

    async def acquire(self, key: str | None, prompts: int, n: int) -> Lease:
        """A lease for `prompts` x `n` sequences of `key`, once they fit its share (None: no key, no share)."""
        need = prompts * n
        if self.limit is None or key is None:
            return Lease()
        queue = self.queues.get(key)
        if not queue and self._fits(key, need):
            self.held[key] = self.held.get(key, 0) + need
            return Lease(self, key, need)
        self._check_room(key, need)
        waiter = _Waiter(need, prompts, asyncio.get_running_loop().create_future())
        self.queues.setdefault(key, deque()).append(waiter)
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.give_back(key, need)   # granted just as the caller gave up
            else:
                self._forget(key, waiter)
            raise
        return Lease(self, key, need)

    def give_back(self, key: str, need: int) -> None:
        """`need` sequences of `key` left the engine; wake the waiters that now fit."""
        left = self.held.get(key, 0) - need
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)
        self._wake(key)

    def _fits(self, key: str, need: int) -> bool:
        held = self.held.get(key, 0)
        return held == 0 or held + need <= self.limit

    def _check_room(self, key: str, need: int) -> None:
        waiting = sum(w.need for w in self.queues.get(key, ()))
        if self.max_waiting is not None and waiting + need > self.max_waiting:
            raise QueueFullError(f"this API key has {self.held.get(key, 0)} sequences in the engine (its share, "
                                 f"--max-running-per-key {self.limit}) and {waiting} more waiting for it "
                                 f"(at most --max-queue {self.max_waiting}); retry later", retry_after=1)

    def _forget(self, key: str, waiter: _Waiter) -> None:
        queue = self.queues.get(key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
        self._wake(key)   # the one behind may fit now

    def _wake(self, key: str) -> None:
        queue = self.queues.get(key)
        while queue and (queue[0].granted.done() or self._fits(key, queue[0].need)):
            waiter = queue.popleft()
            if waiter.granted.done():   # its caller was cancelled: _forget is on its way
                continue
            self.held[key] = self.held.get(key, 0) + waiter.need
            waiter.granted.set_result(None)
        if queue is not None and not queue:
            del self.queues[key]


class ConcurrencyLimit:
    """ASGI middleware: at most `limit` HTTP requests in flight (None: no limit); past it a 503 with
    Retry-After. /health is never refused, so a load balancer still sees the server up."""

    def __init__(self, app, limit: int | None):
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.limit is None or scope.get("path") == "/health":
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            err = APIError(503, f"the server is handling {self.active} requests, its limit "
                                f"(--max-concurrent-requests {self.limit}); retry shortly",
                           type="service_unavailable", code="too_many_concurrent_requests",
                           headers={"Retry-After": "1"})
            return await err.response()(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
