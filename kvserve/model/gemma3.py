"""Gemma 3 text decoder: interleaved sliding-window (local) and full (global) layers."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import attend
from kvserve.kv.spec import FullSpec, SlidingWindowSpec
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.layers import Fused, RotaryEmbedding, embedding
from kvserve.model.regions import EAGER


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up = Fused(self.gate_proj, self.up_proj)
        self.fused = [self.gate_up]

    def forward(self, x):
        gate, up = self.gate_up(x)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(nn.Module):
    """Attention with q/k norm; local layers see a sliding window and use the local RoPE base."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, sliding: bool):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias)
        self.qkv = Fused(self.q_proj, self.k_proj, self.v_proj)
        self.fused = [self.qkv]
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.rope = rope
        self.scale = (cfg.query_pre_attn_scalar or d) ** -0.5
        self.spec = (SlidingWindowSpec(cfg.num_kv_heads, d, window=cfg.sliding_window) if sliding
                     else FullSpec(cfg.num_kv_heads, d))
        self.window = self.spec.visible_window
        self.kv_rows = 0

    def shift_keys(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Cached keys [m, kv_heads, head_dim] rotated at p -> rotated at p - delta (KV eviction)."""
        return self.rope.shift(k, delta)

    def project(self, x, positions):
        """Q [n, heads, head_dim] and K, V [n, kv_heads, head_dim] of the new tokens, normed and rotated."""
        n = x.shape[0]
        q, k, v = self.qkv(x)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        return q, k, v

    def attend(self, q, k, v, meta):
        """Write K/V to the cache and attend (the layer's backend); out [n, heads, head_dim]."""
        self.kv_rows += q.shape[0]
        return attend(q, k, v, self.layer, meta, self.scale, self.window)

    def forward(self, x, positions, meta):
        o = self.attend(*self.project(x, positions), meta)
        return self.o_proj(o.flatten(1))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms around attention and MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, sliding: bool):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, layer, rope, sliding)
        self.mlp = GemmaMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def pre_attention(self, x, positions):
        return self.self_attn.project(self.input_layernorm(x), positions)

    def post_attention(self, x, o):
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(o.flatten(1)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def forward(self, x, positions, meta):
        return self.post_attention(x, self.self_attn.attend(*self.pre_attention(x, positions), meta))


class Gemma3Model(nn.Module):
    """Scaled embeddings, the layer stack, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        kinds = cfg.layer_kinds()
        global_rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        local_rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                     cfg.rope_local_theta or cfg.rope_theta, None)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, local_rope if kinds[i] == "sliding" else global_rope, kinds[i] == "sliding")
            for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.regions = EAGER  # model/regions.py: eager or compiled

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return self.norm(self.regions.run(self.layers, x, positions, meta))


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text model with tied LM head and optional final logit soft-capping."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, Gemma3Model(cfg))
