"""Architecture name -> model class."""

from __future__ import annotations

from torch import nn

from kvserve.model.config import ModelConfig
from kvserve.model.deepseek import DeepseekForCausalLM
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM,
                 "mistral": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM,
                 "deepseek_v2": DeepseekForCausalLM, "deepseek_v3": DeepseekForCausalLM}


def build_model(cfg: ModelConfig) -> nn.Module:
    """Instantiate the model class for `cfg.architecture`."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; "
                         f"supported: {', '.join(sorted(MODEL_CLASSES))}")
    return cls(cfg)
