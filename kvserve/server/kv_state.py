"""The KV-cache state the dashboard, `kvserve top` and `--record` show: one JSON snapshot of the pool,
the requests and the counters, built on the engine thread between two steps (so it is consistent).

`KVStateTracker.snapshot(engine)` reads the KV manager, block pool, scheduler, swap space, tiers and
evictor through their attributes; it never changes them. `StateHub` polls the engine (at most every
`interval` seconds, only building a snapshot when something changed), keeps a short history of
counters for the charts, feeds the `/v1/kv/stream` subscribers and writes the `--record` file.

Blocks are sent as parallel per-block arrays indexed by block id: `state` (one letter each), `ref`,
`group`, `hash` (one string, 16 hex digits per block, all zero for none); holders only for held
blocks. Encoding them is a few list comprehensions, so a snapshot stays cheap for large pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.offload import offload_metrics
from kvserve.kv.sizing import kv_projection_rows

log = logging.getLogger("kvserve.server")

SCHEMA = 1
HISTORY_SECONDS = 300.0   # counters kept for the charts
HASH_BYTES = 8            # leading bytes of a block hash shown (16 hex digits; all zero: no hash)
NO_HASH = bytes(HASH_BYTES)
MAX_SHARE = 0.02          # most of the engine thread's time the stream's snapshots may take
# one letter per block: free, cached-free (holds a reusable hash), used (one holder), shared (ref > 1),
# reserved (the null block of sliding-window models)
FREE, CACHED, USED, SHARED, RESERVED = "f", "c", "u", "s", "r"


class KVStateTracker:
    """Builds snapshots; counts the no-cache K/V rows of requests that finished since it started."""

    def __init__(self, engine, model_name: str = ""):
        self.model_name = model_name
        self.started = time.time()
        self.rows_baseline = engine.model.kv_rows  # K/V rows computed before this server ran
        self.finished_no_cache_rows = 0
        self.finished_cached_rows = 0

    # ---- callbacks -------------------------------------------------------------------------
    def observe_finished(self, rec) -> None:
        """AsyncEngine's on_finished: the rows a no-cache engine would have computed for it."""
        n = max(1, len(rec.finish_reasons))
        each = rec.num_generation_tokens // n  # n > 1 completions counted as equally long
        self.finished_no_cache_rows += n * kv_projection_rows(rec.num_prompt_tokens, each, cached=False)
        self.finished_cached_rows += n * kv_projection_rows(rec.num_prompt_tokens, each, cached=True)

    # ---- snapshots ---------------------------------------------------------------------------
    def change_key(self, engine) -> tuple:
        """Cheap marker that moves whenever the snapshot would."""
        kv = engine.kv
        pool = (kv.pool.num_free, len(kv.pool.cached))
        return engine.stats.num_steps, len(engine.groups), engine.scheduler.num_preemptions, *pool

    def sample(self, engine) -> dict:
        """The counters one point of the charts needs (cumulative; rates are differences)."""
        kv, s, sched = engine.kv, engine.stats, engine.scheduler
        swap = engine.swap
        return {
            "t": round(time.time() - self.started, 3),
            "usage": kv.usage(),
            "queries": kv.stats.queries,
            "hits": kv.stats.hits,
            "generation_tokens": s.generation_tokens,
            "prompt_tokens_computed": s.prompt_tokens_computed,
            "preemptions": sched.num_preemptions,
            "swapped_out_blocks": swap.num_swapped_out_blocks if swap else 0,
            "swapped_in_blocks": swap.num_swapped_in_blocks if swap else 0,
            "evicted_tokens": engine.evictor.metrics().get("kv_evicted_tokens", 0),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
        }

    def snapshot(self, engine) -> dict:
        """The whole state; call on the engine thread (AsyncEngine.call)."""
        requests = _requests(engine)
        return {
            "schema": SCHEMA,
            "time": time.time(),
            "step": engine.stats.num_steps,
            "model": self.model_name,
            "kv": _kv_info(engine),
            "pool": _pool(engine, requests),
            "requests": requests,
            "counters": self._counters(engine),
            "analyzer": self._analyzer(engine),
            "sample": self.sample(engine),
        }

    def _counters(self, engine) -> dict:
        kv, s = engine.kv, engine.stats
        queries = kv.stats.queries
        hits = kv.stats.hits
        return {
            "kv_usage": kv.usage(),
            "prefix_queries": queries,
            "prefix_hits": hits,
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "prompt_tokens": s.prompt_tokens,
            "prompt_tokens_computed": s.prompt_tokens_computed,
            "generation_tokens": s.generation_tokens,
            "preemptions": engine.scheduler.num_preemptions,
            "cow_copies": kv.num_cow_copies,
            "cache_evictions": kv.pool.num_evicted,
            "requests_finished": sum(s.request_success.values()),
            **offload_metrics(engine),
            **engine.evictor.metrics(),
            **engine.speculator.metrics(),
        }

    def _analyzer(self, engine) -> dict:
        """K/V rows computed so far vs what a no-cache engine would compute for the same tokens."""
        live_plain = live_cached = 0
        for members in engine.groups.values():
            for r in members:
                live_plain += kv_projection_rows(r.num_prompt_tokens, r.num_output_tokens, cached=False)
                live_cached += kv_projection_rows(r.num_prompt_tokens, r.num_output_tokens, cached=True)
        computed = engine.model.kv_rows - self.rows_baseline
        plain = self.finished_no_cache_rows + live_plain
        return {
            "kv_rows_computed": computed,
            "kv_rows_no_cache": plain,
            "kv_rows_cache_formula": self.finished_cached_rows + live_cached,
            "saving": 1 - computed / plain if plain else 0.0,
        }


def _kv_info(engine) -> dict:
    kv, cfg = engine.kv, engine.config
    groups = [{"kind": g.spec.kind, "window": g.spec.visible_window, "layers": list(g.layers)}
              for g in engine.kv_groups]
    return {
        "mode": cfg.kv_cache_mode,
        "format": engine.kv_format.description,
        "bytes_per_token": engine.kv_bytes_per_token,
        "page_bytes_per_token": engine.page_bytes_per_token,
        "block_size": kv.block_size,
        "num_blocks": kv.pool.num_blocks,
        "num_usable": kv.num_blocks,
        "prefix_caching": kv.enable_prefix_caching,
        "policy": engine.kv_policy.spec() if engine.kv_policy is not None else None,
        "groups": groups,
    }


def _requests(engine) -> list[dict]:
    """Running requests first, then waiting ones (preempted and swapped included)."""
    sched = engine.scheduler
    return [_request(engine, r) for r in [*sched.running, *sched.waiting]]


def _request(engine, r) -> dict:
    kv, swap = engine.kv, engine.swap
    state = r.status.value
    if swap is not None and swap.is_swapped(r.request_id):
        state = "swapped"
    tables = kv.reqs.get(r.request_id)
    out = {
        "id": r.request_id,
        "group_id": r.group_id,
        "state": state,
        "prompt_tokens": r.num_prompt_tokens,
        "output_tokens": r.num_output_tokens,
        "computed_tokens": r.num_computed_tokens,
        "prefix_hit_tokens": r.num_cached_tokens,
        "blocks": [list(t) for t in tables.tables] if tables is not None else [],
        "swap_blocks": len(swap.held[r.request_id].host_ids) if state == "swapped" else 0,
        "policy": r.kv_policy.spec() if r.kv_policy is not None else None,
    }
    out.update(_eviction(engine, r))
    return out


def _eviction(engine, r) -> dict:
    """Entries each layer keeps and the positions the first evicting layer holds (as ranges)."""
    states = getattr(engine.evictor, "states", None)
    st = states.get(r.request_id) if states else None
    if st is None or not st.policy.evicts:
        return {"kept_tokens": None, "kept_positions": None}
    kept = [max(0, r.num_computed_tokens - e) for e in st.evicted]
    targets = getattr(engine.evictor, "targets", None) or [0]
    return {"kept_tokens": kept, "kept_positions": _ranges(st.pos[targets[0]].tolist())}


def _ranges(positions: list[int]) -> list[list[int]]:
    """Sorted positions as [start, end) runs."""
    out: list[list[int]] = []
    for p in sorted(positions):
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return out


def _pool(engine, requests: list[dict]) -> dict:
    kv = engine.kv
    pool = kv.pool   # no cache: an empty pool, so every list below is empty
    group = [-1] * pool.num_blocks
    holders: dict[int, list[int]] = {}
    for i, req in enumerate(requests):
        for g, table in enumerate(req["blocks"]):
            for b in table:
                if b != kv.null:
                    group[b] = g
                    holders.setdefault(b, []).append(i)
    blocks = pool.blocks
    refs = [b.ref_cnt for b in blocks]
    state = "".join([(SHARED if b.ref_cnt > 1 else USED) if b.ref_cnt else
                     (CACHED if b.block_hash is not None else FREE) for b in blocks])
    state = RESERVED * pool.reserved + state[pool.reserved:]
    hashes = b"".join([NO_HASH if b.block_hash is None else b.block_hash[:HASH_BYTES] for b in blocks]).hex()
    pinned = [b.block_id for b in blocks if b.pin_priority is not None] if pool.num_pinned else []
    counts = {k: state.count(k) for k in (FREE, CACHED, USED, SHARED)}
    return {"counts": counts, "state": state, "ref": refs, "group": group,
            "hash": hashes, "holders": holders, "pinned": pinned}


class StateHub:
    """Polls the engine for snapshots, keeps the counters' history, feeds subscribers and the recorder."""

    def __init__(self, tracker: KVStateTracker, call: Callable[[Callable], Awaitable],
                 interval: float = 0.25, record: str | None = None):
        self.tracker = tracker
        self.call = call             # runs fn(engine) on the engine thread (AsyncEngine.call)
        self.interval = interval
        self.history: deque[dict] = deque(maxlen=int(HISTORY_SECONDS / interval))
        self.subscribers: set[asyncio.Queue] = set()
        self.record_path = record
        self._record = None
        self._task: asyncio.Task | None = None
        self._key = None
        self.cost = 0.0              # seconds the latest snapshot took on the engine thread

    def start(self) -> None:
        """Start polling (on the running event loop)."""
        if self.record_path:
            self._record = open(self.record_path, "a", buffering=1)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop polling and close the recording."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._record is not None:
            self._record.close()
            self._record = None

    async def state(self) -> dict:
        """A fresh snapshot with the counters' history."""
        snap = await self.call(self.tracker.snapshot)
        return {**snap, "history": list(self.history)}

    def subscribe(self) -> asyncio.Queue:
        """A queue that receives each new snapshot as JSON text (only the newest is kept)."""
        q: asyncio.Queue = asyncio.Queue(maxsize=1)
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        """Stop feeding `q`."""
        self.subscribers.discard(q)

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except EngineDeadError as exc:  # the engine stopped: nothing more to show
                log.info("KV state stream stops: %s", exc)
                return
            except Exception:  # a bad snapshot is logged; the next one is tried
                log.exception("KV state snapshot failed")
            await asyncio.sleep(max(self.interval, self.cost / MAX_SHARE))  # a large pool: fewer

    async def _tick(self) -> None:
        full = bool(self.subscribers or self._record)
        key = self._key
        got = await self.call(lambda e: self._poll(e, key, full))
        if got is None:
            return
        self._key, sample, snap = got
        self.history.append(sample)
        if snap is not None:
            self._publish(snap)

    def _poll(self, engine, key, full: bool):
        """(key, sample, snapshot or None) when the state moved since `key`, else None (engine thread)."""
        new = self.tracker.change_key(engine)
        if new == key:
            return None
        if not full:
            return new, self.tracker.sample(engine), None
        t0 = time.perf_counter()
        snap = self.tracker.snapshot(engine)
        self.cost = time.perf_counter() - t0
        return new, snap["sample"], snap

    def _publish(self, snap: dict) -> None:
        """Encode once; every subscriber and the recording get the same JSON text."""
        text = encode(snap)
        for q in list(self.subscribers):
            if q.full():
                q.get_nowait()
            q.put_nowait(text)
        if self._record is not None:
            self._record.write(text + "\n")


def encode(snap: dict) -> str:
    """A snapshot as compact JSON (one line)."""
    return json.dumps(snap, separators=(",", ":"), allow_nan=False)
