"""Where cached KV blocks go when they leave the device: a prefix store on CPU, disk and Redis.

A tier entry is one whole block — every tensor of every storage slot, whatever the KV format —
keyed by the block's chained hash (with its KV group) under a namespace that names everything
that makes two caches incompatible (weights, dtype, KV format, block size, layer specs, tensor
layout). Entries are self-describing and sealed — a CRC-32 over header and payload, or with a
tier key an HMAC-SHA256 (`Seal`, chosen once when the tiers are built) — and checked against the
expected key, tokens, dtypes, shapes and length: a corrupt, truncated or unsigned entry is never
served.

`TierBridge` connects the tiers to the device pool and its KVStorage: it is built with both and
handed to the KVCacheManager as its lower tier and one of its pool listeners
(kv/block_pool.py `BlockPoolListener`). Each tier has a write policy: a `write_through` tier gets
every block the pool stores under a hash (the block is full and final), copied on the step thread
and stored by a background writer (kv/tier_writer.py); a `write_back` tier gets the cached blocks
the pool is about to overwrite (`evicted`, while their memory still holds the data), and also each
block a retention pin takes, through the same background writers (`pinned`). A prefix lookup that
misses on the device asks the bridge which tiers hold the next blocks (`locate`) and loads them
into fresh device blocks (`load`). Blocks a request failed on (`removed`) are deleted from every
tier and from what the writers have queued. `TierEvents`, built before the tiers, turns what each tier
gains and loses into KV events.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvserve.extras import require
from kvserve.kv.block_pool import BlockPoolListener, Evicted
from kvserve.kv.hashing import DEFAULT_HASH_ALGO, BlockHash, split_key
from kvserve.kv.tier_writer import (
    DEFAULT_QUEUE_BYTES,
    FLUSH_TIMEOUT,
    WRITE_POLICIES,
    TierWriter,
    WriteBatch,
    close_writers,
)

log = logging.getLogger("kvserve")

TIER_FORMAT_VERSION = 1
TIER_KINDS = ("cpu", "disk", "redis")


class CorruptEntry(ValueError):
    """A tier entry that fails its checksum or does not describe the expected block."""


class RefusedEntry(CorruptEntry):
    """An entry whose seal this engine does not accept (unsigned, signed under another key, or signed
    while this engine has no key); `keep`: leave it in the tier (it may be valid for other engines)."""

    def __init__(self, message: str, keep: bool = False):
        super().__init__(message)
        self.keep = keep


# ---- seals: what makes an entry trusted ----------------------------------------------------------
class Seal:
    """Appends a tag to an entry's bytes and checks it on the way back; `magic` starts every entry."""

    magic = b""
    tag_size = 0
    foreign = b""      # the other seal's magic
    foreign_help = ""  # what a foreign entry means to this engine
    keep_foreign = False

    def tag(self, body: bytes) -> bytes:
        """The tag of `body`."""
        raise NotImplementedError

    def seal(self, body: bytes) -> bytes:
        """`body` (starting with `magic`) with its tag appended."""
        return body + self.tag(body)

    def open(self, data: bytes) -> memoryview:
        """The body of a sealed entry (tag checked); CorruptEntry or RefusedEntry otherwise."""
        magic = data[:4]
        if magic == self.foreign:
            raise RefusedEntry(self.foreign_help, keep=self.keep_foreign)
        if len(data) < 8 + self.tag_size or magic != self.magic:
            raise CorruptEntry("bad magic or truncated header")
        body = memoryview(data)[:-self.tag_size]
        self.check(body, data[-self.tag_size:])
        return body

    def check(self, body: memoryview, tag: bytes) -> None:
        """Raise CorruptEntry (RefusedEntry) unless `tag` is the tag of `body`."""
        raise NotImplementedError


class CrcSeal(Seal):
    """A CRC-32 of the entry: catches torn, truncated and flipped bytes, not a writer's intent."""

    magic, tag_size, foreign = b"KVT1", 4, b"KVH1"
    foreign_help = ("the entry is signed with a tier key and this engine has none: give it the key the "
                    "writers use (--kv-tier-key-file)")
    keep_foreign = True   # valid for the engines that hold the key

    def tag(self, body) -> bytes:
        return struct.pack("<I", zlib.crc32(body))

    def check(self, body, tag) -> None:
        if struct.pack("<I", zlib.crc32(body)) != tag:
            raise CorruptEntry("checksum mismatch (corrupt or truncated)")


class HmacSeal(Seal):
    """HMAC-SHA256 under a shared key over the namespace and the entry: only a holder of the key can
    write an entry this engine serves (what that does not protect: docs/TIERS.md)."""

    magic, tag_size, foreign = b"KVH1", 32, b"KVT1"
    foreign_help = "the entry is not signed (written by an engine without the tier key)"

    def __init__(self, key: bytes, namespace: str):
        self._key = key
        self._namespace = namespace.encode()

    def __repr__(self) -> str:
        return "HmacSeal(<key>)"

    def tag(self, body) -> bytes:
        mac = hmac.new(self._key, self._namespace + b"\0", hashlib.sha256)
        mac.update(body)
        return mac.digest()

    def check(self, body, tag) -> None:
        if not hmac.compare_digest(self.tag(body), tag):
            raise RefusedEntry("the entry's MAC does not match: signed under another tier key, or altered")


CRC = CrcSeal()


def tier_seal(key: bytes | None, namespace: str) -> Seal:
    """The seal of a namespace's entries: HMAC-SHA256 under `key`, or a CRC-32 without one."""
    return CRC if key is None else HmacSeal(key, namespace)


# ---- entries ---------------------------------------------------------------------------------
Layout = list[tuple[torch.dtype, tuple[int, ...]]]  # (dtype, shape of one block) per block tensor


def _layout_json(layout: Layout) -> list:
    return [[str(dtype).removeprefix("torch."), list(shape)] for dtype, shape in layout]


def pack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[n, ...] tensors (one per block tensor) -> [n, bytes_per_block] uint8 rows on the CPU."""
    n = tensors[0].shape[0]
    parts = [t.detach().to("cpu").contiguous().view(n, -1).view(torch.uint8) for t in tensors]
    return torch.cat(parts, dim=1)


def unpack_rows(rows: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """[n, bytes_per_block] uint8 rows -> one [n, *shape] tensor per layout entry."""
    n, out, off = rows.shape[0], [], 0
    for dtype, shape in layout:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(rows[:, off:off + nbytes].contiguous().view(dtype).view(n, *shape))
        off += nbytes
    return out


def pack_entry(key: BlockHash, token_ids: tuple[int, ...], layout: Layout, row: torch.Tensor,
               seal: Seal = CRC) -> bytes:
    """One block's entry: magic | header length | JSON header | payload | the seal's tag of all before."""
    header = json.dumps({"v": TIER_FORMAT_VERSION, "key": key.hex(), "tokens": list(token_ids),
                         "layout": _layout_json(layout), "nbytes": row.numel()}).encode()
    return seal.seal(seal.magic + struct.pack("<I", len(header)) + header + row.numpy().tobytes())


def unpack_entry(data: bytes, key: BlockHash, token_ids: tuple[int, ...], layout: Layout,
                 seal: Seal = CRC) -> torch.Tensor:
    """The payload row [bytes_per_block] of a verified entry; raises CorruptEntry (RefusedEntry) otherwise."""
    body = seal.open(data)
    (hlen,) = struct.unpack("<I", body[4:8])
    try:
        header = json.loads(bytes(body[8:8 + hlen]))
    except ValueError as e:
        raise CorruptEntry(f"unreadable header: {e}") from None
    expected = {"v": TIER_FORMAT_VERSION, "key": key.hex(), "tokens": list(token_ids),
                "layout": _layout_json(layout)}
    for name, want in expected.items():
        if header.get(name) != want:
            raise CorruptEntry(f"entry {name} does not match the block asked for")
    payload = bytearray(body[8 + hlen:])
    if len(payload) != header.get("nbytes"):
        raise CorruptEntry(f"payload has {len(payload)} bytes, header says {header.get('nbytes')}")
    return torch.frombuffer(payload, dtype=torch.uint8)


# ---- namespace -------------------------------------------------------------------------------
def fingerprint_path(path: str | os.PathLike, memo_dir: str | os.PathLike | None = None) -> str:
    """SHA-256 of a model's weight files (a file, or a directory's config + weight files).

    Content-based, so engines on different machines agree; memoized under `memo_dir` by
    (path, size, mtime) so a large model is hashed once.
    """
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".json"))
    stamp = "|".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    memo = Path(memo_dir) / hashlib.sha256(stamp.encode()).hexdigest()[:32] if memo_dir else None
    if memo is not None and memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(memo, digest.encode())
        except OSError as e:
            log.warning("could not memoize the weights fingerprint in %s: %s", memo_dir, e)
    return digest


def tier_namespace(*, weights: str, dtype: object, kv_format: str, block_size: int,
                   layer_specs: object, layout: Layout, hash_algo: str = "sha256") -> str:
    """Hex name of a cache namespace: entries are only ever shared inside one (block keys are
    chained hashes under `hash_algo`, a request's cache salt mixed into the first)."""
    text = "|".join(str(x) for x in (TIER_FORMAT_VERSION, weights, dtype, kv_format, block_size,
                                      layer_specs, _layout_json(layout), f"hash={hash_algo}"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# ---- tiers -----------------------------------------------------------------------------------
@dataclass
class TierStats:
    """Per-tier counters (entries and bytes)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    entries_written: int = 0
    evictions: int = 0     # entries dropped by the tier's own size bound
    corrupt: int = 0       # entries that failed verification (dropped, never served)
    refused: int = 0       # entries whose seal this engine does not accept (never served)
    poisoned: int = 0      # entries deleted because a request failed on their block
    errors: int = 0        # I/O and connection errors, corrupt entries included
    write_errors: int = 0  # entries that could not be stored (counted in errors too)
    write_drops: int = 0   # blocks a full write-through queue dropped
    flush_seconds: float = 0.0  # time spent waiting for pending write-through writes

    def add(self, **counts) -> None:
        """Add to counters (the step thread and the tier's writer thread both count)."""
        with _STATS_LOCK:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


_STATS_LOCK = threading.Lock()


@dataclass(frozen=True)
class TierSpec:
    """A parsed `cpu:SIZE`, `disk:/path:SIZE` or `redis://host:port/db` (each may end in `:POLICY`)."""

    kind: str
    capacity: int | None = None   # bytes (cpu, disk)
    location: str | None = None   # directory (disk) or URL (redis)
    write_policy: str | None = None  # write_through | write_back; None: the kind's default


class CpuTier:
    """Host-memory entries, bounded in bytes, least recently used dropped first."""

    name = "cpu"

    def __init__(self, capacity: int, write_policy: str = "write_back",
                 on_evict: Callable[[str], None] | None = None):
        self.capacity = capacity
        self.write_policy = write_policy
        self.on_evict = on_evict   # told each key the bound pushes out
        self.entries: OrderedDict[str, bytes] = OrderedDict()
        self.usage_bytes = 0
        self.stats = TierStats()
        self.lock = threading.RLock()  # a write-through writer thread stores while the step thread reads

    def contains(self, keys: list[str]) -> list[bool] | None:
        """Which keys are present (None when the tier cannot answer now)."""
        with self.lock:
            return [k in self.entries for k in keys]

    def get(self, key: str) -> bytes | None:
        """The entry's bytes (marking it recently used), or None."""
        with self.lock:
            data = self.entries.get(key)
            if data is not None:
                self.entries.move_to_end(key)
            return data

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """Store entries, dropping the least recently used ones beyond the bound."""
        with self.lock:
            for key, data in items:
                if len(data) > self.capacity:
                    continue
                self.delete(key)
                self.entries[key] = data
                self.usage_bytes += len(data)
                self.stats.add(bytes_written=len(data), entries_written=1)
                while self.usage_bytes > self.capacity:
                    old_key, old = self.entries.popitem(last=False)
                    self.usage_bytes -= len(old)
                    self.stats.add(evictions=1)
                    if self.on_evict is not None:
                        self.on_evict(old_key)

    def delete(self, key: str) -> None:
        """Drop one entry if present."""
        with self.lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.usage_bytes -= len(old)


class DiskTier:
    """One file per entry under a directory, bounded in bytes, LRU by file mtime (survives restarts).

    Writes go to a temporary file renamed into place, so a reader sees a whole entry or none; a
    file torn by a crash fails its checksum. Under write_through (the writer thread) each file is
    fsynced before the rename and its directory after, so an entry written survives a power loss;
    write_back stores run on the step thread and skip the fsyncs (an entry lost is a miss). Several
    processes may share the directory; each enforces the bound over the files it knows (those it
    wrote, read or found at start). The first failed write is logged, every one is counted
    (`write_errors`).
    """

    name = "disk"
    SUFFIX = ".kvb"

    def __init__(self, root: str | os.PathLike, capacity: int, write_policy: str = "write_through",
                 on_evict: Callable[[str], None] | None = None):
        self.on_evict = None       # the start-up scan drops entries no event ever named
        self.root = Path(root)
        self.capacity = capacity
        self.write_policy = write_policy
        self.durable = write_policy == "write_through"   # fsync entries and their directories
        self.stats = TierStats()
        self.lock = threading.Lock()  # guards the index: a writer thread stores while the step thread reads
        self.write_warned = False     # the first failed write is logged, the rest only counted
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"disk KV tier: cannot create the directory {self.root} ({e}); give a "
                             "directory this process can write") from None
        self.index: OrderedDict[Path, int] = OrderedDict()  # path -> size, least recent first
        self.usage_bytes = 0
        self._scan()
        self.on_evict = on_evict   # told each key the bound pushes out

    def _scan(self) -> None:
        found = []
        for p in self.root.rglob("*"):
            try:
                st = p.stat()
            except OSError:
                continue
            if p.name.endswith(".tmp") and time.time() - st.st_mtime > 600:
                p.unlink(missing_ok=True)  # left by a writer that died
            elif p.suffix == self.SUFFIX:
                found.append((st.st_mtime_ns, p, st.st_size))
        for _, p, size in sorted(found, key=lambda x: x[0]):
            self.index[p] = size
            self.usage_bytes += size
        self._enforce_bound()

    def _path(self, key: str) -> Path:
        ns, _, name = key.partition("/")
        return self.root / ns / name[:2] / (name + self.SUFFIX)

    def contains(self, keys: list[str]) -> list[bool] | None:
        """Which keys have a file (written by any process)."""
        return [self._path(k).is_file() for k in keys]

    def get(self, key: str) -> bytes | None:
        """The entry's bytes (touching its mtime, so LRU order survives restarts), or None."""
        p = self._path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            with self.lock:
                self._forget(p)
            return None
        except OSError as e:
            self.stats.add(errors=1)
            log.warning("disk tier: cannot read %s: %s", p, e)
            return None
        try:
            os.utime(p)
        except OSError:
            pass  # removed meanwhile by another process: the bytes read are still whole
        self._remember(p, len(data))
        return data

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """Write entries atomically (temp file + rename), then enforce the size bound."""
        folders = set()
        for key, data in items:
            if len(data) > self.capacity:
                continue
            p = self._path(key)
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                _atomic_write(p, data, sync=self.durable)
            except OSError as e:
                self._write_failed(p, e)
                continue
            folders.add(p.parent)
            self._remember(p, len(data))
            self.stats.add(bytes_written=len(data), entries_written=1)
        self._sync_folders(folders)
        with self.lock:
            self._enforce_bound()

    def _write_failed(self, p: Path, e: OSError) -> None:
        """Count a failed write; warn for the first one."""
        self.stats.add(errors=1, write_errors=1)
        if not self.write_warned:
            self.write_warned = True
            log.warning("disk tier: cannot write %s (%s); the blocks stay on the device only. Make %s "
                        "writable; further failed writes are only counted (write_errors)", p, e, self.root)

    def _sync_folders(self, folders: set[Path]) -> None:
        """Make the renames into `folders` durable (write_through only)."""
        for folder in folders if self.durable else ():
            try:
                _fsync_dir(folder)
            except OSError as e:
                self._write_failed(folder, e)

    def delete(self, key: str) -> None:
        """Remove one entry's file if present."""
        p = self._path(key)
        p.unlink(missing_ok=True)
        with self.lock:
            self._forget(p)

    def _remember(self, p: Path, size: int) -> None:
        """Mark a file as the most recently used, with its size."""
        with self.lock:
            self._forget(p)
            self.index[p] = size
            self.usage_bytes += size

    def _forget(self, p: Path) -> None:
        size = self.index.pop(p, None)
        if size is not None:
            self.usage_bytes -= size

    def _enforce_bound(self) -> None:
        while self.usage_bytes > self.capacity and self.index:
            p, size = self.index.popitem(last=False)
            self.usage_bytes -= size
            p.unlink(missing_ok=True)
            self.stats.add(evictions=1)
            if self.on_evict is not None:
                self.on_evict(f"{p.parent.parent.name}/{p.stem}")   # the key _path made this path of


class RedisTier:
    """Entries in a Redis server shared by engine processes (bound it with Redis's maxmemory + LRU).

    Every call has a timeout. When the server is down or slow the tier steps aside — lookups
    miss, writes are skipped — logs once, counts the errors, and tries again after a backoff
    (doubling up to `max_backoff` seconds) until a call succeeds. The client is shared by the step
    thread (lookups) and a write-through writer thread (stores); each call takes its own connection.
    """

    name = "redis"
    PREFIX = "kvserve:"
    PIPELINE_BYTES = 8 << 20

    def __init__(self, url: str, timeout: float = 1.0, max_backoff: float = 30.0,
                 write_policy: str = "write_through"):
        redis = require("redis", "redis", "the Redis KV tier")
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self.url = url
        self.write_policy = write_policy
        self.lock = threading.Lock()  # guards the up/down state both threads update
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._redis_error = redis.RedisError
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                           retry=Retry(NoBackoff(), 0))
        self.stats = TierStats()
        self.usage_bytes = None
        self.min_backoff, self.max_backoff = 0.5, max_backoff
        self.backoff = self.min_backoff
        self.down_until = 0.0
        self.down = False
        self.refusal_warned = False   # the first server-side refusal is logged, the rest only counted
        if self._call(self.client.ping) is not None:
            log.info("redis tier: connected to %s", url)

    def _call(self, fn: Callable, *args):
        """fn(*args), or None when the server is down (then back off) or the call fails."""
        if self.down and time.monotonic() < self.down_until:
            return None
        try:
            out = fn(*args)
        except self._errors as e:
            self.stats.add(errors=1)
            with self.lock:
                was_up, self.down = not self.down, True
                self.down_until = time.monotonic() + self.backoff
                self.backoff = min(self.backoff * 2, self.max_backoff)
            if was_up:
                log.warning("redis tier %s unavailable (%s): serving without it, retrying with backoff",
                            self.url, e)
            return None
        except self._redis_error as e:  # a server-side refusal (e.g. out of memory): count, go on
            self._refused(e)
            return None
        with self.lock:
            was_down, self.down, self.backoff = self.down, False, self.min_backoff
        if was_down:
            log.info("redis tier %s reachable again", self.url)
        return out

    def _refused(self, e: Exception) -> None:
        """Count a call the server refused; the first one is logged."""
        self.stats.add(errors=1)
        if not self.refusal_warned:
            self.refusal_warned = True
            log.warning("redis tier %s refused a call (%s); further refusals are only counted (errors, "
                        "write_errors)", self.url, e)

    def contains(self, keys: list[str]) -> list[bool] | None:
        """Which keys exist (one pipelined round trip); None while the server is unavailable."""
        def run():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.PREFIX + k)
            return [bool(x) for x in pipe.execute()]
        return self._call(run)

    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None (absent or server unavailable)."""
        return self._call(self.client.get, self.PREFIX + key)

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """Store entries, pipelined in batches of about PIPELINE_BYTES (each within the timeout). Entries
        the server refuses (maxmemory with noeviction) or that an unavailable server never got are
        counted in write_errors."""
        def run(batch):
            pipe = self.client.pipeline(transaction=False)
            for k, data in batch:
                pipe.set(self.PREFIX + k, data)
            return pipe.execute(raise_on_error=False)
        batch, size = [], 0
        for n, (key, data) in enumerate(items):
            batch.append((key, data))
            size += len(data)
            if size >= self.PIPELINE_BYTES or n == len(items) - 1:
                results = self._call(run, batch)
                if results is None:
                    self.stats.add(write_errors=len(items) - n - 1 + len(batch))   # this batch and the rest
                    return
                stored = [len(d) for (_, d), r in zip(batch, results) if not isinstance(r, Exception)]
                if len(stored) < len(batch):
                    self._refused(next(r for r in results if isinstance(r, Exception)))
                    self.stats.add(write_errors=len(batch) - len(stored))
                self.stats.add(bytes_written=sum(stored), entries_written=len(stored))
                batch, size = [], 0

    def delete(self, key: str) -> None:
        """Remove one entry."""
        self._call(self.client.delete, self.PREFIX + key)


def make_tier(spec: TierSpec, events: TierEvents | None = None):
    """Build the tier a TierSpec names (write_through for disk and redis, write_back for cpu, unless
    named); a bounded tier tells `events` each entry its bound drops."""
    if spec.write_policy not in (None, *WRITE_POLICIES):
        raise ValueError(f"unknown KV tier write policy {spec.write_policy!r}; use one of {WRITE_POLICIES}")
    policy = {"write_policy": spec.write_policy} if spec.write_policy else {}
    on_evict = None if events is None else lambda key: events.evicted(spec.kind, key)
    if spec.kind == "cpu":
        return CpuTier(spec.capacity, **policy, on_evict=on_evict)
    if spec.kind == "disk":
        return DiskTier(spec.location, spec.capacity, **policy, on_evict=on_evict)
    if spec.kind == "redis":
        return RedisTier(spec.location, **policy)
    raise ValueError(f"unknown KV tier kind {spec.kind!r}; use one of {TIER_KINDS}")


# ---- KV events of the tiers ------------------------------------------------------------------
@dataclass
class TierEvents:
    """BlockStored / BlockRemoved events of every tier (medium = the tier's name) into `queue` (a
    KVEventQueue). The Redis tier's own LRU evictions are not seen (Redis drops keys by itself)."""

    queue: object
    namespace: str
    hash_algo: str = DEFAULT_HASH_ALGO

    def stored(self, medium: str, blocks: Evicted) -> None:
        """One BlockStored per block written to a tier (blocks of a batch need not form one chain)."""
        from kvserve.kv.events import BlockStored
        for _, key, tokens in blocks:
            block_hash, g = split_key(key, self.hash_algo)
            self.queue.add(BlockStored([block_hash], None, list(tokens), len(tokens), medium=medium, group=g))

    def evicted(self, medium: str, key: str) -> None:
        """A tier's bound dropped the entry under tier key `key`."""
        if not key.startswith(self.namespace + "/"):
            return  # another engine's entry (a shared directory)
        from kvserve.kv.events import BlockRemoved
        block_hash, g = split_key(bytes.fromhex(key[len(self.namespace) + 1:]), self.hash_algo)
        self.queue.add(BlockRemoved([block_hash], medium=medium, group=g))


# ---- the bridge between the device pool and the tiers -----------------------------------------
@dataclass
class TierBridge(BlockPoolListener):
    """Writes blocks down to the tiers (through or back, per tier) and loads prefix blocks back (see module doc)."""

    tiers: list
    storage: object                       # KVStorage: block_layout / read_blocks / write_blocks
    namespace: str
    pool: object                          # the device BlockPool: a block still holds the hash it was queued under
    queue_bytes: int = DEFAULT_QUEUE_BYTES           # per write-through tier
    events: TierEvents | None = None                 # when KV events are on
    seal: Seal = CRC                                 # how entries are sealed and checked (tier_seal)
    layout: Layout = field(init=False)
    writers: list[TierWriter] = field(init=False)    # one per write_through tier
    pin_writers: list[TierWriter] = field(init=False)  # one per write_back tier: pinned blocks
    _fresh: Evicted = field(default_factory=list, init=False)   # registered since the last write_through
    _pinned: Evicted = field(default_factory=list, init=False)  # pinned since the last write_through
    _loaded: dict = field(default_factory=dict, init=False)     # block id -> (pool key, tier) of a load
    _warned: set = field(default_factory=set, init=False)
    _located: dict = field(default_factory=dict, init=False)  # hash -> index of the tier that has it

    def __post_init__(self):
        self.layout = self.storage.block_layout()
        self.writers = [self._writer(t) for t in self.tiers if t.write_policy == "write_through"]
        self.pin_writers = [self._writer(t) for t in self.tiers if t.write_policy == "write_back"]
        if self.writers or self.pin_writers:  # pending writes reach their tier at exit, or when the bridge is collected
            weakref.finalize(self, close_writers, self.writers + self.pin_writers)

    def _writer(self, tier) -> TierWriter:
        on_stored = None
        if self.events is not None:
            def on_stored(batch, idx, events=self.events):
                events.stored(tier.name, [batch.blocks[i] for i in idx])
        return TierWriter(tier, self.queue_bytes, on_stored)

    def key(self, block_hash: BlockHash) -> str:
        """The tier key of one pool key (chained hash + group) in this namespace."""
        return f"{self.namespace}/{block_hash.hex()}"

    def evicted(self, evicted: Evicted) -> None:
        """Write blocks the device is about to reuse to each write_back tier that lacks them (data still intact)."""
        tiers = [t for t in self.tiers if t.write_policy == "write_back"]
        if not tiers:
            return
        keys = [self.key(h) for _, h, _ in evicted]
        todo = []
        for tier in tiers:
            present = tier.contains(keys)
            if present is not None:
                todo.append((tier, [i for i, p in enumerate(present) if not p]))
        needed = sorted({i for _, idx in todo for i in idx})
        if not needed:
            return
        packed = self._pack([evicted[i] for i in needed], self.storage.read_blocks([evicted[i][0] for i in needed]))
        entries = dict(zip(needed, packed))
        for tier, idx in todo:
            if idx:
                tier.put_many([(keys[i], entries[i]) for i in idx])
                self._report_stored(tier, [evicted[i] for i in idx])

    # ---- write-through ---------------------------------------------------------------
    def stored(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """The pool registered a full block: remember it for the next `write_through`."""
        if not self.writers:
            return
        key_src = self._loaded.pop(block_id, None)
        if key_src is not None and key_src[0] == block_hash and all(w.tier is key_src[1] for w in self.writers):
            return  # just loaded from the only write-through tier: it is there already
        self._fresh.append((block_id, block_hash, token_ids))

    def pinned(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """The pool pinned a block: remember it for the write_back tiers at the next `write_through`."""
        if not self.pin_writers:
            return
        self._pinned.append((block_id, block_hash, token_ids))

    def write_through(self) -> None:
        """Copy the blocks registered (pinned) since the last call and queue them for each
        write-through (write-back) tier.

        Call between steps. The copies are taken here, on the step thread; the writers never read
        the pool. Blocks whose hash the pool forgot meanwhile (reused) are skipped."""
        fresh, pinned = self._fresh, self._pinned
        self._fresh, self._pinned = [], []
        self._loaded.clear()
        self._submit(fresh, self.writers)
        self._submit(pinned, self.pin_writers)

    def _submit(self, blocks: Evicted, writers: list[TierWriter]) -> None:
        blocks = [f for f in blocks if self.pool.blocks[f[0]].block_hash == f[1]]
        if not blocks or not writers:
            return
        per_block = self.storage.bytes_per_block
        take = min(len(blocks), max(w.room(per_block) for w in writers))
        batch = self._batch(blocks[:take]) if take else WriteBatch([], list)
        for w in writers:
            w.submit(batch, len(blocks), per_block)

    def _batch(self, blocks: Evicted) -> WriteBatch:
        tensors = self.storage.read_blocks([b for b, _, _ in blocks])  # copies of whole blocks
        ready = None
        if tensors[0].device.type == "cuda":  # start the copy to host now; the writer waits for it
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]
            ready = torch.cuda.Event()
            ready.record()

        def pack() -> list[bytes]:
            if ready is not None:
                ready.synchronize()
            return self._pack(blocks, tensors)
        return WriteBatch([self.key(h) for _, h, _ in blocks], pack, blocks)

    def pack_blocks(self, blocks: Evicted) -> list[bytes]:
        """Entries of device blocks now (step thread): what a KV connector sends."""
        tensors = [t.cpu() for t in self.storage.read_blocks([b for b, _, _ in blocks])]
        return self._pack(blocks, tensors)

    def _pack(self, blocks: Evicted, tensors: list[torch.Tensor]) -> list[bytes]:
        """One entry per block from `read_blocks` tensors of those blocks."""
        return [pack_entry(h, tokens, self.layout, row, self.seal)
                for (_, h, tokens), row in zip(blocks, pack_rows(tensors))]

    # ---- blocks not to be trusted ------------------------------------------------------
    def removed(self, keys: list[BlockHash]) -> None:
        """A request failed on these blocks: delete their entries from every tier (counted in
        `poisoned`) and from the blocks the writers still hold, so no engine serves them again."""
        doomed = {self.key(h) for h in keys}
        self._fresh = [b for b in self._fresh if self.key(b[1]) not in doomed]
        self._pinned = [b for b in self._pinned if self.key(b[1]) not in doomed]
        for w in self.writers + self.pin_writers:
            w.discard(doomed)
        ordered = sorted(doomed)
        for tier in self.tiers:
            present = tier.contains(ordered)
            gone = [k for k, p in zip(ordered, present or []) if p]
            for k in gone:
                tier.delete(k)
                if self.events is not None:
                    self.events.evicted(tier.name, k)
            tier.stats.add(poisoned=len(gone))

    def _report_stored(self, tier, blocks: Evicted) -> None:
        if self.events is not None:
            self.events.stored(tier.name, blocks)

    def flush(self, timeout: float | None = FLUSH_TIMEOUT) -> bool:
        """Wait for every queued write-through write; False if `timeout` passed first."""
        return all([w.flush(timeout) for w in self.writers + self.pin_writers])

    def close(self) -> None:
        """Flush pending writes and stop the writer threads (they start again if more blocks come)."""
        close_writers(self.writers + self.pin_writers)

    def locate(self, block_hashes: list[BlockHash]) -> list[str | None]:
        """The first tier (by name) holding each block, None where no tier does."""
        where: list[str | None] = [None] * len(block_hashes)
        todo = list(range(len(block_hashes)))
        self._located.clear()
        for t, tier in enumerate(self.tiers):
            if not todo:
                break
            present = tier.contains([self.key(block_hashes[i]) for i in todo])
            if present is None:
                continue
            for i, p in zip(todo, present):
                if p:
                    where[i] = tier.name
                    self._located[block_hashes[i]] = t
                else:
                    tier.stats.add(misses=1)
            todo = [i for i in todo if where[i] is None]
        return where

    def load(self, items: list[tuple[BlockHash, tuple[int, ...], int]],
             pending_copies: Callable[[], list[tuple[int, int]]] | None = None) -> list[str | None]:
        """Load (hash, tokens, device block id) from the first tier with a valid entry; source per item.
        `pending_copies`: the device's block copies due before the next forward, run before the
        loaded blocks are written (a copy's source may be among the blocks written)."""
        sources: list[str | None] = [None] * len(items)
        ids, rows = [], []
        for n, (block_hash, tokens, block_id) in enumerate(items):
            for tier in self.tiers[self._located.get(block_hash, 0):]:
                row = self._read(tier, block_hash, tokens)
                if row is not None:
                    sources[n] = tier.name
                    ids.append(block_id)
                    rows.append(row)
                    self._loaded[block_id] = (block_hash, tier)
                    break
        if ids:
            if pending_copies is not None:
                self.storage.copy_blocks(pending_copies())
            self.storage.write_blocks(ids, unpack_rows(torch.stack(rows), self.layout))
        return sources

    def _read(self, tier, block_hash: BlockHash, tokens: tuple[int, ...]) -> torch.Tensor | None:
        key = self.key(block_hash)
        data = tier.get(key)
        if data is None:
            tier.stats.add(misses=1)
            return None
        try:
            row = unpack_entry(data, block_hash, tokens, self.layout, self.seal)
        except RefusedEntry as e:
            tier.stats.add(refused=1)
            if not e.keep:
                tier.delete(key)
            self._warn_once(tier, "refused", f"refused an entry {key} ({e}){'' if e.keep else ', deleted it'}")
            return None
        except CorruptEntry as e:
            tier.stats.add(corrupt=1, errors=1)
            tier.delete(key)
            self._warn_once(tier, "corrupt", f"dropped a corrupt entry {key} ({e})")
            return None
        tier.stats.add(hits=1, bytes_read=len(data))
        return row

    def _warn_once(self, tier, kind: str, message: str) -> None:
        if (tier.name, kind) not in self._warned:
            self._warned.add((tier.name, kind))
            log.warning("%s tier: %s; counting further ones quietly (%s)", tier.name, message, kind)

    def metrics(self) -> dict[str, dict]:
        """Counters per tier, plus bytes held where the tier knows, its write policy and queued blocks."""
        pending = {id(w.tier): w.pending_blocks for w in self.writers + self.pin_writers}
        return {t.name: {**asdict(t.stats), "usage_bytes": t.usage_bytes, "write_policy": t.write_policy,
                         "pending_writes": pending.get(id(t), 0)} for t in self.tiers}


def _atomic_write(target: Path, data: bytes, sync: bool = False) -> None:
    """Write `target` through a temporary file renamed into place; `sync`: fsync the file first
    (the caller fsyncs the directory, once for many files)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(folder: Path) -> None:
    """fsync a directory, so the renames into it survive a power loss."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
