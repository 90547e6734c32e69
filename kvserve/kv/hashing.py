"""Chained block hashes: a block's hash names its tokens and every token before it.

The chain starts at a namespace root (model, dtype, block size, KV format, hash algorithm). A
request's `cache_salt` is mixed into its first block only, so the whole chain of a salted prompt
differs from the unsalted one (and from any other salt's): requests with different salts never
share a block, on the device or in a tier.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

BlockHash = bytes
HASH_ALGOS = ("sha256", "xxhash")
DEFAULT_HASH_ALGO = "sha256"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def digest_fn(algo: str = DEFAULT_HASH_ALGO) -> Callable[[bytes], bytes]:
    """The function that hashes bytes for `algo` (sha256: 32 bytes; xxhash: xxh3-128, 16 bytes)."""
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError:
            raise ValueError("prefix_caching_hash_algo='xxhash' needs the xxhash package: "
                             "pip install xxhash (or use the default, sha256)") from None
        return xxhash.xxh3_128_digest
    raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")


def namespace_hash(*parts: object, algo: str = DEFAULT_HASH_ALGO) -> BlockHash:
    """Root hash for one cache namespace (model, dtype, block size, KV spec...); names `algo` too."""
    text = "|".join(str(p) for p in (*parts, f"hash={algo}"))
    return digest_fn(algo)(text.encode())


def salt_bytes(salt: str | None) -> bytes:
    """What a cache salt adds to the first block's hash input (nothing without a salt)."""
    if not salt:
        return b""
    raw = salt.encode("utf-8", "surrogatepass")
    return b"salt" + struct.pack("<Q", len(raw)) + raw


def hash_block(parent: BlockHash, token_ids: tuple[int, ...] | list[int], algo: str = DEFAULT_HASH_ALGO,
               extra: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash (or the namespace root)."""
    return _chain(digest_fn(algo), parent, token_ids, extra)


def _chain(digest: Callable[[bytes], bytes], parent: BlockHash, token_ids, extra: bytes = b"") -> BlockHash:
    return digest(parent + struct.pack(f"<{len(token_ids)}q", *token_ids) + extra)


def hash_full_blocks(
    root: BlockHash, token_ids: list[int], block_size: int, start_block: int = 0,
    parent: BlockHash | None = None, algo: str = DEFAULT_HASH_ALGO, salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on (`salt` goes into block 0)."""
    digest = digest_fn(algo)
    hashes = []
    prev = parent if parent is not None else root
    for b in range(start_block, len(token_ids) // block_size):
        extra = salt_bytes(salt) if b == 0 else b""
        prev = _chain(digest, prev, token_ids[b * block_size:(b + 1) * block_size], extra)
        hashes.append(prev)
    return hashes


def split_key(key: BlockHash, algo: str = DEFAULT_HASH_ALGO) -> tuple[BlockHash, int]:
    """(chained hash, KV group) of a pool key: the hash, + 2 bytes of group past group 0."""
    n = len(digest_fn(algo)(b""))
    return key[:n], int.from_bytes(key[n:], "little")
