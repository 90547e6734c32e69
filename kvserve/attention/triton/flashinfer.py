"""FlashInfer's paged decode and prefill for native 16-bit caches, where flashinfer is installed
(`pip install 'kvserve[cuda]'`). Untested here: no GPU has run it yet (docs/KERNELS.md). It is
chosen only by attention_backend='auto' on CUDA, for full-attention groups whose K/V are plain
bfloat16/float16 blocks [num_blocks, block_size, Hkv, D] (FlashInfer's NHD layout, read in place).

Each step plans once per group (on its first layer) and every layer runs the planned kernels.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from kvserve.attention.backends import GatheredBackend, StepBatch
from kvserve.attention.metadata import AttentionMetadata, SlotMetadata
from kvserve.kv.spec import KVGroup
from kvserve.kv.storage import KVStorage

WORKSPACE_BYTES = 128 << 20


def flashinfer_backend(storage: KVStorage, group: KVGroup):
    """A FlashInferBackend for the group, or None (not installed, not CUDA, not native 16-bit)."""
    if importlib.util.find_spec("flashinfer") is None or not group.spec.per_head or group.spec.keeps_window:
        return None
    kv = storage.native_kv(group.layers[0])
    ok = all(storage.native_kv(layer) is not None and storage.rotation(layer) is None for layer in group.layers)
    if (not ok or kv[0].device.type != "cuda" or kv[0].dtype not in (torch.bfloat16, torch.float16)
            or kv[0].dtype != storage.dtype):
        return None
    return FlashInferBackend(storage, group)


def _paged(table: torch.Tensor, lens: torch.Tensor, bs: int):
    """CSR page lists of the rows: (indptr [R+1], indices, last page length [R]), int32."""
    pages = (lens + bs - 1) // bs
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=table.device)
    indptr[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(table.shape[1], device=table.device)
    indices = table[cols[None, :] < pages[:, None]].to(torch.int32)
    last = (lens - (pages - 1) * bs).to(torch.int32)
    return indptr, indices, last


@dataclass
class FlashInferMetadata(SlotMetadata):
    """The paged layout FlashInfer's wrappers plan with, once per step (on the first layer)."""

    fi_decode: tuple | None = None     # (indptr, indices, last page lengths) of the decode rows
    fi_prefill: tuple | None = None    # (q indptr, indptr, indices, last page lengths) of the prefill chunks
    fi_planned: bool = False


class FlashInferBackend(GatheredBackend):
    """Decode and prefill through FlashInfer's batch wrappers over the pool, in place."""

    def __init__(self, storage: KVStorage, group: KVGroup):
        super().__init__(storage, group)
        import flashinfer

        dev = storage.slots[0][0].device
        space = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.decoder = flashinfer.BatchDecodeWithPagedKVCacheWrapper(space, "NHD")
        self.prefiller = flashinfer.BatchPrefillWithPagedKVCacheWrapper(space, "NHD")

    def prepare(self, step: StepBatch, g: int, table: torch.Tensor) -> FlashInferMetadata:
        md = FlashInferMetadata(slot_mapping=self._slot_mapping(step, g, table))
        d, counts = step.num_decodes, step.counts
        lens = step.cache_len_t[g][:len(counts)] + torch.tensor(counts, device=table.device)
        md.fi_decode = _paged(table[:d], lens[:d], self.block_size) if d else None
        if len(counts) > d:
            news = torch.tensor([0, *counts[d:]], device=table.device)
            md.fi_prefill = (torch.cumsum(news, 0).to(torch.int32), *_paged(table[d:], lens[d:], self.block_size))
        return md

    def _plan(self, md: FlashInferMetadata, q: torch.Tensor, kv: torch.Tensor, scale: float) -> None:
        hq, d = q.shape[1], q.shape[2]
        hkv, bs = kv.shape[2], kv.shape[1]
        common = dict(window_left=(self.window - 1) if self.window else -1, sm_scale=scale)
        if md.fi_decode is not None:
            self.decoder.plan(*md.fi_decode, hq, hkv, d, bs, q_data_type=q.dtype, kv_data_type=kv.dtype, **common)
        if md.fi_prefill is not None:
            self.prefiller.plan(*md.fi_prefill, hq, hkv, d, bs, causal=True, q_data_type=q.dtype,
                                kv_data_type=kv.dtype, **common)
        md.fi_planned = True

    def forward(self, layer: int, q, new: list[torch.Tensor], meta: AttentionMetadata, md: FlashInferMetadata,
                scale: float, window: int | None, math) -> torch.Tensor:
        self.storage.write(layer, md.slot_mapping, *new)
        k_pool, v_pool = self.storage.native_kv(layer)
        if not md.fi_planned:
            self._plan(md, q, k_pool, scale)
        out = q.new_empty(math.out_shape(q, new))
        d = meta.num_decodes
        if d:
            out[:d] = self.decoder.run(q[:d].contiguous(), (k_pool, v_pool))
        if md.fi_prefill is not None:
            out[d:] = self.prefiller.run(q[d:].contiguous(), (k_pool, v_pool))
        return out
