"""AsyncEngine: one background thread steps an LLMEngine; asyncio code adds, streams and aborts.

The LLMEngine is not thread-safe, so only the engine thread ever touches it. Everything else
(adding a request, aborting one, reading metrics) is a command the engine thread runs between
two steps; results come back through futures, and each request's outputs come back through an
asyncio.Queue on the caller's event loop. A stream that is closed before its request finished
(the client went away) aborts the request, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.engine import LLMEngine, PromptType
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams, remote_prefill

log = logging.getLogger("kvserve")

# After this long with nothing to run, the engine hands what its steps freed back to the OS
IDLE_RELEASE_SECONDS = 2.0


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an internal error or shutdown); no request can run."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (its blocks are freed); the others go on."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and takes no new requests."""


class QueueFullError(RuntimeError):
    """Too many requests are already waiting; retry later."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class FinishedRequest:
    """What the per-request histograms need about one finished request."""

    request_id: str
    finish_reasons: list[str | None]
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    ttft: float | None
    queue_time: float | None
    e2e: float | None
    inter_token_latencies: list[float] = field(default_factory=list)


class TokenClock:
    """Tokens seen and inter-token gaps of one request's completions, from its outputs (DELTA outputs
    carry the new tokens, the others all of them)."""

    def __init__(self, delta: bool):
        self.delta = delta
        self.seen: dict[int, tuple[int, float]] = {}     # completion index -> (tokens, time of the last)
        self.gaps: list[float] = []

    def record(self, out: RequestOutput, now: float) -> None:
        for c in out.outputs:
            count, last = self.seen.get(c.index, (0, now))
            n = count + len(c.token_ids) if self.delta else len(c.token_ids)
            if n > count:
                if count > 0:
                    self.gaps.extend([(now - last) / (n - count)] * (n - count))
                self.seen[c.index] = (n, now)

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.seen.values())


class RequestStream:
    """The outputs of one request, as an async iterator; closing it early aborts the request."""

    def __init__(self, owner: AsyncEngine, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self) -> RequestOutput:
        """The newest output (older queued ones are skipped: text and token ids are cumulative)."""
        item = await self._queue.get()
        while not self._queue.empty() and not _is_final(item):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                yield await self.next()
        finally:
            self.close()

    def close(self) -> None:
        """Stop listening; aborts the request unless it already finished."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)
        self._owner._streams.pop(self.request_id, None)


def _put_all(pairs: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in pairs:
        stream._put(item)


def _is_final(item) -> bool:
    return isinstance(item, BaseException) or item.finished


class AsyncEngine:
    """Runs an LLMEngine on a background thread for asyncio callers (the HTTP server)."""

    def __init__(self, engine: LLMEngine, max_queue: int | None = None,
                 on_finished: Callable[[FinishedRequest], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 idle_release_seconds: float = IDLE_RELEASE_SECONDS):
        """`idle_release_seconds`: how long the engine waits with nothing to run before its freed host
        memory goes back to the OS (LLMEngine.release_idle_memory), once per busy spell."""
        self.engine = engine
        self.idle_release_seconds = idle_release_seconds
        self._release_at: float | None = None   # when to release, set by each step
        self.max_queue = max_queue
        self.on_finished = on_finished
        self.on_fatal = on_fatal  # called on the engine thread once it has stopped for good
        self._failed_last_step = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._token_times: dict[str, TokenClock] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.draining = False
        self.error: BaseException | None = None

    # ---- life cycle ----------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and healthy."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def begin_drain(self, grace_seconds: float | None = None) -> None:
        """Refuse new requests; after `grace_seconds` abort those still running. Thread-safe."""
        self.draining = True
        if grace_seconds is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, grace_seconds, self.abort_all)

    def abort_all(self) -> None:
        """Abort every unfinished request; their streams end with finish_reason 'abort'."""
        self._send(self._abort_all_now)

    async def shutdown(self) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        self.draining = True
        if self._thread is None:
            return
        self._stopping = True
        self._send(None)
        await asyncio.to_thread(self._thread.join, 30)

    # ---- requests ------------------------------------------------------------------
    async def add(self, prompt: PromptType, params: SamplingParams,
                  request_id: str) -> RequestStream:
        """Queue one request; raises ValueError for bad input, QueueFullError when full."""
        return (await self.add_batch([prompt], params, [request_id]))[0]

    async def add_batch(self, prompts: list[PromptType], params: SamplingParams,
                        request_ids: list[str]) -> list[RequestStream]:
        """Queue several requests at once: all are accepted or none is.

        Tokenize text prompts before (token ids in, as {'prompt', 'prompt_token_ids'}): a text
        prompt is tokenized here on the engine thread, where it stalls every running request.
        """
        self._check_accepting()
        self.check_batch_size(len(prompts), params.n)
        if remote_prefill(params):   # a KV consumer receives the blocks here, off the engine thread
            for p in prompts:
                await asyncio.to_thread(self.engine.receive_kv, p, params)
        streams = [RequestStream(self, rid) for rid in request_ids]
        for s in streams:
            self._streams[s.request_id] = s
        try:
            await self._call(lambda: self._add_now(prompts, params, request_ids))
        except BaseException:
            for s in streams:
                s.finished = True
                self._streams.pop(s.request_id, None)
            raise
        return streams

    def check_batch_size(self, num_prompts: int, n: int = 1) -> None:
        """ValueError for a batch whose sequences (prompts x n) could never be queued, however idle
        the engine; it names `prompt` for a batch, `n` for one prompt."""
        sequences = num_prompts * n
        if self.max_queue is None or sequences <= self.max_queue:
            return
        shape = f"prompt holds {num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise ValueError(f"{shape}: {sequences} sequences, more than can ever wait at once (--max-queue "
                         f"{self.max_queue}): send at most {self.max_queue} sequences (prompts x n) per request")

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes."""
        stream = await self.add(prompt, params, request_id)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it already finished). Thread-safe, does not wait."""
        self._send(lambda: self._abort_now(request_id, notify=False))

    async def get_metrics(self) -> dict:
        """LLMEngine.get_metrics(), read on the engine thread."""
        return await self._call(self.engine.get_metrics)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        return await self._call(lambda: fn(self.engine))

    # ---- hand-off to the engine thread ---------------------------------------------
    def _check_accepting(self) -> None:
        if self.error is not None or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self.error or 'shut down'}")
        if self.draining:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        if self._thread is None:
            raise EngineDeadError("the engine thread was not started: call AsyncEngine.start()")

    def _send(self, fn: Callable[[], Any] | None,
              future: concurrent.futures.Future | None = None) -> None:
        self._commands.put((fn, future))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if self.error is not None or self._thread is None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running: {self.error or 'not started'}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(fn, future)
        return await asyncio.wrap_future(future)

    # ---- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_commands(self._wait_seconds())
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                    self._release_at = time.monotonic() + self.idle_release_seconds
                elif self._release_at is not None and time.monotonic() >= self._release_at:
                    self._release_at = None
                    self.engine.release_idle_memory()
        except BaseException as exc:  # not one request's fault: fail them all, stop for good
            log.exception("engine step failed; the engine stops")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))
        finally:
            self._abort_all_now()
            self._fail_commands()
        if self.error is not None and self.on_fatal is not None:
            self.on_fatal(self.error)

    def _step(self) -> None:
        """One engine step; requests it failed get an error, a second such step in a row is fatal.
        A failure a cached prefix caused (`prefix_fault`: that prefix is evicted) is not the engine's."""
        outputs = self.engine.step()
        self._dispatch(outputs, time.monotonic())
        failed = [out.request_id for out in outputs if out.error is not None and not out.prefix_fault]
        if failed and self._failed_last_step:
            raise RuntimeError(f"the engine failed requests in two steps in a row (now {failed}): "
                               "the engine itself, not one request, is at fault")
        self._failed_last_step = bool(failed)

    def _wait_seconds(self) -> float | None:
        """How long the engine thread may wait for a command: not at all with requests to step, until
        the idle release is due after a busy spell, else for as long as it takes (None)."""
        if self.engine.has_unfinished_requests():
            return 0.0
        if self._release_at is None:
            return None
        return max(0.0, self._release_at - time.monotonic())

    def _run_commands(self, wait: float | None) -> None:
        """Run the queued commands, waiting up to `wait` seconds (None: forever) for the first."""
        try:
            item = self._commands.get_nowait() if wait == 0 else self._commands.get(timeout=wait)
        except queue.Empty:
            return
        while True:
            fn, future = item
            if fn is None:
                self._stopping = True
            elif future is None:
                fn()
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine stopped"))

    def _add_now(self, prompts: list, params: SamplingParams, request_ids: list[str]) -> None:
        """Validate every prompt, then add them all (engine thread)."""
        waiting = len(self.engine.scheduler.waiting)
        if self.max_queue is not None and waiting + len(prompts) * params.n > self.max_queue:
            raise QueueFullError(f"{waiting} requests are already waiting (--max-queue {self.max_queue}) and this "
                                 f"one adds {len(prompts) * params.n} sequences (prompts x n); retry later",
                                 retry_after=1)
        for p, rid in zip(prompts, request_ids):
            self.engine.make_request(p, params, rid)
        for p, rid in zip(prompts, request_ids):
            self.engine.add_request(p, params, rid)
            self._token_times[rid] = TokenClock(params.output_kind == RequestOutputKind.DELTA)

    def _abort_now(self, request_id: str, notify: bool) -> None:
        out = self.engine.abort_request(request_id)  # the final 'abort' output; forgets the group
        if out is not None:
            self._dispatch([out], time.monotonic(), notify=notify)

    def _abort_all_now(self) -> None:
        for rid in list(self.engine.groups):
            try:
                self._abort_now(rid, notify=True)
            except Exception:  # keep aborting the others
                log.exception("aborting request %s failed", rid)

    def _dispatch(self, outputs: list[RequestOutput], now: float, notify: bool = True) -> None:
        items = []
        for out in outputs:
            self._record_token_times(out, now)
            if notify:
                items.append((out.request_id, out if out.error is None else RequestFailedError(out.error)))
            if out.finished:
                self._report_finished(out, self._token_times.pop(out.request_id, None))
        self._deliver_all(items)

    def _record_token_times(self, out: RequestOutput, now: float) -> None:
        """Inter-token gaps per completion, as seen by the engine thread (O(new tokens))."""
        clock = self._token_times.get(out.request_id)
        if clock is not None:
            clock.record(out, now)

    def _report_finished(self, out: RequestOutput, clock: TokenClock | None) -> None:
        if self.on_finished is None:
            return
        tokens = clock.tokens if clock is not None else sum(len(c.token_ids) for c in out.outputs)
        m = out.metrics
        ttft = m.ttft if m is not None else None
        queue_time = m.queue_time if m is not None else None
        e2e = (m.finished_time or time.monotonic()) - m.arrival_time if m is not None else None
        rec = FinishedRequest(out.request_id, [c.finish_reason for c in out.outputs],
                              len(out.prompt_token_ids), tokens, out.num_cached_tokens, ttft, queue_time,
                              e2e, clock.gaps if clock is not None else [])
        try:
            self.on_finished(rec)
        except Exception:
            log.exception("on_finished callback failed")

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to their streams with one wake-up of the event loop (a wake-up per
        output would have the loop take the GIL from the engine thread once per request)."""
        pairs = [(stream, item) for rid, item in items if (stream := self._streams.get(rid)) is not None]
        if pairs and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _fail_all(self, exc: BaseException) -> None:
        self._deliver_all([(rid, exc) for rid in list(self._streams)])
