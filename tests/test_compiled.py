"""Compiled regions (kvserve/model/regions.py) against the eager model: the same logits and greedy
tokens, graphs shared by every layer, and the switches that keep a model eager."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EAGER_ENV, EngineConfig
from kvserve.engine.builder import read_environment
from kvserve.model.regions import EAGER, WARMUP_TOKENS

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "A KV cache stores the keys and values of every past token so that"]


@pytest.fixture(scope="module")
def graphs_and_compiled():
    """(graphs compiled while building it, the bundled model with compiled regions, graphs traced by
    AOTAutograd meanwhile); the native decode stack off (tests/test_native_stack.py), so that decode
    steps run the stack graphs, as they do for the models it does not run."""
    from torch._dynamo.utils import counters
    before, traced = counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EAGER_ENV, "0")
        llm = LLM(kv_cache_memory="32MiB", max_model_len=512, compile_mode="blocking", native_stack="off")
    return counters["stats"]["unique_graphs"] - before, llm, counters["aot_autograd"]["total"] - traced


@pytest.fixture(scope="module")
def eager_int4():
    return LLM(kv_cache_memory="32MiB", max_model_len=512, enforce_eager=True)


def test_compiled_regions_stay_as_close_to_float32_as_eager(llm, graphs_and_compiled, eager_int4):
    """Teacher-forced against the float32 oracle, compiled int4 is as close as eager int4 (fused
    kernels round less often: eager rounds the int4 kernel's bfloat16 input and output on every
    layer), and the greedy tokens agree."""
    from kvserve.tools.evaluate import common_prefix, fidelity, run_forced
    _, compiled, _ = graphs_and_compiled
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
    graphs, compiled, _ = graphs_and_compiled
    layers = compiled.engine.model_config.num_layers
    # three regions (first, between two layers, last), one graph each per warm-up shape at most
    assert 1 <= graphs <= 3 * len(WARMUP_TOKENS) < layers


def test_the_warm_up_traces_each_graph_once(graphs_and_compiled):
    """Every graph AOTAutograd traced is one the engine kept: dynamo never restarted a trace (it did
    for the few-row paged graph, whose attention op took a module's float as a symbolic float)."""
    graphs, _, traced = graphs_and_compiled
    assert traced == graphs


def test_what_runs_eagerly(monkeypatch):
    monkeypatch.setenv(EAGER_ENV, "0")
    assert EngineConfig().compiles("int4")[0]
    assert EngineConfig(dtype="bfloat16").compiles("bfloat16")[0]
    assert EngineConfig(enforce_eager=True).compiles("int4") == (False, "enforce_eager=True")
    assert not EngineConfig(dtype="float32").compiles("float32")[0]   # the oracle
    monkeypatch.setenv(EAGER_ENV, "1")   # read once where the engine is built, passed in as a value
    env = read_environment()
    assert env.enforce_eager and EngineConfig().compiles("int4", env.enforce_eager) == (False, f"{EAGER_ENV}=1")


def test_enforce_eager_is_a_flag():
    from kvserve.cli import build_parser
    args = build_parser().parse_args(["generate", "hi", "--enforce-eager"])
    assert args.enforce_eager is True
    assert build_parser().parse_args(["generate", "hi"]).enforce_eager is False


def test_batch_one_decode_runs_the_one_token_graph(graphs_and_compiled, eager_int4, monkeypatch):
    """A lone sequence decodes through the one-token paged graph (the cache written and read inside
    it: no layer's eager attention runs) and makes the eager model's greedy tokens; the LM head of
    a one-row step runs its group-wise int8 kernel."""
    _, compiled, _ = graphs_and_compiled
    model = compiled.engine.model
    regions_ = model.model.regions
    attn = model.model.layers[3].self_attn
    seen, graph_calls, head_rows = [], [], []
    real_attend, real_graph = attn.attend, regions_.one_token_paged
    (few, real_head), *more = model.lm_head.kernels   # the Q8_0 head's int8-group GEMV first

    def attend(q, k, v, meta):
        seen.append(q.shape[0])
        return real_attend(q, k, v, meta)

    def graph(layers, x, *args):
        graph_calls.append(x.shape[0])
        return real_graph(layers, x, *args)

    def head(layer, x):
        head_rows.append(x.shape[0])
        return real_head(layer, x)
    monkeypatch.setattr(attn, "attend", attend)
    monkeypatch.setattr(regions_, "one_token_paged", graph)
    monkeypatch.setattr(model.lm_head, "kernels", ((few, head), *more))
    rows_before = model.kv_rows
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = compiled.generate(PROMPTS[2], greedy, use_tqdm=False)[0]
    want = eager_int4.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    prompt = len(out.prompt_token_ids)
    assert seen == [prompt]                           # the prompt: regions, attention eager
    assert graph_calls == [1] * 11                    # each decode step: the one-token graph
    assert head_rows == [1] * 12                      # every step samples one row
    assert model.kv_rows - rows_before == prompt + 11  # K/V rows still counted (kvserve analyze)
    assert out.outputs[0].token_ids[:8] == want[:8]


def test_a_few_decodes_run_the_batched_paged_graph(graphs_and_compiled, monkeypatch):
    """Three sequences decoding together: each step's three rows run the few-row paged graph (the
    cache written and read inside it by the C++ decode op: no layer's eager attention runs for
    them), and every sequence gets the tokens it gets decoding alone through the one-token graph
    (each row's kernels do not depend on the rows beside it)."""
    _, compiled, _ = graphs_and_compiled
    model = compiled.engine.model
    regions_ = model.model.regions
    attn = model.model.layers[3].self_attn
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = [compiled.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    seen, graph_rows = [], []
    real_attend, real_graph = attn.attend, regions_.few_paged
    monkeypatch.setattr(attn, "attend", lambda q, k, v, meta: seen.append(q.shape[0]) or real_attend(q, k, v, meta))
    monkeypatch.setattr(regions_, "few_paged", lambda layers, x, *a: graph_rows.append(x.shape[0]) or
                        real_graph(layers, x, *a))
    rows_before = model.kv_rows
    out = compiled.generate(PROMPTS, greedy, use_tqdm=False)
    prompts = sum(len(o.prompt_token_ids) for o in out)
    assert graph_rows == [3] * 9 and sum(seen) == prompts        # decodes in the graph, prompts eagerly
    assert model.kv_rows - rows_before == prompts + 27
    assert [o.outputs[0].token_ids for o in out] == alone


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_one_token_paged_attention_matches_the_paged_reference(pool_dtype):
    """paged_decode_one (traced into the one-token graph) writes the new K/V at its slot and
    attends like paged_decode over the same blocks, grouped query heads included; bfloat16 pools
    under float32 queries store the new K/V rounded and attend in float32."""
    from kvserve.attention.metadata import DecodeChunks
    from kvserve.attention.paged import paged_decode, paged_decode_one
    torch.manual_seed(0)
    nb, bs, hkv, hq, d = 8, 4, 2, 6, 16
    k_pool, v_pool = torch.randn(nb, bs, hkv, d).to(pool_dtype), torch.randn(nb, bs, hkv, d).to(pool_dtype)
    q, k, v = torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    blocks = torch.tensor([5, 2, 7])                  # 10 tokens: the new one at position 9 (block 7, row 1)
    bias = torch.zeros(3 * bs)
    bias[10:] = float("-inf")
    slot = torch.tensor([7 * bs + 1])
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    ref_k[7, 1], ref_v[7, 1] = k[0].to(pool_dtype), v[0].to(pool_dtype)
    want = paged_decode(q, ref_k, ref_v, DecodeChunks(blocks, torch.tensor([0]), bias.view(1, 1, 1, -1), 1, True), 0.25)
    got = paged_decode_one(q, k, v, k_pool, v_pool, slot, blocks, torch.tensor([0, 10]), 0.25)
    assert torch.equal(k_pool, ref_k) and torch.equal(v_pool, ref_v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # by hand for head 4 (K/V head 1): softmax over the 10 visible positions
    keys = ref_k[blocks].view(-1, hkv, d)[:10, 1].float()
    vals = ref_v[blocks].view(-1, hkv, d)[:10, 1].float()
    torch.testing.assert_close(got[0, 4], torch.softmax(keys @ q[0, 4] * 0.25, 0) @ vals, rtol=1e-5, atol=1e-5)


def test_the_row_kernel_head_holds_q8_0_weights_exactly():
    """The one-row LM head kernel: int8 in groups of 32 with float16 scales reproduces Q8_0-coded
    weights exactly, so its logits equal the float32 head's over those weights."""
    from kvserve.model.quant import make_linear
    torch.manual_seed(0)
    n, k = 96, 64
    scale = (torch.rand(n, k // 32) * 0.01 + 1e-3).half()
    codes = torch.randint(-127, 128, (n, k // 32, 32))
    codes[:, :, 0] = 127                                 # Q8_0: each block's largest code is +-127
    w = (codes.float() * scale.float()[..., None]).view(n, k)
    head = make_linear(w, None, "float16", tied=w)
    head.add_row_kernel()
    assert torch.equal(head.row_q8.permute(2, 0, 1).reshape(n, k // 32, 32).long(), codes)
    x = torch.randn(1, k)
    torch.testing.assert_close(head(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert head(torch.randn(3, k)).shape == (3, n)       # more rows: the float16 weight


@pytest.mark.parametrize("stack", ["off", "auto"])
def test_a_hybrid_sliding_model_decodes_in_the_one_token_graph_like_eager(stack, monkeypatch):
    """Gemma-3 (five sliding-window layers per full one, six KV groups): a lone decode past the
    512-token window runs the one-token paged graph (or the native decode stack, no compile), each
    group with its own visible blocks, and makes the eager layers' greedy tokens."""
    from kvserve.tools.evaluate import common_prefix
    prompt = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 60)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    opts = dict(weights="int4", kv_cache_memory="64MiB", max_model_len=1024)
    eager = LLM("gemma3-270m", enforce_eager=True, native_stack="off", **opts)
    want = eager.generate(prompt, greedy, use_tqdm=False)[0]
    del eager
    monkeypatch.setenv(EAGER_ENV, "0")
    llm = LLM("gemma3-270m", compile_mode="blocking", native_stack=stack, **opts)
    runner = llm.engine.runner
    assert runner.captured is not None and len(set(runner.captured.groups)) == len(runner.backends) > 1
    assert llm.engine.compiled == (stack == "off")
    holder, name = (runner.captured, "stack") if stack == "auto" else (llm.engine.model.model.regions, "one_token_paged")
    calls = []
    real = getattr(holder, name)
    monkeypatch.setattr(holder, name, lambda *a: calls.append(1) or real(*a))
    got = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert len(got.prompt_token_ids) > 512 and len(calls) == 11
    assert common_prefix(got.outputs[0].token_ids, want.outputs[0].token_ids) >= 8


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    """(eager, compiled) engines over a tiny random hybrid Gemma-3 checkpoint (three sliding-window
    layers, one global: KV groups whose layers share pool slots), bfloat16 weights and K/V."""
    from family_checkpoints import make_tiny_checkpoint
    path = make_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("hybrid"))
    opts = dict(dtype="bfloat16", kv_cache_memory="4MiB", max_model_len=256, block_size=4)
    eager = LLM(path, enforce_eager=True, **opts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EAGER_ENV, "0")
        compiled = LLM(path, compile_mode="blocking", **opts)
    return eager, compiled


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages under `t` that are resident (mincore): a pool's pages cost memory once written."""
    import ctypes
    import mmap
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) == 0
    return sum(p & 1 for p in pages) * mmap.PAGESIZE


def _pools(llm) -> list[torch.Tensor]:
    storage = llm.engine.runner.storage
    return [t for layer in range(llm.engine.model_config.num_layers) for t in storage.native_kv(layer)]


def test_shared_pool_slots_are_written_in_place_by_the_one_token_graph(tiny_hybrid, monkeypatch):
    """KV groups sharing pool slots: the one-token graph gets each pool tensor once (no two of its
    inputs alias, which would make it copy the pools), so a compiled decode writes the engine's own
    pools in place: their storage unchanged, only the pages of the blocks written resident (a copy
    writes every page back), their contents (prompt and decoded K/V) those the eager engine wrote,
    and the eager engine's greedy tokens."""
    eager, compiled = tiny_hybrid
    runner = compiled.engine.runner
    assert runner.captured is not None and len(runner.backends) > 1
    pools, kv_index = runner.captured.pools, runner.captured.kv_index
    layers = compiled.engine.model_config.num_layers
    assert len({id(t) for t in _pools(compiled)}) == len(pools) < 2 * layers   # slots shared by groups
    assert [id(pools[i]) for kv in kv_index for i in kv] == [id(t) for t in _pools(compiled)]
    ptrs = [t.data_ptr() for t in pools]
    calls = []
    real = compiled.engine.model.model.regions.one_token_paged
    monkeypatch.setattr(compiled.engine.model.model.regions, "one_token_paged", lambda *a: calls.append(1) or real(*a))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 23))}   # past the 8-token window
    got = compiled.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    want = eager.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(calls) == 9 and list(got) == list(want)
    assert [t.data_ptr() for t in pools] == ptrs
    for t in pools:   # 30 tokens per group: a few 4-token blocks of each pool
        assert 0 < _resident_bytes(t) < t.numel() * t.element_size() // 4
    for mine, theirs in zip(_pools(compiled), _pools(eager)):   # the same blocks, written by each engine
        assert theirs.abs().sum() > 0
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=0.05, atol=0.1)   # bfloat16 K/V


def test_no_prompt_length_or_context_recompiles_after_the_warm_up(tiny_hybrid):
    """Prompts of a length in each of the quantized kernels' row ranges (model/quant.py), decodes at
    growing contexts, one after another, and decode steps of 2 to 8 sequences of different lengths
    compile no graph after the warm-up, and make the eager engine's greedy tokens."""
    from torch._dynamo.utils import counters

    from kvserve.model.regions import ROW_BOUNDS
    eager, compiled = tiny_hybrid
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    before = counters["stats"]["unique_graphs"]
    for n in sorted({2, 5, *ROW_BOUNDS, *(b + 1 for b in ROW_BOUNDS), 170}):
        prompt = {"prompt_token_ids": [(7 * i + n) % 200 + 3 for i in range(n)]}
        got = compiled.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
        _agree_up_to_a_tie(eager.generate(prompt, greedy, use_tqdm=False)[0].outputs[0], got, n)
    for streams in (2, 5, 8):   # decode steps of a few rows: the few-row paged graph
        prompts = [{"prompt_token_ids": [(5 * i + s) % 200 + 3 for i in range(20 + 9 * s)]} for s in range(streams)]
        for want, got in zip(eager.generate(prompts, greedy, use_tqdm=False),
                             compiled.generate(prompts, greedy, use_tqdm=False)):
            _agree_up_to_a_tie(want.outputs[0], got.outputs[0], streams)
    assert counters["stats"]["unique_graphs"] == before


def _agree_up_to_a_tie(want, got, label, tol: float = 0.02) -> None:
    """Greedy tokens equal; where they part, the eager engine itself was at a tie (a random-weight
    model's log-probs are nearly flat, and bfloat16 kernels that fuse differently round them
    differently by a few thousandths): the compiled token is its runner-up within `tol` nats."""
    a, b = list(want.token_ids), list(got.token_ids)
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None:
        return
    lps = {t: lp.logprob for t, lp in want.logprobs[n].items()}
    assert b[n] in lps and max(lps.values()) - lps[b[n]] < tol, (label, n, a, b, lps)
