"""Building blocks of decoder models: RMSNorm, rotary embeddings, gated MLP."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (computed in float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with llama3-style scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table, initialised as nn.Embedding does except on the meta device (a model built
    there gets its checkpoint's table; torch's meta normal_ alone takes seconds)."""
    weight = torch.empty(num, dim)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding(num, dim, _weight=weight)


class RotaryEmbedding(nn.Module):
    """Half-split (rotate_half) rotary embedding with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # float32 on the CPU (not a buffer: model.to(dtype) must not round it), also when the model
        # is built on the meta device (model/quant.py keep_formats)
        self.inv_freq = inv_freq
        cos, sin = self._table(0, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _table(self, start: int, end: int):
        freqs = torch.outer(torch.arange(start, end, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [end - start, head_dim]
        return emb.cos(), emb.sin()

    def extend(self, max_positions: int) -> None:
        """Grow the cos/sin tables to cover positions < max_positions (e.g. beyond the trained context)."""
        have = self.cos.shape[0]
        if max_positions > have:
            cos, sin = self._table(have, max_positions)
            self.cos = torch.cat([self.cos, cos.to(self.cos)])
            self.sin = torch.cat([self.sin, sin.to(self.sin)])

    def shift(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Keys rotated at position p -> the same keys rotated at p - delta; k: [n, heads, head_dim],
        delta: [n] >= 0. Exact for rotate-half RoPE: R(p - d) = R(-d) R(p)."""
        cos = self.cos[delta].unsqueeze(1).to(k.dtype)
        sin = self.sin[delta].unsqueeze(1).to(k.dtype)
        return k * cos - _rotate_half(k) * sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Fused:
    """Linears over the same input run as one matmul (q/k/v, gate/up): their weights are
    concatenated once, after the model is loaded and moved, and each linear's weight becomes a
    view of its rows, so nothing is stored twice and the checkpoint names stay as they are."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self.weight = self.bias = None
        self.quant = None  # model/quant.py: the group's KeptLinear once the model is quantized

    def fuse(self) -> None:
        """Concatenate the weights (call after loading and after any .to())."""
        if any(m.bias is None for m in self.linears) != all(m.bias is None for m in self.linears):
            return  # bias on some only: keep them separate
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in self.linears])
            for m, w in zip(self.linears, self.weight.split(self.sizes)):
                m.weight.data = w
            if self.linears[0].bias is not None:
                self.bias = torch.cat([m.bias for m in self.linears])
                for m, b in zip(self.linears, self.bias.split(self.sizes)):
                    m.bias.data = b

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.quant is not None:
            return self.quant(x).split(self.sizes, dim=-1)
        if self.weight is None:
            return tuple(m(x) for m in self.linears)
        return nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def fuse_projections(model: nn.Module) -> None:
    """Fuse every module's `Fused` groups (modules list them in `fused`)."""
    for module in model.modules():
        for group in getattr(module, "fused", ()):
            group.fuse()


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up = Fused(self.gate_proj, self.up_proj)
        self.fused = [self.gate_up]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(nn.functional.silu(gate) * up)
