"""Shared, expensive fixtures: the bundled GGUF and its transformers reference model/tokenizer."""

import os

import pytest
import torch


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    """Absolute path of the bundled SmolLM2-135M-Instruct GGUF (skips when not installed)."""
    from kvserve.model.loader import resolve_model_path

    try:
        return resolve_model_path(None)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(str(exc))


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
