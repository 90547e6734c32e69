"""GPU throughput: kvserve (kernel attention, per KV format) against transformers' `generate` with a
static cache and torch.compile, on a Llama-shaped model of ~1B parameters with random weights
(built from transformers' LlamaConfig: no download), on the same GPU.

    python benchmarks/gpu_throughput.py                    # 1, 16, 64, 256 sequences; writes BENCHMARKS.md
    python benchmarks/gpu_throughput.py --seqs 1,16 --formats auto,int8 --no-write

Per run: output tokens per second over the whole generate call (prefill included), the decode
step time (a max_tokens=1 run's time taken off), and the decode bandwidth it implies: weights plus
the KV bytes every step reads at the mean context, over the step time, against the GPU's peak
(--peak-tbs, 4.3 TB/s for an H200). First, the decode kernel alone per format at 32K context
(--kernel-ctx): the bandwidth its KV reads reach. A long-context row per format (--long) shows what a smaller
cache buys when KV reads dominate. Runs stop starting once --budget-s has passed (marked skipped).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, git_state, md_table, replace_section  # noqa: E402

DEVICE = "cuda"
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384,
             tie_word_embeddings=True, rms_norm_eps=1e-5)


def build_model(folder: Path) -> Path:
    """Save a random-weight Llama of SHAPE in bfloat16 (safetensors) to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    model = None
    torch.cuda.empty_cache()
    return folder


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed + n)
    return torch.randint(3, SHAPE["vocab_size"], (n, length), generator=gen).tolist()


def weight_bytes() -> int:
    h, i, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    kv = h * SHAPE["num_key_value_heads"] // SHAPE["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    return 2 * (layers * per_layer + SHAPE["vocab_size"] * h)


class Row:
    def __init__(self, engine: str, fmt: str, n: int, ctx: int):
        self.engine, self.fmt, self.n, self.ctx = engine, fmt, n, ctx
        self.tps = self.step_ms = self.tbs = None
        self.note = ""


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def finish(row: Row, total_s: float, prefill_s: float, out_len: int, kv_bytes_per_token: float) -> Row:
    """Fill tok/s, decode step time and bandwidth from a full and a prefill-only run."""
    steps = out_len - 1
    row.tps = row.n * out_len / total_s
    step = max(total_s - prefill_s, 1e-9) / steps
    kv = row.n * (row.ctx + out_len / 2) * kv_bytes_per_token
    row.step_ms, row.tbs = step * 1e3, (weight_bytes() + kv) / step / 1e12
    return row


def run_kvserve(path: Path, fmt: str, sizes: list[int], ctx: int, out_len: int, deadline: float) -> list[Row]:
    from kvserve import LLM, SamplingParams

    rows = [Row("kvserve", fmt, n, ctx) for n in sizes]
    if time.perf_counter() > deadline:
        return [_skip(r) for r in rows]
    llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype=fmt, max_num_seqs=max(sizes), enable_prefix_caching=False,
              max_model_len=ctx + out_len + 32, max_num_batched_tokens=max(8192, ctx + 64),
              gpu_memory_utilization=0.85)
    backends = ",".join(llm.engine.runner.backend_names())
    kv_bytes = llm.engine.storage.format.bytes_per_token
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts(2, 64, seed=99), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up: kernels compile
    for row in rows:
        if time.perf_counter() > deadline:
            _skip(row)
            continue
        ps = prompts(row.n, ctx)
        pre = timed(lambda: llm.generate(ps, one, use_tqdm=False))
        total = timed(lambda: llm.generate(ps, params, use_tqdm=False))
        finish(row, total, pre, out_len, kv_bytes)
        row.note = backends
    llm = None
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def run_transformers(path: Path, sizes: list[int], ctx: int, out_len: int, deadline: float) -> list[Row]:
    """generate() with a static cache and the forward compiled (one compile per batch size)."""
    from transformers import AutoModelForCausalLM

    rows = [Row("transformers", "bfloat16 static", n, ctx) for n in sizes]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    kv_bytes = 2 * SHAPE["num_hidden_layers"] * SHAPE["hidden_size"] * SHAPE["num_key_value_heads"] \
        // SHAPE["num_attention_heads"] * 2

    def gen(ids, n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           cache_implementation="static", pad_token_id=0)

    for row in rows:
        if time.perf_counter() > deadline:
            _skip(row)
            continue
        ids = torch.tensor(prompts(row.n, ctx), device="cuda")
        gen(ids, 4)  # compile for this batch size
        pre = timed(lambda: gen(ids, 1))
        total = timed(lambda: gen(ids, out_len))
        finish(row, total, pre, out_len, kv_bytes)
    model = None
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def kernel_bandwidth(fmt: str, rows: int, ctx: int, heads: tuple[int, int] = (32, 8), dim: int = 128,
                     bs: int = 16) -> tuple[float, float]:
    """(ms, TB/s) of one paged_decode launch: `rows` sequences of `ctx` tokens in a pool of format
    `fmt` (one layer, blocks in random order), bytes = the KV the launch reads."""
    import triton

    from kvserve.attention.triton.backend import layer_sources
    from kvserve.attention.triton.decode import paged_decode
    from kvserve.kv.formats import build_kv_format
    from kvserve.kv.spec import FullSpec, group_layers
    from kvserve.kv.storage import KVStorage

    bs = 32 if fmt.startswith("kivi") else bs
    groups = group_layers([FullSpec(heads[1], dim)])
    per = ctx // bs
    nb = rows * per
    st = KVStorage(groups, nb, bs, torch.bfloat16, DEVICE, build_kv_format(groups, torch.bfloat16, bs, fmt),
                   residual_rows=2)
    table = torch.randperm(nb, device=DEVICE).view(rows, per)
    step = 1 << 18
    for a in range(0, rows * ctx, step):  # whole blocks, row-major: KIVI quantizes each at once
        slots = (table.flatten()[a // bs:(a + step) // bs, None] * bs + torch.arange(bs, device=DEVICE)).flatten()
        kv = [torch.randn(slots.numel(), heads[1], dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
        st.write(0, slots, *kv)
    k, v = layer_sources(st, 0)
    q = torch.randn(rows, heads[0], dim, device=DEVICE, dtype=torch.bfloat16)
    ends = torch.full((rows,), ctx, device=DEVICE)
    starts = torch.zeros_like(ends)
    bench = triton.testing.do_bench if DEVICE == "cuda" else lambda f: timed_cpu(f) * 1e3
    ms = bench(lambda: paged_decode(q, k, v, table, starts, ends, dim ** -0.5,
                                                      row_of_block=st.row_of_block, sealed=st.sealed))
    nbytes = rows * ctx * st.format.slot_bytes_per_token(0)
    st = None
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return ms, nbytes / ms / 1e9


def timed_cpu(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernel_table(formats: list[str], sizes: list[int], ctx: int, peak: float, deadline: float) -> str:
    body = []
    for fmt in formats:
        for n in sizes:
            if time.perf_counter() > deadline:
                body.append([fmt, str(n), str(ctx), "—", "—", "—", "skipped (time budget)"])
                continue
            try:
                ms, tbs = kernel_bandwidth(fmt, n, ctx)
                body.append([fmt, str(n), str(ctx), f"{ms:.3f}", f"{tbs:.2f}", f"{100 * tbs / peak:.0f}%", ""])
            except Exception as e:  # a failing format must not hide the others
                body.append([fmt, str(n), str(ctx), "—", "—", "—", f"error: {type(e).__name__}: {e}"[:120]])
            print(body[-1], flush=True)
    return md_table(["KV format", "seqs", "context", "ms per layer", "KV TB/s", "of peak", "notes"], body)


def _skip(row: Row) -> Row:
    row.note = "skipped (time budget)"
    return row


def table(rows: list[Row], peak: float) -> str:
    def f(x, d=1):
        return "—" if x is None else f"{x:,.{d}f}"
    body = [[r.engine, r.fmt, str(r.n), str(r.ctx), f(r.tps), f(r.step_ms, 2), f(r.tbs, 2),
             "—" if r.tbs is None else f"{100 * r.tbs / peak:.0f}%", r.note] for r in rows]
    return md_table(["engine", "KV format", "seqs", "prompt", "output tok/s", "decode step ms", "decode TB/s",
                     "of peak", "notes"], body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="1,16,64,256")
    ap.add_argument("--formats", default="auto,int8,fp8_e4m3,kivi4")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--long", type=int, default=8192, help="prompt length of the long-context rows (0: none)")
    ap.add_argument("--long-seqs", type=int, default=16)
    ap.add_argument("--peak-tbs", type=float, default=4.3, help="the GPU's memory bandwidth, TB/s")
    ap.add_argument("--budget-s", type=float, default=270, help="start no run after this many seconds")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--kernel-ctx", type=int, default=32768, help="context of the decode kernel rows (0: none)")
    ap.add_argument("--kernel-seqs", default="1,16,64")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_throughput.py needs a CUDA device")
    deadline = time.perf_counter() + args.budget_s
    sizes = [int(x) for x in args.seqs.split(",")]
    formats = args.formats.split(",")
    rows: list[Row] = []
    kernels = ""
    if args.kernel_ctx:
        kernels = kernel_table(formats, [int(x) for x in args.kernel_seqs.split(",")], args.kernel_ctx,
                               args.peak_tbs, deadline)
        print(kernels, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "llama-1b-random")
        for i, fmt in enumerate(formats):  # the first format, then transformers, then the others
            rows += run_kvserve(path, fmt, sizes, args.prompt_len, args.output_len, deadline)
            if i == 0 and not args.no_hf:
                rows += run_transformers(path, sizes, args.prompt_len, args.output_len, deadline)
            print(table(rows, args.peak_tbs), flush=True)
        if args.long:
            for fmt in formats:
                rows += run_kvserve(path, fmt, [args.long_seqs], args.long, args.output_len, deadline)
    text = table(rows, args.peak_tbs)
    print(text)
    if not args.no_write:
        facts = (f"Device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, kvserve {git_state()}. "
                 f"Model: Llama shape {SHAPE['num_hidden_layers']} layers x {SHAPE['hidden_size']} hidden, "
                 f"{SHAPE['num_attention_heads']}/{SHAPE['num_key_value_heads']} heads, random bfloat16 weights "
                 f"({weight_bytes() / 1e9:.2f} GB). Decode TB/s = (weights + KV read at the mean context) / "
                 f"decode step; peak {args.peak_tbs} TB/s. Command: `{command_line()}`.")
        kernel_text = ("Decode kernel alone (`paged_decode`, one layer, 32 query / 8 KV heads of 128, blocks "
                       "in random order; TB/s = KV bytes read / time):\n\n" + kernels + "\n\n") if kernels else ""
        replace_section("GPU throughput", facts + "\n\n" + kernel_text + "End to end:\n\n" + text)


if __name__ == "__main__":
    main()
