"""What an LLMEngine is built from: the model (weights, tokenizer, context length) and the KV cache
(layer groups, storage format, pool size and the bounds one sequence needs)."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvserve.config import DTYPES, EAGER_ENV, EngineConfig
from kvserve.engine.eviction import evictor_factory, extend_positions
from kvserve.engine.memory import (
    PoolPlan,
    check_fits,
    device_memory,
    gib,
    measure_activation_peak,
    plan_pool,
)
from kvserve.engine.offload import build_tiers
from kvserve.kv.formats import KVCacheFormat, build_kv_format, split_budget
from kvserve.kv.hashing import namespace_hash
from kvserve.kv.manager import KVCacheManager, new_pool
from kvserve.kv.no_cache import NoCacheManager, NoCacheStorage
from kvserve.kv.policies import parse_policy
from kvserve.kv.sizing import num_blocks_for_budget
from kvserve.kv.spec import group_layers, null_blocks
from kvserve.kv.storage import KVStorage
from kvserve.model import weight_cache
from kvserve.model.config import ModelConfig
from kvserve.model.layers import fuse_projections
from kvserve.model.loader import is_gguf, load_gguf_kept, load_weights, resolve_model_path
from kvserve.model.quant import (
    COPY_FORMATS,
    GGUF_FORMAT,
    cast_unquantized,
    cpu_gemv,
    keep_formats,
    quant_layers,
    quantize_model,
    row_invariant_model,
    slow_half,
    weight_bytes,
)
from kvserve.model.registry import build_model
from kvserve.model.tokenizer import Tokenizer
from kvserve.startup import phase

log = logging.getLogger("kvserve")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# ---- the model ----------------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    """A model on its device with its tokenizer and the formats it runs in."""

    path: str
    config: ModelConfig
    tokenizer: Tokenizer | None
    model: torch.nn.Module
    weight_format: str
    dtype: torch.dtype
    max_model_len: int
    seconds: float
    compiled: bool        # dense regions are to run as torch.compile graphs (engine/compile.py)
    weight_digest: str = ""   # weights=gguf: what each tensor keeps (kept_digest), for the prefix-cache namespace

    @property
    def quantized(self) -> bool:
        """True when the linear weights are stored in another format than the activations."""
        return DTYPES.get(self.weight_format) != self.dtype

    def eos_ids(self) -> list[int]:
        """The model's end-of-sequence ids, plus the tokenizer's."""
        ids = list(self.config.eos_token_ids)
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return ids


@dataclass(frozen=True)
class Environment:
    """What the process environment asks of its engines, read once where an engine is built."""

    enforce_eager: bool = False   # KVSERVE_ENFORCE_EAGER=1: every engine runs eagerly
    malloc_tuning: bool = True    # KVSERVE_MALLOC_TUNING=0: leave glibc's malloc as it is


def read_environment() -> Environment:
    """The engine's environment variables, as values."""
    env = os.environ
    return Environment(enforce_eager=env.get(EAGER_ENV, "") not in ("", "0"),
                       malloc_tuning=env.get("KVSERVE_MALLOC_TUNING", "1") != "0")


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype,
               env: Environment | None = None) -> LoadedModel:
    """Load weights and tokenizer, build the model, quantize its linear layers if asked."""
    t0 = time.perf_counter()
    env = env or read_environment()
    if device.type == "cpu":
        keep_freed_memory(env.malloc_tuning)
    path = resolve_model_path(config.model)
    tokenizer_future = _start_tokenizer(path)
    weight_format, why = config.weight_format(is_gguf(path))
    digest = ""
    if weight_format == GGUF_FORMAT:
        with phase("weights load"):
            model_config, floats, kept = load_gguf_kept(path)
        why, digest = f"{kept_summary(kept)}; {why}", kept_digest(kept)
        model = _cached_kept_model(config, path, model_config, floats, kept, device, dtype)
        del floats, kept
    else:
        quantized = DTYPES.get(weight_format) != dtype
        # quantized weights are made from float32, not from an already rounded copy
        with phase("weights load"):
            model_config, weights = load_weights(path, torch.float32 if quantized else dtype)
        with phase("model build"):
            model = _build_model(model_config, weights, device, dtype, weight_format if quantized else None)
        del weights
        with phase("bf16 copies"):
            _bf16_copies(config, model, device)
    with phase("tokenizer (waited for)"):
        tokenizer = tokenizer_future.result()
    if device.type == "cpu":
        release_freed_memory()
    seconds = time.perf_counter() - t0
    log.info("weights: %s, activations %s (%s); %.1f MiB of weights", weight_format,
             str(dtype).removeprefix("torch."), why, weight_bytes(model) / 2**20)
    if config.batch_invariant:
        row_invariant_model(model)
    max_model_len = _max_model_len(config, model_config)
    extend_positions(model, max_model_len)
    compiled = _compile(config, weight_format, env.enforce_eager)
    return LoadedModel(path, model_config, tokenizer, model, weight_format, dtype, max_model_len, seconds,
                       compiled, digest)


MALLOC_ARENAS = 4   # glibc's arenas at most (its default: 8 per core, each thread that allocates takes one)


def keep_freed_memory(enabled: bool = True) -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the OS: a step
    allocates and frees the same few-MiB activations every time, and fresh pages cost a fault per
    4 KiB (as jemalloc or tcmalloc would, without preloading them). And bound its arenas: a server's
    threads (tokenizing, the event loop's executor, HTTP) each took an arena of their own, and every
    arena holds on to what its thread ever used. `enabled` False (the environment's
    KVSERVE_MALLOC_TUNING=0) skips it. True when glibc took every setting."""
    if not enabled:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:          # not glibc: nothing to tune
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    # glibc's largest mmap threshold: blocks up to 32 MiB come from the heap; keep 1 GiB of freed heap
    settings = ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30), (m_arena_max, MALLOC_ARENAS))
    return all([bool(libc.mallopt(option, value)) for option, value in settings])


def release_freed_memory() -> bool:
    """Hand freed heap that keep_freed_memory's thresholds would keep back to the OS: what loading
    freed (decoded blocks, fused groups' parts, the copies' widened chunks), and what a busy spell's
    steps left free in every thread's arena when the engine goes idle (AsyncEngine). True when
    glibc's malloc_trim released some."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):   # not glibc
        return False


def keep_device_memory() -> bool:
    """An accelerator's caching allocator keeps its own pool: nothing to hand back."""
    return False


def memory_release(device: torch.device) -> Callable[[], bool]:
    """What hands an idle engine's freed host memory back, chosen once for its device."""
    return release_freed_memory if device.type == "cpu" else keep_device_memory


def _bf16_copies(config: EngineConfig, model: torch.nn.Module, device: torch.device) -> bool:
    """Give the int8/int4/int8-group layers their bfloat16 copies when config.bf16_weight_copy says so:
    'auto' only those whose many-row steps do not widen the weight per call in C++ (a GGUF's own
    layouts do: for them the copy buys 10-20% of prefill at 2 bytes a weight, docs/WEIGHTS.md)."""
    setting = copy_setting(config)
    candidates = [m for m in quant_layers(model) if m.fmt in COPY_FORMATS and m.copies]
    layers = [m for m in candidates if not (setting == "auto" and m.widens)]
    if candidates and not layers and setting == "auto":
        log.info("bf16_weight_copy=auto: no bfloat16 copy (the layers widen their weights per call in C++; "
                 "bf16_weight_copy=on keeps one: 10-20%% faster prefill, 2 bytes a weight)")
    if not layers or setting == "off":
        return False
    need = sum(2 * m.in_features * m.out_features for m in layers)
    if setting == "auto":
        if device.type != "cpu" or slow_half(device):
            return False
        if need > device_memory(device) // 4:
            log.info("bf16_weight_copy=auto: no bfloat16 copy of the weights (%.0f MiB is more than a quarter "
                     "of the available RAM)", need / 2**20)
            return False
    for m in layers:
        m.add_bf16_copy()
    log.info("bfloat16 copy of the %s weights for steps of more than 12-16 rows: %.0f MiB (bf16_weight_copy=%s)",
             "/".join(sorted({m.fmt for m in layers})), need / 2**20, setting)
    return True


def copy_setting(config: EngineConfig) -> str:
    """bf16_weight_copy as it applies: off in the batch-invariant mode, whose kernels never read it."""
    return "off" if config.batch_invariant else config.bf16_weight_copy


def _compile(config: EngineConfig, weight_format: str, eager_by_env: bool) -> bool:
    """Whether the model's dense regions are to be compiled (model/regions.py); the engine compiles them
    once its KV pool exists (engine/compile.py), the model runs eagerly until then."""
    wanted, why = config.compiles(weight_format, eager_by_env)
    log.info("model regions: %s", why)
    return wanted


def _build_model(mc: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 quant: str | None) -> torch.nn.Module:
    model = build_model(mc)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and mc.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if quant is None:
        model = model.to(device=device, dtype=dtype).eval()
        fuse_projections(model)
        if dtype == torch.bfloat16 and cpu_gemv(device, "bfloat16"):
            quantize_model(model, "bfloat16")   # the same weights, their few-row steps on the C++ GEMV
        return model
    model = model.to(device=device).eval()
    fuse_projections(model)
    quantize_model(model, quant)
    cast_unquantized(model, dtype)
    return model


def _cached_kept_model(config: EngineConfig, path: str, mc: ModelConfig, floats: dict[str, torch.Tensor],
                       kept: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The kept-format model with its bfloat16 copies: on CPU mapped from the weight cache
    (model/weight_cache.py) when it holds this build, else built and written there."""
    if device.type != "cpu":
        with phase("model build"):
            model = _build_kept_model(mc, floats, kept, device, dtype)
        with phase("bf16 copies"):
            _bf16_copies(config, model, device)
        return model
    key = weight_cache.cache_key(weights=GGUF_FORMAT, dtype=dtype, device=device.type,
                                 bf16_weight_copy=copy_setting(config))
    file = weight_cache.cache_file(path, key)
    with phase("model build (weight cache)"):
        model = _build_kept_model(mc, _on_meta(floats), _on_meta(kept), device, dtype, torch.device("meta"))
        _bf16_copies(config, model, device)
        if weight_cache.load(model, file):
            return model
    with phase("model build"):
        model = _build_kept_model(mc, floats, kept, device, dtype)
    with phase("bf16 copies"):
        _bf16_copies(config, model, device)
    weight_cache.save(model, file)
    return model


def _on_meta(tensors: dict) -> dict:
    """The same tensors (or KeptTensors) as meta tensors: shapes and dtypes only."""
    return {name: t.to("meta") for name, t in tensors.items()}


def _build_kept_model(mc: ModelConfig, floats: dict[str, torch.Tensor], kept: dict, device: torch.device,
                      dtype: torch.dtype, place: torch.device | None = None) -> torch.nn.Module:
    """The model with every GGUF weight in its kept layout, its layers to run on `device`, its tensors
    on `place` (default `device`; the meta device for the weight cache): built on the meta device,
    so no float32 weight is ever allocated for a layer that keep_formats replaces."""
    place = place or device
    with torch.device("meta"):
        model = build_model(mc)
    _, unexpected = model.load_state_dict(floats, strict=False, assign=True)
    keep_formats(model, kept, device)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and place.type != "meta"]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model = model.to(place).eval()
    cast_unquantized(model, dtype)
    return model


def kept_summary(kept: dict) -> str:
    """'Q4_K x 162 (52.1 MiB), Q5_0 x 72 (...)': what the GGUF's weights keep, per block type, with
    the reason for every type mapped to another layout."""
    counts, sizes, notes = {}, {}, {}
    for t in kept.values():
        counts[t.gguf_type] = counts.get(t.gguf_type, 0) + 1
        sizes[t.gguf_type] = sizes.get(t.gguf_type, 0) + t.nbytes
        if t.note:
            notes[t.gguf_type] = t.note
    text = ", ".join(f"{k} x {counts[k]} ({sizes[k] / 2**20:.1f} MiB)" for k in sorted(counts, key=counts.get, reverse=True))
    return text + "".join(f"; {note}" for note in notes.values())


def kept_digest(kept: dict) -> str:
    """A digest of what every tensor keeps (name, block type, layout), for the prefix-cache namespace."""
    import hashlib
    text = "|".join(f"{name}:{t.gguf_type}:{t.kind}" for name, t in sorted(kept.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    limit = mc.max_position_embeddings
    n = config.max_model_len or limit
    if n > limit and not config.kv_policy:
        raise ValueError(f"max_model_len={n} exceeds the model's context length {limit}")
    if n > limit:  # a kv_policy stream may run past it (sinks/window re-index positions: docs/EVICTION.md)
        log.warning("max_model_len=%d exceeds the model's context length %d (allowed with kv_policy)", n, limit)
    return n


def _start_tokenizer(path: str) -> Future:
    """The tokenizer's load: beside the weights where it is built (a first start, from the GGUF's
    vocabulary: seconds of transformers), at once where a cached folder is read."""
    if Tokenizer.is_quick(path):
        done = Future()
        done.set_result(load_tokenizer(path))
        return done
    job = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")
    try:
        return job.submit(load_tokenizer, path)
    finally:
        job.shutdown(wait=False)


def load_tokenizer(path: str) -> Tokenizer | None:
    """The model's tokenizer; None for a HF directory that ships none (token-id prompts only)."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        log.warning("no tokenizer files in %s: prompts must be token ids and outputs have no text", path)
        return None
    return Tokenizer.load(path)


# ---- the KV cache -------------------------------------------------------------------------------------
class CachePlanner:
    """Sizes one engine's KV cache: layer groups, storage format, pool plan, and what one sequence needs.

    Built from the engine's options (engine/options.py's checked copy), the loaded model (its model,
    tokenizer and dtype: per-head precision calibration runs the model) and the device."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device):
        cfg = self.config = config
        self.loaded = loaded
        self.device = device
        self.max_model_len = loaded.max_model_len
        self.policy = parse_policy(cfg.kv_policy) if cfg.kv_policy else None   # engine-wide default
        # Under a kv_policy every layer gets its own group: H2O and SnapKV keep different tokens per
        # layer, and a group's layers share one table (docs/EVICTION.md).
        self.groups = group_layers(loaded.model.kv_specs(), size=1 if self.policy is not None else None)
        self.format = self._kv_format()   # kv/formats.py: how K/V are stored, what a token costs
        self.residual_rows = 0
        self.plan: PoolPlan | None = None
        self.tiers = None   # the TierBridge build() puts below the manager, when kv_tiers asks for one
        self.draft_kv: tuple[int, str] | None = None   # a draft model's KV pool: bytes, what set them

    @property
    def block_size(self) -> int:
        """Contiguous layout: one max_model_len "block" per sequence, reserved up front."""
        return self.max_model_len if self.config.kv_cache_mode == "contiguous" else self.config.block_size

    @property
    def token_budget(self) -> int:
        """Tokens one step may run: max_num_batched_tokens, or max_model_len without a cache (a step
        runs whole sequences)."""
        return self.max_model_len if self.config.kv_cache_mode == "none" else self.config.max_num_batched_tokens

    def _kv_format(self) -> KVCacheFormat:
        """The KV storage format from the config (calibrating per-head precision if asked)."""
        cfg = self.config
        high = None
        if cfg.kv_cache_head_precision and cfg.kv_cache_mode != "none":
            from kvserve.engine.kv_calibration import choose_high_precision_heads
            high = choose_high_precision_heads(self.loaded, self.device, self.groups, cfg)
        kv_dtype, why = cfg.kv_dtype(self.loaded.dtype, self.device)
        fmt = build_kv_format(self.groups, self.loaded.dtype, self.block_size, kv_dtype,
                              cfg.kv_cache_dtype_k, cfg.kv_cache_dtype_v, cfg.kv_cache_dtype_skip_layers,
                              cfg.kv_cache_rotation, high, cfg.kv_cache_head_precision_dtype)
        if cfg.kv_cache_mode != "none":
            name = str(self.loaded.dtype).removeprefix("torch.") if fmt.description == "auto" else fmt.description
            log.info("KV format: %s (%s)", name, why)
        return fmt

    def plan_pool(self) -> PoolPlan:
        """Blocks that fit the memory budget (and KIVI residual rows); refuses a pool too small for one sequence."""
        cfg, block_size = self.config, self.block_size
        activation = 0
        if cfg.kv_cache_memory is None and (cfg.gpu_memory_utilization is not None or self.device.type == "cuda"):
            activation = measure_activation_peak(self.device, self.warmup)
        plan = plan_pool(cfg.kv_cache_memory, cfg.gpu_memory_utilization, self.device,
                         weight_bytes(self.loaded.model), activation, block_size, self.format.page_bytes_per_token)
        plan = self._less_draft(plan)
        if self.format.has_residual:  # KIVI: full-precision rows for still-filling blocks, from the budget
            plan.num_blocks, self.residual_rows = self.split_residual(plan.budget_bytes, block_size)
        self.plan = plan  # the prefill chunk of a streaming kv_policy is sized from it
        check_fits(plan, self.blocks_per_sequence(block_size), self.max_model_len, self.bound_note())
        return plan

    def _less_draft(self, plan: PoolPlan) -> PoolPlan:
        """`plan` less the draft model's KV pool (speculative method draft_model): one budget holds both
        pools; the draft's bytes and what set them stay in `draft_kv` for spec/draft.py."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return plan
        self.draft_kv = spec.draft_kv_bytes(plan.budget_bytes)
        budget = plan.budget_bytes - self.draft_kv[0]
        return PoolPlan(num_blocks_for_budget(max(0, budget), plan.block_size, plan.bytes_per_token), plan.block_size,
                        plan.bytes_per_token, budget, f"{plan.source} less the draft model's {self.draft_kv[0] / 2**20:.1f} MiB")

    def split_residual(self, budget: int, block_size: int) -> tuple[int, int]:
        """(blocks, residual rows) of a KIVI pool; one sequence needs two rows per KV group (the block
        a prefill chunk completes and the one it leaves filling)."""
        groups = len(self.groups)
        blocks, rows = split_budget(max(0, budget), block_size, self.format.page_bytes_per_token,
                                    self.format.residual_bytes_per_token, self.config.max_num_seqs * groups,
                                    min_rows=2 * groups)
        if rows < 2 * groups:
            raise ValueError(f"KV cache too small for {self.format.description}: {max(0, budget) / 2**20:.1f} MiB "
                             f"cannot hold the {2 * groups} full-precision residual rows one sequence needs plus "
                             "its blocks. Raise kv_cache_memory / gpu_memory_utilization.")
        return blocks, rows

    def kv_len_bound(self) -> int:
        """Most tokens one layer holds for one sequence: max_model_len, or less under a bounding kv_policy."""
        p, n = self.policy, self.max_model_len
        if p is None or not p.evicts or not p.is_resolved:
            return n
        return min(n, p.cache_bound(n, n, self.prefill_chunk(p)))

    def blocks_per_sequence(self, block_size: int, kv_len: int | None = None) -> int:
        """Blocks one sequence holding `kv_len` tokens per layer (default: the most one max_model_len
        sequence holds) needs, over all KV groups."""
        kv_len = kv_len or self.kv_len_bound()
        return sum(g.spec.blocks_held(kv_len, block_size) for g in self.groups) + null_blocks(self.groups)

    def prefill_chunk(self, policy) -> int:
        """Most prompt tokens a request under `policy` runs per step: max_num_batched_tokens, or fewer for
        a streaming policy whose capacity plus one chunk would not fit the pool (it evicts between chunks)."""
        chunk, plan = self.config.max_num_batched_tokens, self.plan
        if plan is None or policy is None or not policy.streaming or not policy.is_resolved:
            return chunk

        def fits(c: int) -> bool:
            return self.blocks_per_sequence(plan.block_size, policy.capacity + c) <= plan.num_blocks
        if fits(chunk):
            return chunk
        if not fits(1):  # not even one token: the start-up / admission check refuses
            return 1
        lo, hi = 1, chunk  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def bound_note(self) -> str:
        """What one sequence holds at most, for the start-up error."""
        p = self.policy
        if p is None or not p.streaming or not p.is_resolved:
            return ""
        return f"kv_policy {p.spec()!r} holds {p.capacity} tokens per layer plus one prefill chunk (at least 1)"

    @torch.inference_mode()
    def warmup(self) -> None:
        """One no-cache forward of max_num_batched_tokens tokens to measure activation memory."""
        from kvserve.attention import AttentionMetadata, PrefillSpan
        model = self.loaded.model
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(prefills=[PrefillSpan(0, n, n)])
        hidden = model(ids, torch.arange(n, device=self.device), meta)
        model.compute_logits(hidden[-256:])
        for layer in model.model.layers:
            layer.self_attn.kv_rows = 0

    def namespace(self) -> bytes:
        """What a block hash is scoped to: model, dtype, block size, KV format, weight format."""
        mc, lm = self.loaded.config, self.loaded
        return namespace_hash(mc.name, mc.architecture, lm.dtype, self.config.block_size,
                              mc.num_layers, mc.num_kv_heads, mc.head_dim, self.format.description,
                              *([f"weights={lm.weight_format}{lm.weight_digest}"] if lm.quantized else []),
                              *(["batch_invariant"] if self.config.batch_invariant else []),
                              algo=self.config.prefix_caching_hash_algo)

    def build(self, events=None, *, tiers: bool = False,
              eviction: bool = False) -> tuple[KVCacheManager | NoCacheManager, KVStorage | NoCacheStorage]:
        """Plan the pool and build the KV manager and storage over it (kv/no_cache.py's, holding
        nothing, without a cache).

        The pool comes first: the storage asks it which blocks are free, the tiers check it before
        writing, the manager runs on it. `events`: the KV events queue; `tiers`: build the tiers of
        `kv_tiers` (kept in `self.tiers`) below the manager; `eviction`: the manager evicts under
        the kv_policy (kv/evictor.py). A tensor-parallel follower's pool asks for neither."""
        cfg = self.config
        if cfg.kv_cache_mode == "none":
            return NoCacheManager(), NoCacheStorage()
        plan = self.plan_pool()
        pool = new_pool(plan.num_blocks, self.groups, cfg.kv_pin_fraction)
        storage = KVStorage(self.groups, plan.num_blocks, plan.block_size, self.loaded.dtype, self.device,
                            self.format, self.residual_rows, block_is_free=pool.is_free)
        self.tiers = build_tiers(self, storage, pool, events) if tiers else None
        kv = KVCacheManager(
            plan.num_blocks, plan.block_size, self.namespace(),
            enable_prefix_caching=cfg.enable_prefix_caching and cfg.kv_cache_mode == "paged",
            groups=self.groups, hash_algo=cfg.prefix_caching_hash_algo, pin_fraction=cfg.kv_pin_fraction,
            pool=pool, listeners=[self.tiers] if self.tiers is not None else [], lower=self.tiers,
            events=events, eviction=self._eviction(storage) if eviction else None,
            residual_rows=self.residual_rows or None)  # the scheduler admits this many filling blocks
        return kv, storage

    def _eviction(self, storage: KVStorage):
        """The manager's eviction strategy under the kv_policy, or None."""
        if self.policy is None:
            return None
        return evictor_factory(storage, self.loaded.model, self.groups)

    def log(self, storage: KVStorage | NoCacheStorage) -> None:
        """The pool at start-up: blocks, tokens, bytes, format and concurrency at max_model_len."""
        if self.plan is None:
            log.info("KV cache: none (every step recomputes the whole sequence)")
            return
        p, fmt = self.plan, self.format
        per_seq = self.blocks_per_sequence(p.block_size)
        log.info("KV cache (%s): %d blocks x %d tokens = %d tokens (%s, format %s, %d B/token, %d KV group(s)) "
                 "from %s; max concurrency at max_model_len=%d: %.1fx", self.config.kv_cache_mode, p.num_blocks,
                 p.block_size, p.num_tokens // len(self.groups), gib(p.nbytes), fmt.description,
                 fmt.bytes_per_token, len(self.groups), p.source, self.max_model_len, p.num_blocks / per_seq)
        if self.residual_rows:
            log.info("KV cache residual: %d full-precision rows of %d tokens for still-filling blocks (%s)",
                     self.residual_rows, p.block_size, gib(storage.residual_nbytes))
        for note in fmt.notes:
            log.info("KV cache format: %s", note)
