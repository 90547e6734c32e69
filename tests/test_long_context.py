"""Decode speed has no cliff at long context: the one-token graph holds no shape that depends on the
context length (attention/paged.py one_token_blocks), so a stream growing past every bound (one
block to two, Inductor's 4096-element cascade-sum switch, a sliding window) neither recompiles nor
leaves the graph, and decodes what full recompute and the eager engine decode."""

import types

import pytest
import torch
from torch._dynamo.utils import counters

from kvserve import LLM, SamplingParams
from kvserve.attention import cpu as cpu_kernel
from kvserve.attention.paged import one_token_blocks, paged_decode_one
from kvserve.config import EAGER_ENV

BS, HKV, HQ, D = 16, 2, 6, 32
# context lengths whose visible blocks cross every size bound: one block, two, Inductor's 4096, past it
LENGTHS = (1, 2, 17, 4096, 4097, 5000)
DECODES = {"torch ops": paged_decode_one, "CPU kernel": cpu_kernel.paged_decode_one}


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _own_copy(fn):
    """`fn` with a code object of its own: Dynamo keeps graphs per code object, so each test compiles."""
    _own_copy.n = getattr(_own_copy, "n", 0) + 1
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{_own_copy.n}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _by_hand(q, keys, values, scale):
    """float64 attention of each query head over its K/V head's visible keys [L, Hkv, D]."""
    g = HQ // HKV
    out = torch.empty(HQ, D, dtype=torch.float64)
    for h in range(HQ):
        k, v = keys[:, h // g].double(), values[:, h // g].double()
        out[h] = torch.softmax(k @ q[0, h].double() * scale, 0) @ v
    return out


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode,threads", [("torch ops", 1), ("CPU kernel", 1), ("CPU kernel", 2)])
def test_the_one_token_attention_compiles_once_for_every_length(decode, threads, pool_dtype, monkeypatch):
    """One compiled graph of the one-token attention serves a growing context (and a sliding window's
    span) without recompiling, and matches float64 attention over the visible positions; with two
    threads the kernel splits the lone row's positions into parts (combined exactly)."""
    if decode == "CPU kernel" and not cpu_kernel.kernel():
        pytest.fail("the CPU decode kernel did not build (see the log): this test needs a C++ compiler")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)   # what the kernel is told to use
    torch.manual_seed(0)
    nb = max(LENGTHS) // BS + 2
    k_pool = torch.randn(nb, BS, HKV, D).to(pool_dtype)
    v_pool = torch.randn(nb, BS, HKV, D).to(pool_dtype)
    table = torch.randperm(nb)
    fn = torch.compile(_own_copy(DECODES[decode]), dynamic=False, fullgraph=True)
    before = _graphs()
    spans = [(0, n) for n in LENGTHS] + [(4097 - 512, 4097)]   # the last: a 512-token window
    with torch.inference_mode():
        for start, end in spans:
            # K and V as strided views (as the q/k/v split hands them over; V transposed)
            q, k, v = torch.randn(1, HQ, D), torch.randn(1, HKV + 1, D)[:, 1:], torch.randn(1, D, HKV).transpose(1, 2)
            p = end - 1    # the new token's position
            slot = (table[p // BS] * BS + p % BS).view(1)
            blocks, span = one_token_blocks(table, start, end, BS)
            got = fn(q, k, v, k_pool, v_pool, slot, blocks, span, 0.2)
            assert torch.equal(k_pool.view(-1, HKV, D)[slot], k.to(pool_dtype))
            assert torch.equal(v_pool.view(-1, HKV, D)[slot], v.to(pool_dtype))
            pos = torch.arange(start, end)
            rows = table[pos // BS] * BS + pos % BS
            keys, values = k_pool.view(-1, HKV, D)[rows], v_pool.view(-1, HKV, D)[rows]
            torch.testing.assert_close(got[0].double(), _by_hand(q, keys, values, 0.2), rtol=2e-5, atol=2e-5)
    assert _graphs() - before == 1, "the one-token attention recompiled as the context grew"


def _stream(llm, prompt_ids, n, monkeypatch):
    """(greedy tokens of one stream, graphs compiled after its first decode step, calls of what runs
    a decode step: the native decode stack, or the one-token graph over the paged pools, or with
    attention as an opaque op)."""
    captured = llm.engine.runner.captured
    if captured is not None and captured.stack is not None:
        holder, name = captured, "stack"
    else:
        holder, name = llm.engine.model.model.regions, "one_token_paged" if captured is not None else "one_token"
    real, calls = getattr(holder, name), []
    monkeypatch.setattr(holder, name, lambda *a: calls.append(1) or real(*a))
    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    outs, steps, first = [], 0, None
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        steps += 1
        if steps == 2:    # the prefill step, then the first decode step: every graph exists now
            first = _graphs()
    return outs[0].outputs[0].token_ids, _graphs() - first, len(calls)


@pytest.mark.parametrize("kv, stack", [("auto", "off"), ("int8", "auto")])
def test_a_stream_crosses_4096_tokens_without_recompiling(kv, stack, monkeypatch):
    """A lone stream decoding from 4,090 to 4,104 tokens (across Inductor's 4096 bound and block
    boundaries) stays in one call per step, with no new graph, and makes the eager layers' greedy
    tokens; bfloat16 pools with the native decode stack off (the CPU kernel in the paged graph; the
    stack has no shapes to bound) and int8 K/V (the gathered path, attention as an opaque op of the
    one-token graph)."""
    opts = dict(kv_cache_dtype=kv, kv_cache_memory="96MiB", max_model_len=4160, enable_prefix_caching=False)
    eager = LLM(enforce_eager=True, native_stack="off", **opts)   # the oracle: every layer eager
    ids = eager.get_tokenizer().encode(" ".join(
        f"Line {i}: the cache keeps every key and value it has seen so far." for i in range(400)))[:4090]
    assert len(ids) == 4090
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    want = eager.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    del eager
    monkeypatch.setenv(EAGER_ENV, "0")
    llm = LLM(compile_mode="blocking", native_stack=stack, **opts)
    tokens, new_graphs, graph_calls = _stream(llm, ids, 14, monkeypatch)
    assert new_graphs == 0, "a graph compiled while the stream grew"
    assert graph_calls == 13                  # every decode step in one call (no eager fallback)
    assert list(tokens) == list(want)
