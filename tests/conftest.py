"""Shared, expensive fixtures: the bundled GGUF and its transformers reference model/tokenizer."""

import os

import pytest
import torch


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    """Absolute path of the bundled SmolLM2-135M-Instruct GGUF (`make test` installs it)."""
    from kvserve.model.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def hf_model(bundled_model_path):
    """transformers' LlamaForCausalLM loaded from the bundled GGUF in float32 (loaded once)."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(bundled_model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(bundled_model_path):
    """transformers' tokenizer built from the bundled GGUF (loaded once)."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(bundled_model_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def llm():
    """kvserve on the bundled model with a small paged pool (shared by tests; leaves it idle)."""
    from kvserve import LLM

    return LLM(kv_cache_memory="128MiB", max_model_len=2048)


@pytest.fixture(scope="session")
def llm_nocache():
    """The oracle: the same model recomputing the whole sequence at every step."""
    from kvserve import LLM

    return LLM(kv_cache_mode="none", max_model_len=2048)
