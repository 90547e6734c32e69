"""Offline throughput on the bundled model: kvserve vs transformers vs llama-cpp-python,
and the paged KV layout vs the contiguous one under the same KV memory budget.

    python benchmarks/throughput.py            # full run, results go to BENCHMARKS.md
    python benchmarks/throughput.py --quick --no-write   # smoke run

Every engine gets the same requests: token-id prompts cut from CPython's own documentation
(`pydoc_data.topics`), seeded random lengths, greedy decoding of exactly `--output-len` tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    OtherLoad,
    command_line,
    fmt,
    load_average,
    machine_facts,
    make_prompts,
    md_table,
    percentile,
    replace_section,
)
from tqdm.auto import tqdm  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.loader import resolve_model_path  # noqa: E402

HERE = Path(__file__).resolve().parent


@dataclass
class Result:
    """One engine's run over the workload."""

    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    ttft: list[float] = field(default_factory=list)   # seconds, per request
    tpot: list[float] = field(default_factory=list)   # seconds, per request
    outputs: list[list[int]] | None = None            # generated token ids, request order
    load_s: float | None = None
    notes: list[str] = field(default_factory=list)
    other_cores: float | None = None                 # CPU cores other processes used meanwhile

    @property
    def output_tps(self) -> float:
        """Generated tokens per second of wall time."""
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        """Prompt + generated tokens per second of wall time."""
        return (self.prompt_tokens + self.output_tokens) / self.wall_s


@dataclass
class LayoutResult:
    """One KV layout under a fixed memory budget, stepped by hand."""

    mode: str
    kv_cache_bytes: int
    block_size: int
    num_blocks: int
    bytes_per_token: int
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    peak_blocks: int             # most blocks held at once
    peak_live_tokens: int        # most tokens in the KV cache while that many blocks were held
    peak_running: int            # most requests running at once
    num_preemptions: int
    seq_tokens: list[int]        # prompt + output tokens per request
    other_cores: float | None = None

    @property
    def pool_tokens(self) -> int:
        """Token slots in the pool."""
        return self.num_blocks * self.block_size

    @property
    def output_tps(self) -> float:
        """Generated tokens per second."""
        return self.output_tokens / self.wall_s

    @property
    def reserved_bytes_workload(self) -> int:
        """KV bytes the workload's sequences reserve, summed over requests."""
        blocks = sum(math.ceil(n / self.block_size) for n in self.seq_tokens)
        return blocks * self.block_size * self.bytes_per_token

    @property
    def used_bytes_workload(self) -> int:
        """KV bytes the workload's tokens need, summed over requests."""
        return sum(self.seq_tokens) * self.bytes_per_token

    @property
    def fit_at_once(self) -> float:
        """Sequences of this workload's mean length the pool holds at once."""
        mean_blocks = sum(math.ceil(n / self.block_size) for n in self.seq_tokens) / len(self.seq_tokens)
        return self.num_blocks / mean_blocks


# ---------------------------------------------------------------------------- kvserve


def greedy(output_len: int) -> SamplingParams:
    """Greedy, exactly output_len tokens."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def warm_up(llm: LLM, prompt: list[int]) -> None:
    """A tiny request so one-time costs stay out of the timed run; forget its cached blocks."""
    llm.generate([prompt[:48]], greedy(4), use_tqdm=False)
    llm.reset_prefix_cache()


def config_options(name: str) -> dict:
    """LLM options of a --dtypes entry: a dtype, a weight format over float32 activations, or auto."""
    if name == "auto":
        return {}
    if name in ("int8", "int4"):
        return {"weights": name, "dtype": "float32"}
    return {"dtype": name}


def run_kvserve(prompts: list[list[int]], output_len: int, args, dtype: str) -> tuple[Result, LLM]:
    """All requests at once through LLM.generate."""
    t0 = time.perf_counter()
    llm = LLM(kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, compile_mode="blocking",
              **config_options(dtype))
    load_s = time.perf_counter() - t0
    warm_up(llm, prompts[0])
    mon, start = OtherLoad(), time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(output_len))
    wall, other = time.perf_counter() - start, mon.stop()
    ttft, tpot, tokens = [], [], []
    for o in outs:
        m, toks = o.metrics, o.outputs[0].token_ids
        tokens.append(list(toks))
        ttft.append(m.ttft)
        if len(toks) > 1:
            tpot.append((m.last_token_time - m.first_token_time) / (len(toks) - 1))
    met = llm.get_metrics()
    if dtype == "auto":
        dtype = f"auto = {llm.engine.weight_format} weights"
    res = Result(f"kvserve ({dtype}, paged)", len(prompts), sum(map(len, prompts)), sum(map(len, tokens)),
                 wall, ttft, tpot, tokens, load_s, other_cores=other)
    res.notes.append(f"kvserve ({dtype}): {met['num_steps']} engine steps, {met['num_preemptions']} preemptions, "
                     f"prefix-cache hits {met['prefix_cache_hits']} of {met['prefix_cache_queries']} "
                     f"queried tokens, pool {met['num_blocks_total']} blocks x {met['block_size']} tokens "
                     f"({met['kv_cache_bytes'] / 2**20:.0f} MiB).")
    return res, llm


# ---------------------------------------------------------------------------- transformers


class _StepTimer:
    """A stopping criterion that never stops and notes when each new token exists."""

    def __init__(self, bar=None):
        self.times: list[float] = []
        self.bar = bar

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        if self.bar is not None:
            self.bar.update(input_ids.shape[0])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def run_transformers(prompts: list[list[int]], output_len: int, gguf: str, pad_id: int, args, dtype: str) -> Result:
    """Batched greedy generate, left padding, prompts grouped by length into a few batches."""
    from transformers import AutoModelForCausalLM, StoppingCriteriaList
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    folder, name = os.path.split(gguf)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t0
    gen_kwargs = dict(do_sample=False, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)

    def generate(batch, n, timer=None):
        ids, mask = _left_pad(batch, pad_id)
        crit = StoppingCriteriaList([timer]) if timer else None
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 stopping_criteria=crit, **gen_kwargs)
        return out[:, ids.shape[1]:].tolist()

    generate([prompts[0][:48]], 4)  # warm-up
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    bs = args.hf_batch_size
    tokens: list[list[int] | None] = [None] * len(prompts)
    ttft: list[float] = []
    tpot: list[float] = []
    bar = tqdm(total=len(prompts) * output_len, desc="transformers generate (tokens)", dynamic_ncols=True)
    mon, start = OtherLoad(), time.perf_counter()
    for b in range(0, len(order), bs):
        idx = order[b:b + bs]
        timer = _StepTimer(bar)
        outs = generate([prompts[i] for i in idx], output_len, timer)
        for i, o in zip(idx, outs):
            tokens[i] = o
        first, last = timer.times[0], timer.times[-1]
        ttft += [first - start] * len(idx)
        if len(timer.times) > 1:
            tpot += [(last - first) / (len(timer.times) - 1)] * len(idx)
    wall, other = time.perf_counter() - start, mon.stop()
    bar.close()
    res = Result(f"transformers generate ({dtype}, batched)", len(prompts), sum(map(len, prompts)),
                 sum(map(len, tokens)), wall, ttft, tpot, tokens, load_s, other_cores=other)
    res.notes.append(
        f"transformers: {math.ceil(len(prompts) / bs)} batches of up to {bs}, prompts sorted by length "
        "(least padding), left padding, greedy, min_new_tokens = max_new_tokens. Batched generate "
        "gives no per-request first-token time; TTFT/TPOT here come from a stopping-criteria hook "
        "called after every step, so every request in a batch shares its batch's time, and TTFT "
        "counts from the start of the whole run (like kvserve's, where all requests arrive at once).")
    return res


# ---------------------------------------------------------------------------- llama-cpp-python


def run_llamacpp(prompts: list[list[int]], output_len: int, gguf: str, eos_ids: list[int], args) -> Result | None:
    """Sequential requests through llama-cpp-python's create_completion, streamed for TTFT/TPOT."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    t0 = time.perf_counter()
    n_ctx = max(1024, max(map(len, prompts)) + output_len + 8)
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=args.llamacpp_threads, verbose=False)
    load_s = time.perf_counter() - t0
    bias = {t: -1e9 for t in set(eos_ids) | {llm.token_eos()}}  # = ignore_eos

    def complete(prompt, n, record=None):
        first = last = None
        chunks = 0
        reason = None
        for chunk in llm.create_completion(prompt=prompt, max_tokens=n, temperature=0.0, stream=True,
                                           logit_bias=bias):
            last = time.perf_counter()
            first = first or last
            chunks += 1
            reason = chunk["choices"][0].get("finish_reason") or reason
        return first, last, reason

    complete(prompts[0][:48], 4)  # warm-up
    ttft, ttft_queued, tpot, reasons = [], [], [], set()
    mon, start = OtherLoad(), time.perf_counter()
    for p in tqdm(prompts, desc="llama-cpp-python (requests)", dynamic_ncols=True):
        t = time.perf_counter()
        first, last, reason = complete(p, output_len)
        reasons.add(reason)
        ttft.append(first - t)
        ttft_queued.append(first - start)
        tpot.append((last - first) / (output_len - 1) if output_len > 1 else 0.0)
    wall, other = time.perf_counter() - start, mon.stop()
    res = Result(f"llama-cpp-python (Q4_1, sequential, {args.llamacpp_threads} threads)", len(prompts),
                 sum(map(len, prompts)), len(prompts) * output_len, wall, ttft, tpot, None, load_s,
                 other_cores=other)
    res.notes.append(
        "llama-cpp-python: one request at a time (its Python API serves one sequence per Llama "
        "object); it runs the GGUF's Q4_1 weights directly, kvserve and transformers run them "
        f"dequantized (in the dtype their row names). EOS is masked with logit_bias so every request makes exactly "
        f"{output_len} tokens (finish reasons seen: {sorted(map(str, reasons))}). TTFT is measured "
        "from each request's own submission; counted from the start of the run, as if all requests "
        f"arrived at once like kvserve's, TTFT p50/p99 would be {fmt(percentile(ttft_queued, 50))} / "
        f"{fmt(percentile(ttft_queued, 99))} s. TPOT is (last chunk - first chunk) / "
        f"({output_len} - 1) of the stream.")
    return res


# ---------------------------------------------------------------------------- layouts


def run_layout(prompts: list[list[int]], output_len: int, mode: str, args) -> LayoutResult:
    """Step the engine by hand under one KV budget, tracking the peak of blocks held."""
    llm = LLM(kv_cache_mode=mode, kv_cache_memory=args.layout_kv_memory, max_model_len=args.layout_max_model_len,
              dtype=args.dtypes[0], compile_mode="blocking")
    warm_up(llm, prompts[0])
    engine = llm.engine
    m = llm.get_metrics()
    pre0 = m["num_preemptions"]
    sp = greedy(output_len)
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, sp)
    peak_blocks = peak_live = peak_running = 0
    outputs: dict[str, int] = {}
    bar = tqdm(total=len(prompts), desc=f"{mode} layout (requests)", dynamic_ncols=True)
    mon, start = OtherLoad(), time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = len(out.outputs[0].token_ids)
                bar.update(1)
        m = llm.get_metrics()
        running = engine.scheduler.running
        peak_running = max(peak_running, len(running))
        live = sum(r.num_computed_tokens for r in running)
        if m["num_blocks_used"] > peak_blocks:
            peak_blocks, peak_live = m["num_blocks_used"], live
        elif m["num_blocks_used"] == peak_blocks:
            peak_live = max(peak_live, live)
    wall, other = time.perf_counter() - start, mon.stop()
    bar.close()
    return LayoutResult(mode, m["kv_cache_bytes"], m["block_size"], m["num_blocks_total"], llm.kv_bytes_per_token,
                        wall, sum(outputs.values()), sum(map(len, prompts)), peak_blocks, peak_live,
                        peak_running, m["num_preemptions"] - pre0, [len(p) + output_len for p in prompts], other)


# ---------------------------------------------------------------------------- profile


PROFILE_ROWS = [
    # (label, how to find the time)
    ("linear layers (q/k/v/o, MLP)", "linear_body"),
    ("lm_head (compute_logits)", "lm_head"),
    ("attention: KV gather (storage.read)", "gather"),
    ("attention: SDPA", "sdpa"),
    ("attention: KV write (index_copy_)", "kv_write"),
    ("RMSNorm", "rmsnorm"),
    ("RoPE", "rope"),
    ("other model ops (SiLU, residual adds, copies, embedding)", "model_rest"),
    ("model_runner.prepare (slots, block tables, masks)", "prepare"),
    ("sampler", "sampler"),
    ("scheduler.schedule", "schedule"),
    ("kv.cache_blocks (block hashing)", "cache_blocks"),
    ("token append + detokenize + stop checks", "append"),
    ("rest (engine loop, outputs, tqdm)", "rest"),
]


def _find(stats: dict, file_part: str, func: str):
    return [k for k in stats if k[2] == func and file_part in k[0]]


def _cum(stats: dict, file_part: str, func: str) -> float:
    return sum(stats[k][3] for k in _find(stats, file_part, func))


def _tottime_from(stats: dict, callee_pred, caller_pred=None) -> float:
    total = 0.0
    for key, (_, _, tt, _, callers) in stats.items():
        if not callee_pred(key):
            continue
        if caller_pred is None:
            total += tt
        else:
            total += sum(v[2] for c, v in callers.items() if caller_pred(c))
    return total


def _method_cum(stats: dict, method) -> float:
    code = method.__code__
    return sum(v[3] for k, v in stats.items()
               if k[0] == code.co_filename and k[1] == code.co_firstlineno and k[2] == code.co_name)


def profile_breakdown(prof: cProfile.Profile | str) -> tuple[float, dict[str, float]]:
    """Seconds per category of one profiled generate() call (a Profile or a saved stats file)."""
    from kvserve.model.layers import RMSNorm, RotaryEmbedding
    st = pstats.Stats(prof).stats
    total = _cum(st, "kvserve/llm.py", "generate")
    forward = _cum(st, "kvserve/engine/model_runner.py", "execute") - _cum(st, "kvserve/engine/model_runner.py", "prepare")
    linear_all = _tottime_from(st, lambda k: k[0] == "~" and "_nn.linear" in k[2])
    lm_head = _cum(st, "kvserve/model/", "compute_logits")
    parts = {
        "linear_body": max(0.0, linear_all - lm_head),
        "lm_head": lm_head,
        # tensor indexing is a slot wrapper cProfile does not see: all of read() is the gather
        "gather": _cum(st, "kvserve/kv/storage.py", "read"),
        "sdpa": _tottime_from(st, lambda k: "scaled_dot_product_attention" in k[2]),
        "kv_write": _tottime_from(st, lambda k: "index_copy_" in k[2]),
        "prepare": _cum(st, "kvserve/engine/model_runner.py", "prepare"),
        "sampler": _cum(st, "kvserve/engine/engine.py", "_sample"),
        "schedule": _cum(st, "kvserve/engine/scheduler.py", "schedule"),
        "cache_blocks": _cum(st, "kvserve/kv/manager.py", "cache_blocks"),
        "append": _cum(st, "kvserve/engine/engine.py", "_append"),
        "rmsnorm": _method_cum(st, RMSNorm.forward),
        "rope": _method_cum(st, RotaryEmbedding.forward),
    }
    model_keys = ("linear_body", "lm_head", "gather", "sdpa", "kv_write", "rmsnorm", "rope")
    parts["model_rest"] = max(0.0, forward - sum(parts[k] for k in model_keys))
    parts["rest"] = max(0.0, total - sum(parts.values()))
    return total, parts


def run_profile(prompts: list[list[int]], output_len: int, llm: LLM, path: Path | None) -> tuple[float, dict[str, float], float]:
    """Run the kvserve workload again under cProfile; returns total, categories, unprofiled wall."""
    llm.reset_prefix_cache()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(output_len))
    prof.disable()
    wall = time.perf_counter() - start
    if path is not None:
        prof.dump_stats(str(path))
        print(f"cProfile stats written to {path} (python -m pstats {path})")
    total, parts = profile_breakdown(prof)
    return total, parts, wall


# ---------------------------------------------------------------------------- report


def results_table(results: list[Result]) -> str:
    """Markdown table of the engines."""
    rows = []
    for r in results:
        rows.append([r.name, str(r.num_requests), f"{r.output_tps:.1f}", f"{r.total_tps:.1f}",
                     fmt(percentile(r.ttft, 50)), fmt(percentile(r.ttft, 99)),
                     fmt(percentile(r.tpot, 50), 1000, 1), fmt(percentile(r.tpot, 99), 1000, 1),
                     f"{r.wall_s:.1f}", fmt(r.load_s, 1, 1), fmt(r.other_cores)])
    return md_table(["engine", "requests", "output tok/s", "total tok/s", "TTFT p50 (s)", "TTFT p99 (s)",
                     "TPOT p50 (ms)", "TPOT p99 (ms)", "wall (s)", "model load (s)", "others' CPU (cores)"], rows)


def ratio_lines(results: list[Result]) -> list[str]:
    """Each kvserve row / each peer row."""
    lines = []
    for ours in [r for r in results if r.name.startswith("kvserve")]:
        for peer in [r for r in results if not r.name.startswith("kvserve")]:
            t50o, t50p = percentile(ours.tpot, 50), percentile(peer.tpot, 50)
            lines.append(f"- {ours.name} / {peer.name}: output tok/s **{ours.output_tps / peer.output_tps:.2f}x**, "
                         f"total tok/s **{ours.total_tps / peer.total_tps:.2f}x**, TPOT p50 "
                         f"{t50o / t50p:.2f}x (lower is better)")
    return lines


def agreement(a: Result, b: Result) -> str | None:
    """How many greedy outputs of two engines agree, token for token."""
    if a.outputs is None or b.outputs is None:
        return None
    same = sum(x == y for x, y in zip(a.outputs, b.outputs))
    prefix = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x)) for x, y in zip(a.outputs, b.outputs)]
    return (f"Greedy outputs of kvserve and transformers: {same} of {len(a.outputs)} requests identical over all "
            f"{len(a.outputs[0])} tokens; median first divergence at token {sorted(prefix)[len(prefix) // 2]} "
            "(batch shapes change summation order, so near-ties can flip).")


def layout_table(rs: list[LayoutResult], max_model_len: int) -> str:
    """Markdown table comparing the layouts."""
    mib = 2 ** 20
    rows = []
    for r in rs:
        at_max = r.num_blocks if r.mode == "contiguous" else r.pool_tokens // max_model_len
        rows.append([
            r.mode, f"{r.num_blocks} x {r.block_size}", f"{r.kv_cache_bytes / mib:.0f}",
            str(at_max), f"{r.fit_at_once:.1f}" if r.mode == "paged" else str(r.num_blocks), str(r.peak_running),
            f"{r.reserved_bytes_workload / mib:.0f} / {r.used_bytes_workload / mib:.0f} "
            f"({r.used_bytes_workload / r.reserved_bytes_workload:.0%})",
            f"{r.peak_blocks * r.block_size * r.bytes_per_token / mib:.0f} / {r.peak_live_tokens * r.bytes_per_token / mib:.0f}",
            str(r.num_preemptions), f"{r.output_tps:.1f}", f"{r.wall_s:.1f}", fmt(r.other_cores)])
    return md_table(["layout", "blocks x tokens", "KV MiB", f"seqs of {max_model_len} at once",
                     "seqs of this workload at once", "peak running (measured)",
                     "workload KV reserved / used MiB (used %)", "at peak: held / in-use MiB",
                     "preemptions", "output tok/s", "wall (s)", "others' CPU (cores)"], rows)


def plot_layouts(rs: list[LayoutResult], path: Path) -> None:
    """Three bars per layout: sequences at once, KV reserved vs used at peak, output tok/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mib = 2 ** 20
    names = [r.mode for r in rs]
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
    ax[0].bar(names, [r.peak_running for r in rs], color=["tab:blue", "tab:orange"])
    ax[0].set_title("sequences running at once (peak)")
    x = range(len(rs))
    held = [r.peak_blocks * r.block_size * r.bytes_per_token / mib for r in rs]
    live = [r.peak_live_tokens * r.bytes_per_token / mib for r in rs]
    ax[1].bar([i - 0.2 for i in x], held, width=0.4, label="held (reserved)")
    ax[1].bar([i + 0.2 for i in x], live, width=0.4, label="holding tokens")
    ax[1].set_xticks(list(x), names)
    ax[1].set_title("KV MiB at peak")
    ax[1].set_ylim(0, max(held + live) * 1.35)
    ax[1].legend(loc="upper right", fontsize=8)
    ax[2].bar(names, [r.output_tps for r in rs], color=["tab:blue", "tab:orange"])
    ax[2].set_title("output tokens/s")
    fig.suptitle(f"same KV budget ({rs[0].kv_cache_bytes / mib:.0f} MiB), {len(rs[0].seq_tokens)} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 32 output tokens")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--skip-throughput", action="store_true", help="only the layout comparison")
    p.add_argument("--skip-layout", action="store_true", help="no paged-vs-contiguous comparison")
    p.add_argument("--kv-cache-memory", default="2GiB", help="kvserve KV pool for the throughput run")
    p.add_argument("--max-model-len", type=int, default=2048, help="kvserve max_model_len for the throughput run")
    p.add_argument("--dtypes", default="float32,bfloat16", type=lambda v: [d.strip() for d in v.split(",") if d.strip()],
                   help="comma-separated kvserve configurations: a dtype, int8/int4 (weights over float32 "
                        "activations) or auto (the default); transformers runs once in each dtype")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--llamacpp-threads", type=int, default=2)
    p.add_argument("--layout-kv-memory", default="512MiB")
    p.add_argument("--layout-max-model-len", type=int, default=2048)
    p.add_argument("--profile", action="store_true",
                   help="run the kvserve workload once more under cProfile and print where time goes")
    p.add_argument("--plot", default=str(HERE / "paged_vs_contiguous.png"))
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    p.add_argument("--note", action="append", default=[], help="a line to add under the results (repeatable)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.output_len = 8, 32
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    facts = machine_facts()
    load_before = load_average()
    gguf = resolve_model_path(None)
    tok_llm = None
    from kvserve.model.tokenizer import Tokenizer
    tokenizer = Tokenizer.load(gguf)
    prompts = make_prompts(tokenizer, args.num_requests, args.min_prompt, args.max_prompt, args.seed)
    n_prompt = sum(map(len, prompts))
    print(f"workload: {len(prompts)} requests, prompt tokens {n_prompt} "
          f"(min {min(map(len, prompts))}, max {max(map(len, prompts))}), {args.output_len} output tokens each")
    print("machine: " + "; ".join(f"{k}: {v}" for k, v in facts.items()) + f"; load {load_before}")

    results: list[Result] = []
    profile = None
    if not args.skip_throughput:
        eos_ids, pad_id = [], tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        for i, dtype in enumerate(args.dtypes):
            res, tok_llm = run_kvserve(prompts, args.output_len, args, dtype)
            results.append(res)
            eos_ids = list(tok_llm.engine.sampler.eos_token_ids or [])
            if args.profile and i == len(args.dtypes) - 1:
                profile = run_profile(prompts, args.output_len, tok_llm,
                                      Path(tempfile.gettempdir()) / "kvserve_throughput.prof")
            del tok_llm
        if not args.skip_transformers:
            for dtype in [d for d in args.dtypes if d in ("float32", "bfloat16", "float16")]:
                results.append(run_transformers(prompts, args.output_len, gguf, pad_id, args, dtype))
        if not args.skip_llamacpp:
            r = run_llamacpp(prompts, args.output_len, gguf, eos_ids, args)
            if r is None:
                print("llama-cpp-python is not installed; skipping it (pip install llama-cpp-python)")
            else:
                results.append(r)

    layouts: list[LayoutResult] = []
    if not args.skip_layout:
        for mode in ("paged", "contiguous"):
            layouts.append(run_layout(prompts, args.output_len, mode, args))
    load_after = load_average()

    header = [f"Command: `{command_line()}`", "",
              "Machine: " + "; ".join(f"{k} {v}" for k, v in facts.items()) + ".",
              f"Load average (1/5/15 min) before / after: {load_before} -> {load_after}.", "",
              f"Workload: {len(prompts)} requests, prompt lengths {args.min_prompt}-{args.max_prompt} tokens "
              f"(seeded random, seed {args.seed}; {n_prompt} prompt tokens in all) cut from CPython's "
              f"`pydoc_data.topics` prose and passed as token ids; {args.output_len} output tokens each, "
              "greedy, EOS ignored; bundled SmolLM2-135M-Instruct (Q4_1 GGUF)."]
    sections: dict[str, str] = {}
    if results:
        body = header + ["", results_table(results), ""]
        body += ["Ratios:"] + ratio_lines(results) if len(results) > 1 else []
        body += [""] + [f"- {n}" for r in results for n in r.notes]
        for ours in [r for r in results if r.name.startswith("kvserve")]:
            dtype = ours.name.split("(")[1].split(",")[0]
            hf = next((r for r in results if r.name.startswith(f"transformers generate ({dtype}")), None)
            if hf is not None and agreement(ours, hf):
                body.append(f"- {dtype}: {agreement(ours, hf)}")
        body.append("- TTFT for kvserve counts from `generate()` (all requests arrive at once), so it "
                    "includes queueing behind the token budget; TPOT = (last token - first token) / "
                    "(tokens - 1) per request. Model load (s) is engine construction, not counted in wall. "
                    "Others' CPU: cores other processes kept busy during that engine's timed run "
                    "(/proc/stat minus this process); above ~0.2 the machine was shared and that row is slowed.")
        body += [f"- {n}" for n in args.note]
        if profile is not None:
            total, parts, wall = profile
            rows = [[label, f"{parts[key]:.1f}", f"{parts[key] / total:.0%}"] for label, key in PROFILE_ROWS]
            kv_rows = [r for r in results if r.name.startswith("kvserve")]
            body += ["", f"cProfile of the {kv_rows[-1].name} run (`--profile`; {total:.1f} s under the profiler "
                     f"vs {kv_rows[-1].wall_s:.1f} s without; the profiler inflates Python-heavy parts):", "",
                     md_table(["where", "seconds", "share"], rows)]
        sections["Throughput"] = "\n".join(body)
        print("\n" + sections["Throughput"])
    if layouts:
        mib = 2 ** 20
        p, c = layouts
        body = header + [
            "", f"Same KV budget for both layouts: kv_cache_memory={args.layout_kv_memory}, "
            f"max_model_len={args.layout_max_model_len}, {p.bytes_per_token} KV bytes per token ({args.dtypes[0]}). "
            "The contiguous layout reserves max_model_len tokens per sequence up front; the paged one "
            f"takes {p.block_size}-token blocks as sequences grow. The engine was stepped by hand "
            "(`engine.step()`), reading `num_blocks_used` after every step.", "",
            layout_table(layouts, args.layout_max_model_len), "",
            f"- Sequences at once: paged holds {p.peak_running / max(c.peak_running, 1):.1f}x as many running "
            f"requests as contiguous ({p.peak_running} vs {c.peak_running}); output throughput "
            f"{p.output_tps / c.output_tps:.2f}x.",
            f"- Reserved vs used for this workload: contiguous reserves {c.reserved_bytes_workload / mib:.0f} MiB "
            f"for {c.used_bytes_workload / mib:.0f} MiB of tokens "
            f"({1 - c.used_bytes_workload / c.reserved_bytes_workload:.0%} wasted); paged reserves "
            f"{p.reserved_bytes_workload / mib:.0f} MiB "
            f"({1 - p.used_bytes_workload / p.reserved_bytes_workload:.1%} wasted, only the last partial block).",
            "- 'At peak: held / in-use' is the moment the most blocks were held: blocks held x block size x "
            "bytes per token, against the tokens whose K/V were actually in the cache then."]
        if not args.no_write and args.plot:
            plot_layouts(layouts, Path(args.plot))
            body += ["", f"![paged vs contiguous]({Path(args.plot).relative_to(HERE.parent).as_posix()})"]
        sections["Paged vs contiguous"] = "\n".join(body)
        print("\n" + sections["Paged vs contiguous"])
    if not args.no_write:
        for title, body in sections.items():
            replace_section(title, body)
        print(f"\nwrote {', '.join(sections)} to BENCHMARKS.md")


if __name__ == "__main__":
    main()
