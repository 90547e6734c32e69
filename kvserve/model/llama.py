"""Llama-family decoders (Llama, Qwen2, Qwen3, Mistral: RMSNorm, RoPE, GQA/MQA, SwiGLU) over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionMetadata, attend
from kvserve.kv.spec import FullSpec, KVSpec, SlidingWindowSpec
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.layers import Fused, GatedMLP, RMSNorm, RotaryEmbedding, embedding
from kvserve.model.regions import EAGER


def layer_spec(cfg: ModelConfig, layer: int) -> KVSpec:
    """Full attention, or a sliding window where the config puts one on this layer."""
    kinds = cfg.layer_kinds() if hasattr(cfg, "layer_kinds") else ["full"] * cfg.num_layers
    window = getattr(cfg, "sliding_window", None)
    if kinds[layer] == "sliding" and window:
        return SlidingWindowSpec(cfg.num_kv_heads, cfg.head_dim, window=window)
    return FullSpec(cfg.num_kv_heads, cfg.head_dim)


class LlamaAttention(nn.Module):
    """Self-attention with grouped K/V heads (optional QKV bias, q/k norm, sliding window)."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_bias = cfg.attention_bias or cfg.architecture == "qwen2"
        o_bias = cfg.attention_bias and cfg.architecture != "qwen2"
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        self.qkv = Fused(self.q_proj, self.k_proj, self.v_proj)
        self.fused = [self.qkv]
        if getattr(cfg, "qk_norm", False):
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.spec = layer_spec(cfg, layer)
        self.window = self.spec.visible_window
        self.scale = self.head_dim ** -0.5
        self.rope = rope
        self.kv_rows = 0  # token rows pushed through k_proj/v_proj (instrumented, for `analyze`)

    def shift_keys(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Cached keys [m, kv_heads, head_dim] rotated at p -> rotated at p - delta (KV eviction)."""
        return self.rope.shift(k, delta)

    def project(self, x, positions):
        """Q [n, heads, head_dim] and K, V [n, kv_heads, head_dim] of the new tokens, rotated."""
        n = x.shape[0]
        q, k, v = self.qkv(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        return q, k, v

    def attend(self, q, k, v, meta: AttentionMetadata):
        """Write K/V to the cache and attend (the layer's backend); out [n, heads, head_dim]."""
        self.kv_rows += q.shape[0]
        return attend(q, k, v, self.layer, meta, self.scale, self.window)

    def forward(self, x, positions, meta: AttentionMetadata):
        o = self.attend(*self.project(x, positions), meta)
        return self.o_proj(o.flatten(1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, rope)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def pre_attention(self, x, positions):
        return self.self_attn.project(self.input_layernorm(x), positions)

    def post_attention(self, x, o):
        x = x + self.self_attn.o_proj(o.flatten(1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, positions, meta):
        return self.post_attention(x, self.self_attn.attend(*self.pre_attention(x, positions), meta))


class LlamaModel(nn.Module):
    """The decoder stack."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.regions = EAGER  # model/regions.py: eager or compiled

    def forward(self, input_ids, positions, meta):
        return self.norm(self.regions.run(self.layers, self.embed_tokens(input_ids), positions, meta))


class LlamaForCausalLM(CausalLM):
    """Decoder + LM head; logits only for the rows asked for."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, LlamaModel(cfg))
