"""The rank-0 sampler: greedy, filters, penalties, min_tokens, logit_bias, seeding,
distribution, logprobs."""

from __future__ import annotations

import collections

import pytest
import torch

from nvllm.common.worker_protocol import WorkerSampling
from nvllm.worker.sampler import Sampler, SampleRequest


def req(prompt=(0,), output=(), **params) -> SampleRequest:
    return SampleRequest(params=WorkerSampling(**params),
                         token_ids=list(prompt) + list(output),
                         num_prompt_tokens=len(prompt))


def sample(logits, reqs, sampler=None):
    logits = torch.as_tensor(logits, dtype=torch.float32)
    if logits.dim() == 1:
        logits = logits[None]
    return (sampler or Sampler(0))(logits, reqs)


def counts_of(tokens, vocab):
    c = collections.Counter(tokens)
    return torch.tensor([c[i] for i in range(vocab)], dtype=torch.float64) / len(tokens)


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=g)
    tokens, lps = Sampler(0)(logits, [req(temperature=0.0) for _ in range(16)])
    assert tokens == logits.argmax(-1).tolist()
    assert lps is None


def test_greedy_ignores_filters_and_seed():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    for kw in (dict(top_k=2), dict(top_p=0.1), dict(min_p=0.9), dict(seed=3)):
        assert sample(logits, [req(temperature=0.0, **kw)])[0] == [1]


def test_sampler_does_not_modify_input_logits():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    Sampler(0)(logits, [req(prompt=[1, 2, 3], output=[4, 4], temperature=0.8, top_k=5,
                            top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.5, min_tokens=5,
                            stop_token_ids=[4], logprobs=3)] * 3)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("seed", [None, 0, 12345])
def test_top_k_1_is_argmax(seed):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(32, 64, generator=g)
    reqs = [req(temperature=1.5, top_k=1, seed=seed, output=[0] * i) for i in range(32)]
    tokens, _ = Sampler(0)(logits, reqs)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_restricts_support():
    logits = torch.zeros(1000, 8)
    logits[:, :] = torch.tensor([0.0, 0.1, 3.0, 0.2, 2.9, 2.8, 0.3, 0.0])
    tokens, _ = Sampler(0)(logits, [req(temperature=1.0, top_k=3)] * 1000)
    assert set(tokens) == {2, 4, 5}


def test_small_top_p_keeps_only_the_top_token():
    n = 500
    logits = torch.tensor([1.0, 1.1, 0.9, 1.05]).expand(n, 4).contiguous()
    tokens, _ = Sampler(0)(logits, [req(temperature=1.0, top_p=0.01)] * n)
    assert set(tokens) == {1}


def test_top_p_keeps_the_token_crossing_the_threshold():
    # probs 0.5, 0.3, 0.2: top_p=0.6 keeps {0, 1} (1 crosses 0.6), drops 2.
    n = 2000
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(n, 3).contiguous()
    tokens, _ = Sampler(0)(logits, [req(temperature=1.0, top_p=0.6)] * n)
    assert set(tokens) == {0, 1}
    freq = counts_of(tokens, 3)
    assert abs(freq[0].item() - 0.5 / 0.8) < 0.05


def test_min_p():
    # probs 0.5, 0.3, 0.15, 0.05; min_p=0.5 drops tokens below 0.25.
    n = 2000
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(n, 4).contiguous()
    tokens, _ = Sampler(0)(logits, [req(temperature=1.0, min_p=0.5)] * n)
    assert set(tokens) == {0, 1}
    tokens, _ = Sampler(0)(logits, [req(temperature=1.0, min_p=0.2)] * n)
    assert set(tokens) == {0, 1, 2}
    tokens, _ = Sampler(0)(logits, [req(temperature=1.0, min_p=1.0)] * n)
    assert set(tokens) == {0}


def test_repetition_penalty_positive_logits():
    logits = [2.0, 1.9, 0.0, -5.0]
    assert sample(logits, [req(prompt=[3], temperature=0.0)])[0] == [0]
    # 2.0 / 1.2 = 1.67 < 1.9: the repeated token loses; prompt tokens count too.
    assert sample(logits, [req(prompt=[0], temperature=0.0, repetition_penalty=1.2)])[0] == [1]
    assert sample(logits, [req(prompt=[3], output=[0], temperature=0.0,
                               repetition_penalty=1.2)])[0] == [1]
    # A penalty < 1 rewards repetition.
    assert sample(logits, [req(prompt=[1], temperature=0.0, repetition_penalty=0.9)])[0] == [1]


def test_repetition_penalty_negative_logits_are_multiplied():
    logits = [-1.0, -1.05, -9.0]
    assert sample(logits, [req(prompt=[2], temperature=0.0)])[0] == [0]
    # -1.0 * 1.2 = -1.2 < -1.05 (dividing would have made it win even more).
    assert sample(logits, [req(prompt=[0], temperature=0.0, repetition_penalty=1.2)])[0] == [1]


def test_presence_penalty_counts_output_tokens_only():
    logits = [1.0, 0.8, -3.0]
    # In the output once: 1.0 - 0.5 = 0.5 < 0.8.
    assert sample(logits, [req(prompt=[2], output=[0], temperature=0.0,
                               presence_penalty=0.5)])[0] == [1]
    # Only in the prompt: no penalty.
    assert sample(logits, [req(prompt=[0, 0], output=[2], temperature=0.0,
                               presence_penalty=0.5)])[0] == [0]
    # Presence does not scale with the count: 1.0 - 0.1 > 0.8 even if repeated.
    assert sample(logits, [req(prompt=[2], output=[0, 0, 0], temperature=0.0,
                               presence_penalty=0.1)])[0] == [0]
    # Negative presence penalty encourages the seen token.
    assert sample([0.8, 1.0], [req(prompt=[1], output=[0], temperature=0.0,
                                   presence_penalty=-0.5)])[0] == [0]


def test_frequency_penalty_scales_with_count():
    logits = [1.0, 0.5, -3.0]
    assert sample(logits, [req(prompt=[2], output=[0], temperature=0.0,
                               frequency_penalty=0.2)])[0] == [0]  # 0.8 > 0.5
    assert sample(logits, [req(prompt=[2], output=[0, 2, 0, 0], temperature=0.0,
                               frequency_penalty=0.2)])[0] == [1]  # 0.4 < 0.5
    assert sample(logits, [req(prompt=[0, 0, 0, 0], output=[2], temperature=0.0,
                               frequency_penalty=0.2)])[0] == [0]  # prompt not counted


def test_penalties_apply_under_sampling_too():
    n = 300
    logits = torch.tensor([5.0, 0.0, -1.0]).expand(n, 3).contiguous()
    tokens, _ = Sampler(0)(logits, [req(prompt=[1], output=[0], temperature=1.0, top_k=1,
                                        frequency_penalty=2.0, presence_penalty=2.0,
                                        repetition_penalty=10.0)] * n)
    # token 0: 5 / 10 - 2 - 2 = -3.5; token 1: 0 / 10 = 0; token 2: -1.
    assert set(tokens) == {1}


def test_min_tokens_masks_stop_ids_until_reached():
    logits = [0.0, 1.0, 0.5, 9.0, 8.0]
    p = dict(temperature=0.0, min_tokens=3, stop_token_ids=[3, 4, 99])
    got = [sample(logits, [req(prompt=[0, 0], output=[1] * k, **p)])[0][0] for k in range(5)]
    assert got == [1, 1, 1, 3, 3]
    # Under sampling as well: the stop tokens dominate but can never be drawn early.
    n = 500
    big = torch.tensor(logits).expand(n, 5).contiguous()
    tokens, _ = Sampler(0)(big, [req(output=[1, 1], temperature=1.0, min_tokens=3,
                                     stop_token_ids=[3, 4])] * n)
    assert 3 not in tokens and 4 not in tokens
    tokens, _ = Sampler(0)(big, [req(output=[1, 1, 1], temperature=1.0, min_tokens=3,
                                     stop_token_ids=[3, 4])] * n)
    assert 3 in tokens


def test_min_tokens_without_stop_ids_is_a_no_op():
    assert sample([0.0, 2.0], [req(temperature=0.0, min_tokens=5)])[0] == [1]


# --- seeding -------------------------------------------------------------------------

VOCAB = 64


def _seeded(seed, n_out, **kw):
    return req(prompt=[1, 2, 3], output=[5] * n_out, temperature=1.0, seed=seed, **kw)


def test_seeded_independent_of_batch_and_sampler_instance():
    g = torch.Generator().manual_seed(3)
    target = torch.randn(VOCAB, generator=g) * 0.1  # nearly flat: the draw decides
    others = torch.randn(5, VOCAB, generator=g)
    for n_out in range(6):
        me = _seeded(77, n_out)
        alone = Sampler(0)(target[None], [me])[0][0]
        other_reqs = [req(temperature=1.0), req(temperature=0.5, seed=77),
                      _seeded(78, n_out), req(temperature=0.0), _seeded(77, n_out + 1)]
        # Other rows first, then the target; then reversed order; other sampler seeds.
        batch = torch.cat([others, target[None]])
        t1 = Sampler(1)(batch, other_reqs + [me])[0][-1]
        batch_r = torch.cat([target[None], others.flip(0)])
        t2 = Sampler(999)(batch_r, [me] + other_reqs[::-1])[0][0]
        # A sampler that has already drawn a lot of unseeded tokens.
        s = Sampler(5)
        s(others, [req(temperature=1.0)] * 5)
        t3 = s(target[None], [me])[0][0]
        assert alone == t1 == t2 == t3, (n_out, alone, t1, t2, t3)


def test_seeded_same_position_same_token_in_one_batch():
    logits = torch.zeros(8, VOCAB)
    tokens, _ = Sampler(0)(logits, [_seeded(11, 4)] * 8)
    assert len(set(tokens)) == 1


def test_seeded_depends_on_position_and_seed():
    logits = torch.zeros(1, VOCAB)
    by_pos = [Sampler(0)(logits, [_seeded(11, k)])[0][0] for k in range(200)]
    # Uniform over 64 tokens: 200 draws are anything but constant.
    assert len(set(by_pos)) > 40
    by_seed = [Sampler(0)(logits, [_seeded(s, 0)])[0][0] for s in range(200)]
    assert len(set(by_seed)) > 40
    # The prompt length does not enter the key: only the output position does.
    a = Sampler(0)(logits, [req(prompt=[1] * 3, output=[2] * 4, temperature=1.0, seed=5)])
    b = Sampler(0)(logits, [req(prompt=[1] * 9, output=[3] * 4, temperature=1.0, seed=5)])
    assert a[0] == b[0]


def test_seeded_draws_across_positions_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None]
    tokens = [Sampler(0)(logits, [_seeded(2024, k)])[0][0] for k in range(3000)]
    assert (counts_of(tokens, 4) - probs.double()).abs().max() < 0.035


def test_unseeded_sampler_seed_reproducible_and_rows_differ():
    logits = torch.zeros(64, VOCAB)
    reqs = [req(temperature=1.0)] * 64
    a, _ = Sampler(7)(logits, reqs)
    b, _ = Sampler(7)(logits, reqs)
    assert a == b
    assert len(set(a)) > 20


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_distribution_matches_softmax(temperature):
    n = 4000
    raw = torch.tensor([0.0, 1.0, -0.5, 0.7])
    expected = (raw / temperature).softmax(-1).double()
    logits = raw.expand(n, 4).contiguous()
    tokens, _ = Sampler(123)(logits, [req(temperature=temperature)] * n)
    err = (counts_of(tokens, 4) - expected).abs().max().item()
    assert err < 0.03, (counts_of(tokens, 4), expected)


def test_tiny_temperature_behaves_like_greedy():
    logits = [1.0, 5.0, 3.0, 2.0]
    assert sample(logits, [req(temperature=1e-38)])[0] == [1]


# --- logit_bias ----------------------------------------------------------------------


def bias(mapping: dict[int, float]) -> dict:
    return {"logit_bias_ids": list(mapping), "logit_bias_values": list(mapping.values())}


def test_logit_bias_in_the_batched_greedy_path_changes_only_its_rows():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    plain = logits.argmax(-1).tolist()
    forced = [t for t in range(50) if t not in plain][:2]
    reqs = [req(temperature=0.0), req(temperature=0.0, **bias({forced[0]: 100.0})),
            req(temperature=0.0, logprobs=2),
            req(temperature=0.0, logprobs=2, **bias({forced[1]: 100.0, plain[3]: -100.0})),
            req(temperature=0.0, **bias({plain[4]: 1e-3}))]  # too small to matter
    tokens, lps = Sampler(0)(logits, reqs)
    assert tokens == [plain[0], forced[0], plain[2], forced[1], plain[4]]
    assert torch.equal(logits, before)
    # Logprobs are the raw logits', the biased pick included.
    raw = torch.log_softmax(before, -1)
    assert lps[3][0] == pytest.approx(float(raw[3, forced[1]]))
    assert [t for t, _ in lps[3][1]] == torch.topk(raw[3], 2).indices.tolist()
    assert lps[0] is None and lps[2][0] == pytest.approx(float(raw[2].max()))


def test_minus_100_bans_the_top_token_greedy_and_sampled():
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0]]).expand(400, 4).contiguous()
    ban = bias({1: -100.0})
    assert sample(logits[:1], [req(temperature=0.0, **ban)])[0] == [2]
    tokens, _ = Sampler(0)(logits, [req(temperature=1.0, **ban)] * 400)
    assert 1 not in tokens and 2 in tokens


def test_plus_100_forces_a_token_under_sampling():
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(4))
    tokens, _ = Sampler(0)(logits, [req(temperature=1.0, seed=s, **bias({17: 100.0}))
                                    for s in range(64)])
    assert tokens == [17] * 64


def test_logit_bias_shifts_the_sampled_distribution():
    # +ln 3 on token 0 of a uniform pair: probabilities 3/4 and 1/4.
    n = 4000
    logits = torch.zeros(n, 2)
    tokens, _ = Sampler(0)(logits, [req(temperature=1.0, **bias({0: 1.0986123}))] * n)
    assert counts_of(tokens, 2)[0] == pytest.approx(0.75, abs=0.03)


def test_logit_bias_comes_before_penalties():
    # Token 0: 1.0 + 1.0 = 2.0, then / 4 (seen, repetition_penalty 4) = 0.5 < 0.6: token 1.
    # Penalty first would give 1.0 / 4 + 1.0 = 1.25 and pick token 0.
    logits = torch.tensor([1.0, 0.6, 0.0])
    r = req(prompt=[0], temperature=0.0, repetition_penalty=4.0, **bias({0: 1.0}))
    assert sample(logits, [r])[0] == [1]


def test_batched_and_per_row_greedy_agree_on_biased_rows():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 40, generator=g)
    biases = [bias({int(t): float(v) for t, v in zip(torch.randperm(40, generator=g)[:6],
                                                     torch.rand(6, generator=g) * 6 - 3)})
              for _ in range(8)]
    batched, _ = Sampler(0)(logits, [req(temperature=0.0, **b) for b in biases])
    # A row needing row work (pending min_tokens, no stop ids) sends the rest through the
    # subset path, and itself through the per-row path.
    mixed, _ = Sampler(0)(logits, [req(temperature=0.0, min_tokens=1 if i == 0 else 0, **b)
                                   for i, b in enumerate(biases)])
    assert batched == mixed
    assert batched != logits.argmax(-1).tolist(), "the biases must change a pick"


# --- logprobs ------------------------------------------------------------------------

def test_logprobs_of_raw_logits_and_sorted_top_n():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 50, generator=g) * 3
    reqs = [
        req(temperature=0.0, logprobs=5),
        req(prompt=[1, 2], output=[3], temperature=0.7, top_k=10, repetition_penalty=1.5,
            presence_penalty=1.0, logprobs=20),
        req(temperature=1.0, logprobs=None),
        req(temperature=1.3, seed=4, logprobs=0),
    ]
    tokens, lps = Sampler(0)(logits, reqs)
    ref = torch.log_softmax(logits.double(), -1)
    # Float32 log_softmax vs float64, on any CPU: z_t - max rounds once (eps * 2max|z|), the
    # sum of V exponentials in any order is within V*eps relatively (so is its log,
    # absolutely), the exp and log add a few eps each: eps * (V + 4max|z| + 8).
    tol = torch.finfo(torch.float32).eps * (logits.shape[1] + 4 * float(logits.abs().max()) + 8)
    assert len(lps) == 4 and lps[2] is None
    for i, k in ((0, 5), (1, 20), (3, 0)):
        tok_lp, top = lps[i]
        assert isinstance(tok_lp, float)
        assert tok_lp == pytest.approx(ref[i, tokens[i]].item(), abs=tol)
        assert len(top) == k
        ids = [t for t, _ in top]
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        assert all(isinstance(t, int) for t in ids)
        assert ids == (ref[i].topk(k).indices.tolist() if k else [])
        for t, v in top:
            assert v == pytest.approx(ref[i, t].item(), abs=tol)
    # Greedy: the sampled token is the top-1.
    assert lps[0][1][0][0] == tokens[0]
    assert lps[0][0] == lps[0][1][0][1]


def test_logprobs_none_when_nobody_asks():
    _, lps = Sampler(0)(torch.zeros(2, 5), [req(temperature=1.0), req(temperature=0.0)])
    assert lps is None
