"""Physical KV tensors, sized once. Layer j of every KV group shares storage slot j:
block ids never overlap across groups, so one tensor per slot serves them all.

Each slot keeps the tensors its format asks for (kv/formats.py): for native formats one tensor per
entry (K, V or the MLA latent); quantized formats add scales and zero points. Every one of them is
[num_blocks, ...], indexed by block id on dim 0. KIVI formats also keep the still-filling blocks
in full-precision residual rows (see formats.py for why and how).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.kv.formats import KVCacheFormat, NativeCodec, _flat, build_kv_format, zeroed
from kvserve.kv.spec import KVGroup

log = logging.getLogger("kvserve")


# (model dtype, pool dtype) pairs whose pools attention reads in place, widening as it loads
WIDENED = {(torch.float32, torch.bfloat16)}


@dataclass
class _ResidualPlan:
    """How one write splits for KIVI entries (see KVStorage._residual_plan)."""

    whole_blocks: torch.Tensor   # [nw] blocks written whole in this call
    whole_tokens: torch.Tensor   # [nw, block_size] their rows in the batch, in offset order
    rest: torch.Tensor           # [nr] rows of the other tokens
    rest_slots: torch.Tensor     # [nr] their flat slots in the residual rows
    filled: torch.Tensor         # blocks whose last slot comes among the rest: quantize from the row


class KVStorage:
    """Per-slot cache tensors [num_blocks, ...] for K and V (or one MLA latent), in `kv_format`."""

    def __init__(self, groups: list[KVGroup], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 kv_format: KVCacheFormat | None = None, residual_rows: int = 0,
                 block_is_free: Callable[[int], bool] | None = None):
        """`block_is_free`: block id -> True when no request holds it (the pool's `is_free`); the
        residual rows of such blocks are given back when rows run short."""
        self.num_blocks = num_blocks
        self.block_is_free = block_is_free
        self.block_size = block_size
        self.dtype = dtype
        self.format = (kv_format or build_kv_format(groups, dtype, block_size)).to(device)
        if self.format.block_size != block_size:
            raise ValueError(f"format planned for block_size {self.format.block_size}, pool has {block_size}")
        self.layer_slot = {layer: j for g in groups for j, layer in enumerate(g.layers)}
        self.layer_group = {layer: gi for gi, g in enumerate(groups) for layer in g.layers}
        self._has_residual = self.format.has_residual   # read per layer per step: computed once
        rows = residual_rows if self._has_residual else 0
        fresh = iter(zeroed(self._tensor_specs(num_blocks, rows), device))
        # slots[j]: the tensors of every part of every entry, in order; parts[j][e]: (part, tensors)
        self.slots: list[list[torch.Tensor]] = []
        self.parts: list[list[list[tuple]]] = []
        for sf in self.format.slots:
            tensors, entries = [], []
            for e in sf.entries:
                entry = []
                for p in e.parts:
                    ts = [next(fresh) for _ in p.codec.tensor_specs(block_size)]
                    heads = None if p.heads is None else torch.tensor(p.heads, device=device)
                    entry.append((p, heads, ts))
                    tensors += ts
                entries.append(entry)
            self.slots.append(tensors)
            self.parts.append(entries)
        self._init_residual(rows, device, fresh)
        self._native: list[bool | None] = [None] * len(self.slots)

    def _tensor_specs(self, num_blocks: int, rows: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of every pool tensor: each part's block tensors slot by slot, then the
        residual rows of every residual entry (the order __init__ takes them in)."""
        blocks = [((num_blocks, *shape), dtype) for sf in self.format.slots for e in sf.entries for p in e.parts
                  for shape, dtype in p.codec.tensor_specs(self.block_size)]
        residual = [((rows, self.block_size, *e.shape), self.dtype)
                    for sf in self.format.slots for e in sf.entries if e.residual]
        return blocks + residual

    # ---- residual rows (KIVI: still-filling blocks in full precision) -------------------------
    def _init_residual(self, rows: int, device, fresh) -> None:
        self.residual = [[next(fresh) if e.residual else None for e in sf.entries] for sf in self.format.slots]
        self.row_of_block = torch.full((self.num_blocks,), -1, dtype=torch.long, device=device)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.num_rows = rows
        # Blocks quantized during the current layer keep their row until the next write, so that
        # queries in such a block still see its keys exact (own block) while others see them packed.
        self.sealed = torch.zeros(self.num_blocks, dtype=torch.bool, device=device)
        self._to_release: list[int] = []

    @property
    def has_residual(self) -> bool:
        """True when still-filling blocks are kept in residual rows."""
        return self._has_residual

    @property
    def residual_nbytes(self) -> int:
        """Bytes of the residual rows."""
        return sum(t.numel() * t.element_size() for slot in self.residual for t in slot if t is not None)

    def _rows_for(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Residual row of each written token's block, giving rows to blocks that start now."""
        rows = self.row_of_block[blocks]
        missing = rows < 0
        if bool(missing.any()):
            new = blocks[missing].unique()
            starts = set(blocks[offsets == 0].tolist())
            for b in new.tolist():
                if b not in starts:
                    raise RuntimeError(
                        f"KV block {b} is still filling but has no residual row: a still-filling block of a "
                        "KIVI cache was moved without export_residual/import_residual")
                self.row_of_block[b] = self._take_row()
            rows = self.row_of_block[blocks]
        return rows

    def _take_row(self) -> int:
        if not self.free_rows and self._to_release:  # called between steps (import_residual): reads are done
            self._release(self._to_release)
            self._to_release = []
        if not self.free_rows:
            self._collect_rows()
        if not self.free_rows:
            self._grow_rows()
        return self.free_rows.pop()

    def _collect_rows(self) -> None:
        """Give back the rows of blocks no request holds any more (freed while still filling)."""
        if self.block_is_free is None:
            return
        for b in (self.row_of_block >= 0).nonzero().flatten().tolist():
            if self.block_is_free(b):
                self._release([b])

    def _grow_rows(self) -> None:
        """Last resort, never reached while KVCacheManager.residual_rows bounds the filling blocks."""
        extra = max(1, self.num_rows)
        log.warning("KV residual rows exhausted (%d still-filling blocks): adding %d rows beyond the budget",
                    self.num_rows, extra)
        for slot in self.residual:
            for e, t in enumerate(slot):
                if t is not None:
                    slot[e] = torch.cat([t, torch.zeros((extra, *t.shape[1:]), dtype=t.dtype, device=t.device)])
        self.free_rows = list(range(self.num_rows + extra - 1, self.num_rows - 1, -1)) + self.free_rows
        self.num_rows += extra

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            row = int(self.row_of_block[b])
            self.sealed[b] = False
            if row >= 0:
                self.row_of_block[b] = -1
                self.free_rows.append(row)

    def _seal(self, j: int, blocks: torch.Tensor) -> None:
        """Quantize the residual rows of `blocks` (now full) into slot j's packed tensors."""
        rows = self.row_of_block[blocks]
        for e, entry in enumerate(self.parts[j]):
            res = self.residual[j][e]
            if res is None:
                continue
            x = res[rows]                                        # [nb, block_size, *shape]
            for part, heads, ts in entry:
                if not part.codec.residual:
                    continue
                xp = x if heads is None else x[:, :, heads]
                for t, enc in zip(ts, part.codec.encode_blocks(xp)):
                    t.index_copy_(0, blocks, enc)
        self.sealed[blocks] = True

    def export_residual(self, block_ids: list[int]):
        """Residual rows of `block_ids` as (has_row [n] bool, per slot per entry [n, block_size, ...]
        or None), or None when the format keeps no residual. Pair with import_residual."""
        if not self.has_residual:
            return None
        rows = self.row_of_block[torch.tensor(block_ids, dtype=torch.long, device=self.row_of_block.device)]
        data = [[None if t is None else t[rows.clamp(min=0)].clone() for t in slot] for slot in self.residual]
        return rows >= 0, data

    def import_residual(self, block_ids: list[int], state) -> None:
        """Put back what export_residual returned, for the blocks now at `block_ids`."""
        if state is None:
            return
        has, data = state
        moved = set(block_ids)  # a release still pending for an earlier owner must not hit the new rows
        self._to_release = [b for b in self._to_release if b not in moved]
        for i, b in enumerate(block_ids):
            self._release([b])
            if not bool(has[i]):
                continue
            row = self._take_row()
            self.row_of_block[b] = row
            for slot, saved in zip(self.residual, data):
                for t, s in zip(slot, saved):
                    if t is not None:
                        t[row] = s[i].to(t.device)

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes the cache tensors hold: data, scales, zero points and residual rows."""
        blocks = sum(t.numel() * t.element_size() for slot in self.slots for t in slot)
        return blocks + self.residual_nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of the per-block tensors only (num_blocks * block_size * page bytes per token)."""
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot)

    @property
    def device(self) -> torch.device:
        """Where the pool tensors live."""
        return self.slots[0][0].device

    def move_tokens(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the raw per-token rows at flat slots `src` to `dst` in every tensor of the layer's
        slot (data and scales as stored: lossless for any per-token format, not for KIVI)."""
        for t in self.slots[self.layer_slot[layer]]:
            flat = _flat(t)
            flat[dst] = flat[src]

    def _flat(self, layer: int) -> list[torch.Tensor]:
        """Flat views [num_blocks * block_size, ...] of the layer's per-token tensors."""
        return [_flat(t) for t in self.slots[self.layer_slot[layer]]]

    def native_kv(self, layer: int) -> list[torch.Tensor] | None:
        """[K pool, V pool], each [num_blocks, block_size, kv_heads, head_dim], when the layer keeps K
        and V as plain floats (attention can then read blocks in place): in the model dtype, or in
        bfloat16 under a float32 model (WIDENED; readers cast or widen as they load). Else None."""
        j = self.layer_slot[layer]
        if self._native[j] is None:
            entries = self.parts[j]
            self._native[j] = len(entries) == 2 and all(
                len(e) == 1 and e[0][1] is None and isinstance(e[0][0].codec, NativeCodec)
                and self._in_place(e[0][0].codec.store) and not e[0][0].codec.residual for e in entries)
        return [entry[0][2][0] for entry in self.parts[j]] if self._native[j] else None

    def _in_place(self, store: torch.dtype) -> bool:
        return store == self.dtype or (self.dtype, store) in WIDENED

    def rotation(self, layer: int) -> torch.Tensor | None:
        """The orthonormal matrix applied to q, k, v of this layer (None: no rotation)."""
        return self.format.slots[self.layer_slot[layer]].rotation

    # ---- write and read ------------------------------------------------------------------------
    def write(self, layer: int, slot_mapping: torch.Tensor, *entries: torch.Tensor) -> None:
        """Store new per-token entries [num_tokens, ...] (K, V or the latent) at their slots.

        Per-token formats quantize now. KIVI entries of a block written whole in this call are
        quantized now; the others go to the block's residual row, and the block is quantized from
        it when its last slot is written.
        """
        j = self.layer_slot[layer]
        if self._to_release:  # the previous layer's reads are done: rows of its full blocks go back
            self._release(self._to_release)
            self._to_release = []
        plan = self._residual_plan(slot_mapping) if self.has_residual else None
        for e, (entry, x) in enumerate(zip(self.parts[j], entries)):
            for part, heads, ts in entry:
                xp = x if heads is None else x[:, heads]
                if not part.codec.residual:
                    for t, enc in zip(ts, part.codec.encode(xp)):
                        _flat(t).index_copy_(0, slot_mapping, enc)
                elif plan.whole_blocks.numel():
                    for t, enc in zip(ts, part.codec.encode_blocks(xp[plan.whole_tokens])):
                        t.index_copy_(0, plan.whole_blocks, enc)
            res = self.residual[j][e] if plan is not None else None
            if res is not None and plan.rest.numel():
                _flat(res).index_copy_(0, plan.rest_slots, x[plan.rest].to(res.dtype))
        if plan is not None and plan.filled.numel():
            self._seal(j, plan.filled)
            if j == len(self.slots) - 1:  # the group's last layer: its rows go back after its reads
                self._to_release += plan.filled.tolist()

    def _residual_plan(self, slot_mapping: torch.Tensor) -> _ResidualPlan:
        """Split a write into blocks written whole (quantized at once) and the rest (residual rows).

        A request's new tokens are contiguous in the batch with consecutive positions, so a block
        whose offset 0 and offset block_size - 1 both come in this write is written whole, in order.
        """
        bs = self.block_size
        n = slot_mapping.numel()
        offsets = slot_mapping % bs
        starts = (offsets == 0).nonzero().flatten()
        ends = starts + bs - 1
        ok = ends < n
        starts, ends = starts[ok], ends[ok]
        whole = starts[slot_mapping[ends] == slot_mapping[starts] + bs - 1]
        whole_tokens = whole[:, None] + torch.arange(bs, device=slot_mapping.device)     # [nw, bs]
        whole_blocks = slot_mapping[whole] // bs
        if whole_blocks.numel() and bool((self.row_of_block[whole_blocks] >= 0).any()):
            self._release(whole_blocks.tolist())  # rows left by earlier, freed owners of these blocks
        keep = torch.ones(n, dtype=torch.bool, device=slot_mapping.device)
        keep[whole_tokens.flatten()] = False
        rest = keep.nonzero().flatten()
        blocks, offs = slot_mapping[rest] // bs, offsets[rest]
        rows = self._rows_for(blocks, offs) if rest.numel() else blocks
        return _ResidualPlan(whole_blocks, whole_tokens, rest, rows * bs + offs, blocks[offs == bs - 1])

    def read(self, layer: int, slot_idx: torch.Tensor, own_blocks: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Gather entries at slot indices of any shape -> [*slot_idx.shape, ...] each (model dtype).

        KIVI: still-filling blocks read from their residual rows; a block quantized in this layer
        reads packed, except in rows of slot_idx whose `own_blocks` entry ([*slot_idx.shape[:-1]])
        names it: a query sees its own block's earlier tokens exact (formats.py).
        """
        j = self.layer_slot[layer]
        return [self._read_entry(j, e, slot_idx, own_blocks) for e in range(len(self.parts[j]))]

    def has_own_block_view(self, layer: int) -> bool:
        """True when queries must see their own block exact (KIVI entries in this layer's slot)."""
        return any(r is not None for r in self.residual[self.layer_slot[layer]])

    def exact_view(self, layer: int, slot_idx: torch.Tensor, fresh: list[torch.Tensor] | None = None):
        """Entries at 1-D slot_idx as a query in their own block sees them: KIVI parts exact (from
        `fresh` [len(slot_idx), ...] per entry, else from the residual rows), other parts as stored."""
        j = self.layer_slot[layer]
        stored = [self._read_entry(j, e, slot_idx, None) for e in range(len(self.parts[j]))]
        out = []
        for e, (entry, x) in enumerate(zip(self.parts[j], stored)):
            res = self.residual[j][e]
            if res is None:
                out.append(x)
                continue
            if fresh is not None:
                exact = fresh[e].to(self.dtype)
            else:
                rows = self.row_of_block[slot_idx // self.block_size]
                exact = _flat(res)[rows.clamp(min=0) * self.block_size + slot_idx % self.block_size]
            for part, heads, _ in entry:
                if part.codec.residual:
                    if heads is None:
                        x = exact
                    else:
                        x = x.clone()
                        x[..., heads, :] = exact[..., heads, :]
            out.append(x)
        return out

    def _read_entry(self, j: int, e: int, idx: torch.Tensor, own: torch.Tensor | None = None) -> torch.Tensor:
        entry = self.parts[j][e]
        shape = self.format.slots[j].entries[e].shape
        if len(entry) == 1 and entry[0][1] is None:
            part, _, ts = entry[0]
            out = part.codec.decode(ts, idx, self.block_size)
        else:
            out = torch.empty((*idx.shape, *shape), dtype=self.dtype, device=idx.device)
            for part, heads, ts in entry:
                out[..., heads, :] = part.codec.decode(ts, idx, self.block_size)
        res = self.residual[j][e]
        if res is None:
            return out
        blocks = idx // self.block_size
        rows = self.row_of_block[blocks]
        live = rows >= 0
        if not bool(live.any()):
            return out
        sealed = self.sealed[blocks]
        if own is not None:
            sealed &= blocks != own.unsqueeze(-1)
        live &= ~sealed
        fresh = _flat(res)[rows.clamp(min=0) * self.block_size + idx % self.block_size]
        live = live.view(*live.shape, *[1] * len(shape))
        for part, heads, _ in entry:
            if not part.codec.residual:
                continue
            if heads is None:
                out = torch.where(live, fresh, out)
            else:
                out[..., heads, :] = torch.where(live, fresh[..., heads, :], out[..., heads, :])
        return out

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
        self.import_residual([p[1] for p in pairs], self.export_residual([p[0] for p in pairs]))

    # ---- whole blocks out and in (swap, KV tiers): generic over every tensor of every slot -----
    def block_tensors(self) -> list[torch.Tensor]:
        """Every per-block tensor [num_blocks, ...], slot by slot, in a fixed order."""
        return [t for slot in self.slots for t in slot]

    def block_layout(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape of one block) of each tensor of `block_tensors()`, in that order."""
        return [(t.dtype, tuple(t.shape[1:])) for t in self.block_tensors()]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all slots and tensors (scales and zero points included)."""
        return sum(t[0].numel() * t.element_size() for t in self.block_tensors())

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Gather whole blocks: one [len(block_ids), ...] tensor per `block_tensors()` entry.

        Still-filling blocks of a residual format (KIVI) also need export_residual."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.slots[0][0].device)
        return [_raw(t).index_select(0, idx).view(t.dtype) for t in self.block_tensors()]

    def write_blocks(self, block_ids: list[int], tensors: list[torch.Tensor]) -> None:
        """Overwrite whole blocks with tensors shaped as `read_blocks` returns them (any device).

        The blocks then hold exactly that data: any residual row they had is released (a
        still-filling block gets its row back through import_residual afterwards)."""
        targets = self.block_tensors()
        if len(tensors) != len(targets):
            raise ValueError(f"write_blocks got {len(tensors)} tensors, the storage has {len(targets)}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=targets[0].device)
        for t, x in zip(targets, tensors):
            _raw(t).index_copy_(0, idx, _raw(x.to(device=t.device, dtype=t.dtype)))
        if self.has_residual:
            self._release(block_ids)
            written = set(block_ids)  # a release still pending for an earlier owner must not hit the new data
            self._to_release = [b for b in getattr(self, "_to_release", []) if b not in written]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """One-byte tensors (fp8, int8, packed bits) as uint8: index ops exist for every such dtype."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t
