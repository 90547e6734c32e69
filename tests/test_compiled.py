"""Compiled regions (kvserve/model/regions.py) against the eager model: the same logits and greedy
tokens, graphs shared by every layer, and the switches that keep a model eager."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.model.regions import EAGER, EAGER_ENV, WARMUP_TOKENS

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "A KV cache stores the keys and values of every past token so that"]


@pytest.fixture(scope="module")
def graphs_and_compiled():
    """(graphs compiled while building it, the bundled model with compiled regions)."""
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EAGER_ENV, "0")
        llm = LLM(kv_cache_memory="32MiB", max_model_len=512)
    return counters["stats"]["unique_graphs"] - before, llm


@pytest.fixture(scope="module")
def eager_int4():
    return LLM(kv_cache_memory="32MiB", max_model_len=512, enforce_eager=True)


def test_compiled_regions_stay_as_close_to_float32_as_eager(llm, graphs_and_compiled, eager_int4):
    """Teacher-forced against the float32 oracle, compiled int4 is as close as eager int4 (fused
    kernels round less often: eager rounds the int4 kernel's bfloat16 input and output on every
    layer), and the greedy tokens agree."""
    from kvserve.tools.evaluate import common_prefix, fidelity, run_forced
    _, compiled = graphs_and_compiled
    assert compiled.engine.compiled and compiled.engine.model.model.regions is not EAGER
    assert eager_int4.engine.model.model.regions is EAGER
    ids = compiled.engine.tokenizer.encode(" ".join(PROMPTS) * 2)
    forced = [(ids[:20], ids[20:52])]
    targets = torch.tensor(ids[20:52])
    oracle = run_forced(llm, forced, [])[0][0]
    kl = {}
    for name, engine in (("compiled", compiled), ("eager", eager_int4)):
        f = fidelity(oracle, run_forced(engine, forced, [])[0][0], targets)
        kl[name] = sum(f["kl"]) / len(f["kl"])
        assert sum(f["top1"]) / len(f["top1"]) >= 0.9, name
    assert kl["compiled"] < 2e-3 and kl["compiled"] <= 1.5 * kl["eager"] + 1e-4, kl
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = compiled.generate(PROMPTS, greedy, use_tqdm=False)    # batched decode steps: the dynamic graph
    want = eager_int4.generate(PROMPTS, greedy, use_tqdm=False)
    same = [common_prefix(o.outputs[0].token_ids, w.outputs[0].token_ids) for o, w in zip(out, want)]
    assert min(same) >= 4 and sum(same) >= 32, same


def test_every_layer_shares_the_regions_graphs(graphs_and_compiled):
    graphs, compiled = graphs_and_compiled
    layers = compiled.engine.model_config.num_layers
    # three regions (first, between two layers, last), one graph each per warm-up shape at most
    assert 1 <= graphs <= 3 * len(WARMUP_TOKENS) < layers


def test_what_runs_eagerly(monkeypatch):
    monkeypatch.setenv(EAGER_ENV, "0")
    assert EngineConfig().compiles("int4")[0]
    assert EngineConfig(dtype="bfloat16").compiles("bfloat16")[0]
    assert EngineConfig(enforce_eager=True).compiles("int4") == (False, "enforce_eager=True")
    assert not EngineConfig(dtype="float32").compiles("float32")[0]   # the oracle
    monkeypatch.setenv(EAGER_ENV, "1")
    assert not EngineConfig().compiles("int4")[0]


def test_enforce_eager_is_a_flag():
    from kvserve.cli import build_parser
    args = build_parser().parse_args(["generate", "hi", "--enforce-eager"])
    assert args.enforce_eager is True
    assert build_parser().parse_args(["generate", "hi"]).enforce_eager is False


def test_a_failed_compile_leaves_the_model_eager(llm, monkeypatch, caplog):
    """Compiling that fails (say, no C++ compiler) logs why and keeps the model eager and working."""
    import logging

    import kvserve.model.regions as regions

    def broken(fn):
        def run(*args):
            raise RuntimeError("no compiler")
        return run

    model = llm.engine.model
    monkeypatch.setattr(regions, "_compile", broken)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert regions.compile_regions(model, llm.engine.device, show_progress=False) is False
    assert model.model.regions is EAGER and "no compiler" in caplog.text
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_batch_one_decode_runs_the_one_token_graph(graphs_and_compiled, eager_int4, monkeypatch):
    """A lone sequence decodes through the one-token stack graph (its attention runs as the opaque
    op, with the step's metadata in regions._STEP) and makes the eager model's greedy tokens."""
    import kvserve.model.regions as regions
    _, compiled = graphs_and_compiled
    attn = compiled.engine.model.model.layers[3].self_attn
    seen = []
    real = attn.attend

    def attend(q, k, v, meta):
        seen.append((q.shape[0], bool(regions._STEP)))
        return real(q, k, v, meta)
    monkeypatch.setattr(attn, "attend", attend)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = compiled.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    want = eager_int4.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert seen[0][0] > 1 and not seen[0][1]                  # the prompt: regions, attention eager
    assert [s for s in seen[1:]] == [(1, True)] * 11          # each decode step: the one-token graph
    assert out[:8] == want[:8]
