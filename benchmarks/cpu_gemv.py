"""The CPU GEMV for GGUF block codes (`kvserve_cpu::q8g_gemv`) against the other few-row paths.

    python benchmarks/cpu_gemv.py                       # default shapes and rows, torch's threads
    python benchmarks/cpu_gemv.py --threads 1 --shapes 1536x576 --rows 1,16 --rounds 5 --no-write

For each [N, K] int8 weight and row count: q8g_gemv with groups of 32 (Q8_0's layout), 32 with
mins (Q5_1 / Q5_K), 16 (Q6_K), the per-channel int8_gemv on the same codes, torch's
`_weight_int8pack_mm`, and a float32 `linear` on the dequantized weight (what a layer not kept
in its codes runs). Each call is timed alone, right after an untimed one (a weight that fits the
caches is in them; the LM heads do not fit), interleaved with the others, and the fastest of
`--rounds` calls is kept (a shared machine's other work only ever adds time); GB/s counts the
N*K bytes of codes only, so scales and mins cost what they cost.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import command_line, machine_facts, md_table, replace_section  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kvserve.model import cpu  # noqa: E402

DEFAULT_SHAPES = "1536x576,49152x576,262144x640"   # a SmolLM2 projection, its LM head, Gemma-3's head
PATHS = ["q8g g32", "q8g g32+mins", "q8g g16", "int8_gemv", "int8pack_mm", "f32 linear"]


def calls(n: int, k: int, m: int) -> dict:
    """Each path's call on one seeded [N, K] weight and m rows."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s32, s16 = torch.rand(n, k // 32, generator=g), torch.rand(n, k // 16, generator=g)
    mins = torch.randn(k // 32, n, generator=g)   # [K/32, N], the op's layout
    scale = torch.rand(n, generator=g).bfloat16()
    dense = (codes.view(n, -1, 32).float() * s32[..., None]).view(n, k)
    x = torch.randn(m, k, generator=g)
    xb = x.bfloat16()
    ops = torch.ops.kvserve_cpu
    t32, t16 = ops.q8g_tile(codes, s32, 32), ops.q8g_tile(codes, s16, 16)   # the layers' tiles
    return {"q8g g32": lambda: ops.q8g_gemv(x, *t32, None, 32, n),
            "q8g g32+mins": lambda: ops.q8g_gemv(x, *t32, mins, 32, n),
            "q8g g16": lambda: ops.q8g_gemv(x, *t16, None, 16, n),
            "int8_gemv": lambda: ops.int8_gemv(x, codes, scale),
            "int8pack_mm": lambda: torch.ops.aten._weight_int8pack_mm(xb, codes, scale),
            "f32 linear": lambda: torch.nn.functional.linear(x, dense)}


def fastest(fns: dict, rounds: int) -> dict[str, float]:
    """The fastest single call of each function over `rounds` interleaved rounds, in seconds; each
    timed call follows an untimed one, so a weight that fits the caches is in them."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxK,... weight shapes")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not cpu.available():
        print("the C++ GEMVs did not build here (see the warning above)")
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    table = []
    for (n, k), m in tqdm([(s, m) for s in shapes for m in rows], desc="shapes x rows"):
        best = fastest(calls(n, k, m), args.rounds)
        ratio = best["int8_gemv"] / best["q8g g32"]
        table.append([f"{n} x {k}", str(m)] + [f"{n * k / best[p] / 1e9:.1f} ({best[p] * 1e6:.0f} us)" for p in PATHS]
                     + [f"{ratio:.2f}"])
    header = ["weight", "rows"] + [f"{p} GB/s" for p in PATHS] + ["q8g g32 / int8_gemv"]
    text = "\n".join([
        f"Command: `{command_line()}`", "",
        f"GB/s of int8 codes read (N*K bytes over the fastest of {args.rounds} single calls), "
        f"{torch.get_num_threads()} thread(s); float32 x.", "",
        md_table(header, table), "",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in machine_facts().items())])
    print(text)
    if not args.no_write:
        replace_section("CPU GEMV on GGUF block codes", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
