"""One chat stream on the bundled model: kvserve's weight formats vs llama-cpp-python, same GGUF.

    python benchmarks/single_stream.py            # results go to BENCHMARKS.md "Single stream"
    python benchmarks/single_stream.py --quick --no-write

Decode: `--output-len` greedy tokens after a short prompt (tokens/s of the decode phase, first
token excluded). Prefill: a ~800-token prompt of CPython's documentation, one token out
(prompt tokens/s). Each configuration runs `--repeats` times in turn with llama-cpp-python and the
best run counts, so every ratio compares runs made on the same machine minutes apart.
A step profile (host time per decode step at batch 1 and 64, split into time inside torch ops and
the rest) goes to the same section.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    OtherLoad,
    command_line,
    llama_cpp_python_peer,
    machine_facts,
    make_prompts,
    md_table,
    peer_lines,
    replace_section,
)

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.loader import resolve_model_path  # noqa: E402

CHAT_PROMPT = "The three most useful things to know about a KV cache are"
CONFIGS = {  # name -> LLM options
    "kvserve default (auto)": {},
    "kvserve float32": {"dtype": "float32"},
    "kvserve bfloat16": {"dtype": "bfloat16"},
    "kvserve int8 weights": {"weights": "int8", "dtype": "float32"},
    "kvserve int4 weights": {"weights": "int4", "dtype": "float32"},
    "kvserve int4 eager": {"weights": "int4", "dtype": "float32", "enforce_eager": True},
}


def kvserve_runner(options: dict, prefill_ids: list[int], output_len: int):
    """A function running one decode and one prefill measurement with a loaded engine."""
    llm = LLM(kv_cache_memory="256MiB", max_model_len=2048, enable_prefix_caching=False, compile_mode="blocking",
              **options)
    return engine_runner(llm, prefill_ids, output_len), llm


def engine_runner(llm: LLM, prefill_ids: list[int], output_len: int):
    """A function running one decode and one prefill measurement with `llm` (warmed up here); the
    prefix cache is emptied before each prefill, so a repeat computes the whole prompt again; a
    background compile is waited for first, so the runs measure the compiled engine."""
    if hasattr(llm, "wait_compiled"):
        llm.wait_compiled()
    decode = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(CHAT_PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up

    def run() -> tuple[float, float]:
        out = llm.generate(CHAT_PROMPT, decode, use_tqdm=False)[0]
        m = out.metrics
        dec = (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prefill_ids}, one, use_tqdm=False)
        return dec, len(prefill_ids) / (time.perf_counter() - t0)
    return run


def llamacpp_best(gguf: str, prefill_ids: list[int], output_len: int, threads: int | None,
                  repeats: int) -> tuple[float, float] | None:
    """Best (decode tok/s, prefill tok/s) of llama-cpp-python over `repeats` runs, measured in a child
    process so that neither runtime's spinning worker threads steal cores from the other."""
    import json
    import subprocess
    job = json.dumps({"gguf": gguf, "prefill": prefill_ids, "n": output_len, "threads": threads, "repeats": repeats})
    out = subprocess.run([sys.executable, __file__, "--peer-job", job], capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def llamacpp_job(job: dict) -> tuple[float, float]:
    """The child's side of llamacpp_best: load the GGUF, run the decode and prefill measurements."""
    from llama_cpp import Llama
    llm = Llama(model_path=job["gguf"], n_ctx=job.get("n_ctx", 2048), n_threads=job["threads"], verbose=False)
    bias = {llm.token_eos(): -1e9}
    best = (0.0, 0.0)
    for _ in range(job["repeats"]):
        llm.reset()
        first, n = None, 0
        for _ in llm.create_completion(CHAT_PROMPT, max_tokens=job["n"], temperature=0, stream=True,
                                       logit_bias=bias):
            n += 1
            if first is None:
                first = time.perf_counter()
        dec = (n - 1) / (time.perf_counter() - first)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(job["prefill"])
        best = (max(best[0], dec), max(best[1], len(job["prefill"]) / (time.perf_counter() - t0)))
    return best


def ratio(a: float, b: float) -> str:
    """a / b as '1.23x', or a dash when b was not measured."""
    return f"{a / b:.2f}x" if b else "—"


def step_profile(options: dict, batch: int, steps: int = 8) -> tuple[float, float]:
    """(ms per decode step, ms of it inside torch ops) at `batch` sequences of ~64-token contexts."""
    llm = LLM(kv_cache_memory="256MiB", max_model_len=1024, enable_prefix_caching=False, compile_mode="blocking",
              **options)
    eng = llm.engine
    prompts = make_prompts(eng.tokenizer, batch, 48, 80, seed=1)
    for p in prompts:
        eng.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=2 * steps + 40, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in [*eng.scheduler.waiting, *eng.scheduler.running]):
        eng.step()
    eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t0) / steps
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    ops = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / steps
    for rid in list(eng.groups):
        eng.abort_request(rid)
    return wall * 1e3, ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llamacpp-threads", type=int, default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--quick", action="store_true", help="32 tokens, 1 repeat, no profile")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--peer-job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_job:
        import json
        print(json.dumps(llamacpp_job(json.loads(args.peer_job))))
        return 0
    if args.quick:
        args.output_len, args.repeats, args.no_profile = 32, 1, True
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    gguf = resolve_model_path(None)
    probe = LLM(kv_cache_mode="none", dtype="float32")
    prefill_ids = make_prompts(probe.engine.tokenizer, 1, args.prefill_len, args.prefill_len, seed=3)[0]
    del probe
    rows, results = [], {}
    load = OtherLoad()
    for name in names:
        run, llm = kvserve_runner(CONFIGS[name], prefill_ids, args.output_len)
        kv = llm.engine.kv_format.description
        kv = str(llm.engine.dtype).removeprefix("torch.") if kv == "auto" else kv
        picked = (f"{llm.engine.weight_format} weights, {str(llm.engine.dtype).removeprefix('torch.')} activations, "
                  f"{kv} KV, "
                  + ("compiled" if llm.engine.compiled else "eager"))
        best = (0.0, 0.0)
        for _ in range(args.repeats):
            got = run()
            best = (max(best[0], got[0]), max(best[1], got[1]))
        del llm, run
        peer_best = llamacpp_best(gguf, prefill_ids, args.output_len, args.llamacpp_threads, args.repeats)
        peer = peer_best is not None
        peer_best = peer_best or (0.0, 0.0)
        results[name] = (best, peer_best)
        rows.append([name, picked, f"{best[0]:.1f}", f"{peer_best[0]:.1f}" if peer else "—",
                     ratio(best[0], peer_best[0]), f"{best[1]:.0f}", f"{peer_best[1]:.0f}" if peer else "—",
                     ratio(best[1], peer_best[1])])
        print(" | ".join(rows[-1]), flush=True)
    other = load.stop()
    header = ["configuration", "picked", "decode tok/s", "llama.cpp decode tok/s", "ratio",
              "prefill tok/s", "llama.cpp prefill tok/s", "ratio"]
    body = [f"Command: `{command_line()}`", "",
            f"One stream, greedy, {args.output_len} tokens after a {len(CHAT_PROMPT.split())}-word prompt; "
            f"prefill of a {len(prefill_ids)}-token prompt. Best of {args.repeats} runs; after each kvserve "
            f"configuration, llama-cpp-python runs as many times on the same GGUF ({Path(gguf).name}) in a "
            "child process (in one process, each runtime's spinning worker threads slow the other).", "",
            md_table(header, rows)]
    if not args.no_profile:
        prof_rows = []
        for name in ("kvserve float32", "kvserve int4 eager", "kvserve default (auto)"):
            for batch in (1, 64):
                wall, ops = step_profile(CONFIGS[name], batch)
                prof_rows.append([name, str(batch), f"{wall:.1f}", f"{ops:.1f}", f"{max(0.0, wall - ops):.1f}"])
                print(" | ".join(prof_rows[-1]), flush=True)
        body += ["", "Decode step profile (ms per engine step; 'in torch ops' is the self time of every "
                 "aten op under torch.profiler, the rest is Python and framework overhead):", "",
                 md_table(["configuration", "batch", "ms per step", "in torch ops", "rest (host)"], prof_rows)]
    facts = machine_facts()
    body += ["", "The peer, llama-cpp-python:", "", peer_lines(llama_cpp_python_peer())]
    body += ["", "Machine: " + "; ".join(f"{k} {v}" for k, v in facts.items())
             + (f"; other processes kept {other:.2f} cores busy" if other is not None else "")]
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        replace_section("Single stream", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
