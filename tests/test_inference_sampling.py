"""Sampling against explicit computations on a four-token vocabulary with probabilities
p = [0.5, 0.25, 0.15, 0.1]: temperature T gives p^(1/T) renormalised, top-k the k largest
renormalised, top-p the smallest prefix (by probability) reaching p; the empirical
frequencies of 20000 draws (on the test device) match the explicit distribution."""
import pytest
import torch

from megalite.inference import SamplingParams, filter_logits, sample

P = torch.tensor([0.5, 0.25, 0.15, 0.1])
LOGITS = P.log().unsqueeze(0)


def _explicit(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    probs = P ** (1 / temperature)
    probs = probs / probs.sum()
    keep = torch.zeros(4, dtype=torch.bool)
    keep[:top_k or 4] = True  # P is sorted, so the k largest are the first k
    probs = torch.where(keep, probs, 0.0) / probs[keep].sum()
    mass = 0.0
    for i in range(4):  # smallest prefix whose mass reaches top_p
        if mass >= top_p:
            keep[i] = False
        mass += float(probs[i])
    return torch.where(keep, probs, 0.0) / probs[keep].sum()


CASES = [(1.0, 0, 1.0), (2.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7),
         (1.0, 0, 0.8), (2.0, 3, 0.6), (1.0, 1, 1.0)]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_filtered_distribution_is_explicit(temperature, top_k, top_p):
    probs = filter_logits(LOGITS, temperature, top_k, top_p).softmax(-1)[0]
    torch.testing.assert_close(probs, _explicit(temperature, top_k, top_p), rtol=1e-6,
                               atol=1e-7)


def test_top_p_examples_by_hand():
    """0.5 < 0.7 <= 0.75: two tokens; 0.75 < 0.8 <= 0.9: three."""
    assert (filter_logits(LOGITS, 1.0, 0, 0.7).isfinite()[0] == torch.tensor(
        [True, True, False, False])).all()
    assert filter_logits(LOGITS, 1.0, 0, 0.8).isfinite().sum() == 3


@pytest.mark.parametrize("temperature,top_k,top_p", [(2.0, 0, 1.0), (1.0, 3, 0.8)])
def test_sample_frequencies_follow_the_distribution(temperature, top_k, top_p, device):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    generator = torch.Generator(device=device).manual_seed(0)
    draws = sample(LOGITS.to(device).expand(20000, 4), params, generator).cpu()
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert (freq - _explicit(temperature, top_k, top_p)).abs().max() < 0.015


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(device):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)).to(device)
    params = SamplingParams(temperature=1.0)
    draw = [sample(logits, params, torch.Generator(device=device).manual_seed(s))
            for s in (5, 5, 6)]
    assert torch.equal(draw[0], draw[1]) and not torch.equal(draw[0], draw[2])
    top1 = sample(logits, SamplingParams(temperature=1.3, top_k=1),
                  torch.Generator(device=device).manual_seed(5))
    assert torch.equal(top1, logits.argmax(-1))


@pytest.mark.parametrize("field,value", [("max_new_tokens", -1), ("temperature", -0.5),
                                         ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5)])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
