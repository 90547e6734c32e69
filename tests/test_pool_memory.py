"""A CPU KV pool holds memory for the blocks written, not for its whole budget, and reads zeros elsewhere."""

import gc

import pytest
import torch

from kvserve.engine.builder import keep_freed_memory
from kvserve.engine.memory import rss_bytes
from kvserve.kv.formats import build_kv_format
from kvserve.kv.spec import FullSpec, group_layers
from kvserve.kv.storage import KVStorage

MIB = 1 << 20
SMOL = [FullSpec(3, 64)] * 30   # SmolLM2-135M's layers
BLOCK = 16


def smol_pool(num_blocks: int, name: str = "auto", dtype=torch.bfloat16, rows: int = 0) -> KVStorage:
    groups = group_layers(SMOL)
    fmt = build_kv_format(groups, dtype, BLOCK if name not in ("kivi4", "kivi2") else 32, name)
    return KVStorage(groups, num_blocks, fmt.block_size, dtype, kv_format=fmt, residual_rows=rows)


def write_every_layer(st: KVStorage, blocks: range) -> None:
    """Write K and V of every token of `blocks` in every layer, as prefill does."""
    slots = torch.arange(blocks.start * st.block_size, blocks.stop * st.block_size)
    k = torch.randn(len(slots), 3, 64).to(st.dtype)
    for layer in range(len(SMOL)):
        st.write(layer, slots, k, -k)


def test_pool_memory_follows_the_blocks_written():
    num_blocks = 1536                                  # about 540 MiB in bfloat16
    before = rss_bytes()
    st = smol_pool(num_blocks)
    fresh = rss_bytes() - before
    assert st.nbytes > 500 * MIB
    assert fresh < st.nbytes / 20                      # building the pool commits (almost) nothing
    written = range(100, 500)                          # 400 blocks, about 140 MiB
    write_every_layer(st, written)
    grown = rss_bytes() - before - fresh
    expected = len(written) * st.bytes_per_block
    assert 0.9 * expected < grown < 1.2 * expected + 16 * MIB
    held = rss_bytes()
    del st
    gc.collect()
    # dropping the pool gives its pages back (the write's temporaries may stay in malloc's kept heap)
    assert held - rss_bytes() > 0.9 * expected


@pytest.mark.parametrize("name", ["auto", "int8", "kivi4"])
def test_unwritten_blocks_read_zero_after_the_heap_held_other_data(name):
    keep_freed_memory()                                # freed heap is kept for reuse, as the engine runs
    dirty = [torch.full((8 * MIB,), 7, dtype=torch.uint8) for _ in range(4)]
    del dirty
    st = smol_pool(24, name, dtype=torch.float32, rows=2)   # every tensor far below malloc's mmap threshold
    assert all(bool((t == 0).all()) for t in st.block_tensors())
    assert all(bool((t == 0).all()) for slot in st.residual for t in slot if t is not None)
    written = range(4, 8)
    write_every_layer(st, written)
    for b in range(24):
        blocks = st.read_blocks([b])
        assert all(bool((t == 0).all()) for t in blocks) == (b not in written), b
