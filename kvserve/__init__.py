"""kvserve: an LLM inference engine built around the KV cache."""

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import BeamSearchParams, KVRetention, RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "KVRetention", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":  # import torch-heavy modules only when needed
        from kvserve.llm import LLM
        return LLM
    raise AttributeError(name)
