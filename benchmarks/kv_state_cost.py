"""What a KV state snapshot (/v1/kv/state, /v1/kv/stream, --record) costs the engine thread at 64
running requests, next to the decode step it delays.

The snapshot is built on the engine thread between two steps; the stream builds at most 4 a second
while the state changes. Serializing it to JSON happens on the server's event loop, not on the
engine thread, but is shown too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import OtherLoad, command_line, machine_facts, make_prompts, md_table, replace_section  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.kv.hashing import namespace_hash  # noqa: E402
from kvserve.kv.manager import KVCacheManager  # noqa: E402
from kvserve.server.kv_state import KVStateTracker, _pool  # noqa: E402

SNAPSHOTS_PER_SECOND = 4  # the stream's most (one every 250 ms)


def timed(fn, reps: int) -> float:
    """Median seconds of fn() over `reps` runs."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fill(llm: LLM, num: int, prompt_len: int, max_tokens: int) -> None:
    """Add `num` requests and step until every one is running its decode."""
    engine = llm.engine
    prompts = make_prompts(engine.tokenizer, num, prompt_len, prompt_len, seed=0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    for i, ids in enumerate(prompts):
        engine.add_request({"prompt_token_ids": ids}, params, f"req-{i}")
    while len(engine.scheduler.running) < num or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()


def large_pool(num_blocks: int, running: int, cached: int, tokens: int, reps: int) -> tuple[float, dict]:
    """Seconds to encode the pool of a KV manager of `num_blocks` blocks (no tensors: the pool part of
    a snapshot only reads the manager) with `running` requests holding `tokens` tokens each and
    `cached` finished ones whose blocks stay cached and free."""
    from types import SimpleNamespace
    kv = KVCacheManager(num_blocks, 16, namespace_hash("kv-state-cost"))
    for i in range(running + cached):
        ids = [(i * 7919 + t) % 32000 for t in range(tokens)]
        kv.allocate_slots(f"r{i}", 0, tokens)
        kv.cache_blocks(f"r{i}", ids, tokens)
    for i in range(running, running + cached):
        kv.free(f"r{i}")
    engine = SimpleNamespace(kv=kv)
    requests = [{"blocks": [kv.block_ids(f"r{i}")]} for i in range(running)]
    return timed(lambda: _pool(engine, requests), reps), _pool(engine, requests)["counts"]


def measure(args) -> dict:
    llm = LLM(kv_cache_memory=args.kv_cache_memory, max_model_len=2048, max_num_seqs=args.requests)
    engine = llm.engine
    fill(llm, args.requests, args.prompt_len, args.max_tokens)
    tracker = KVStateTracker(engine, "bench")
    load = OtherLoad()
    snap = tracker.snapshot(engine)
    out = {
        "running": len(engine.scheduler.running),
        "blocks": len(snap["pool"]["state"]),
        "used": snap["pool"]["counts"]["u"] + snap["pool"]["counts"]["s"],
        "snapshot_s": timed(lambda: tracker.snapshot(engine), args.reps),
        "unchanged_s": timed(lambda: tracker.change_key(engine), args.reps),
        "sample_s": timed(lambda: tracker.sample(engine), args.reps),
        "json_s": timed(lambda: json.dumps(snap, separators=(",", ":")), args.reps),
        "json_bytes": len(json.dumps(snap, separators=(",", ":"))),
        "step_s": timed(engine.step, args.steps),
    }
    out["large_s"], out["large_counts"] = large_pool(args.large_pool, args.requests, args.large_cached,
                                                     2048, max(3, args.reps // 10))
    out["other_load"] = load.stop()
    return out


def report(m: dict) -> str:
    ms = 1e3
    share = SNAPSHOTS_PER_SECOND * m["snapshot_s"]
    rows = [
        ["full snapshot (engine thread)", f"{m['snapshot_s'] * ms:.2f} ms"],
        ["unchanged-state check (engine thread, every 250 ms)", f"{m['unchanged_s'] * 1e6:.1f} µs"],
        ["counters sample only (engine thread)", f"{m['sample_s'] * 1e6:.1f} µs"],
        ["JSON encoding (event loop)", f"{m['json_s'] * ms:.2f} ms, {m['json_bytes'] / 1024:.0f} KiB"],
        [f"decode step, {m['running']} requests", f"{m['step_s'] * ms:.1f} ms"],
        ["snapshot / decode step", f"{m['snapshot_s'] / m['step_s']:.2%}"],
        [f"engine-thread time at {SNAPSHOTS_PER_SECOND} snapshots/s", f"{share:.2%}"],
        [f"pool part alone, {sum(m['large_counts'].values()):,}-block pool ({m['large_counts']['u']:,} held, "
         f"{m['large_counts']['c']:,} cached free)", f"{m['large_s'] * ms:.1f} ms"],
    ]
    return md_table(["", "cost"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--large-pool", type=int, default=131072, help="blocks of the synthetic large pool")
    p.add_argument("--large-cached", type=int, default=512, help="finished 2048-token requests it keeps cached")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    m = measure(args)
    table = report(m)
    facts = machine_facts()
    other = "n/a" if m["other_load"] is None else f"{m['other_load']:.2f}"
    note = (f"{m['running']} requests decoding ({args.prompt_len}-token prompts from real text), pool of "
            f"{m['blocks']} blocks ({m['used']} held); medians of {args.reps} snapshots and {args.steps} steps. "
            f"Machine: {facts['CPU']}, {facts['cores (os.cpu_count / usable)']} cores, torch threads "
            f"{facts['torch threads']}, {facts['device']}; the machine was shared with other jobs "
            f"(other processes kept {other} cores busy on average), so times are upper bounds. The "
            "snapshot runs on the engine thread between two steps, so its cost delays the next step; the "
            "stream builds one only when the state changed and at most every 250 ms, and waits longer when "
            "a snapshot takes more than 2% of that time (a large pool: the pool part above alone paces the stream "
            f"to one snapshot every {m['large_s'] / 0.02:.1f} s). Read the cost against the 250 ms interval "
            "(the engine-thread share) rather than against the decode step, which depends on the load the "
            "machine carried.")
    print(table)
    print(note)
    if not args.no_write:
        replace_section("KV state snapshot cost (dashboard, kvserve top, --record)",
                        f"`{command_line()}` (tree {facts['kvserve tree']})\n\n{table}\n\n{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
