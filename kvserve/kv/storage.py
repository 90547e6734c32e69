"""Physical KV tensors, sized once. Layer j of every KV group shares storage slot j:
block ids never overlap across groups, so one tensor per slot serves them all."""

from __future__ import annotations

import torch

from kvserve.kv.spec import KVGroup


class KVStorage:
    """Per-slot cache tensors [num_blocks, block_size, *entry_shape] (K and V, or one MLA latent)."""

    def __init__(self, groups: list[KVGroup], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shapes = groups[0].spec.entry_shapes
        num_slots = len(groups[0].layers)
        self.slots = [[torch.zeros((num_blocks, block_size, *s), dtype=dtype, device=device) for s in shapes]
                      for _ in range(num_slots)]
        self.layer_slot = {layer: j for g in groups for j, layer in enumerate(g.layers)}
        self.layer_group = {layer: gi for gi, g in enumerate(groups) for layer in g.layers}

    @property
    def nbytes(self) -> int:
        """Bytes the cache tensors hold."""
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot)

    def _flat(self, layer: int) -> list[torch.Tensor]:
        return [t.view(-1, *t.shape[2:]) for t in self.slots[self.layer_slot[layer]]]

    def write(self, layer: int, slot_mapping: torch.Tensor, *entries: torch.Tensor) -> None:
        """Store new per-token entries [num_tokens, ...] (K, V or the latent) at their slots."""
        for flat, x in zip(self._flat(layer), entries):
            flat.index_copy_(0, slot_mapping, x.to(flat.dtype))

    def read(self, layer: int, slot_idx: torch.Tensor) -> list[torch.Tensor]:
        """Gather entries at slot indices of any shape -> [*slot_idx.shape, ...] each."""
        return [flat[slot_idx] for flat in self._flat(layer)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every slot (copy-on-write)."""
        if not pairs:
            return
        device = self.slots[0][0].device
        src = torch.tensor([p[0] for p in pairs], device=device)
        dst = torch.tensor([p[1] for p in pairs], device=device)
        for slot in self.slots:
            for t in slot:
                t[dst] = t[src]
