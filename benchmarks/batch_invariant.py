"""Batch invariance: does a greedy request give the tokens it gets alone when others share its steps,
and what does `batch_invariant=True` cost? The default mode against the batch-invariant one on the
bundled model, in the same run.

Per mode: `--prompts` prompts of ~400 tokens of real text, each run alone (the prefix cache emptied
before each), then the first 8 together and all of them together; a request "differs" when its
tokens are not its alone tokens. Speed: single-stream decode tok/s (a short prompt, first token
excluded), the alone runs' mean latency, and the concurrent runs' output tok/s.

    .venv/bin/python benchmarks/batch_invariant.py [--prompts 16] [--max-tokens 128] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, git_state, machine_facts, make_prompts, md_table, replace_section  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402

MODES = {"default": {}, "batch_invariant": {"batch_invariant": True}}
CHAT_PROMPT = "The three most useful things to know about a KV cache are"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def decode_rate(llm: LLM, tokens: int = 64) -> float:
    """Single-stream decode tok/s after a short prompt, first token excluded."""
    llm.generate([CHAT_PROMPT], greedy(2), use_tqdm=False)   # warm
    t0 = time.perf_counter()
    llm.generate([CHAT_PROMPT], greedy(1), use_tqdm=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([CHAT_PROMPT], greedy(tokens + 1), use_tqdm=False)
    return tokens / (time.perf_counter() - t0 - first)


def run_mode(name: str, options: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    llm = LLM(max_model_len=2048, **options)
    llm.wait_compiled()
    row = {"mode": name, "decode": decode_rate(llm)}
    alone, t0 = [], time.perf_counter()
    for p in tqdm(prompts, desc=f"{name}: alone", unit="req", leave=False):
        llm.reset_prefix_cache()
        alone.append(llm.generate([{"prompt_token_ids": p}], greedy(max_tokens), use_tqdm=False)[0].outputs[0].token_ids)
    row["alone_latency"] = (time.perf_counter() - t0) / len(prompts)
    for concurrency in (8, len(prompts)):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:concurrency]], greedy(max_tokens),
                            use_tqdm=False)
        seconds = time.perf_counter() - t0
        row[f"differ_{concurrency}"] = sum(o.outputs[0].token_ids != a for o, a in zip(outs, alone))
        row[f"rate_{concurrency}"] = concurrency * max_tokens / seconds
    llm.close()
    return row


def table(rows: list[dict], n: int) -> str:
    header = ["mode", "single-stream decode (tok/s)", "alone: latency per request (s)",
              "8 together: requests that differ from alone", "8 together: output tok/s",
              f"{n} together: requests that differ", f"{n} together: output tok/s"]
    body = [[r["mode"], f"{r['decode']:.1f}", f"{r['alone_latency']:.2f}", f"{r['differ_8']} / 8",
             f"{r['rate_8']:.1f}", f"{r[f'differ_{n}']} / {n}", f"{r[f'rate_{n}']:.1f}"] for r in rows]
    return md_table(header, body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = p.parse_args()
    if args.prompts < 8:
        raise SystemExit("--prompts must be at least 8 (the 8-together run)")
    from kvserve.model.loader import resolve_model_path
    from kvserve.model.tokenizer import Tokenizer
    tokenizer = Tokenizer.load(resolve_model_path(None))
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_len - 20, args.prompt_len + 20, seed=3)
    t0 = time.perf_counter()
    rows = [run_mode(name, options, prompts, args.max_tokens) for name, options in tqdm(MODES.items(), desc="modes")]
    text = table(rows, args.prompts)
    print(text)
    notes = [f"`{command_line()}` at {git_state()}, {time.perf_counter() - t0:.0f} s.",
             f"{args.prompts} prompts of {args.prompt_len} ± 20 tokens of CPython's documentation, "
             f"{args.max_tokens} greedy tokens each (ignore_eos), the bundled model in its default formats; "
             "the default mode runs compiled (after wait_compiled()), the batch-invariant one eagerly. "
             "\"Differ\": the request's tokens are not the tokens it got alone on the same engine.",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine_facts().items()) + "."]
    if not args.no_write:
        replace_section("Batch invariance", text + "\n\n" + "\n\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
