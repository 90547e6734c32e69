"""Tests for SamplingParams validation and the Sampler (vLLM semantics)."""

import math
import re

import pytest
import torch

from kvserve.engine.sampler import (
    Sampler,
    SamplingError,
    SamplingInput,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    kernel_row_stats,
    process_logits,
    prompt_logprobs,
    request_generator,
    torch_row_stats,
)
from kvserve.sampling_params import BeamSearchParams, SamplingParams

VOCAB = 32
EOS = 0


def make_input(prompt=(1, 2), output=(), seed=None, num_samples=1, **params):
    """One SamplingInput with a per-request generator when seed is given."""
    gen = request_generator(seed) if seed is not None else None
    return SamplingInput(SamplingParams(seed=seed, **params), list(prompt), list(output), gen,
                         num_samples)


def log_probs(probs):
    """A [1, len(probs)] logits row whose softmax is `probs`."""
    return torch.tensor([probs], dtype=torch.float32).log()


NUCLEUS_PROBS = [0.5, 0.3, 0.15, 0.05]


# ---------------------------------------------------------------- SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_stop_normalised_to_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_edge_values_accepted():
    SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, max_tokens=None, min_tokens=5,
                   presence_penalty=-2, frequency_penalty=2, logprobs=20, prompt_logprobs=0)
    SamplingParams(max_tokens=3, min_tokens=3, top_k=0, temperature=0.0)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5),
    ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.1),
    ("max_tokens", 0), ("max_tokens", -3),
    ("min_tokens", -1), ("min_tokens", 17),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("logprobs", -1), ("logprobs", 21),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21),
    ("stop", ""), ("stop", ["ok", ""]),
    ("stop_token_ids", [-1]),
    ("seed", 1.5),
])
def test_invalid_sampling_params_raise(field, value):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**{field: value})
    assert "got" in str(err.value)


def test_error_message_names_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1\.5"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize("field, value", [
    ("beam_width", 0), ("max_tokens", 0), ("temperature", -1.0),
    ("length_penalty", float("inf")),
])
def test_invalid_beam_search_params_raise(field, value):
    kwargs = {"beam_width": 2, "max_tokens": 8, field: value}
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1e-50),   # 0 in float32: logits / 0
    ("repetition_penalty", 1e39),    # inf in float32
    ("temperature", 1e39),           # inf in float32: -inf / inf is NaN
])
def test_values_float32_cannot_hold_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must be .*float32.*got {re.escape(repr(value))}"):
        SamplingParams(**{field: value})


def test_tiny_temperature_is_raised_to_vllms_floor():
    assert SamplingParams(temperature=1e-30).temperature == 0.01
    assert SamplingParams(temperature=5e-324).temperature == 0.01
    assert SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.2e-38, temperature=0.01),   # logits / rep overflow to inf
    dict(repetition_penalty=3.4e38, min_tokens=2),         # logits * rep overflow to -inf
    dict(temperature=3.4e38, min_tokens=2),                # -inf / huge stays -inf
    dict(temperature=0.01, top_p=1e-30, min_p=1e-30),
])
def test_extreme_but_valid_params_still_sample(params):
    logits = torch.tensor([[30.0, -20.0, 25.0, 0.0, -1.0]])
    inp = make_input(prompt=(0, 1, 2, 3), output=[4], seed=1, **params)
    (result,) = Sampler([EOS], 5)(logits, [inp])
    assert 0 <= result.token_ids[0] < 5


def test_rows_that_cannot_be_sampled_raise_naming_them():
    logits = torch.randn(3, VOCAB)
    logits[1] = float("nan")
    logits[2] = float("-inf")
    inputs = [make_input(seed=1), make_input(temperature=0.0), make_input(seed=2)]
    with pytest.raises(SamplingError) as err:
        Sampler([EOS], VOCAB)(logits, inputs)
    assert err.value.rows == [1, 2]


# ---------------------------------------------------------------- greedy, top-k


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(64, VOCAB)
    inputs = [make_input(temperature=0.0) for _ in range(64)]
    results = Sampler([EOS], VOCAB)(logits, inputs)
    expected = logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    assert [r.token_ids for r in results] == [[t] for t in expected]
    for row, r in enumerate(results):
        assert r.logprobs[0] == pytest.approx(ref[row, expected[row]].item(), abs=1e-5)
        assert r.top_logprobs is None


def _stats_rows():
    """Rows across the kernel's lanes, tails and 2048-value chunks: ties in other lanes and chunks,
    a NaN, +inf, all -inf, a lone -inf-free value, huge and tiny spreads."""
    torch.manual_seed(5)
    rows = []
    for v in (1, 15, 16, 17, 2047, 2049, 5000, 49152):
        x = torch.randn(4, v) * 4
        if v > 40:
            x[1, [v - 1, 7, 2100 % v, 19]] = 50.0          # a tie: the first index wins
            x[2, :] = float("-inf")
            x[2, v // 2] = -3.0                            # one finite value among -inf
            x[3, 0] = float("nan")
        rows += list(x)
    x = torch.full((3, 100), float("-inf"))
    x[1, 40] = float("inf")
    x[2, 99] = 1e30                                         # exp of everything else underflows
    return rows + list(x)


@pytest.mark.skipif(not __import__("kvserve.engine.cpu", fromlist=["available"]).available(),
                    reason="no C++ compiler: the sampler runs torch's reductions")
def test_row_stats_kernel_matches_torch_reductions():
    for row in _stats_rows():
        x = row[None]
        got, want = kernel_row_stats(x), torch_row_stats(x)
        same_nan = math.isnan(got.peak[0]) and math.isnan(want.peak[0])
        assert same_nan or got.peak == want.peak, row
        if not math.isnan(want.peak[0]):
            assert got.argmax == want.argmax, row
        torch.testing.assert_close(got.lse, x.double().logsumexp(-1).float(), rtol=1e-6, atol=1e-6, equal_nan=True)
        if math.isfinite(want.peak[0]):   # the maximum's log-prob, against float64's log_softmax
            oracle = torch.log_softmax(x.double(), -1)[0, want.argmax[0]].item()
            assert got.top_logprob[0] == pytest.approx(oracle, rel=1e-6, abs=1e-6)
    wide = torch.randn(3, 70)
    strided = wide[:, :64]                                  # rows 70 apart, as _check_logits' cut leaves them
    assert kernel_row_stats(strided).argmax == strided.argmax(-1).tolist()
    columns = torch.randn(64, 3).t()                        # values 3 apart: copied first
    assert kernel_row_stats(columns).argmax == columns.argmax(-1).tolist()
    batch = torch.randn(5, 3000)                            # a row's stats do not depend on its batch
    alone = [kernel_row_stats(batch[i:i + 1]) for i in range(5)]
    together = kernel_row_stats(batch)
    assert [a.top_logprob[0] for a in alone] == together.top_logprob
    assert torch.equal(torch.cat([a.lse for a in alone]), together.lse)


def test_bad_rows_raise_on_either_row_statistics():
    x = torch.randn(4, 3000)
    x[1, 7] = float("nan")
    x[2] = float("-inf")
    x[3, 2999] = float("inf")
    for stats in (torch_row_stats, kernel_row_stats):
        with pytest.raises(SamplingError) as err:
            stats(x).check()
        assert err.value.rows == [1, 2, 3]


def test_plain_greedy_batch_is_not_copied():
    logits = torch.randn(64, VOCAB)
    inputs = [make_input(temperature=0.0) for _ in range(64)]
    assert process_logits(logits, inputs, [EOS]) is logits


def test_top_k_1_at_temperature_1_is_argmax():
    torch.manual_seed(1)
    logits = torch.randn(16, VOCAB)
    inputs = [make_input(top_k=1) for _ in range(16)]
    results = Sampler([EOS], VOCAB, seed=0)(logits, inputs)
    assert [r.token_ids[0] for r in results] == logits.argmax(-1).tolist()


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 5.0]])
    out = apply_top_k_top_p(logits.clone(), [2], [1.0])
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False, True]
    assert out[0, 0] == 3.0 and out[0, 4] == 5.0


def test_top_k_per_row_with_one_row_off_and_combined_with_top_p():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 5.0]] * 3)
    out = apply_top_k_top_p(logits.clone(), [3, 0, -1], [1.0] * 3)
    assert torch.isfinite(out).sum(-1).tolist() == [3, 5, 5]
    # top-k 3 then top-p 0.5 of the renormalised top-3 keeps only the favourite
    both = apply_top_k_top_p(logits.clone(), [3, 3, 0], [0.5, 1.0, 0.5])
    assert torch.isfinite(both).sum(-1).tolist() == [1, 3, 1]
    assert both[0, 4] == 5.0


def test_sampler_does_not_modify_caller_logits():
    torch.manual_seed(7)
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    inputs = [make_input(output=[1], temperature=0.5, top_k=4, repetition_penalty=1.5),
              make_input(top_p=0.5, min_p=0.1, min_tokens=2),
              make_input(temperature=0.0, presence_penalty=1.0, output=[2])]
    Sampler([EOS], VOCAB, seed=0)(logits, inputs)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- top-p, min-p


@pytest.mark.parametrize("top_p, nucleus", [(0.45, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}),
                                            (1.0, {0, 1, 2, 3})])
def test_top_p_mask_is_exactly_the_nucleus(top_p, nucleus):
    out = apply_top_k_top_p(log_probs(NUCLEUS_PROBS), [0], [top_p])
    assert {i for i in range(4) if math.isfinite(out[0, i].item())} == nucleus


def test_top_p_samples_only_nucleus_tokens():
    inp = make_input(top_p=0.75, seed=7, num_samples=400)
    (result,) = Sampler([EOS], 4)(log_probs(NUCLEUS_PROBS), [inp])
    assert set(result.token_ids) == {0, 1}


def test_top_p_renormalises_nucleus():
    out = apply_top_k_top_p(log_probs(NUCLEUS_PROBS), [0], [0.75]).softmax(-1)[0]
    assert out[:2].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8], abs=1e-6)


def test_min_p_masks_below_scaled_top_prob():
    # threshold = 0.4 * 0.5 = 0.2: keep 0.5 and 0.3
    out = apply_min_p(log_probs(NUCLEUS_PROBS), [0.4])
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    inp = make_input(min_p=0.4, seed=3, num_samples=400)
    (result,) = Sampler([EOS], 4)(log_probs(NUCLEUS_PROBS), [inp])
    assert set(result.token_ids) == {0, 1}


# ---------------------------------------------------------------- temperature


def chi_square(counts, probs):
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_softmax_of_scaled_logits(temperature):
    raw = [1.0, 0.5, 0.0, -1.0]
    expected = torch.tensor(raw).div(temperature).softmax(-1).tolist()
    inp = make_input(temperature=temperature, seed=11, num_samples=20000)
    (result,) = Sampler([EOS], 4)(torch.tensor([raw]), [inp])
    counts = [result.token_ids.count(t) for t in range(4)]
    assert chi_square(counts, expected) < 16.27  # chi2(df=3) at p = 0.001


def test_temperature_changes_the_distribution():
    raw = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    cold = make_input(temperature=0.5, seed=5, num_samples=5000)
    hot = make_input(temperature=2.0, seed=5, num_samples=5000)
    cold_r, hot_r = Sampler([EOS], 4)(raw.repeat(2, 1), [cold, hot])
    assert cold_r.token_ids.count(0) > hot_r.token_ids.count(0) + 500


# ---------------------------------------------------------------- penalties


def expected_penalized(row, prompt, output, rep, freq, pres):
    """Penalty formulas written out token by token (vLLM / OpenAI)."""
    out = list(row)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        count = output.count(t)
        out[t] -= freq * count + pres * (count > 0)
    return out


@pytest.mark.parametrize("rep, freq, pres", [(2.0, 0.0, 0.0), (1.0, 0.5, 0.0),
                                             (1.0, 0.0, 0.25), (1.3, -0.7, 1.5)])
def test_penalties_match_formulas(rep, freq, pres):
    row = [2.0, -1.0, 3.0, -0.5, 1.5, 0.0, -2.0, 4.0]
    prompt, output = [1, 2], [2, 3, 3, 6]
    inp = make_input(prompt, output, repetition_penalty=rep, frequency_penalty=freq,
                     presence_penalty=pres)
    plain = make_input(prompt, output)
    logits = torch.tensor([row, row])
    out = apply_penalties(logits.clone(), [inp, plain])
    assert out[0].tolist() == pytest.approx(expected_penalized(row, prompt, output, rep, freq,
                                                               pres))
    assert out[1].tolist() == row  # a row without penalties is untouched


def test_repetition_penalty_uses_prompt_but_frequency_does_not():
    row = [1.0] * 4
    inp = make_input(prompt=[0], output=[], repetition_penalty=2.0, frequency_penalty=1.0,
                     presence_penalty=1.0)
    out = apply_penalties(torch.tensor([row]), [inp])
    assert out[0].tolist() == [0.5, 1.0, 1.0, 1.0]


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    inp = make_input(output=[1], temperature=0.0, frequency_penalty=0.5)
    (result,) = Sampler([EOS], 4)(logits, [inp])
    assert result.token_ids == [2]
    # the reported logprob is from the raw distribution, not the penalized one
    assert result.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


# ---------------------------------------------------------------- min_tokens


def eos_favoured_logits(rows=1):
    logits = torch.zeros(rows, 8)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0  # a stop token id in the tests below
    logits[:, 3] = 8.0
    return logits


def test_min_tokens_masks_eos_and_stop_token_ids():
    sampler = Sampler([EOS], 8)
    early = make_input(output=[4], temperature=0.0, min_tokens=3, stop_token_ids=[5])
    done = make_input(output=[4, 4, 4], temperature=0.0, min_tokens=3, stop_token_ids=[5])
    r_early, r_done = sampler(eos_favoured_logits(2), [early, done])
    assert r_early.token_ids == [3]
    assert r_done.token_ids == [EOS]


def test_min_tokens_with_ignore_eos_masks_only_stop_ids():
    inp = make_input(output=[], temperature=0.0, min_tokens=2, stop_token_ids=[5],
                     ignore_eos=True)
    (result,) = Sampler([EOS], 8)(eos_favoured_logits(), [inp])
    assert result.token_ids == [EOS]


def test_min_tokens_masked_eos_never_sampled():
    inp = make_input(output=[], min_tokens=1, seed=0, num_samples=300)
    (result,) = Sampler([EOS], 8)(eos_favoured_logits(), [inp])
    assert EOS not in result.token_ids


# ---------------------------------------------------------------- seeds


def run_steps(sampler, logits, inputs, steps=3):
    return [[r.token_ids for r in sampler(logits, inputs)] for _ in range(steps)]


def test_seeded_request_is_independent_of_batch():
    torch.manual_seed(2)
    row = torch.randn(1, VOCAB)
    alone = run_steps(Sampler([EOS], VOCAB), row, [make_input(seed=42, num_samples=4)])
    others = torch.randn(3, VOCAB)
    batch_logits = torch.cat([others[:2], row, others[2:]])
    batch = [make_input(), make_input(seed=1, top_p=0.9), make_input(seed=42, num_samples=4),
             make_input(top_k=5)]
    in_batch = run_steps(Sampler([EOS], VOCAB, seed=123), batch_logits, batch)
    assert [step[0] for step in alone] == [step[2] for step in in_batch]


def test_different_seeds_differ_and_sampler_seed_reproduces():
    logits = torch.zeros(2, VOCAB)  # uniform
    a, b = Sampler([EOS], VOCAB)(logits, [make_input(seed=1, num_samples=20),
                                          make_input(seed=2, num_samples=20)])
    assert a.token_ids != b.token_ids
    first = run_steps(Sampler([EOS], VOCAB, seed=9), logits, [make_input(), make_input()])
    second = run_steps(Sampler([EOS], VOCAB, seed=9), logits, [make_input(), make_input()])
    assert first == second


# ---------------------------------------------------------------- logprobs


def test_top_logprobs_match_log_softmax_with_ranks():
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    inputs = [make_input(temperature=0.0, logprobs=3), make_input(seed=4, logprobs=5),
              make_input(temperature=0.0)]
    results = Sampler([EOS], VOCAB)(logits, inputs)
    ref = torch.log_softmax(logits, -1)
    for row, k in [(0, 3), (1, 5)]:
        (top,) = results[row].top_logprobs
        order = ref[row].argsort(descending=True).tolist()
        chosen = results[row].token_ids[0]
        assert set(top) == set(order[:k]) | {chosen}
        for tok, lp in top.items():
            assert lp.logprob == pytest.approx(ref[row, tok].item(), abs=1e-5)
            assert lp.rank == order.index(tok) + 1
    assert results[2].top_logprobs is None


def test_chosen_token_outside_top_k_is_added_with_its_rank():
    # min_tokens forbids EOS (the raw favourite): greedy takes rank 2, reported raw
    inp = make_input(output=[], temperature=0.0, min_tokens=1, logprobs=0)
    (result,) = Sampler([EOS], 8)(eos_favoured_logits(), [inp])
    ref = torch.log_softmax(eos_favoured_logits(), -1)[0]
    assert result.token_ids == [5]
    assert list(result.top_logprobs[0]) == [5]
    assert result.top_logprobs[0][5].rank == 2
    assert result.top_logprobs[0][5].logprob == pytest.approx(ref[5].item())
    inp1 = make_input(output=[], temperature=0.0, min_tokens=1, logprobs=1)
    (result1,) = Sampler([EOS], 8)(eos_favoured_logits(), [inp1])
    assert {t: lp.rank for t, lp in result1.top_logprobs[0].items()} == {5: 2, EOS: 1}


def test_prompt_logprobs_format():
    torch.manual_seed(4)
    prompt = [3, 7, 1, 7]
    logits = torch.randn(len(prompt) - 1, VOCAB)
    out = prompt_logprobs(logits, prompt, k=2)
    ref = torch.log_softmax(logits, -1)
    assert len(out) == len(prompt) and out[0] is None
    for i, entry in enumerate(out[1:]):
        order = ref[i].argsort(descending=True).tolist()
        tok = prompt[i + 1]
        assert set(entry) == set(order[:2]) | {tok}
        assert entry[tok].rank == order.index(tok) + 1
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[i, t].item(), abs=1e-5)
    assert prompt_logprobs(torch.zeros(0, VOCAB), [5], k=3) == [None]


def test_prompt_logprobs_rejects_wrong_shape():
    with pytest.raises(ValueError, match="len\\(prompt\\) - 1"):
        prompt_logprobs(torch.zeros(4, VOCAB), [1, 2, 3], k=1)


# ---------------------------------------------------------------- num_samples


def test_num_samples_greedy_repeats_argmax_and_random_draws_n():
    torch.manual_seed(5)
    logits = torch.randn(2, VOCAB)
    inputs = [make_input(temperature=0.0, num_samples=4, logprobs=1),
              make_input(num_samples=6, top_k=3)]
    greedy, rand = Sampler([EOS], VOCAB, seed=0)(logits, inputs)
    assert greedy.token_ids == [logits[0].argmax().item()] * 4
    assert len(greedy.logprobs) == 4 and len(greedy.top_logprobs) == 4
    top3 = set(logits[1].topk(3).indices.tolist())
    assert len(rand.token_ids) == 6 and set(rand.token_ids) <= top3
    assert rand.logprobs == pytest.approx(
        [torch.log_softmax(logits[1], -1)[t].item() for t in rand.token_ids], abs=1e-5)


def test_mixed_batch_and_padded_vocab():
    torch.manual_seed(6)
    logits = torch.randn(3, VOCAB + 8)  # padded embedding columns are never sampled
    logits[:, VOCAB:] = 100.0
    inputs = [make_input(temperature=0.0), make_input(seed=3), make_input(top_p=0.5)]
    results = Sampler([EOS], VOCAB, seed=0)(logits, inputs)
    assert results[0].token_ids == [logits[0, :VOCAB].argmax().item()]
    assert all(r.token_ids[0] < VOCAB for r in results)
