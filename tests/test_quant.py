"""Weight formats (model/quant.py): kernels against the dequantized reference, and the engine end to end."""

import pytest
import torch

from kvserve.model import quant
from kvserve.model.quant import GROUP_SIZE, TILE_ROWS, F16Linear, Int4GroupLinear, make_linear


def _layer(fmt, n=96, k=128, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return w, b, make_linear(w, b, fmt)


@pytest.mark.parametrize("fmt,n", [("int8", 96), ("int4", 96), ("int4", 128)])
def test_dequantized_weight_is_within_half_a_step(fmt, n):
    w, _, q = _layer(fmt, n=n)
    err = (q.dequantize() - w).abs()
    if fmt == "int8":
        assert (err <= q.scale[:, None] / 2 + 1e-6).all()
    else:  # float16 scale and min per group of GROUP_SIZE: 2^-11 of |min| more
        step = q.group_scales().float().repeat_interleave(GROUP_SIZE, dim=1)
        low = q.mins.float().t().abs().repeat_interleave(GROUP_SIZE, dim=1)
        assert (err <= step / 2 + low * 2**-10 + 1e-6).all()
        assert isinstance(q, Int4GroupLinear)   # kvserve's CPU layout at any row count
    assert err.max() > 0  # it really is quantized


@pytest.mark.parametrize("fmt,n", [("float32", 96), ("bfloat16", 96), ("float16", 96), ("int8", 96),
                                   ("int4", 96), ("int4", 128)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, TILE_ROWS + 3])
def test_kernel_matches_the_dequantized_reference(fmt, n, rows):
    """Each kernel (int8 small-row kernel, widened path, int4 kernel) computes x W^T + b for the stored W."""
    w, b, q = _layer(fmt, n=n)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(1))
    ref = x.double() @ q.dequantize(torch.float64).T + b.double()
    out = q(x)
    assert out.dtype == torch.float32 and out.shape == (rows, w.shape[0])
    # bfloat16 activations in the CPU kernels: error ~ 2^-8 relative per product, summed over k=128
    tol = 1e-4 if fmt == "float32" else 0.08
    assert torch.allclose(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=0.02)


@pytest.mark.parametrize("fmt", ["int4", "float16", "bfloat16"])
def test_widened_paths_give_each_row_the_result_it_gets_alone(fmt, monkeypatch):
    """Many-row steps take another path (int4: a float32 matmul on the dequantized weight; 16-bit on a
    CPU without 16-bit units: float32 arithmetic): 16-bit rows get what they get in a one-row step
    (the kernel's roundings), up to the last bit of the 16-bit output; an int4 row's one-row result
    (its int16-quantized row) is within 1e-4 of the largest value of the exact product it gets with many."""
    monkeypatch.setattr(quant, "_native_half_cpu", lambda: False)
    w, b, q = _layer(fmt, n=128)
    x = torch.randn(TILE_ROWS + 3, w.shape[1], generator=torch.Generator().manual_seed(2))
    alone = torch.cat([q(x[i:i + 1]) for i in range(len(x))])
    together = q(x)
    if fmt == "int4":
        exact = x.double() @ q.dequantize(torch.float64).T + b.double()
        assert torch.allclose(together.double(), exact, rtol=1e-5, atol=1e-4)
        assert ((alone - together).abs() <= 1e-4 * (together - b).abs().max()).all()
        return
    ulp = 2 ** -8 if fmt != "float16" else 2 ** -11
    assert torch.allclose(alone, together, rtol=2 * ulp, atol=1e-3)


def test_int4_many_rows_run_a_bfloat16_matmul_where_the_cpu_has_bfloat16_units(monkeypatch):
    """With bfloat16 units, a step of more than TILE_ROWS rows multiplies in bfloat16 by the
    dequantized weight rounded to bfloat16: within a bfloat16 step (of the largest output) of the
    exact product and of each row's one-row result (the GEMV's int16 rows: within 1e-4)."""
    monkeypatch.setattr(quant, "_native_half_cpu", lambda: True)
    w, b, q = _layer("int4", n=128)
    x = torch.randn(TILE_ROWS + 3, w.shape[1], generator=torch.Generator().manual_seed(2))
    together = q(x)
    w_bf16 = q.dequantize().to(torch.bfloat16)
    assert torch.equal(together, torch.nn.functional.linear(x.to(torch.bfloat16), w_bf16).float() + b)
    alone = torch.cat([q(x[i:i + 1]) for i in range(len(x))])
    ref = x.double() @ q.dequantize(torch.float64).T + b.double()
    scale = ref.abs().max().item()
    err = {name: (y.double() - ref).abs().max().item() / scale for name, y in (("alone", alone), ("together", together))}
    assert err["alone"] < 1e-4 and err["together"] < 2 ** -7, err
    assert (alone - together).abs().max().item() / scale < 2 ** -7


def test_tied_head_reads_the_float32_embedding_for_many_rows(monkeypatch):
    """The float16 LM head of a tied model computes multi-row steps from the float32 embedding it
    shares (no widening, no extra copy), and a single row on the float16 weight: both agree."""
    monkeypatch.setattr(quant, "_native_half_cpu", lambda: False)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(64, 32)
    model = torch.nn.Module()
    model.embed, model.lm_head = emb, torch.nn.Linear(32, 64, bias=False)
    model.lm_head.weight = emb.weight
    quant.quantize_model(model, "int4")
    head = model.lm_head
    assert head.fmt == "float16" and head.tied[0] is emb.weight and head.wide_rows == 1
    x = torch.randn(5, 32)
    calls = []
    monkeypatch.setattr(torch.Tensor, "float", lambda t, *a, **k: calls.append(t.shape) or t.to(torch.float32))
    together = head(x)
    assert (64, 32) not in calls                       # the weight was not widened
    monkeypatch.undo()
    alone = torch.cat([head(x[i:i + 1]) for i in range(5)])
    # they differ by the float16 rounding of the weights (2^-12 relative) summed over 32 products,
    # and of the outputs (2^-11 relative)
    assert torch.allclose(alone, together, rtol=2 ** -9 + 2 ** -11, atol=32 ** 0.5 * 2 ** -11)
    assert quant.weight_bytes(model) == emb.weight.numel() * 4 + head.weight.numel() * 2


def test_int8_result_of_a_row_does_not_depend_on_the_rows_beside_it():
    """Above SMALL_ROWS the widened path applies the kernel's roundings: batch-invariant results."""
    w, b, q = _layer("int8")
    x = torch.randn(quant.SMALL_ROWS + 8, w.shape[1])
    alone = torch.cat([q(x[i:i + 1]) for i in range(len(x))])
    together = q(x)
    assert torch.allclose(alone, together, rtol=0, atol=1e-5 * together.abs().max().item() + 0.02)
    exact = x @ q.dequantize().T + b                   # float32 throughout: no bfloat16 rounding
    assert not torch.allclose(together, exact, atol=1e-5)
    assert torch.allclose(together, exact, rtol=0.02, atol=0.1)


@pytest.mark.parametrize("k", [8, 24, 40])
def test_int8_any_width_is_computed_right(k):
    """Widths the CPU int8 kernel cannot take (not a multiple of 16) take the widened path."""
    w, b, q = _layer("int8", n=24, k=k)
    x = torch.randn(3, k)
    ref = x @ q.dequantize().T + b
    assert torch.allclose(q(x), ref, rtol=0.02, atol=0.05)


def test_int4_refuses_a_width_it_cannot_group():
    with pytest.raises(ValueError, match="divisible by 32"):
        make_linear(torch.randn(8, 40), None, "int4")


def test_quantized_layer_holds_fewer_bytes():
    sizes = {fmt: _layer(fmt, n=256, k=256, bias=False)[2].nbytes for fmt in ("float32", "int8", "int4")}
    assert sizes["int8"] < sizes["float32"] / 3
    assert sizes["int4"] < sizes["float32"] / 6 < sizes["int8"]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_bfloat16_copy_serves_steps_of_many_rows(fmt):
    """add_bf16_copy keeps the stored weight rounded to bfloat16 once; steps of more than COPY_ROWS
    rows read it (one bfloat16 GEMM), fewer rows keep the quantized kernel; its bytes are counted."""
    w, b, q = _layer(fmt, n=128, k=128)
    before = q.nbytes
    small, many = torch.randn(quant.COPY_ROWS, 128), torch.randn(quant.COPY_ROWS + 1, 128)
    small_out = q(small)
    q.add_bf16_copy()
    assert q.nbytes == before + 2 * 128 * 128
    assert torch.equal(q.bf16_t, q.dequantize().t().to(torch.bfloat16))
    torch.testing.assert_close(q(small), small_out, rtol=0, atol=0)          # the kernel as before
    want = (many.bfloat16().float() @ q.bf16_t.float()).bfloat16().float() + b
    torch.testing.assert_close(q(many), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q(many), many @ q.dequantize().t() + b, rtol=0.05, atol=0.5)  # still the layer


def test_the_engine_adds_bfloat16_copies_when_asked(monkeypatch):
    """bf16_weight_copy: 'on' always, 'off' never, 'auto' on a CPU with bfloat16 units when the copy
    fits in a quarter of the available RAM, for the layers that do not widen per call in C++ (the
    int4 groups do where the C++ ops build; int8 per channel does not); fused groups' layers included."""
    from kvserve.config import EngineConfig
    from kvserve.engine import builder
    from kvserve.model.layers import Fused

    def model():
        m = torch.nn.Module()
        m.plain = make_linear(torch.randn(64, 64), None, "int4")
        m.fused = [Fused(torch.nn.Linear(64, 32))]
        m.fused[0].quant = make_linear(torch.randn(32, 64), None, "int8")
        m.head = make_linear(torch.randn(64, 64), None, "float16")
        return m

    def copies(mode, **patch):
        for name, value in patch.items():
            monkeypatch.setattr(builder, name, value)
        m = model()
        builder._bf16_copies(EngineConfig(bf16_weight_copy=mode), m, torch.device("cpu"))
        return [layer.bf16_t is not None for layer in (m.plain, m.fused[0].quant, m.head)]
    assert copies("on", slow_half=lambda d: True) == [True, True, False]
    assert copies("off", slow_half=lambda d: False) == [False, False, False]
    assert copies("auto", slow_half=lambda d: True) == [False, False, False]       # no bfloat16 units
    int4_widens = model().plain.widens
    assert int4_widens == quant.q4g_kernel(torch.device("cpu"))
    want = [not int4_widens, True, False]
    assert copies("auto", slow_half=lambda d: False, device_memory=lambda d: 1 << 30) == want
    need = 2 * (32 * 64 + (0 if int4_widens else 64 * 64))
    assert copies("auto", device_memory=lambda d: 4 * need - 4) == [False, False, False]
    with pytest.raises(ValueError, match="bf16_weight_copy"):
        EngineConfig(bf16_weight_copy="yes").validate()


@pytest.fixture(scope="module")
def llm_int8():
    from kvserve import LLM
    return LLM(weights="int8", dtype="float32", kv_cache_memory="64MiB", max_model_len=1024, bf16_weight_copy="off")


def test_int8_engine_tracks_float32_logits(llm, llm_int8):
    """Teacher-forced on the same text, int8 weights stay close to the float32 oracle."""
    from kvserve.tools.evaluate import fidelity, run_forced
    tok = llm.engine.tokenizer
    ids = tok.encode("The key-value cache stores the keys and values of every past token, so that each new "
                     "token only computes its own projections and attends over what is stored. " * 3)
    forced = [(ids[:48], ids[48:80])]
    ref, _ = run_forced(llm, forced, [])
    got, _ = run_forced(llm_int8, forced, [])
    f = fidelity(ref[0], got[0], torch.tensor(ids[48:80]))
    assert sum(f["kl"]) / len(f["kl"]) < 0.02
    assert sum(f["top1"]) / len(f["top1"]) >= 0.9
    assert llm_int8.engine.weight_format == "int8"
    from kvserve.model.quant import quant_layers, weight_bytes
    body = [m for m in quant_layers(llm_int8.engine.model) if m.fmt == "int8"]   # fused groups included
    assert len(body) == 4 * llm.engine.model_config.num_layers
    assert sum(m.nbytes for m in body) < 0.3 * sum(4 * m.in_features * m.out_features for m in body)
    # the float32 embedding and the float16 head stay: about half the float32 model's bytes in all
    assert weight_bytes(llm_int8.engine.model) < 0.6 * weight_bytes(llm.engine.model)
    head = llm_int8.engine.model.lm_head      # float16: the GGUF's Q8_0 head held almost exactly
    assert isinstance(head, F16Linear) and head.fmt == "float16"
    full = llm.engine.model.lm_head.weight
    assert (head.dequantize() - full).abs().max() <= full.abs().max() * 2 ** -11


def test_int8_cached_decode_equals_recompute(llm_int8):
    """The cache invariant holds with quantized weights: teacher-forced cached decode gives the
    logits of a no-cache recompute of the whole sequence at every step."""
    from kvserve import LLM
    from kvserve.tools.evaluate import fidelity, run_forced
    plain = LLM(weights="int8", dtype="float32", kv_cache_mode="none", max_model_len=1024)
    ids = llm_int8.engine.tokenizer.encode("A KV cache holds the keys and values of every token seen so far, "
                                           "so a decode step computes one new row per layer.")
    forced = [(ids[:6], ids[6:22])]
    (cached,), _ = run_forced(llm_int8, forced, [])
    (recomputed,), _ = run_forced(plain, forced, [])
    f = fidelity(recomputed, cached, torch.tensor(ids[6:22]))
    assert max(f["kl"]) < 2e-3
    # bfloat16 logits (an ulp is 1/16 at 12), and every int8 layer rounds its input to bfloat16: the
    # two paths' float32 attention sums differ in the last bits (cache kernel vs full attention),
    # which flips some of those roundings. Mean: ~1 ulp; worst logit: a few ulps (0.39 and 0.58
    # with two decode kernels of equal float64 error, 1.4e-7 mean).
    diff = (cached - recomputed).abs()
    assert diff.mean() < 0.15 and diff.max() < 1.0


def test_weights_option_reaches_the_engine_from_the_cli():
    from kvserve.cli import build_parser
    from kvserve.engine_args import engine_kwargs
    args = build_parser().parse_args(["generate", "hi", "--weights", "int4", "--dtype", "bfloat16"])
    kw = engine_kwargs(args)
    assert kw["weights"] == "int4" and kw["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--weights", "int3"])


def test_auto_weights_follow_an_explicit_dtype_and_keep_each_gguf_tensors_blocks_on_cpu():
    from kvserve.config import EngineConfig
    assert EngineConfig(dtype="float32").weight_format(gguf=True)[0] == "float32"
    assert EngineConfig(dtype="bfloat16").weight_format()[0] == "bfloat16"
    cpu = EngineConfig(device="cpu")
    assert cpu.weight_format(gguf=True)[0] == "gguf"       # every tensor in its own block format
    assert cpu.weight_format(gguf=False)[0] == "float32"   # safetensors: float stays float
    assert EngineConfig(device="cpu", weights="int4").weight_format(gguf=True)[0] == "int4"
    with pytest.raises(ValueError, match="not a .gguf file"):
        EngineConfig(device="cpu", weights="gguf").weight_format(gguf=False)
    with pytest.raises(ValueError, match="weights must be"):
        EngineConfig(weights="int3").validate()


def test_default_engine_keeps_the_bundled_gguf_in_its_own_blocks_and_says_so(caplog):
    from kvserve import LLM, SamplingParams
    with caplog.at_level("INFO", logger="kvserve"):
        llm = LLM(kv_cache_memory="32MiB", max_model_len=512)
    assert llm.engine.weight_format == "gguf"
    assert any("weights: gguf" in r.message and "Q4_1 x 210" in r.message and "Q8_0 x 1" in r.message
               for r in caplog.records)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].text.strip()


def test_unknown_llm_option_names_the_options():
    from kvserve import LLM
    with pytest.raises(TypeError, match="kv_cache_memory"):
        LLM(kv_cache_memroy="1GiB")


def test_eval_weights_measures_a_format_against_float32():
    from kvserve.tools.evaluate_weights import evaluate_weights, spec_options, table_rows
    assert spec_options("bfloat16:int4") == {"dtype": "bfloat16", "weights": "int4"}
    assert spec_options("int8") == {"dtype": "float32", "weights": "int8"}
    with pytest.raises(ValueError, match="bad weight spec"):
        spec_options("int3")
    (res,) = evaluate_weights(None, ["int8"], context=48, score_tokens=8, samples=1, log=lambda _: None)
    assert (res.weights, res.dtype, res.scored_tokens) == ("int8", "float32", 8)
    assert 0 < res.mean_kl < 0.05 and res.top1 >= 0.75
    assert res.weight_mib < 300    # 513 MiB in float32 (the float32 embedding and float16 head stay)
    assert table_rows([res])[0][-1] == ("pass" if res.passes_gate else "fail")


def test_cpu_engines_ask_malloc_to_keep_freed_memory(monkeypatch):
    """glibc takes both settings (the engine calls this when it loads a model on the CPU); the
    environment switch turns it off."""
    import platform

    from kvserve.engine.builder import keep_freed_memory, read_environment
    if platform.libc_ver()[0] == "glibc":
        assert keep_freed_memory(read_environment().malloc_tuning) is True
    monkeypatch.setenv("KVSERVE_MALLOC_TUNING", "0")
    assert keep_freed_memory(read_environment().malloc_tuning) is False
