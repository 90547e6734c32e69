"""TritonBackend: attention over the paged cache with the Triton kernels of this package.

Decode rows: one `paged_decode` launch per layer over the rows' block tables; prefill chunks: one
`paged_extend` launch over all of them (every format of source.py, KIVI included). Writes: the
store kernel for native, int8 and fp8 entries; the storage's own write for KIVI (residual rows). A rotation is applied around the kernels as the
torch backends do. Chosen by `select_backend` (kvserve/attention/backends.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backends import GatheredBackend, StepBatch
from kvserve.attention.metadata import AttentionMetadata, SlotMetadata
from kvserve.attention.triton.decode import paged_decode
from kvserve.attention.triton.extend import paged_extend
from kvserve.attention.triton.source import KVSource, source_of
from kvserve.attention.triton.store import STORABLE, store
from kvserve.kv.spec import KVGroup
from kvserve.kv.storage import KVStorage


def layer_sources(storage: KVStorage, layer: int) -> list[KVSource] | None:
    """The KVSource of each entry of `layer`, or None when some entry is split by heads (per-head
    precision) or kept in a format no kernel reads."""
    j = storage.layer_slot[layer]
    out = []
    for e, entry in enumerate(storage.parts[j]):
        if len(entry) != 1 or entry[0][1] is not None:
            return None
        part, _, tensors = entry[0]
        src = source_of(part.codec, tensors, storage.residual[j][e])
        if src is None:
            return None
        out.append(src)
    return out


def supports(storage: KVStorage, group: KVGroup) -> bool:
    """True when the kernels read every layer of the group."""
    return all(layer_sources(storage, layer) is not None for layer in group.layers)


@dataclass
class TritonMetadata(SlotMetadata):
    """The block tables and lengths the kernels take (int32): no gathered slot lists or masks."""

    decode: tuple | None = None    # (tables [B, W], start [B], end [B]) of the decode rows
    extend: tuple | None = None    # (tables, q_start, q_len, ctx_len, longest) of the prefill chunks


class TritonBackend(GatheredBackend):
    """Paged decode, extend and write kernels over the group's storage (see the module docstring)."""

    # ---- metadata ----------------------------------------------------------------------------
    def prepare(self, step: StepBatch, g: int, table: torch.Tensor) -> TritonMetadata:
        """Slots of the new tokens, and the block tables and lengths the kernels take (they walk the
        tables and mask by position)."""
        md = TritonMetadata(slot_mapping=self._slot_mapping(step, g, table))
        d = step.num_decodes
        counts = step.counts
        if d:
            self._prepare_decodes(md, step, g, table)
        if len(counts) > d:
            dev = table.device
            news = torch.tensor(counts[d:], device=dev)
            i32 = torch.int32
            md.extend = (table[d:].to(i32), (torch.cumsum(news, 0) - news).to(i32), news.to(i32),
                         (step.cache_len_t[g][d:len(counts)] + news).to(i32), max(counts[d:]))
        return md

    def _prepare_decodes(self, md: TritonMetadata, step: StepBatch, g: int, table: torch.Tensor) -> None:
        start, end = self._decode_range(step, g)
        width = max(1, -(-(max(step.cache_lens[g][:step.num_decodes]) + 1) // self.block_size))
        i32 = torch.int32  # once per step, not per layer
        md.decode = (table[:step.num_decodes, :width].to(i32).contiguous(), start.to(i32), end.to(i32))

    # ---- attention ---------------------------------------------------------------------------
    def forward(self, layer: int, q, new: list[torch.Tensor], meta: AttentionMetadata, md: TritonMetadata,
                scale: float, window: int | None, math) -> torch.Tensor:
        rot = self.storage.rotation(layer) if math.rotates else None
        if rot is not None:
            q, new = q @ rot, [x @ rot for x in new]
        srcs = layer_sources(self.storage, layer)
        self._write(layer, md.slot_mapping, new, srcs)
        k, v = srcs if len(srcs) == 2 else (srcs[0], srcs[0].value_view(math.rank))
        out = q.new_empty(math.out_shape(q, new))
        d = meta.num_decodes
        if d:
            table, start, end = md.decode
            out[:d] = paged_decode(q[:d], k, v, table, start, end, scale,
                                   row_of_block=self.storage.row_of_block, sealed=self.storage.sealed)
        if meta.prefills:
            table, q_start, q_len, ctx_len, longest = md.extend
            out[d:] = paged_extend(q[d:], k, v, table, q_start, q_len, ctx_len, scale, self.window,
                                   max_len=longest, fresh=[x[d:] for x in new],
                                   row_of_block=self.storage.row_of_block, sealed=self.storage.sealed)
        return out if rot is None else out @ rot.mT

    def _write(self, layer: int, slots: torch.Tensor, new: list[torch.Tensor], srcs: list[KVSource]) -> None:
        if all(s.fmt in STORABLE for s in srcs):
            for x, s in zip(new, srcs):
                store(x, slots, s)
        else:
            self.storage.write(layer, slots, *new)
