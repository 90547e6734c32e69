"""Write-through to one KV tier off the step loop: a background thread behind a bounded queue.

The step thread hands over copies of whole blocks (a `WriteBatch`, never the live pool); the
writer packs them into entries once, skips the ones its tier already holds and stores the rest.
A full queue drops blocks (counted in the tier's `write_drops`) instead of blocking the step;
`flush` waits until everything queued is written (or the tier gave up on it). `discard` takes
keys back: they are not written, or deleted again if their write was under way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("kvserve")

WRITE_POLICIES = ("write_through", "write_back")
DEFAULT_QUEUE_BYTES = 256 << 20   # block copies one writer may hold queued
FLUSH_TIMEOUT = 60.0              # seconds close() waits for pending writes


class WriteBatch:
    """Blocks copied off the device in one step: their tier keys, and their entries packed once on demand."""

    def __init__(self, keys: list[str], pack: Callable[[], list[bytes]], blocks: list | None = None):
        self.keys = keys
        self.blocks = blocks          # what each key is (the bridge's (block id, pool key, tokens)), for events
        self._pack = pack
        self._entries: list[bytes] | None = None
        self._lock = threading.Lock()

    def entries(self) -> list[bytes]:
        """One packed entry per key (the first writer to ask packs them; writers share the result)."""
        with self._lock:
            if self._entries is None:
                self._entries, self._pack = self._pack(), None
            return self._entries


class TierWriter:
    """Stores queued batches in `tier` on a daemon thread; the queue holds at most `max_bytes` of blocks.
    `on_stored(batch, indices)` is told, on the writer thread, which of a batch's blocks it wrote."""

    def __init__(self, tier, max_bytes: int = DEFAULT_QUEUE_BYTES,
                 on_stored: Callable[[WriteBatch, list[int]], None] | None = None):
        self.tier = tier
        self.max_bytes = max_bytes
        self.pending_bytes = 0
        self.pending_blocks = 0
        self._queue: deque[tuple[WriteBatch, int, int]] = deque()  # (batch, leading blocks to write, bytes)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._warned = False
        self._discarded: set[str] = set()  # keys of queued blocks not to store (cleared when the queue empties)
        self.on_stored = on_stored

    def room(self, bytes_per_block: int) -> int:
        """How many more blocks of this size the queue takes now."""
        return max(0, (self.max_bytes - self.pending_bytes) // bytes_per_block)

    def submit(self, batch: WriteBatch, num_blocks: int, bytes_per_block: int) -> int:
        """Queue the leading blocks of `batch` that fit, out of `num_blocks` offered; count the rest as dropped."""
        with self._cond:
            n = min(len(batch.keys), num_blocks, self.room(bytes_per_block))
            if n:
                self._queue.append((batch, n, n * bytes_per_block))
                self.pending_bytes += n * bytes_per_block
                self.pending_blocks += n
                self._stop = False
                self._start()
                self._cond.notify_all()
        dropped = num_blocks - n
        if dropped:
            self.tier.stats.add(write_drops=dropped)
            if not self._warned:
                self._warned = True
                log.warning("%s tier: write-through queue full (%d MiB pending), dropping blocks; the tier is "
                            "slower than the engine fills blocks: use a faster tier or ':write_back' "
                            "(further drops are only counted, in write_drops)", self.tier.name,
                            self.pending_bytes >> 20)
        return n

    def discard(self, keys: set[str]) -> None:
        """Store none of these keys from what is queued now; one being written is deleted after."""
        with self._cond:
            if self._queue:
                self._discarded |= keys

    def flush(self, timeout: float | None = FLUSH_TIMEOUT) -> bool:
        """Wait until every queued block is handled; False if `timeout` seconds passed first."""
        if threading.current_thread() is self._thread:
            return False  # a collection ran the bridge's finalizer on this writer: it cannot wait for itself
        t0 = time.perf_counter()
        with self._cond:
            done = self._cond.wait_for(lambda: not self._queue, timeout)
        self.tier.stats.add(flush_seconds=time.perf_counter() - t0)
        if not done:
            log.warning("%s tier: %d blocks still waiting to be written after %.0f s; giving up on them",
                        self.tier.name, self.pending_blocks, timeout)
        return done

    def close(self, timeout: float | None = FLUSH_TIMEOUT) -> bool:
        """Flush, then stop the thread (a later submit starts a new one)."""
        done = self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and done:
            thread.join(timeout)
        return done

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=f"kvserve-{self.tier.name}-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if not self._queue:
                    return
                batch, n, nbytes = self._queue[0]
            try:
                self._write(batch, n)
            except Exception as e:  # a writer never dies: count the error, go on with the next batch
                self.tier.stats.add(errors=1)
                log.warning("%s tier: write-through failed (%s: %s); the blocks stay on the device only",
                            self.tier.name, type(e).__name__, e)
            with self._cond:
                self._queue.popleft()
                self.pending_bytes -= nbytes
                self.pending_blocks -= n
                if not self._queue:
                    self._discarded.clear()
                self._cond.notify_all()

    def _write(self, batch: WriteBatch, n: int) -> None:
        keys, skip = batch.keys[:n], self._taken_back()
        todo = [i for i in range(n) if keys[i] not in skip]
        present = self.tier.contains([keys[i] for i in todo]) if todo else []
        if present is None:  # the tier is unavailable now (it counted the error): skip these blocks
            return
        missing = [i for i, p in zip(todo, present) if not p]
        if missing:
            entries = batch.entries()
            self.tier.put_many([(keys[i], entries[i]) for i in missing])
            late = self._taken_back()
            for i in missing:
                if keys[i] in late:   # discarded while it was being written
                    self.tier.delete(keys[i])
                    self.tier.stats.add(poisoned=1)
            missing = [i for i in missing if keys[i] not in late]
            if self.on_stored is not None and missing:
                self.on_stored(batch, missing)

    def _taken_back(self) -> set[str]:
        with self._cond:
            return set(self._discarded)


def close_writers(writers: list[TierWriter], timeout: float | None = FLUSH_TIMEOUT) -> None:
    """Flush and stop each writer (at exit, or when the bridge that owns them is collected)."""
    for w in writers:
        w.close(timeout)
