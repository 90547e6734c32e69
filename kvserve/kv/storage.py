"""Physical KV tensors: one K and one V tensor per layer, sized once, written by slot."""

from __future__ import annotations

import torch


class KVStorage:
    """Per-layer K/V caches shaped [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes the cache tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat views [num_slots, num_kv_heads, head_dim] of one layer's K and V."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V rows [num_tokens, num_kv_heads, head_dim] at their slots."""
        k_slots, v_slots = self.slots(layer)
        k_slots.index_copy_(0, slot_mapping, k.to(k_slots.dtype))
        v_slots.index_copy_(0, slot_mapping, v.to(v_slots.dtype))

    def read(self, layer: int, slot_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V at slot indices of any shape -> [*slot_idx.shape, heads, head_dim]."""
        k_slots, v_slots = self.slots(layer)
        return k_slots[slot_idx], v_slots[slot_idx]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.k[0].device)
        dst = torch.tensor([p[1] for p in pairs], device=self.k[0].device)
        for cache in self.k + self.v:
            cache[dst] = cache[src]
