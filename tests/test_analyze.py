"""`kvserve analyze`: the K/V-work formula, FLOP counts by hand, and the engine's counted rows."""

import json

import pytest

from kvserve.kv import sizing
from kvserve.tools import analyze
from kvserve.tools.analyze import attention_span_sum, flops_per_token, total_flops
from kvserve.tools.presets import get_model_preset

SMOL = get_model_preset("SmolLM2-135M")  # 30 layers, hidden 576, 9 heads / 3 KV heads x 64, MLP 1536


def cli(argv, capsys):
    """Run `kvserve ARGV` through the real entry point; (exit code, stdout, stderr)."""
    from kvserve.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_work_avoided_matches_its_derivation():
    for n in (1, 2, 3, 10, 100, 1000):
        without = sum(range(1, n + 1))            # step t recomputes t rows: N(N+1)/2 in all
        assert sizing.kv_projection_rows(1, n, cached=False) == without == n * (n + 1) // 2
        assert sizing.kv_projection_rows(1, n, cached=True) == n
        assert sizing.kv_work_avoided(n) == pytest.approx(1 - n / without)
        assert sizing.kv_work_avoided(n) == pytest.approx((n - 1) / (n + 1))
    assert sizing.kv_work_avoided(100) == pytest.approx(9900 / 10100)   # 98.02%


def test_rows_with_a_prompt():
    # P = 5, N = 4: cache 5 + 3 = 8 rows; no cache 5 + 6 + 7 + 8 = 26 = 4*5 + 4*3/2
    assert sizing.kv_projection_rows(5, 4, cached=True) == 8
    assert sizing.kv_projection_rows(5, 4, cached=False) == 26
    assert sizing.kv_projection_rows(5, 0, cached=False) == 0


def test_flops_per_token_by_hand_smollm2():
    f = flops_per_token(SMOL, 20, cached=True)
    assert f["QKV projections"] == 30 * 2 * 576 * 64 * (9 + 2 * 3) == 33177600
    assert f["attention (scores + weighted sum)"] == 30 * 4 * 9 * 64 * 20 == 1382400
    assert f["output projection"] == 30 * 2 * 576 * 576
    assert f["MLP"] == 30 * 2 * 3 * 576 * 1536 == 159252480
    assert f["LM head"] == 2 * 576 * 49152
    g = flops_per_token(SMOL, 20, cached=False)
    assert g["QKV projections"] == 20 * f["QKV projections"]
    assert g["MLP"] == 20 * f["MLP"]
    assert g["attention (scores + weighted sum)"] == 30 * 4 * 9 * 64 * (20 * 21 // 2)
    assert g["LM head"] == f["LM head"]  # only the last row's logits are needed


def test_total_flops_sums_positions():
    n = 7
    with_cache = total_flops(SMOL, n, cached=True)
    assert with_cache["MLP"] == n * flops_per_token(SMOL, 1, True)["MLP"]
    without = total_flops(SMOL, n, cached=False)
    assert without["MLP"] == (n * (n + 1) // 2) * flops_per_token(SMOL, 1, True)["MLP"]


def test_sliding_window_attention():
    assert attention_span_sum(10, 4) == 1 + 2 + 3 + 4 + 6 * 4 == 34
    assert attention_span_sum(3, 4) == 6 and attention_span_sum(5) == 15
    gemma = get_model_preset("Gemma-3-270M")  # 15 local (window 512) + 3 global, 4 heads x 256
    f = flops_per_token(gemma, 1000, cached=True)
    assert f["attention (scores + weighted sum)"] == 4 * 4 * 256 * (3 * 1000 + 15 * 512)


def test_bad_input():
    with pytest.raises(ValueError, match="tokens"):
        analyze.analysis(SMOL, 0)
    with pytest.raises(ValueError, match="MLA"):
        analyze.analysis(get_model_preset("DeepSeek-V3"), 10)


def test_cli_text_json_plot(tmp_path, capsys):
    code, out, _ = cli(["analyze", "--tokens", "100", "--model", "SmolLM2-135M"], capsys)
    assert code == 0
    assert "98.02% avoided" in out and "(N^2 - N)/(N^2 + N)" in out and "N(N+1)/2" in out
    assert "LM head" in out and "What this leaves out" in out and "memory traffic" in out
    code, out, _ = cli(["analyze", "--tokens", "10", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["kv_rows_without_cache"] == 55 and data["kv_rows_with_cache"] == 10
    png = tmp_path / "a.png"
    code, _, _ = cli(["analyze", "--tokens", "30", "--plot", str(png)], capsys)
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 1000
    code, _, err = cli(["analyze", "--tokens", "-3"], capsys)
    assert code == 2 and "tokens" in err
    code, _, err = cli(["analyze", "--model", "smollm3"], capsys)
    assert code == 2 and "Did you mean" in err


def test_measured_rows_equal_formula(bundled_model_path):
    m = analyze.measure(tokens=6, prompt="Hello there", kv_cache_memory="64MiB", max_model_len=1024)
    c, u = m["with_cache"], m["without_cache"]
    p, n = c["prompt_tokens"], c["generation_tokens"]
    assert n == 6 and u["generation_tokens"] == 6 and u["prompt_tokens"] == p
    assert c["kv_projection_rows"] == sizing.kv_projection_rows(p, n, cached=True) == p + n - 1
    assert u["kv_projection_rows"] == sizing.kv_projection_rows(p, n, cached=False)
    assert m["measured_saving"] == pytest.approx(m["formula_saving"])
    assert m["same_tokens"]
    assert "measured" in analyze.format_measure(m)
