"""KV bytes per token and bytes held per sequence for each attention family, measured from the
paged pool (blocks actually held by a growing sequence) next to the analytic formula."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, md_table, replace_section  # noqa: E402

from kvserve.kv.hashing import namespace_hash  # noqa: E402
from kvserve.kv.manager import KVCacheManager  # noqa: E402
from kvserve.kv.sizing import KVLayout, get_kv_format, kv_bytes_per_sequence  # noqa: E402
from kvserve.kv.spec import FullSpec, KVSpec, MLASpec, SlidingWindowSpec, group_layers  # noqa: E402

LAYERS, HEAD_DIM, DTYPE_BYTES, BLOCK = 32, 128, 2, 16


def families() -> dict[str, tuple[list[KVSpec], KVLayout]]:
    """Same 32-layer, head_dim-128 shape; only the attention/cache layout changes."""
    def full(h):
        return FullSpec(h, HEAD_DIM)
    gemma = [SlidingWindowSpec(8, HEAD_DIM, window=1024) if (i + 1) % 6 else full(8) for i in range(LAYERS)]
    n_local = sum(s.kind == "sliding" for s in gemma)
    return {
        "MHA (Llama-2 style, 32 KV heads)": ([full(32)] * LAYERS, KVLayout(LAYERS, 32, HEAD_DIM)),
        "GQA (Llama-3/Qwen style, 8 KV heads)": ([full(8)] * LAYERS, KVLayout(LAYERS, 8, HEAD_DIM)),
        "MQA (1 KV head)": ([full(1)] * LAYERS, KVLayout(LAYERS, 1, HEAD_DIM)),
        "Mistral sliding 4096, 8 KV heads": ([SlidingWindowSpec(8, HEAD_DIM, window=4096)] * LAYERS,
                                             KVLayout(LAYERS, 8, HEAD_DIM, sliding_window=4096, num_local_layers=LAYERS)),
        "Gemma-3 hybrid 5:1, window 1024": (gemma, KVLayout(LAYERS, 8, HEAD_DIM, sliding_window=1024,
                                                              num_local_layers=n_local)),
        "Gemma-3 shape, all layers full": ([full(8)] * LAYERS, KVLayout(LAYERS, 8, HEAD_DIM)),
        "MLA (DeepSeek-V3 dims: 512 + 64)": ([MLASpec(latent_dim=512, rope_dim=64)] * LAYERS,
                                             KVLayout(LAYERS, kv_lora_rank=512, rope_dim=64)),
    }


def held_bytes(specs: list[KVSpec], context: int) -> int:
    """Grow one sequence to `context` tokens through the pool; bytes of the blocks it holds."""
    groups = group_layers(specs)
    page = len(groups[0].layers) * groups[0].spec.bytes_per_token(DTYPE_BYTES) * BLOCK
    kv = KVCacheManager(len(groups) * (context // BLOCK + 2) + 1, BLOCK, namespace_hash("bench"),
                        enable_prefix_caching=False, groups=groups)
    done = 0
    while done < context:
        step = min(256, context - done)
        assert kv.allocate_slots("seq", done, step)
        done += step
    kv.allocate_slots("seq", done, 0)  # lets sliding groups drop what the next query cannot see
    return (kv.pool.num_usable - kv.pool.num_free) * page


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    fmt = get_kv_format("bf16")
    rows = []
    for name, (specs, layout) in tqdm(families().items(), desc="families"):
        per_token = sum(s.bytes_per_token(DTYPE_BYTES) for s in specs)
        cells = []
        for c in contexts:
            cells.append(f"{held_bytes(specs, c) / 2**20:.1f} / {kv_bytes_per_sequence(layout, fmt, c) / 2**20:.1f}")
        rows.append([name, f"{per_token:,}"] + cells)
    head = ["family (32 layers, head_dim 128, bf16)", "B/token"] + [f"MiB held @ {c // 1024}K (pool / formula)" for c in contexts]
    table = md_table(head, rows)
    print(table)
    if not args.no_write:
        note = ("Pool: bytes of the blocks one sequence holds after growing to the context in 256-token "
                f"steps (block size {BLOCK}); sliding groups have freed the blocks outside their window. "
                "Formula: `kvserve.kv.sizing.kv_bytes_per_sequence`. The pool rounds up to whole blocks "
                "and a sliding group keeps the block that straddles its window edge.")
        replace_section("KV layouts by model family", f"`{command_line()}`\n\n{note}\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
