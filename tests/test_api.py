"""The offline API surface: chat, prompt forms, dtypes, pool sizing, the CLI."""

import logging
import os
import subprocess
import sys

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import parse_bytes
from kvserve.engine.memory import plan_pool

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def test_prompt_forms_agree(llm):
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    a, b, c = llm.generate([text, ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.prompt_token_ids == ids and a.prompt == text


def test_chat_uses_template_and_reuses_prefix(llm):
    llm.reset_prefix_cache()
    conv = [{"role": "user", "content": "Name a fruit that is yellow."}]
    first = llm.chat(conv, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True)
    assert first.prompt_token_ids == expected
    conv2 = conv + [{"role": "assistant", "content": first.outputs[0].text},
                    {"role": "user", "content": "And a red one?"}]
    second = llm.chat(conv2, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert second.num_cached_tokens >= 16  # the earlier turn's full blocks came from the cache


def test_bfloat16_halves_kv_bytes():
    bf = LLM(dtype="bfloat16", kv_cache_memory="32MiB", max_model_len=256)
    assert bf.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    out = bf.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_pool_size_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        LLM(kv_cache_memory="64MiB", max_model_len=512, dtype="float32")
    line = next(r.message for r in caplog.records if r.message.startswith("KV cache"))
    blocks = (64 << 20) // (16 * 46080)
    assert f"{blocks} blocks x 16 tokens = {blocks * 16} tokens" in line
    assert f"max concurrency at max_model_len=512: {blocks * 16 / 512:.1f}x" in line


def test_utilization_budget_subtracts_activation_peak():
    plan = plan_pool(None, 0.5, __import__("torch").device("cpu"), weight_bytes=10, activation_bytes=1 << 20,
                     block_size=16, bytes_per_token=1000)
    assert plan.budget_bytes > 0
    assert plan.num_blocks == plan.budget_bytes // 16000
    fixed = plan_pool(4 << 20, None, __import__("torch").device("cpu"), 0, 0, 16, 1000)
    assert fixed.num_blocks == (4 << 20) // 16000


def test_gpu_memory_utilization_on_cpu_measures_warmup():
    small = LLM(gpu_memory_utilization=0.02, max_model_len=256, max_num_batched_tokens=256, dtype="float32")
    assert "gpu_memory_utilization=0.02" in small.engine.pool_plan.source
    assert small.get_metrics()["num_blocks_total"] >= 16


@pytest.mark.parametrize("text, value", [("2GiB", 2 << 30), ("512 MiB", 512 << 20), ("1GB", 10**9), (4096, 4096)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def _kvserve(*args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, **kw)


def test_cli_generate():
    r = _kvserve("generate", "The capital of France is", "--max-tokens", "5", "--quiet",
                 "--kv-cache-memory", "64MiB", "--max-model-len", "512")
    assert r.returncode == 0, r.stderr
    assert "The capital of France is Paris" in r.stdout
    assert "cold start to first token" in r.stderr


def test_cli_bad_input_exits_cleanly():
    r = _kvserve("generate", "hi", "--max-tokens", "0", "--quiet", "--kv-cache-memory", "64MiB",
                 "--max-model-len", "512")
    assert r.returncode == 2 and "max_tokens" in r.stderr and "Traceback" not in r.stderr


def test_cli_chat_keeps_conversation_and_reports_cache():
    r = _kvserve("chat", "--max-tokens", "8", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                 input="Name a yellow fruit.\nAnd a red one?\n\n")
    assert r.returncode == 0, r.stderr
    counts = [line for line in r.stdout.splitlines() if "from cache" in line]
    assert len(counts) == 2
    cached_second = int(counts[1].split(",")[1].split()[0])
    assert cached_second >= 16


def test_progress_bar_shows_live_prompt_and_output_rates(llm, capsys):
    import re
    llm.reset_prefix_cache()
    before = llm.engine.stats.prompt_tokens_computed
    out = llm.generate(["The capital of France is", "A short poem about the sea:"],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=True)
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in out)
    assert llm.engine.stats.prompt_tokens_computed - before == computed
    rates = re.findall(r"input: ([\d.]+) toks/s, output: ([\d.]+) toks/s", capsys.readouterr().err)
    assert rates and float(rates[-1][0]) > 0 and float(rates[-1][1]) > 0
