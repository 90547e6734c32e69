"""Decode attention that reads blocks by id (kvserve/attention/paged.py `paged_decode`, and the CPU
kernel kvserve/attention/cpu/) against the attention formula computed directly in float64 over each
row's own tokens."""

import math

import pytest
import torch

from kvserve.attention import paged_decode, plan_chunks


def paged_decode_plan(tables, starts, ends, block_size, per_chunk):
    """plan_chunks over the tables padded into one [B, W] tensor (the padding is never read)."""
    width = max(len(t) for t in tables)
    table = torch.stack([torch.cat([t, torch.full((width - len(t),), -1)]) for t in tables])
    return plan_chunks(table, torch.tensor(starts), torch.tensor(ends), block_size, per_chunk)


def _pool_and_tables(lengths, block_size, kv_heads, head_dim, dtype, seed=0):
    """A pool of random K/V with each row's blocks scattered over it (block ids shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(need) + 3
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for n in need:
        tables.append(order[used:used + n])
        used += n
    return k, v, tables


def _oracle(q, k, v, tables, starts, ends, block_size, scale):
    """softmax(q k^T * scale) v per row over positions [start, end), in float64."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for i, (table, start, end) in enumerate(zip(tables, starts, ends)):
        pos = torch.arange(start, end)
        slots = table[pos // block_size] * block_size + pos % block_size
        ks = k.reshape(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)   # [L, Hq, D]
        vs = v.reshape(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)
        w = torch.einsum("hd,lhd->hl", q[i].double(), ks).mul(scale).softmax(-1)
        out[i] = torch.einsum("hl,lhd->hd", w, vs)
    return out


@pytest.mark.parametrize("kv_heads,q_heads", [(3, 9), (1, 4), (4, 4)])   # GQA, MQA, MHA
@pytest.mark.parametrize("block_size,per_chunk", [(16, 4), (16, 1), (32, 2), (4, 3)])
def test_paged_decode_equals_attention_formula(kv_heads, q_heads, block_size, per_chunk):
    lengths = [1, 5, block_size, block_size + 1, 3 * block_size - 1, 97, 200]
    d = 16
    k, v, tables = _pool_and_tables(lengths, block_size, kv_heads, d, torch.float32)
    q = torch.randn(len(lengths), q_heads, d, generator=torch.Generator().manual_seed(1))
    starts = [0] * len(lengths)
    plan = paged_decode_plan(tables, starts, lengths, block_size, per_chunk)
    assert not plan.one_per_row  # ragged lengths: rows in chunks, combined by log-sum-exp
    got = paged_decode(q, k, v, plan, 0.25)
    want = _oracle(q, k, v, tables, starts, lengths, block_size, 0.25)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads,q_heads", [(3, 9), (1, 4)])
def test_paged_decode_one_chunk_per_row_when_lengths_are_close(kv_heads, q_heads):
    """Rows of similar length: each row is one padded chunk (nothing to combine), same result."""
    lengths = [60, 64, 57, 49]
    k, v, tables = _pool_and_tables(lengths, 16, kv_heads, 16, torch.float32, seed=9)
    q = torch.randn(len(lengths), q_heads, 16, generator=torch.Generator().manual_seed(2))
    plan = paged_decode_plan(tables, [0] * 4, lengths, 16, 1)
    assert plan.one_per_row and plan.row.tolist() == [0, 1, 2, 3]
    got = paged_decode(q, k, v, plan, 0.2)
    torch.testing.assert_close(got.double(), _oracle(q, k, v, tables, [0] * 4, lengths, 16, 0.2),
                               atol=1e-5, rtol=1e-5)


def test_paged_decode_sliding_window_skips_old_blocks():
    """Rows whose window starts mid-table: blocks before it are never read (they may be freed)."""
    bs, window = 8, 20
    lengths = [7, 20, 21, 45, 64, 100]
    k, v, tables = _pool_and_tables(lengths, bs, 2, 8, torch.float32, seed=3)
    starts = [max(0, n - window) for n in lengths]
    plan = paged_decode_plan(tables, starts, lengths, bs, 2)
    read = set(plan.blocks.tolist())
    for table, start in zip(tables, starts):
        assert not read & set(table[:start // bs].tolist())
    q = torch.randn(len(lengths), 6, 8, generator=torch.Generator().manual_seed(4))
    got = paged_decode(q, k, v, plan, 0.3)
    torch.testing.assert_close(got.double(), _oracle(q, k, v, tables, starts, lengths, bs, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_paged_decode_bfloat16_close_to_formula():
    """bf16 pools: scores and softmax in float32, so the error is bf16 rounding of K, V and q only."""
    lengths = [3, 40, 130, 300]
    k, v, tables = _pool_and_tables(lengths, 16, 3, 64, torch.bfloat16, seed=5)
    q = torch.randn(len(lengths), 9, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    starts = [0] * len(lengths)
    got = paged_decode(q, k, v, paged_decode_plan(tables, starts, lengths, 16, 4), 0.125)
    assert got.dtype == torch.bfloat16
    want = _oracle(q, k, v, tables, starts, lengths, 16, 0.125)
    assert (got.double() - want).abs().max() < 2e-2


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_paged_decode_large_scores_do_not_overflow(path):
    """Softmax takes each row's maximum over all its chunks (all its keys) before exponentiating."""
    from kvserve.attention import cpu
    lengths = [50, 70]
    k, v, tables = _pool_and_tables(lengths, 16, 1, 64, torch.float32, seed=7)
    k = k * 100.0
    q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(8)) * 100.0
    if path == "torch":
        got = paged_decode(q, k, v, paged_decode_plan(tables, [0, 0], lengths, 16, 1), 1.0)
    else:
        table = torch.stack([torch.cat([t, torch.full((5 - len(t),), -1)]) for t in tables])
        got = cpu.paged_decode(q, k, v, table, torch.zeros(2, dtype=torch.long), torch.tensor(lengths), 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _oracle(q, k, v, tables, [0, 0], lengths, 16, 1.0),
                               atol=1e-4, rtol=1e-4)


PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    """Count calls of owner.name (still calling through)."""
    calls, real = [0], getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


def test_default_engine_decodes_in_place_and_equals_recompute(llm, llm_nocache, monkeypatch):
    """Default (attention_backend='auto') on CPU: the C++ kernel decodes; the torch path, put in
    its place, decodes by block chunks; both equal full recompute."""
    from helpers import assert_same_completions

    from kvserve import SamplingParams
    from kvserve.attention import PagedBackend, backends, cpu
    runner = llm.engine.runner
    assert set(runner.backend_names()) == {"PagedBackend"}
    assert all(b.kernel for b in runner.backends)
    assert set(runner.backend_names(detail=True)) == {"PagedBackend (CPU kernel)"}
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    want = llm_nocache.generate(PROMPTS, params, use_tqdm=False)
    in_kernel = _count_calls(monkeypatch, cpu, "paged_decode")
    assert_same_completions(llm.generate(PROMPTS, params, use_tqdm=False), want)
    assert in_kernel[0] >= 7 * len(runner.model.model.layers)  # every decode step after the first token
    kernel_backends = runner.backends
    try:
        runner.set_backends([PagedBackend(llm.engine.storage, g) for g in llm.engine.kv.groups])
        by_chunks = _count_calls(monkeypatch, backends, "paged_decode")
        assert_same_completions(llm.generate(PROMPTS, params, use_tqdm=False), want)
        assert by_chunks[0] >= 7
    finally:
        runner.set_backends(kernel_backends)


def _kernel_case(lengths, starts, block_size, kv_heads, q_heads, d, dtype, seed, q_dtype=None):
    from kvserve.attention import cpu
    k, v, tables = _pool_and_tables(lengths, block_size, kv_heads, d, dtype, seed=seed)
    width = max(len(t) for t in tables)
    table = torch.stack([torch.cat([t, torch.full((width - len(t),), -1)]) for t in tables])
    # q as a slice of a wider tensor: rows and heads strided, as the model's fused projections give
    wide = torch.randn(len(lengths), q_heads, d + 8, generator=torch.Generator().manual_seed(seed + 1))
    wide = wide.to(q_dtype or dtype)
    q = wide[..., :d]
    got = cpu.paged_decode(q, k, v, table, torch.tensor(starts), torch.tensor(lengths), 0.2)
    return got, _oracle(q, k, v, tables, starts, lengths, block_size, 0.2)


@pytest.mark.parametrize("d", [64, 128, 256, 48, 8])   # 16-lane vector path; scalar path (48, 8)
@pytest.mark.parametrize("kv_heads,q_heads", [(3, 9), (1, 4), (4, 4), (2, 16)])   # GQA, MQA, MHA, 8:1
def test_cpu_kernel_equals_attention_formula(d, kv_heads, q_heads):
    from kvserve.attention import cpu
    if not cpu.kernel():
        pytest.fail("the CPU decode kernel did not build (a C++ compiler is part of the install)")
    lengths = [1, 15, 16, 17, 33, 97, 300]
    got, want = _kernel_case(lengths, [0] * len(lengths), 16, kv_heads, q_heads, d, torch.float32, seed=d)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 48])
def test_cpu_kernel_many_rows_read_all_heads_per_item(d):
    """40 rows: each work item then takes all K/V heads of its row (with up to 5 threads); every
    other row has a window starting mid-block."""
    lengths = [(37 * i) % 300 + 1 for i in range(40)]
    starts = [max(0, n - 45) if i % 2 else 0 for i, n in enumerate(lengths)]
    got, want = _kernel_case(lengths, starts, 16, 3, 9, d, torch.float32, seed=7)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [4, 40])
@pytest.mark.parametrize("d", [64, 40])
def test_cpu_kernel_float32_queries_over_bfloat16_pools(rows, d):
    """bfloat16 pools under float32 queries: float32 arithmetic on the stored bf16 values, so the
    output equals the formula over those values to float32 rounding (no bf16 output rounding)."""
    lengths = [(53 * i) % 260 + 5 for i in range(rows)]
    got, want = _kernel_case(lengths, [0] * rows, 16, 3, 9, d, torch.bfloat16, seed=9, q_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_cpu_kernel_sliding_windows_and_block_sizes(block_size):
    """Rows whose window starts mid-block and mid-table; tokens straddling blocks of any size."""
    lengths = [7, 20, 21, 45, 64, 100, 257]
    starts = [max(0, n - 20) for n in lengths]
    got, want = _kernel_case(lengths, starts, block_size, 2, 6, 64, torch.float32, seed=3)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 40])
def test_cpu_kernel_bfloat16_close_to_formula(d):
    """bf16 pools and queries: float32 arithmetic, one bf16 rounding of the output."""
    lengths = [3, 40, 130, 300]
    got, want = _kernel_case(lengths, [0] * 4, 16, 3, 9, d, torch.bfloat16, seed=5)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() < 2e-2


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_decode_batch_stores_every_row_then_attends(pool_dtype):
    """decode_batch, the op of the captured few-row graph: one request's token and its three
    speculated tokens (one block table, each row one position further) and two other requests (one
    with a sliding window that starts mid-table), in one call. Every row's K/V lands at its slot in
    the pools' dtype, each row attends over its own range of the pools as written (the float64
    formula), and the result is paged_decode's over those pools, bit for bit."""
    from kvserve.attention import cpu
    assert cpu.kernel(), "the CPU decode kernel did not build (a C++ compiler is part of the install)"
    bs, hkv, hq, d, scale = 4, 2, 6, 32, 0.2
    k_pool, v_pool, tables = _pool_and_tables([37, 20, 50], bs, hkv, d, pool_dtype, seed=21)
    gen = torch.Generator().manual_seed(22)
    # (request, position of the row's token, first visible position)
    rows = [(0, 33, 0), (0, 34, 0), (0, 35, 0), (0, 36, 0), (1, 19, 0), (2, 49, 30)]
    row_tables = [tables[r] for r, _, _ in rows]
    width = max(len(t) for t in row_tables)
    table = torch.stack([torch.cat([t, torch.full((width - len(t),), -1)]) for t in row_tables])
    slots = torch.tensor([int(tables[r][p // bs]) * bs + p % bs for r, p, _ in rows])
    starts, ends = torch.tensor([s for _, _, s in rows]), torch.tensor([p + 1 for _, p, _ in rows])
    q = torch.randn(len(rows), hq, d, generator=gen)
    k, v = torch.randn(len(rows), hkv, d, generator=gen), torch.randn(len(rows), hkv, d, generator=gen)
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    ref_k.view(-1, hkv, d)[slots], ref_v.view(-1, hkv, d)[slots] = k.to(pool_dtype), v.to(pool_dtype)
    got = cpu.paged_decode_batch(q, k, v, k_pool, v_pool, slots, table, torch.stack((starts, ends)), scale)
    assert torch.equal(k_pool, ref_k) and torch.equal(v_pool, ref_v)
    want = _oracle(q, ref_k, ref_v, row_tables, starts.tolist(), ends.tolist(), bs, scale)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got, cpu.paged_decode(q, ref_k, ref_v, table, starts, ends, scale))
    # the four rows of request 0 share one pass over its K/V; each row's result is its own call's, bit for bit
    grouped = cpu.paged_decode(q, ref_k, ref_v, table, starts, ends, scale, split=False)
    for i in range(len(rows)):
        alone = cpu.paged_decode(q[i:i + 1], ref_k, ref_v, table[i:i + 1], starts[i:i + 1], ends[i:i + 1], scale,
                                 split=False)
        assert torch.equal(grouped[i:i + 1], alone), i
    with pytest.raises(RuntimeError, match="slots"):
        cpu.paged_decode_batch(q, k, v, k_pool, v_pool, slots[:2], table, torch.stack((starts, ends)), scale)


def test_cpu_kernel_split_rows_equal_their_lone_calls():
    """With two threads a long row's positions are split into parts scored apart and combined: the
    parts are fixed stretches of positions, so a row's result is the same bit for bit whether it
    decodes alone or beside other rows (a speculating request's token and proposals, other
    requests), as the engine's greedy output with and without speculation relies on; and it is the
    attention formula's."""
    from kvserve.attention import cpu
    assert cpu.kernel()
    bs, hkv, hq, d, scale = 16, 3, 9, 64, 0.125
    k_pool, v_pool, tables = _pool_and_tables([1500, 40], bs, hkv, d, torch.bfloat16, seed=31)
    gen = torch.Generator().manual_seed(32)
    row_tables = [tables[0]] * 5 + [tables[1]]
    ends = torch.tensor([1496, 1497, 1498, 1499, 1500, 40])
    starts = torch.zeros(6, dtype=torch.long)
    table = torch.stack([torch.cat([t, torch.full((len(tables[0]) - len(t),), -1)]) for t in row_tables])
    q = torch.randn(6, hq, d, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = cpu.paged_decode(q, k_pool, v_pool, table, starts, ends, scale)
        alone = [cpu.paged_decode(q[i:i + 1], k_pool, v_pool, table[i:i + 1], starts[i:i + 1], ends[i:i + 1], scale)
                 for i in range(6)]
    finally:
        torch.set_num_threads(threads)
    for i in range(6):
        assert torch.equal(together[i:i + 1], alone[i]), i
    want = _oracle(q, k_pool, v_pool, row_tables, starts.tolist(), ends.tolist(), bs, scale)
    torch.testing.assert_close(together.double(), want, atol=2e-6, rtol=1e-5)


def test_cpu_kernel_without_a_compiler_falls_back_to_torch(llm_nocache, monkeypatch, tmp_path, caplog):
    """No C++ compiler: a warning says why, the engine decodes through torch's ops, same tokens."""
    from helpers import assert_same_completions

    from kvserve import LLM, SamplingParams
    from kvserve.attention import cpu
    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(cpu.CACHE_ENV, str(tmp_path / "kernels"))
    with caplog.at_level("INFO", logger="kvserve"):
        eng = LLM(kv_cache_memory="32MiB", max_model_len=256, dtype="float32")
    assert "CPU decode attention kernel unavailable" in caplog.text
    assert "attention backend per KV group: PagedBackend (torch ops)" in caplog.text
    assert not any(b.kernel for b in eng.engine.runner.backends)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    assert_same_completions(eng.generate(PROMPTS, params, use_tqdm=False),
                            llm_nocache.generate(PROMPTS, params, use_tqdm=False))


def test_quantized_pool_reads_through_its_codec(llm_nocache, monkeypatch):
    """int8 decodes gather through Int8Codec.decode, not in place: the log-probs move by an
    int8-sized amount from the recompute oracle (neither zero nor large)."""
    from kvserve import LLM, SamplingParams
    from kvserve.attention import backends
    from kvserve.kv.formats import Int8Codec
    q = LLM(kv_cache_dtype="int8", kv_cache_memory="32MiB", max_model_len=256, dtype="float32")
    assert q.engine.runner.backend_names() == ["GatheredBackend"]
    in_place = _count_calls(monkeypatch, backends, "paged_decode")
    decoded = _count_calls(monkeypatch, Int8Codec, "decode")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    out = q.generate(PROMPTS, params, use_tqdm=False)
    assert in_place[0] == 0 and decoded[0] > 0
    ref = llm_nocache.generate(PROMPTS, params, use_tqdm=False)
    diffs = []
    for a, b in zip(out, ref):
        ta, la = _chosen_logprobs(a)
        tb, lb = _chosen_logprobs(b)
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        assert same >= 4
        diffs += [abs(x - y) for x, y in zip(la[:same], lb[:same])]
    assert 1e-5 < max(diffs) < 0.1


def _chosen_logprobs(out):
    c = out.outputs[0]
    return c.token_ids, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]


def test_bfloat16_in_place_decode_tracks_float32(llm):
    """bf16 engine against the float32 one (the oracle): decode by block chunks stays within bf16
    noise, no noisier than the same engine decoding through the padded token gather."""
    from kvserve import LLM, SamplingParams
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    ref = llm.generate(prompts, params, use_tqdm=False)
    bf = LLM(dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512)
    fast = bf.generate(prompts, params, use_tqdm=False)
    from kvserve.attention import GatheredBackend
    eng = bf.engine
    eng.runner.set_backends([GatheredBackend(eng.storage, group) for group in eng.kv.groups])
    slow = bf.generate(prompts, params, use_tqdm=False)
    errors = {"fast": [], "slow": []}
    for r, *pair in zip(ref, fast, slow):
        tr, lr = _chosen_logprobs(r)
        for name, out in zip(errors, pair):
            t, lp = _chosen_logprobs(out)
            same = next((i for i, (x, y) in enumerate(zip(t, tr)) if x != y), len(t))
            assert same >= 6, (name, t, tr)
            errors[name] += [abs(x - y) for x, y in zip(lp[:same], lr[:same])]
    assert max(errors["fast"]) < 0.3
    mean = {k: sum(v) / len(v) for k, v in errors.items()}
    assert mean["fast"] <= 2 * mean["slow"] + 0.02, mean


def test_float32_engine_reads_bfloat16_pools_in_place(llm, monkeypatch):
    """kv_cache_dtype=bfloat16 under float32 activations (what dtype=auto picks on a CPU): the pools
    hold bfloat16, the C++ kernel reads them in place with float32 queries, and the torch path and
    the codec's gather give the same tokens and logprobs (to a few bfloat16 roundings: the paths'
    float32 sums differ in the last bits, which can move a later layer's K/V to the next bfloat16
    value); against float32 K/V (the oracle) only bfloat16's rounding of K/V shows."""
    from kvserve import LLM, SamplingParams
    from kvserve.attention import GatheredBackend, PagedBackend, cpu
    # no prefix caching: a prompt read back from bfloat16 blocks is not the prompt prefilled from
    # float32 K/V, and each run below must prefill alike
    bf = LLM(dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512,
             enable_prefix_caching=False)
    eng = bf.engine
    assert {p.dtype for layer in range(len(eng.model.model.layers)) for p in eng.storage.native_kv(layer)} \
        == {torch.bfloat16}
    assert set(eng.runner.backend_names(detail=True)) == {"PagedBackend (CPU kernel)"}
    prompts = [*PROMPTS, "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    in_kernel = _count_calls(monkeypatch, cpu, "paged_decode")
    fast = bf.generate(prompts, params, use_tqdm=False)
    assert in_kernel[0] >= 9 * len(eng.model.model.layers)
    kernel_backends = eng.runner.backends
    try:
        for make in (lambda g: PagedBackend(eng.storage, g), lambda g: GatheredBackend(eng.storage, g)):
            eng.runner.set_backends([make(g) for g in eng.kv.groups])
            for a, b in zip(bf.generate(prompts, params, use_tqdm=False), fast):
                ta, la = _chosen_logprobs(a)
                tb, lb = _chosen_logprobs(b)
                assert ta == tb
                assert max(abs(x - y) for x, y in zip(la, lb)) < 0.01
    finally:
        eng.runner.set_backends(kernel_backends)
    diffs = []
    for a, b in zip(fast, llm.generate(prompts, params, use_tqdm=False)):
        ta, la = _chosen_logprobs(a)
        tb, lb = _chosen_logprobs(b)
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        assert same >= 6, (ta, tb)
        diffs += [abs(x - y) for x, y in zip(la[:same], lb[:same])]
    assert 0 < max(diffs) < 0.05
