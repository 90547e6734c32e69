"""The persistent batch: block tables of the requests that hold KV blocks, one preallocated row
each, changed by appends and removals as requests come and go instead of rebuilt every step."""

from __future__ import annotations

import torch


class BlockTables:
    """One KV group's block tables [rows, max_blocks] (long), with a Python copy of each row to
    tell an append from an edit (copy-on-write, eviction) without reading the tensor."""

    def __init__(self, rows: int, max_blocks: int):
        self.table = torch.zeros((rows, max_blocks), dtype=torch.long)
        self.synced: list[list[int]] = [[] for _ in range(rows)]

    def sync(self, row: int, ids: list[int]) -> None:
        """Make row `row` equal `ids`: write only the new tail when the old row is a prefix of it."""
        have = self.synced[row]
        n = len(have)
        if len(ids) < n or ids[:n] != have:
            n = 0
            have.clear()
        if len(ids) > n:
            if len(ids) > self.table.shape[1]:
                self._grow(len(ids))
            self.table[row, n:len(ids)] = torch.tensor(ids[n:], dtype=torch.long)
            have.extend(ids[n:])

    def clear(self, row: int) -> None:
        self.synced[row] = []

    def _grow(self, blocks: int) -> None:
        old = self.table
        self.table = torch.zeros((old.shape[0], max(blocks, 2 * old.shape[1])), dtype=torch.long)
        self.table[:, :old.shape[1]] = old

    def add_rows(self, extra: int) -> None:
        old = self.table
        self.table = torch.zeros((old.shape[0] + extra, old.shape[1]), dtype=torch.long)
        self.table[:old.shape[0]] = old
        self.synced += [[] for _ in range(extra)]


class InputBatch:
    """Rows of the persistent block tables, one per request holding blocks, for every KV group."""

    def __init__(self, num_groups: int, rows: int, max_blocks: int, device: torch.device):
        self.groups = [BlockTables(rows, max_blocks) for _ in range(num_groups)]
        self.device = device
        self.row_of: dict[str, int] = {}
        self.free = list(range(rows - 1, -1, -1))

    def tables(self, req_ids: list[str], block_ids) -> list[torch.Tensor]:
        """Each group's block tables of the requests, in their order, on the device ([R, W]: W the
        longest of them), after syncing the rows with `block_ids(req_id, group)`: one copy per group."""
        out = []
        for rid in req_ids:
            row = self.row_of.get(rid)
            if row is None:
                row = self._add(rid)
            for g, tables in enumerate(self.groups):
                tables.sync(row, block_ids(rid, g))
            out.append(row)
        rows = torch.tensor(out, dtype=torch.long)
        return [t.table[rows, :max(1, max(len(t.synced[r]) for r in out))].to(self.device) for t in self.groups]

    def release(self, keep) -> None:
        """Give back the rows of requests for which `keep(req_id)` is False (they hold no blocks)."""
        for rid in [r for r in self.row_of if not keep(r)]:
            row = self.row_of.pop(rid)
            for tables in self.groups:
                tables.clear(row)
            self.free.append(row)

    def _add(self, rid: str) -> int:
        if not self.free:
            extra = max(1, len(self.row_of))
            start = len(self.row_of)
            for tables in self.groups:
                tables.add_rows(extra)
            self.free = list(range(start + extra - 1, start - 1, -1))
        row = self.free.pop()
        self.row_of[rid] = row
        return row
