"""Triton kernels (kvserve/attention/triton/) against a float64 torch reference.

On a CPU they run under the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py before triton is
first imported); `pytest -m cuda` selects them on a GPU, where they are compiled. Shapes stay
small: the interpreter runs every program instance in Python.
"""

import pytest
import torch

triton = pytest.importorskip("triton")  # off CUDA, conftest.py has set TRITON_INTERPRET=1

from kvserve.attention.backends import _own_block_context  # noqa: E402
from kvserve.attention.metadata import PrefillSpan, window_mask  # noqa: E402
from kvserve.attention.triton.decode import paged_decode  # noqa: E402
from kvserve.attention.triton.extend import paged_extend  # noqa: E402
from kvserve.attention.triton.source import source_of  # noqa: E402
from kvserve.kv.formats import build_kv_format  # noqa: E402
from kvserve.kv.spec import FullSpec, KVSpec, MLASpec, group_layers  # noqa: E402
from kvserve.kv.storage import KVStorage  # noqa: E402

pytestmark = pytest.mark.cuda
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- a filled pool and the reference ------------------------------------------------------------


class Pool:
    """One layer's KV storage in format `fmt`, filled with random K/V for ragged requests."""

    def __init__(self, spec: KVSpec, fmt: str, lens: list[int], bs: int, dtype=torch.float32, seed=0,
                 split: list[int] | None = None):
        gen = torch.Generator().manual_seed(seed)
        self.spec, self.bs, self.lens = spec, bs, lens
        groups = group_layers([spec])
        width = max(-(-n // bs) for n in lens)
        nb = sum(-(-n // bs) for n in lens) + 3
        k_fmt, _, v_fmt = fmt.partition("/")
        kvf = build_kv_format(groups, dtype, bs, k_fmt, kv_cache_dtype_v=v_fmt or None)
        self.st = KVStorage(groups, nb, bs, dtype, DEVICE, kvf, residual_rows=len(lens))
        perm = torch.randperm(nb, generator=gen)
        self.table = torch.zeros(len(lens), width, dtype=torch.long)
        used = 0
        for r, n in enumerate(lens):
            k = -(-n // bs)
            self.table[r, :k] = perm[used:used + k]
            used += k
        self.table = self.table.to(DEVICE)
        # a prefill up to split[r] (default: all but the last token), then one more write of the rest
        # (a decode step or a chunk; KIVI: blocks it fills are sealed, their queries see them exact)
        split = split or [n - 1 for n in lens]
        for part in range(2):
            spans = [(0, c) if part == 0 else (c, n) for c, n in zip(split, lens)]
            slots = torch.cat([self.slots(r, a, b) for r, (a, b) in enumerate(spans)])
            new = [(torch.randn(slots.numel(), *s, generator=gen) * 2).to(DEVICE, dtype) for s in spec.entry_shapes]
            if slots.numel():
                self.st.write(0, slots, *new)
        self.fresh = new  # the second write's entries, request by request

    def slots(self, r: int, a: int, b: int) -> torch.Tensor:
        p = torch.arange(a, b, device=self.table.device)
        return self.table[r, p // self.bs] * self.bs + p % self.bs

    def sources(self):
        st = self.st
        return [source_of(part.codec, ts, st.residual[0][e]) for e, entry in enumerate(st.parts[0])
                for part, _, ts in entry]

    def read(self, r: int, a: int, b: int, own: bool) -> list[torch.Tensor]:
        """Entries at positions [a, b) of request r as attention sees them, float64."""
        idx = self.slots(r, a, b)
        own_block = idx[-1:] // self.bs if own else None
        return [x[0].double() for x in self.st.read(0, idx[None], own_block)]


def ref_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask=None) -> torch.Tensor:
    """q [n, Hq, D] over k [L, Hkv, D], v [L, Hkv, Dv], float64 (mask [n, L] bool) -> [n, Hq, Dv]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def tolerance(dtype) -> dict:
    """float32: the float64 reference to rounding; bfloat16: q, K, V, probabilities and the output
    each rounded to 8 bits of mantissa."""
    return dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-2)


def decode_case(spec, fmt, lens, bs, window=None, splits=None, seed=0, dtype=torch.float32, group=4):
    pool = Pool(spec, fmt, lens, bs, dtype, seed)
    hq = spec.num_kv_heads * group if spec.kind != "mla" else group
    dk = spec.entry_shapes[0][-1]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), hq, dk, generator=gen).to(DEVICE, dtype)
    ends = torch.tensor(lens, device=DEVICE)
    starts = (ends - window).clamp(min=0) if window else torch.zeros_like(ends)
    scale = dk ** -0.5
    srcs = pool.sources()
    k, v = (srcs[0], srcs[0].value_view(spec.latent_dim)) if spec.kind == "mla" else srcs
    st = pool.st
    out = paged_decode(q, k, v, pool.table, starts, ends, scale, num_splits=splits,
                       row_of_block=st.row_of_block, sealed=st.sealed)
    for r, n in enumerate(lens):
        ents = pool.read(r, int(starts[r]), n, own=True)
        if spec.kind == "mla":
            kk = ents[0][:, None]
            ref = ref_attend(q[r:r + 1], kk, kk[..., :spec.latent_dim], scale)
        else:
            ref = ref_attend(q[r:r + 1], ents[0], ents[1], scale)
        torch.testing.assert_close(out[r:r + 1].double(), ref, **tolerance(dtype))
    return out


def extend_case(spec, fmt, lens, news, bs, window=None, seed=0, dtype=torch.float32, group=3):
    """Each request's last `news[r]` tokens are a prefill chunk over its cached prefix."""
    pool = Pool(spec, fmt, lens, bs, dtype, seed, split=[c - n for c, n in zip(lens, news)])
    hq = spec.num_kv_heads * group if spec.kind != "mla" else group
    dk = spec.entry_shapes[0][-1]
    gen = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(sum(news), hq, dk, generator=gen).to(DEVICE, dtype)
    t = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731
    q_start = t([sum(news[:r]) for r in range(len(news))])
    scale = dk ** -0.5
    srcs = pool.sources()
    k, v = (srcs[0], srcs[0].value_view(spec.latent_dim)) if spec.kind == "mla" else srcs
    st = pool.st
    out = paged_extend(q, k, v, pool.table, q_start, t(news), t(lens), scale, window=window, fresh=pool.fresh,
                       row_of_block=st.row_of_block, sealed=st.sealed)
    for r, (ctx, n) in enumerate(zip(lens, news)):
        rows = slice(int(q_start[r]), int(q_start[r]) + n)
        if st.has_own_block_view(0):  # KIVI: the torch chunk path defines what a query sees
            span = PrefillSpan(rows.start, n, ctx)
            c = _own_block_context(0, st, span, pool.slots(r, 0, ctx), [x[rows] for x in pool.fresh], window)
            ref = ref_attend(q[rows], *[e.double() for e in c.entries], scale, c.mask)
            torch.testing.assert_close(out[rows].double(), ref, **tolerance(dtype))
            continue
        ents = pool.read(r, 0, ctx, own=False)
        qp, kp = torch.arange(ctx - n, ctx), torch.arange(ctx)
        mask = window_mask(qp, kp, window).to(DEVICE)
        if spec.kind == "mla":
            kk = ents[0][:, None]
            ref = ref_attend(q[rows], kk, kk[..., :spec.latent_dim], scale, mask)
        else:
            ref = ref_attend(q[rows], ents[0], ents[1], scale, mask)
        torch.testing.assert_close(out[rows].double(), ref, **tolerance(dtype))


def store_case(fmt, shape, dtype=torch.float32, seed=0):
    """The store kernel writes the bytes the torch codec writes."""
    from kvserve.attention.triton.store import store
    from kvserve.kv.formats import _flat, make_codec

    gen = torch.Generator().manual_seed(seed)
    codec = make_codec(fmt, "k", shape, dtype)
    x = (torch.randn(24, *shape, generator=gen) * torch.logspace(-5, 3, 24).view(-1, *[1] * len(shape))).to(dtype)
    x[3] = 0
    slots = torch.randperm(64, generator=gen)[:24]
    ref, got = codec.allocate(4, 16, DEVICE), codec.allocate(4, 16, DEVICE)
    for t, enc in zip(ref, codec.encode(x.to(DEVICE))):
        _flat(t).index_copy_(0, slots.to(DEVICE), enc)
    store(x.to(DEVICE), slots.to(DEVICE), source_of(codec, got))
    for a, b in zip(ref, got):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


# ---- the cases ------------------------------------------------------------------------------------
# Shapes cover MHA (G = 1), GQA (G = 3, 4) and MQA (Hkv = 1), head dims 64/128/256, block sizes
# 16/32, ragged lengths (1 token, partial and whole blocks), windows and split-K.


@pytest.mark.parametrize("heads, dim, bs, window, splits", [
    (2, 64, 16, None, None),      # GQA, one pass
    (1, 128, 32, None, 3),        # MQA, split-K
    (4, 64, 16, 20, 2),           # sliding window + split-K
    (1, 256, 16, None, 2),        # head dim 256
])
def test_decode_native(heads, dim, bs, window, splits):
    decode_case(FullSpec(heads, dim), "auto", [1, 37, 70, 16], bs, window=window, splits=splits)


@pytest.mark.parametrize("fmt", ["auto", "int8", "kivi4"])
def test_bfloat16_models(fmt):
    """16-bit models: tile products in bfloat16 on tensor cores (float32 accumulation)."""
    decode_case(FullSpec(2, 64), fmt, [9, 33], 32, splits=2, dtype=torch.bfloat16)
    extend_case(FullSpec(1, 64), fmt, [40], [17], 32, dtype=torch.bfloat16)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_decode_int8_fp8(fmt):
    decode_case(FullSpec(2, 64), fmt, [5, 49, 16], 16, window=40, splits=2)


@pytest.mark.parametrize("fmt", ["kivi4", "kivi2"])
def test_decode_kivi(fmt):
    """Whole blocks packed, a still-filling block in its residual row, and a block sealed by the
    decode write (lengths 64, 96) that the query still sees exact."""
    decode_case(FullSpec(2, 64), fmt, [5, 64, 96, 40], 32, splits=2)


def test_decode_mixed_k_v_formats():
    """K int8, V kivi4 ("K/V" names two formats): each source read in its own format."""
    decode_case(FullSpec(2, 64), "int8/kivi4", [45, 64], 32)


@pytest.mark.parametrize("fmt", ["auto", "int8"])
def test_decode_mla(fmt):
    decode_case(MLASpec(latent_dim=64, rope_dim=16), fmt, [5, 40], 16, splits=2)


def test_many_query_heads_per_kv_head():
    """G = 20 (over the 16 heads a program takes): MQA decode and extend, MLA decode."""
    decode_case(FullSpec(1, 64), "auto", [9, 40], 16, group=20)
    extend_case(FullSpec(1, 64), "auto", [30], [12], 16, group=20)
    decode_case(MLASpec(latent_dim=64, rope_dim=16), "auto", [20], 16, group=20)


@pytest.mark.parametrize("fmt, heads, dim, bs, window", [
    ("auto", 2, 64, 16, None),     # G = 3 (non power of two)
    ("auto", 1, 128, 32, 12),      # MQA, window inside the chunk
    ("int8", 2, 64, 16, None),
    ("fp8_e4m3", 1, 64, 32, 20),
])
def test_extend(fmt, heads, dim, bs, window):
    extend_case(FullSpec(heads, dim), fmt, [20, 45, 9], [20, 7, 1], bs, window=window)


@pytest.mark.parametrize("fmt, window", [("kivi4", None), ("kivi2", 40), ("int8/kivi4", None)])
def test_extend_kivi(fmt, window):
    """Chunks starting inside a block (its earlier tokens in the residual row), spanning whole
    blocks (packed at once, seen exact by their own queries) and filling a block (sealed)."""
    extend_case(FullSpec(2, 64), fmt, [75, 64, 40], [40, 20, 40], 32, window=window)


def test_extend_mla():
    extend_case(MLASpec(latent_dim=64, rope_dim=16), "auto", [40], [9], 16)


@pytest.mark.parametrize("fmt", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_store_matches_codec(fmt):
    store_case(fmt, (3, 64))
    store_case(fmt, (3, 64), torch.bfloat16)


def test_store_mla_latent():
    store_case("int8", (80,))


# ---- the backend in the engine ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from family_checkpoints import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("triton_tiny")
    return {f: make_tiny_checkpoint(f, root / f) for f in ("llama", "gemma3", "deepseek_v2")}


@pytest.mark.parametrize("family, fmt", [("llama", dict(kv_cache_dtype="auto")),
                                         ("gemma3", dict(kv_cache_dtype="int8", kv_cache_rotation=True)),
                                         ("llama", dict(kv_cache_dtype="kivi4")),
                                         ("deepseek_v2", dict(kv_cache_dtype="int8"))],
                         ids=["native", "int8-rot", "kivi4", "mla-int8"])
def test_engine_tokens_match_torch_backend(tiny, family, fmt):
    """Greedy tokens and log-probs of a tiny model (gemma3: sliding-window layers; a Hadamard
    rotation; deepseek_v2: MLA latents): TritonBackend equals the torch backends, over chunked
    prefill and decode."""
    from helpers import assert_same_completions

    from kvserve import LLM, SamplingParams
    from kvserve.attention import select_backend

    llm = LLM(tiny[family], kv_cache_memory="4MiB", max_model_len=128, dtype="float32",
              max_num_batched_tokens=32, **fmt)
    prompts = [[(5 * i + 3) % 250 + 3 for i in range(n)] for n in (37, 7)]  # KIVI: a block fills
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    eng = llm.engine
    auto = {type(select_backend(eng.storage, g, False, "auto")).__name__ for g in eng.kv.groups}
    assert (auto == {"TritonBackend"}) == (DEVICE == "cuda")   # auto: the kernels on CUDA only
    runs = []
    for kind in ("torch", "triton"):
        eng.runner.set_backends([select_backend(eng.storage, g, False, kind) for g in eng.kv.groups])
        llm.reset_prefix_cache()
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    assert set(eng.runner.backend_names()) == {"TritonBackend"}
    assert_same_completions(runs[1], runs[0], tol=1e-4)


def test_attention_backend_option_reaches_the_runner(tiny):
    """LLM(attention_backend=...) picks each KV group's backend; the Triton engine generates."""
    from kvserve import LLM, SamplingParams

    common = dict(kv_cache_memory="4MiB", max_model_len=128, dtype="float32")
    torch_llm = LLM(tiny["llama"], attention_backend="torch", **common)
    assert set(torch_llm.engine.runner.backend_names()) == {"PagedBackend"}
    llm = LLM(tiny["llama"], attention_backend="triton", **common)
    assert set(llm.engine.runner.backend_names()) == {"TritonBackend"}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = [[7, 11, 13, 17, 19]]
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == torch_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_select_backend_choices():
    """'triton' takes every format the kernels read; per-head precision, watched scores and
    'torch' keep the torch backends; 'auto' off CUDA never imports the kernels."""
    from kvserve.attention import select_backend

    def pick(spec, kind, observed=False, **fmt):
        groups = group_layers([spec])
        kvf = build_kv_format(groups, torch.float32, 32, **fmt)
        st = KVStorage(groups, 4, 32, torch.float32, DEVICE, kvf, residual_rows=2)
        return type(select_backend(st, groups[0], observed, kind)).__name__

    full, mla = FullSpec(2, 64), MLASpec(latent_dim=64, rope_dim=16)
    for fmt in ("auto", "int8", "fp8_e5m2", "kivi2"):
        assert pick(full, "triton", kv_cache_dtype=fmt) == "TritonBackend"
    assert pick(mla, "triton", kv_cache_dtype="int8") == "TritonBackend"
    assert pick(full, "triton", kv_cache_dtype="kivi4", kv_cache_dtype_k="int8") == "TritonBackend"
    assert pick(full, "triton", kv_cache_dtype="kivi2", high_heads={0: [1]}) == "GatheredBackend"
    assert pick(full, "triton", observed=True) == "GatheredBackend"
    assert pick(full, "torch") == "PagedBackend"
    if DEVICE == "cpu":
        assert pick(full, "auto") == "PagedBackend"
