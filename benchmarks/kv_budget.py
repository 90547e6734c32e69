"""Tokens a KV budget holds in each format, from the engine's real pool (no generation).

One engine per format loads the bundled SmolLM2-135M-Instruct; for each budget the engine builds
its pool again (`LLMEngine._build_cache`, the set-up the constructor runs) and the table reports
its blocks, KIVI's residual rows and the bytes the pool's tensors hold.

    python benchmarks/kv_budget.py              # prints the table and writes BENCHMARKS.md
    python benchmarks/kv_budget.py --no-write
"""

from __future__ import annotations

import argparse
import gc
import time

from common import command_line, md_table, replace_section

from kvserve import LLM
from kvserve.config import parse_bytes

FORMATS = ["bfloat16", "int8", "kivi4", "kivi2"]
BUDGETS = ["64MiB", "256MiB", "1GiB", "4GiB"]
SETTINGS = dict(dtype="bfloat16", block_size=32, max_model_len=2048)


def measure(fmt: str, budgets: list[str]) -> dict[str, dict]:
    """Pool facts per budget for one format."""
    llm = LLM(kv_cache_dtype=fmt, kv_cache_memory=budgets[0], **SETTINGS)
    e = llm.engine
    out = {}
    for budget in budgets:
        e.config.kv_cache_memory = parse_bytes(budget)
        e.storage = e.kv = e.runner = None  # free the old pool before the next one is allocated
        gc.collect()
        e._build_cache(e.planner.loaded)
        m = llm.get_metrics()
        out[budget] = dict(blocks=m["num_blocks_total"], rows=e.kv_residual_rows, bytes=m["kv_cache_bytes"],
                           residual_bytes=m["kv_cache_residual_bytes"], page=e.page_bytes_per_token)
    return out


def table(results: dict[str, dict[str, dict]], budgets: list[str]) -> str:
    header = ["format", "B/token (page)"] + [f"{b}: tokens (x bf16)" for b in budgets] + ["residual rows"]
    rows = []
    for fmt, per in results.items():
        cells = [fmt, f"{per[budgets[0]]['page']:,}"]
        for b in budgets:
            tokens = per[b]["blocks"] * SETTINGS["block_size"]
            base = results["bfloat16"][b]["blocks"] * SETTINGS["block_size"]
            cells.append(f"{tokens:,} ({tokens / base:.2f}x)")
        cells.append(" / ".join(str(per[b]["rows"]) for b in budgets) if per[budgets[0]]["rows"] else "—")
        rows.append(cells)
    return md_table(header, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = {fmt: measure(fmt, BUDGETS) for fmt in FORMATS}
    for fmt, per in results.items():
        for b, r in per.items():
            assert r["bytes"] <= parse_bytes(b), (fmt, b, r)
    body = (f"Tokens one KV budget holds, SmolLM2-135M-Instruct (30 layers x 3 KV heads x 64), model dtype "
            f"bfloat16, block_size 32, max_model_len 2048, max_num_seqs 256: the engine's own pool for each "
            f"budget, residual rows (KIVI's full-precision still-filling blocks, at most 5% of the budget, "
            f"kvserve/kv/formats.py) included. Every pool's tensors fit its budget.\n\n"
            f"{table(results, BUDGETS)}\n\n"
            f"- `{command_line()}`, {time.perf_counter() - t0:.0f} s")
    print(body)
    if not args.no_write:
        replace_section("KV tokens per budget", body)


if __name__ == "__main__":
    main()
