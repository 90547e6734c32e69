"""Attention in the batch-invariant mode (EngineConfig.batch_invariant; docs/SERVING.md "Batch
invariance").

Every row of a step (a decode token, a token of a prefill chunk, a token recomputed after a
preemption) attends through the CPU decode kernel (attention/cpu/) over the K/V its group's pools
hold once the step's new entries are written, each row's positions summed in one part. A row's
attention then runs the same arithmetic in the same order whatever else shares the step, however
its prompt was chunked, and whether its prefix was computed here, found in the prefix cache or
loaded from a tier (the same stored bytes)."""

from __future__ import annotations

import torch

from kvserve.attention import cpu as cpu_kernel
from kvserve.attention.backends import PagedBackend, StepBatch
from kvserve.attention.metadata import AttentionMetadata, DecodeRange, PagedMetadata
from kvserve.kv.spec import KVGroup
from kvserve.kv.storage import KVStorage

NATIVE_KV = ("auto", "bfloat16", "float32")   # K/V formats the kernel reads in place


def check_options(config) -> None:
    """ValueError naming what batch_invariant=True cannot run with, and what to change."""
    if not config.batch_invariant:
        return
    refusals = [
        (config.torch_device().type != "cpu", "runs on CPU (its kernels are the C++ CPU ones): use device='cpu'"),
        (config.kv_cache_mode == "none", "needs a KV cache: kv_cache_mode='paged' or 'contiguous'"),
        (config.tensor_parallel_size > 1, "runs on one process: tensor_parallel_size=1"),
        (config.kv_policy is not None, "keeps every K/V entry: leave kv_policy unset"),
        (config.attention_backend != "auto", "picks its own attention: leave attention_backend='auto'"),
        (config.dtype == "float16", "takes float32 or bfloat16 activations: dtype='auto', 'float32' or 'bfloat16'"),
        (config.kv_cache_dtype not in NATIVE_KV or config.kv_cache_dtype_k or config.kv_cache_dtype_v
         or config.kv_cache_rotation or config.kv_cache_head_precision,
         f"reads K/V in place: kv_cache_dtype one of {', '.join(NATIVE_KV)}, no per-K/V, rotated or per-head formats"),
    ]
    for refused, what in refusals:
        if refused:
            raise ValueError(f"batch_invariant {what}")


class InvariantBackend(PagedBackend):
    """Every row of the step through the CPU kernel, unsplit (see the module's docstring)."""

    metadata = PagedMetadata

    def __init__(self, storage: KVStorage, group: KVGroup):
        super().__init__(storage, group, use_kernel=True)
        pools = [p for layer in group.layers for p in (storage.native_kv(layer) or [None])]
        if not group.spec.per_head or any(p is None or not cpu_kernel.supports(p)
                                          or not cpu_kernel.reads(storage.dtype, p.dtype) for p in pools):
            raise ValueError("batch_invariant reads K/V in place: it needs per-head K/V (not MLA latents) in "
                             "the model's dtype or bfloat16 on CPU")
        if not self.kernel:
            raise ValueError("batch_invariant needs the CPU decode attention kernel, which did not build here "
                             "(see the warning above: a C++ compiler is required)")

    def prepare(self, step: StepBatch, g: int, table: torch.Tensor) -> PagedMetadata:
        """Every token's row: its block table and the positions [start, end) up to and with itself."""
        md = self.metadata(slot_mapping=self._slot_mapping(step, g, table))
        end = step.cache_len_t[g][step.token_req] + step.token_off + 1
        start = (end - self.window).clamp(min=0) if self.window else torch.zeros_like(end)
        width = max(1, -(-int(end.max()) // self.block_size))
        md.decode = DecodeRange(table[step.token_req, :width], start, end)
        return md

    def forward(self, layer: int, q, new: list[torch.Tensor], meta: AttentionMetadata, md: PagedMetadata,
                scale: float, window: int | None, math) -> torch.Tensor:
        self.storage.write(layer, md.slot_mapping, *new)
        k_pool, v_pool = self.storage.native_kv(layer)
        r = md.decode
        return cpu_kernel.paged_decode(q, k_pool, v_pool, r.tables, r.start, r.end, scale, split=False)
