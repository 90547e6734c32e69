"""Single-stream decode speed against context length: kvserve's default configuration and llama.cpp
(llama-cpp-python) on the same GGUF file, in the same run, with the K/V bytes each step reads.

    python benchmarks/long_context.py                        # results go to BENCHMARKS.md "Long context"
    python benchmarks/long_context.py --lengths 512,1024 --tokens 16 --no-write

For each model and each context length L, a prompt of L tokens of prose is prefilled, then
`--tokens` greedy tokens are decoded; decode tok/s counts the steps after the first token. Each
runtime decodes every length in turn (llama.cpp in a child process, so that neither runtime's
spinning threads steal the other's cores). Speed should follow the bytes read per step (weights,
plus K/V growing with L), with no fall at any shape: the plot (benchmarks/long_context.png) shows it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, machine_facts, md_table, prose_corpus, replace_section  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.kv.sizing import cached_tokens  # noqa: E402
from kvserve.model.loader import resolve_model_path  # noqa: E402

PLOT = Path(__file__).with_name("long_context.png")
MODELS = {"smollm2": None, "gemma3-270m": "gemma3-270m"}   # name -> LLM's model argument


def prompt_ids(tokenizer, length: int) -> list[int]:
    """`length` tokens of real prose (the corpus repeated when it is short)."""
    ids = tokenizer.encode(prose_corpus())
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def kv_bytes_read(llm: LLM, context: int) -> int:
    """K/V bytes one decode step at `context` cached tokens reads: every layer's visible tokens
    (a sliding layer's window at most) times its K and V rows in the pool's dtype."""
    cfg, storage = llm.engine.model_config, llm.engine.storage
    window = cfg.sliding_window or 0
    total = 0
    for layer, kind in enumerate(cfg.layer_kinds()):
        k_pool, v_pool = storage.native_kv(layer)
        row = sum(p[0, 0].numel() * p.element_size() for p in (k_pool, v_pool))   # one token's K and V
        total += row * cached_tokens(context, window if kind == "sliding" else 0)
    return total


def kvserve_decode(model: str | None, lengths: list[int], tokens: int) -> tuple[dict, dict[int, list[int]]]:
    """({L: (decode tok/s, K/V bytes a step reads at L)} of kvserve's default configuration, the
    prompt of each length)."""
    from tqdm.auto import tqdm
    llm = LLM(model, enable_prefix_caching=False, max_model_len=max(lengths) + tokens + 16, compile_mode="blocking")
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate("Warm-up", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    out, prompts = {}, {n: prompt_ids(llm.get_tokenizer(), n) for n in lengths}
    for length in tqdm(lengths, desc=f"kvserve {model or 'smollm2'}", unit="length"):
        done = llm.generate({"prompt_token_ids": prompts[length]}, greedy, use_tqdm=False)[0]
        m = done.metrics
        out[length] = ((len(done.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time),
                       kv_bytes_read(llm, length + tokens // 2))
    return out, prompts


def llamacpp_decode(gguf: str, ids: dict[int, list[int]], tokens: int) -> tuple[dict[int, float], str] | None:
    """({L: decode tok/s}, llama.cpp's system_info line) from a child process, or None without
    llama-cpp-python."""
    job = json.dumps({"gguf": gguf, "ids": {str(k): v for k, v in ids.items()}, "tokens": tokens})
    # the job (token ids of long prompts) goes through stdin: it outgrows a command-line argument
    out = subprocess.run([sys.executable, __file__, "--peer-job", "-"], input=job, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {int(k): v for k, v in res["tok_s"].items()}, res["system_info"]


def llamacpp_job(job: dict) -> dict:
    """The child's side of llamacpp_decode: prefill each prompt, time `tokens` greedy tokens."""
    import llama_cpp
    ids = {int(k): v for k, v in job["ids"].items()}
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=max(ids) + job["tokens"] + 16, verbose=False)
    tok_s = {}
    for length, prompt in sorted(ids.items()):
        llm.reset()
        first, n = None, 0
        for _ in llm.generate(prompt, temp=0.0, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == job["tokens"]:
                break
        tok_s[length] = (n - 1) / (time.perf_counter() - first)
    info = llama_cpp.llama_print_system_info()
    return {"tok_s": tok_s, "system_info": info.decode() if isinstance(info, bytes) else str(info)}


def has_llamacpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def plot(results: dict, lengths: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for (model, runtime), speeds in results.items():
        xs = [n for n in lengths if n in speeds]
        ax.plot(xs, [speeds[n] for n in xs], marker="o", linestyle="-" if runtime == "kvserve" else "--",
                label=f"{model}: {runtime}")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Single-stream decode against context length")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096,6144,8000", help="context lengths, comma-separated (SmolLM2 holds 8192 positions: prompt + tokens)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded after each prompt")
    ap.add_argument("--models", default=",".join(MODELS), help=f"some of {', '.join(MODELS)}")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md and the plot alone")
    ap.add_argument("--peer-job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_job:
        print(json.dumps(llamacpp_job(json.loads(sys.stdin.read() if args.peer_job == "-" else args.peer_job))))
        return 0
    lengths = sorted(int(x) for x in args.lengths.split(","))
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if args.tokens < 2:
        ap.error("--tokens must be at least 2 (decode speed counts the steps after the first token)")
    peer = has_llamacpp()
    if not peer:
        print("llama-cpp-python is not installed (pip install llama-cpp-python): kvserve only", file=sys.stderr)
    results, rows, system_info = {}, [], None
    for name in models:
        ours, prompts = kvserve_decode(MODELS[name], lengths, args.tokens)
        results[(name, "kvserve")] = {n: s for n, (s, _) in ours.items()}
        theirs = {}
        if peer:
            got = llamacpp_decode(resolve_model_path(MODELS[name]), prompts, args.tokens)
            if got is not None:
                theirs, system_info = got
                results[(name, "llama.cpp")] = theirs
        for n in lengths:
            speed, kv = ours[n]
            peer_speed = theirs.get(n)
            rows.append([name, str(n), f"{kv / 2**20:.1f}", f"{speed:.1f}", f"{1e3 / speed:.1f}",
                         f"{peer_speed:.1f}" if peer_speed else "—",
                         f"{speed / peer_speed:.2f}x" if peer_speed else "—"])
    table = md_table(["model", "context", "K/V MiB read per step (kvserve)", "kvserve tok/s", "kvserve ms/step",
                      "llama.cpp tok/s", "ratio"], rows)
    print(table)
    print("llama.cpp system_info:", system_info or "(not run)")
    if args.no_write:
        return 0
    plot(results, lengths)
    facts = "\n".join(f"- {k}: {v}" for k, v in machine_facts().items())
    replace_section("Long context", f"""
`{command_line()}`

Single-stream greedy decode after a prompt of each length (prose), {args.tokens} tokens each;
kvserve's default configuration (`LLM()`, prefix caching off) against llama-cpp-python on the same
GGUF file, measured in the same run (llama.cpp in a child process). The K/V column counts what
kvserve's attention reads per step (every layer's visible tokens: a sliding layer's window at most).

{table}

![decode tok/s against context length]({PLOT.name})

llama.cpp `system_info`: `{system_info or "not run"}`

{facts}
""")
    print(f"wrote BENCHMARKS.md (Long context) and {PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
