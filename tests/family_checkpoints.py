"""Tiny random-weight checkpoints of each supported model family, saved by transformers.

`make_tiny_checkpoint(family, tmp_path)` builds a small model with transformers (fixed seed),
perturbs every parameter and buffer that transformers saves (norm weights get 1 + noise, or
noise alone where the norm is applied as `1 + weight`), and `save_pretrained`s it as
safetensors. Tests load the folder in kvserve and compare with transformers' own forward.
"""

from __future__ import annotations

from pathlib import Path

import torch

SEED = 0
NOISE = 0.05

# Shapes every family shares: small enough to build and run in a second on a CPU.
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Per family: (transformers config class, model class, config overrides on top of COMMON).
FAMILY_SPECS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, tie_word_embeddings=False)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=1,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            topk_method="greedy",
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
}

# Variants: a family plus overrides (MQA: one K/V head shared by all query heads).
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama_mqa": ("llama", dict(num_key_value_heads=1)),
    "qwen2_mqa": ("qwen2", dict(num_key_value_heads=1)),
}

FAMILIES = tuple(FAMILY_SPECS)
ALL_CHECKPOINTS = FAMILIES + tuple(VARIANTS)
# Families whose RMSNorm multiplies by (1 + weight): their norm weights are noise around 0.
OFFSET_NORM_FAMILIES = {"gemma3"}


def tiny_config(family: str, **overrides):
    """The transformers config of a tiny `family` model (a name of ALL_CHECKPOINTS)."""
    import transformers

    if family in VARIANTS:
        base, variant_overrides = VARIANTS[family]
        return tiny_config(base, **{**variant_overrides, **overrides})
    if family not in FAMILY_SPECS:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(ALL_CHECKPOINTS)}")
    config_cls, _, family_overrides = FAMILY_SPECS[family]
    kwargs = {**COMMON, **family_overrides, **overrides}
    return getattr(transformers, config_cls)(**kwargs)


def tiny_model(family: str, seed: int = SEED, **overrides):
    """A tiny random-weight transformers model of `family` in float32, eval mode."""
    import transformers

    config = tiny_config(family, **overrides)
    base = VARIANTS[family][0] if family in VARIANTS else family
    model_cls = getattr(transformers, FAMILY_SPECS[base][1])
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _perturb(model, offset_norms=base in OFFSET_NORM_FAMILIES, seed=seed)
    return model


def make_tiny_checkpoint(family: str, tmp_path, **overrides) -> str:
    """Build a tiny random `family` model with transformers, save it (safetensors) and return the folder."""
    model = tiny_model(family, **overrides)
    folder = Path(tmp_path) / f"tiny-{family}"
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


@torch.no_grad()
def _perturb(model, offset_norms: bool, seed: int) -> None:
    """Make every saved tensor non-trivial, so a missing or misapplied weight changes the logits."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point():
            continue
        noise = torch.randn(tensor.shape, generator=gen) * NOISE
        if "norm" in name or name.endswith("e_score_correction_bias"):
            base = 0.0 if offset_norms or "correction_bias" in name else 1.0
            tensor.data.copy_(base + noise)
        elif tensor.abs().max() == 0:  # biases and other zero-initialised tensors
            tensor.data.copy_(noise)
