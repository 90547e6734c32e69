"""`kvserve plan`: size the KV cache for a model on given hardware, from kv/sizing.py formulas."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, field, replace

from kvserve.extras import require
from kvserve.kv import sizing
from kvserve.tools import presets
from kvserve.tools.presets import Hardware, ModelShape

DEFAULT_CONTEXT = 8192
DEFAULT_GPU = "H100-80GB"
PLOT_FORMATS = ("bf16", "fp8", "int8", "kivi4", "kivi2")
ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")


@dataclass
class Plan:
    """Everything `kvserve plan` reports for one model, format, hardware, context and batch.

    Byte counts are per GPU unless the name ends in `_total`.
    """

    model: str
    attention: str
    kv_format: str
    context: int
    batch: int
    gpu: str
    num_gpus: int
    num_layers: int
    num_local_layers: int
    sliding_window: int
    kv_heads: int
    kv_heads_per_gpu: int
    kv_replication: float
    kv_bytes_per_token: int
    kv_bytes_per_token_total: int
    kv_bytes_per_token_global: int
    kv_bytes_per_sequence: int
    kv_bytes_batch: int
    num_params: float
    weight_dtype: str
    weight_bytes_total: int
    weight_bytes_per_gpu: int
    memory_bytes_per_gpu: int
    gpu_memory_utilization: float
    reserved_fraction: float
    kv_budget_bytes: int
    max_concurrent_sequences: int
    batch_fits: bool
    weight_bytes_read_per_step: int
    kv_bytes_read_per_step: int
    bytes_read_per_step: int
    dominant_reads: str
    bandwidth_bytes_per_s: float
    time_per_output_token_s: float
    tokens_per_s_ceiling: float
    notes: list[str] = field(default_factory=list)


def plan(model: ModelShape, context: int = DEFAULT_CONTEXT, batch: int = 1, kv_dtype: str = "bf16",
         gpu: Hardware | str = DEFAULT_GPU, num_gpus: int = 1,
         gpu_memory_utilization: float = 0.9, reserved_fraction: float = 0.0,
         weight_dtype: str | None = None) -> Plan:
    """Size the KV cache and the decode-step reads for `model` on `num_gpus` x `gpu`."""
    sizing.check_context(context)
    if batch <= 0:
        raise ValueError(f"batch must be a positive number of sequences, got {batch}")
    if num_gpus <= 0:
        raise ValueError(f"num_gpus must be positive, got {num_gpus}")
    hw = presets.get_hardware(gpu) if isinstance(gpu, str) else gpu
    fmt = sizing.get_kv_format(kv_dtype)
    layout = model.kv_layout()
    sizing.check_layout(layout)
    heads_per_gpu = 1 if layout.is_mla else sizing.kv_heads_per_gpu(layout.num_kv_heads, num_gpus)
    per_seq = sizing.kv_bytes_per_sequence(layout, fmt, context, num_gpus)
    weights_total, dtype_name = weight_bytes(model, weight_dtype)
    weights_gpu = weights_total // num_gpus
    budget = sizing.kv_budget_bytes(hw.memory_bytes, weights_gpu, gpu_memory_utilization, reserved_fraction)
    max_seqs = sizing.max_concurrent_sequences(budget, per_seq)
    read_fraction = weights_read_fraction(model, batch)
    weights_read = int(weights_gpu * read_fraction)
    kv_read = batch * per_seq
    step_bytes = int(sizing.decode_bytes_read(weights_read, per_seq, batch))
    tpot = sizing.time_per_output_token(step_bytes, hw.bandwidth_bytes_per_s)
    result = Plan(
        model=model.name, attention=sizing.attention_kind(layout, model.num_heads), kv_format=fmt.name,
        context=context, batch=batch, gpu=hw.name, num_gpus=num_gpus,
        num_layers=layout.num_layers, num_local_layers=layout.num_local_layers,
        sliding_window=layout.sliding_window, kv_heads=0 if layout.is_mla else layout.num_kv_heads,
        kv_heads_per_gpu=heads_per_gpu, kv_replication=sizing.kv_replication(layout, num_gpus),
        kv_bytes_per_token=sizing.layout_bytes_per_token(layout, fmt, num_gpus),
        kv_bytes_per_token_total=num_gpus * sizing.layout_bytes_per_token(layout, fmt, num_gpus),
        kv_bytes_per_token_global=sizing.layout_bytes_per_token(
            replace(layout, num_layers=layout.num_global_layers), fmt, num_gpus) if layout.num_global_layers else 0,
        kv_bytes_per_sequence=per_seq, kv_bytes_batch=batch * per_seq,
        num_params=model.num_params, weight_dtype=dtype_name, weight_bytes_total=weights_total,
        weight_bytes_per_gpu=weights_gpu, memory_bytes_per_gpu=hw.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization, reserved_fraction=reserved_fraction,
        kv_budget_bytes=budget, max_concurrent_sequences=max_seqs, batch_fits=batch <= max_seqs,
        weight_bytes_read_per_step=weights_read, kv_bytes_read_per_step=kv_read,
        bytes_read_per_step=step_bytes, dominant_reads="weights" if weights_read >= kv_read else "KV",
        bandwidth_bytes_per_s=hw.bandwidth_bytes_per_s, time_per_output_token_s=tpot,
        tokens_per_s_ceiling=sizing.tokens_per_second_ceiling(batch, tpot),
    )
    result.notes = plan_notes(result, model, fmt, read_fraction)
    return result


def weight_bytes(model: ModelShape, weight_dtype: str | None) -> tuple[int, str]:
    """(bytes of all weights, dtype label): params x dtype, or the GGUF file's own tensor bytes."""
    if weight_dtype is None and model.weight_bytes:
        return model.weight_bytes, "as stored (GGUF)"
    name = weight_dtype or "bf16"
    return int(model.num_params * sizing.get_weight_dtype_bytes(name)), name


def weights_read_fraction(model: ModelShape, batch: int) -> float:
    """Share of the weights one decode step reads (1 for dense models, less for MoE)."""
    if not model.num_params:
        return 1.0
    read = sizing.moe_params_read(model.num_params, model.active_params, model.num_experts,
                                  model.experts_per_token, batch)
    return read / model.num_params


def plan_notes(p: Plan, model: ModelShape, fmt: sizing.KVFormat, read_fraction: float) -> list[str]:
    """Plain-language remarks: replication, fit, what dominates, what the format counts."""
    notes = []
    if p.num_gpus > 1 and p.kv_replication > 1:
        if p.attention == "MLA":
            notes.append(f"MLA latent is replicated on all {p.num_gpus} GPUs (it is shared by every "
                         "head, so tensor parallelism cannot split it)")
        elif p.kv_heads < p.num_gpus:
            notes.append(f"KV heads replicated: {p.kv_heads} KV head(s) over {p.num_gpus} GPUs; each GPU "
                         f"keeps 1 head, so every head is stored {p.kv_replication:g} times")
        else:
            notes.append(f"{p.kv_heads} KV heads do not divide over {p.num_gpus} GPUs; counted as "
                         f"{p.kv_heads_per_gpu} per GPU")
    if p.num_local_layers:
        notes.append(f"{p.num_local_layers} of {p.num_layers} layers keep only the last "
                     f"{p.sliding_window} tokens; only the other {p.num_layers - p.num_local_layers} grow with context")
    if fmt.note and fmt.scale_bytes:
        notes.append(f"{fmt.name}: {fmt.note}")
    if p.kv_budget_bytes <= 0:
        notes.append("the weights do not fit: no memory left for the KV cache; add GPUs or lower --weight-dtype")
    elif not p.batch_fits:
        notes.append(f"batch {p.batch} does not fit: at most {p.max_concurrent_sequences} sequences of "
                     f"{p.context} tokens")
    if model.max_context and p.context > model.max_context:
        notes.append(f"context {p.context} is beyond the model's trained length {model.max_context}")
    if read_fraction < 1:
        notes.append(f"MoE: a step of batch {p.batch} reads about {read_fraction:.0%} of the weights "
                     "(uniform routing assumed)")
    if not model.num_params:
        notes.append("no parameter count given: weights counted as 0 (use --params)")
    notes.append(f"{p.dominant_reads} dominate the bytes read per decode step")
    return notes


# --- --compare: one shape, several attention kinds --------------------------------------------


def attention_variant(model: ModelShape, kind: str) -> ModelShape:
    """`model` with its attention swapped for mha, gqa[N], mqa or mla (weights kept fixed)."""
    kind = kind.strip().lower()
    base = replace(model, kv_lora_rank=0, rope_dim=0)
    if not model.num_heads and kind != "mla":
        raise ValueError(f"{model.name} has no query-head count; give --heads to compare attention kinds")
    if kind == "mha":
        return replace(base, name=f"{model.name} MHA", num_kv_heads=model.num_heads)
    if kind == "mqa":
        return replace(base, name=f"{model.name} MQA", num_kv_heads=1)
    if kind.startswith("gqa"):
        groups = int(kind[3:]) if kind[3:].isdigit() else default_gqa_heads(model)
        return replace(base, name=f"{model.name} GQA-{groups}", num_kv_heads=groups)
    if kind == "mla":
        rank = model.kv_lora_rank or 4 * model.head_dim
        rope = model.rope_dim if model.kv_lora_rank else model.head_dim // 2
        return replace(model, name=f"{model.name} MLA", kv_lora_rank=rank, rope_dim=rope)
    raise ValueError(f"unknown attention kind {kind!r}; use mha, gqa, gqaN (N KV heads), mqa or mla")


def default_gqa_heads(model: ModelShape) -> int:
    """The model's own KV heads if it is GQA, else the largest divisor of its heads up to 8."""
    if 1 < model.num_kv_heads < model.num_heads and not model.kv_lora_rank:
        return model.num_kv_heads
    divisors = [g for g in range(2, min(8, model.num_heads - 1) + 1) if model.num_heads % g == 0]
    if not divisors:
        raise ValueError(f"{model.name} has {model.num_heads} heads: no GQA grouping; give gqaN")
    return divisors[-1]


def compare(model: ModelShape, kinds: list[str], **plan_args) -> list[Plan]:
    """Plans for `model` under each attention kind in `kinds`."""
    return [plan(attention_variant(model, k), **plan_args) for k in kinds]


# --- text, JSON and plot output ---------------------------------------------------------------


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"


def human_count(n: float) -> str:
    """8.03e9 -> '8.03B'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def format_table(rows: list[list[str]], header: list[str] | None = None, align: str = "") -> str:
    """Aligned plain-text table; `align` has 'l' or 'r' per column (default: first l, rest r)."""
    all_rows = ([header] if header else []) + rows
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    align = align or "l" + "r" * (len(widths) - 1)

    def line(r):
        cells = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)]
        return "  ".join(cells).rstrip()

    out = [line(r) for r in all_rows]
    if header:
        out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_plan(p: Plan) -> str:
    """The readable report for one plan."""
    per_gpu = " per GPU" if p.num_gpus > 1 else ""
    title = (f"{p.model} on {p.num_gpus} x {p.gpu}: context {p.context:,}, batch {p.batch}, "
             f"KV {p.kv_format}")
    rows = [
        ["attention", attention_line(p)],
        ["KV per token", f"{human_bytes(p.kv_bytes_per_token)}{per_gpu} ({p.kv_bytes_per_token:,} B)"
         + total_suffix(p) + window_suffix(p)],
        ["KV per sequence", f"{human_bytes(p.kv_bytes_per_sequence)}{per_gpu}"],
        ["KV for the batch", f"{human_bytes(p.kv_bytes_batch)}{per_gpu}"],
        ["weights", f"{human_bytes(p.weight_bytes_total)} ({human_count(p.num_params)} params, "
         f"{p.weight_dtype})" + (f", {human_bytes(p.weight_bytes_per_gpu)} per GPU" if per_gpu else "")],
        ["memory", f"{human_bytes(p.memory_bytes_per_gpu)}{per_gpu} x {p.gpu_memory_utilization:g} used, "
         f"{p.reserved_fraction:.0%} of that reserved"],
        ["KV budget", f"{human_bytes(max(p.kv_budget_bytes, 0))}{per_gpu}"],
        ["max sequences", f"{p.max_concurrent_sequences:,} at {p.context:,} tokens"
         + ("" if p.batch_fits else f" (batch {p.batch} does NOT fit)")],
        ["read per step", f"{human_bytes(p.bytes_read_per_step)}{per_gpu} = weights "
         f"{human_bytes(p.weight_bytes_read_per_step)} + KV {human_bytes(p.kv_bytes_read_per_step)}"
         f" ({p.dominant_reads} dominate)"],
        ["time per token", f">= {p.time_per_output_token_s * 1e3:.3g} ms at "
         f"{p.bandwidth_bytes_per_s / 1e9:,.0f} GB/s (bandwidth bound)"],
        ["tokens/s", f"<= {p.tokens_per_s_ceiling:,.0f} for the batch, "
         f"<= {p.tokens_per_s_ceiling / p.batch:,.0f} per sequence"],
    ]
    notes = "\n".join(f"  - {n}" for n in p.notes)
    return f"{title}\n{format_table(rows, align='ll')}\nnotes:\n{notes}"


def attention_line(p: Plan) -> str:
    """'GQA: 32 layers x 8 KV heads' and friends."""
    if p.attention == "MLA":
        text = f"MLA: {p.num_layers} layers x 1 latent vector"
    else:
        text = f"{p.attention}: {p.num_layers} layers x {p.kv_heads} KV heads"
        if p.num_gpus > 1:
            text += f" ({p.kv_heads_per_gpu} per GPU)"
    if p.num_local_layers:
        text += f"; {p.num_local_layers} local layers (window {p.sliding_window})"
    return text


def window_suffix(p: Plan) -> str:
    """For windowed models: what one more token costs once the windows are full."""
    if not p.num_local_layers:
        return ""
    return (f"; past the window only {p.num_layers - p.num_local_layers} layers grow: "
            f"{human_bytes(p.kv_bytes_per_token_global)} per token")


def total_suffix(p: Plan) -> str:
    """For TP: the bytes per token over all GPUs and the replication factor."""
    if p.num_gpus == 1:
        return ""
    text = f"; {human_bytes(p.kv_bytes_per_token_total)} over {p.num_gpus} GPUs"
    if p.kv_replication > 1:
        text += f", KV REPLICATED {p.kv_replication:g}x"
    return text


def format_compare(plans: list[Plan]) -> str:
    """One row per attention kind."""
    header = ["attention", "KV heads", "KV/token", "KV/sequence", "max seqs", "read/step",
              "ms/token", "reads"]
    rows = [[p.model, "latent" if p.attention == "MLA" else str(p.kv_heads),
             human_bytes(p.kv_bytes_per_token), human_bytes(p.kv_bytes_per_sequence),
             f"{p.max_concurrent_sequences:,}", human_bytes(p.bytes_read_per_step),
             f"{p.time_per_output_token_s * 1e3:.3g}", p.dominant_reads] for p in plans]
    p0 = plans[0]
    title = (f"attention kinds on {p0.num_gpus} x {p0.gpu}: context {p0.context:,}, batch {p0.batch}, "
             f"KV {p0.kv_format} (weights held fixed; byte counts per GPU)")
    notes = compare_notes(plans)
    return "\n".join([title, format_table(rows, header)] + [f"  - {n}" for n in notes])


def compare_notes(plans: list[Plan]) -> list[str]:
    """Notes of a comparison: shared ones once, the others named by their variant."""
    shared = set.intersection(*(set(p.notes) for p in plans))
    notes = [n for n in plans[0].notes if n in shared and "dominate" not in n]
    for p in plans:
        notes += [f"{p.model}: {n}" for n in p.notes if n not in shared and "dominate" not in n]
    return notes


def format_list() -> str:
    """The model and hardware presets as two tables."""
    header = ["model", "layers", "heads/KV", "head_dim", "attention", "params", "context", "note"]
    rows = []
    for m in presets.MODEL_PRESETS:
        kind = sizing.attention_kind(m.kv_layout(), m.num_heads)
        rows.append([m.name, str(m.num_layers), f"{m.num_heads}/{m.num_kv_heads}", str(m.head_dim),
                     kind, human_count(m.num_params), f"{m.max_context:,}", m.note])
    hw_rows = [[h.name, human_bytes(h.memory_bytes), f"{h.bandwidth_bytes_per_s / 1e9:,.0f} GB/s", h.note]
               for h in presets.HARDWARE_PRESETS]
    formats = [[f.name, f"{f.bits:g}", f.note] for f in sizing.KV_FORMATS.values()]
    return "\n\n".join([
        format_table(rows, header, align="lrrrrrrl"),
        format_table(hw_rows, ["hardware", "memory", "bandwidth", "note"], align="lrrl"),
        format_table(formats, ["KV format", "bits", "note"], align="lrl"),
    ])


def plot_kv_vs_context(path: str, model: ModelShape, p: Plan, variants: list[ModelShape] | None = None) -> None:
    """Write a PNG of KV GiB (batch, per GPU) vs context: one line per format, or per variant."""
    matplotlib = require("matplotlib", "plots", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(p.context, model.max_context or 0, 4096)
    contexts = [2 ** k for k in range(9, 40) if 2 ** k <= top]
    if contexts[-1] < top:
        contexts.append(top)
    fig, ax = plt.subplots(figsize=(8, 5))
    if variants:
        fmt = sizing.get_kv_format(p.kv_format)
        lines = [(v.name, v.kv_layout(), fmt) for v in variants]
    else:
        lines = [(f, model.kv_layout(), sizing.get_kv_format(f)) for f in PLOT_FORMATS]
    for i, (label, layout, fmt) in enumerate(lines):
        gib = [p.batch * sizing.kv_bytes_per_sequence(layout, fmt, c, p.num_gpus) / 2**30 for c in contexts]
        ax.plot(contexts, gib, marker="o", markersize=3, linestyle=("-", "--", ":", "-.")[i % 4], label=label)
    if p.kv_budget_bytes > 0:
        ax.axhline(p.kv_budget_bytes / 2**30, color="gray", linestyle="--", label="KV budget per GPU")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"KV cache GiB (batch {p.batch}, per GPU)")
    ax.set_title(f"{model.name} on {p.num_gpus} x {p.gpu}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the command line -------------------------------------------------------------------------


def parse_count(text: str) -> float:
    """'8B' -> 8e9, '135M' -> 1.35e8, '70e9' -> 7e10."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"cannot read a parameter count from {text!r}; use e.g. 8B, 135M or 7e9")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale


def parse_tokens(text: str) -> int:
    """'32K' -> 32768, '128k' -> 131072, '1M' -> 1048576, '-5' -> -5 (checked later)."""
    m = re.fullmatch(r"\s*(-?[0-9]+)\s*([km]?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"cannot read a token count from {text!r}; use e.g. 8192 or 32K")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2)]


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "plan", help="size the KV cache for a model on given hardware",
        description="Size the KV cache: bytes per token and sequence, the budget after weights, "
                    "how many sequences fit, bytes read per decode step and the bandwidth bound.",
    )
    p.add_argument("model", nargs="?", help="preset name, HF config.json (or its folder), or .gguf file")
    p.add_argument("--list", action="store_true", help="list model, hardware and format presets")
    p.add_argument("--context", default=str(DEFAULT_CONTEXT), help="tokens per sequence (e.g. 8192, 32K)")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    p.add_argument("--kv-dtype", default="bf16", help="bf16, fp16, fp32, fp8, int8, kivi4, kivi2")
    p.add_argument("--gpu", default=DEFAULT_GPU, help="hardware preset (see --list)")
    p.add_argument("--num-gpus", type=int, default=1, help="tensor-parallel GPU count")
    p.add_argument("--memory-gib", type=float, help="override memory per device (e.g. for --gpu cpu)")
    p.add_argument("--bandwidth-gbs", type=float, help="override memory bandwidth, GB/s")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reserved-fraction", type=float, default=0.0,
                   help="share of the used memory held back for activations")
    p.add_argument("--weight-dtype", help="bf16, fp16, fp32, fp8, int8, int4 (default bf16; GGUF: as stored)")
    p.add_argument("--tflops", type=float, help="override dense BF16 compute per device, TFLOP/s")
    traffic = p.add_argument_group("replicas (with --rate): how many engines a traffic mix needs, "
                                   "--num-gpus each, and what prefix-aware routing saves")
    traffic.add_argument("--rate", type=float, help="requests per second")
    traffic.add_argument("--prompt-tokens", default="1024", help="prompt tokens per request (e.g. 2K)")
    traffic.add_argument("--output-tokens", default="256", help="output tokens per request")
    traffic.add_argument("--shared-prefix", type=float, default=0.0,
                         help="fraction of each prompt that is a prefix shared with other requests (0-1)")
    traffic.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes, equally often")
    traffic.add_argument("--max-batch", type=int, default=256, help="most sequences a replica decodes at once")
    traffic.add_argument("--max-utilization", type=float, default=0.8,
                         help="busy share of each replica's time to plan for")
    shape = p.add_argument_group("custom shape (alone, or overriding MODEL's numbers)")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--heads", type=int, help="query heads (tells MHA from GQA)")
    shape.add_argument("--kv-heads", type=int)
    shape.add_argument("--head-dim", type=int)
    shape.add_argument("--kv-lora-rank", type=int, help="MLA latent width")
    shape.add_argument("--rope-dim", type=int, help="MLA rope key width")
    shape.add_argument("--sliding-window", type=int)
    shape.add_argument("--local-layers", type=int, help="layers capped at the window (default all)")
    shape.add_argument("--params", help="parameter count, e.g. 8B")
    p.add_argument("--compare", metavar="MODEL", help="compare attention kinds on MODEL's shape")
    p.add_argument("--attention", help="kinds to compare, e.g. mha,gqa,mqa,mla (gqa4: 4 KV heads)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="write KV GiB vs context")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvserve plan`; returns the exit code (bad input: a ValueError, which the
    `kvserve` command reports)."""
    if args.list:
        print(format_list())
        return 0
    model = model_from_args(args)
    plan_args = dict(
        context=parse_tokens(args.context), batch=args.batch, kv_dtype=args.kv_dtype,
        gpu=presets.get_hardware(args.gpu, args.memory_gib, args.bandwidth_gbs, args.tflops),
        num_gpus=args.num_gpus, gpu_memory_utilization=args.gpu_memory_utilization,
        reserved_fraction=args.reserved_fraction, weight_dtype=args.weight_dtype,
    )
    if args.rate is not None:
        return _run_replicas(args, model, plan_args)
    if args.compare or args.attention:
        kinds = [k for k in (args.attention or ",".join(ATTENTION_KINDS)).split(",") if k.strip()]
        variants = [attention_variant(model, k) for k in kinds]
        plans = [plan(v, **plan_args) for v in variants]
        print(json.dumps([asdict(p) for p in plans], indent=2) if args.json else format_compare(plans))
        if args.plot:
            plot_kv_vs_context(args.plot, model, plans[0], variants)
        return 0
    result = plan(model, **plan_args)
    print(json.dumps(asdict(result), indent=2) if args.json else format_plan(result))
    if args.plot:
        plot_kv_vs_context(args.plot, model, result)
    return 0


def _run_replicas(args: argparse.Namespace, model: ModelShape, plan_args: dict) -> int:
    from kvserve.tools.replicas import Traffic, format_replica_plan, plan_replicas

    traffic = Traffic(args.rate, parse_tokens(args.prompt_tokens), parse_tokens(args.output_tokens),
                      args.shared_prefix, args.num_prefixes)
    plan_args = {k: v for k, v in plan_args.items() if k not in ("context", "batch")}
    result = plan_replicas(model, traffic, max_batch=args.max_batch, max_utilization=args.max_utilization,
                           **plan_args)
    print(json.dumps(asdict(result), indent=2) if args.json else format_replica_plan(result))
    return 0


def model_from_args(args: argparse.Namespace) -> ModelShape:
    """The ModelShape named by MODEL / --compare, with any custom-shape options applied."""
    spec = args.compare or args.model
    if spec:
        model = presets.load_model_shape(spec)
    elif args.layers and (args.kv_heads or args.kv_lora_rank):
        model = ModelShape("custom", args.layers, 0, args.heads or 0,
                           args.kv_heads or 0, args.head_dim or 0, 0, source="custom")
    else:
        raise ValueError("give a MODEL (preset, config.json or .gguf; see --list) or a custom shape "
                         "with --layers and --kv-heads/--head-dim (or --kv-lora-rank for MLA)")
    return apply_overrides(model, args)


def apply_overrides(model: ModelShape, args: argparse.Namespace) -> ModelShape:
    """Replace the shape's numbers with the ones given on the command line."""
    changes = {}
    for arg, name in (("layers", "num_layers"), ("heads", "num_heads"), ("kv_heads", "num_kv_heads"),
                      ("head_dim", "head_dim"), ("kv_lora_rank", "kv_lora_rank"), ("rope_dim", "rope_dim"),
                      ("sliding_window", "sliding_window"), ("local_layers", "num_local_layers")):
        value = getattr(args, arg, None)
        if value is not None:
            if value < 0:
                raise ValueError(f"--{arg.replace('_', '-')} must be >= 0, got {value}")
            changes[name] = value
    if args.params:
        changes["num_params"] = parse_count(args.params)
        changes["weight_bytes"] = 0
    if args.sliding_window and args.local_layers is None and not model.num_local_layers:
        changes["num_local_layers"] = changes.get("num_layers", model.num_layers)
    if "num_kv_heads" in changes and args.kv_lora_rank is None:
        changes["kv_lora_rank"] = 0
    return replace(model, **changes) if changes else model
