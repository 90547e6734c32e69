"""Chained block hashes: a block's hash names its tokens and every token before it."""

from __future__ import annotations

import hashlib
import struct

BlockHash = bytes


def namespace_hash(*parts: object) -> BlockHash:
    """Root hash for one cache namespace (model, dtype, block size, KV spec...)."""
    text = "|".join(str(p) for p in parts)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def hash_block(parent: BlockHash, token_ids: tuple[int, ...] | list[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (or the namespace root)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_full_blocks(
    root: BlockHash, token_ids: list[int], block_size: int, start_block: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on."""
    hashes = []
    prev = parent if parent is not None else root
    for b in range(start_block, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[b * block_size:(b + 1) * block_size])
        hashes.append(prev)
    return hashes
