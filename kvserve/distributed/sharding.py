"""Which part of a Llama-family model one tensor parallel rank holds.

Attention is split by KV head: a rank keeps its KV heads' k/v rows and the query heads that read
them (q rows, o_proj columns). When there are fewer KV heads than ranks (MQA), each KV head is
replicated on size // num_kv_heads ranks, as vLLM does, and the query heads are split among them.
The MLP is split by columns (gate/up rows) and rows (down_proj columns). Embedding, norms and the
LM head are replicated. o_proj and down_proj give partial sums; RowParallel adds them over the
group. Their biases are kept on rank 0 only, so the sum counts them once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.kv.sizing import kv_heads_per_gpu
from kvserve.model.config import ModelConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: the query heads, KV heads and MLP columns it holds ([start, stop))."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]


def valid_sizes(num_heads: int, num_kv_heads: int, intermediate: int) -> list[int]:
    """Tensor parallel sizes this model splits into (up to its number of query heads)."""
    return [n for n in range(1, num_heads + 1) if _fits(n, num_heads, num_kv_heads, intermediate)]


def _fits(n: int, heads: int, kv_heads: int, intermediate: int) -> bool:
    kv_ok = kv_heads % n == 0 or n % kv_heads == 0
    return kv_ok and heads % n == 0 and intermediate % n == 0


def check_model(mc: ModelConfig, size: int) -> None:
    """Raise ValueError when `mc` cannot be split over `size` ranks, saying which sizes work."""
    if mc.architecture not in ARCHITECTURES:
        raise ValueError(f"tensor parallel supports the Llama family ({', '.join(ARCHITECTURES)}); "
                         f"{mc.name} is {mc.architecture!r}: use tensor_parallel_size=1")
    if not _fits(size, mc.num_heads, mc.num_kv_heads, mc.intermediate_size):
        sizes = valid_sizes(mc.num_heads, mc.num_kv_heads, mc.intermediate_size)
        raise ValueError(
            f"tensor_parallel_size={size} does not split {mc.name}: it needs to divide the {mc.num_heads} "
            f"query heads and the MLP width {mc.intermediate_size}, and to divide the {mc.num_kv_heads} KV "
            f"heads or be a multiple of them (KV heads are then replicated); sizes that work: "
            f"{', '.join(map(str, sizes))}")


def plan_shard(mc: ModelConfig, rank: int, size: int) -> Shard:
    """The heads and MLP columns rank `rank` of `size` holds."""
    check_model(mc, size)
    q = mc.num_heads // size
    kv = kv_heads_per_gpu(mc.num_kv_heads, size)
    # KV heads shared by several ranks (size > num_kv_heads): rank r keeps head r // replicas
    kv_start = rank * kv if mc.num_kv_heads >= size else rank // (size // mc.num_kv_heads)
    m = mc.intermediate_size // size
    return Shard(rank, size, (rank * q, rank * q + q), (kv_start, kv_start + kv), (rank * m, rank * m + m))


def shard_config(mc: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of the rank's slice: its heads and MLP width (head_dim unchanged)."""
    return dataclasses.replace(mc, num_heads=_len(shard.q_heads), num_kv_heads=_len(shard.kv_heads),
                               intermediate_size=_len(shard.mlp))


def shard_weights(weights: dict[str, torch.Tensor], mc: ModelConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """The rank's slice of every HF-named weight (replicated ones as they are)."""
    return {name: _shard_tensor(name, w, mc, shard) for name, w in weights.items()}


def _shard_tensor(name: str, w: torch.Tensor, mc: ModelConfig, shard: Shard) -> torch.Tensor:
    d = mc.head_dim
    module, _, kind = name.rpartition(".")
    proj = module.rpartition(".")[2]
    if proj == "q_proj":
        return _rows(w, shard.q_heads, d)
    if proj in ("k_proj", "v_proj"):
        return _rows(w, shard.kv_heads, d)
    if proj in ("gate_proj", "up_proj"):
        return _rows(w, shard.mlp, 1)
    if proj in ("o_proj", "down_proj"):
        if kind == "bias":
            return w if shard.rank == 0 else torch.zeros_like(w)
        return _columns(w, shard.q_heads if proj == "o_proj" else shard.mlp, d if proj == "o_proj" else 1)
    return w


def _rows(w: torch.Tensor, span: tuple[int, int], width: int) -> torch.Tensor:
    """Rows span[0] * width .. span[1] * width (weights [out, in] and biases [out])."""
    return w[span[0] * width:span[1] * width].clone()


def _columns(w: torch.Tensor, span: tuple[int, int], width: int) -> torch.Tensor:
    return w[:, span[0] * width:span[1] * width].clone()


def _len(span: tuple[int, int]) -> int:
    return span[1] - span[0]


class RowParallel(nn.Module):
    """A linear over this rank's slice of the input features; the partial outputs are summed over
    the group, so every rank gets the full output."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)   # [num_tokens, hidden], this rank's share
        self.group.all_reduce(y)
        return y


def parallelize(model: nn.Module, group) -> None:
    """Wrap every layer's o_proj and down_proj so their outputs are summed over the group."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
