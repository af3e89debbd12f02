"""Fidelity metrics against hand-made cases, the competition starter kit's formulas and SciPy."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from pyro_fa.metrics import (agreement, competition_wasserstein, deep_ensemble_equivalent, predictive_wasserstein2,
                             total_variation)


def _random_probs(n, c, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g, dtype=torch.float64).mul(2).softmax(-1)


# ---------------------------------------------------------------- the starter kit's formulas, restated in NumPy
def kit_agreement(predictions, reference):
    return (predictions.argmax(axis=-1) == reference.argmax(axis=-1)).mean()


def kit_total_variation(predictions, reference):
    return np.abs(predictions - reference).sum(axis=-1).mean() / 2.0


def kit_w2_distance(predictions, reference):  # the kit's score: minus the mean of SciPy's 1-D Wasserstein distance
    return -np.mean([stats.wasserstein_distance(p, r) for p, r in zip(predictions, reference)])


def test_agreement_and_total_variation_hand_cases():
    p = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.6, 0.4, 0.0], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]], dtype=torch.float64)
    assert float(agreement(p, q)) == pytest.approx(2 / 3)
    # per point: 0.5 * (0.3 + 0.3) = 0.3, 0.5 * (0.1 + 0.4 + 0.5) = 0.5, 0
    assert float(total_variation(p, q)) == pytest.approx((0.3 + 0.5 + 0.0) / 3)
    assert float(agreement(p, p)) == 1.0 and float(total_variation(p, p)) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_agreement_and_total_variation_match_the_starter_kit(seed):
    p, q = _random_probs(200, 10, seed), _random_probs(200, 10, seed + 10)
    assert float(agreement(p, q)) == pytest.approx(kit_agreement(p.numpy(), q.numpy()), abs=1e-15)
    assert float(total_variation(p, q)) == pytest.approx(kit_total_variation(p.numpy(), q.numpy()), rel=1e-12)


def test_draws_are_averaged_before_comparing():
    draws = torch.stack([_random_probs(30, 4, s) for s in range(5)])  # (S, N, C)
    ref = _random_probs(30, 4, 99)
    assert torch.equal(agreement(draws, ref), agreement(draws.mean(0), ref))
    assert torch.allclose(total_variation(draws, ref), total_variation(draws.mean(0), ref))


@pytest.mark.parametrize("sizes", [(1000, 1000), (300, 700), (1, 5)])
def test_competition_wasserstein_matches_scipy_and_the_kit(sizes):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(7, sizes[0], generator=g, dtype=torch.float64)
    b = 1.5 * torch.randn(7, sizes[1], generator=g, dtype=torch.float64) + 0.3
    expected = -kit_w2_distance(a.numpy(), b.numpy())
    assert float(competition_wasserstein(a, b)) == pytest.approx(expected, rel=1e-10)
    assert float(competition_wasserstein(a, a)) == 0.0


def test_competition_wasserstein_hand_case_with_ties():
    # u = {0, 0, 1}, v = {1}: |F_u - F_v| = 2/3 on [0, 1): W1 = 2/3
    assert float(competition_wasserstein(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[1.0]]))) == \
        pytest.approx(2 / 3)


def test_predictive_wasserstein2_is_the_gaussian_quantile_distance():
    m, v = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64), torch.tensor([1.0, 0.25, 4.0], dtype=torch.float64)
    mr, vr = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64), torch.tensor([2.0, 0.25, 1.0], dtype=torch.float64)
    # W2^2 = int_0^1 (F^-1(u) - G^-1(u))^2 du, by quadrature on the normal quantiles
    u = (np.arange(200_000) + 0.5) / 200_000
    per_point = [math.sqrt(np.mean((stats.norm.ppf(u, float(a), math.sqrt(float(b)))
                                     - stats.norm.ppf(u, float(c), math.sqrt(float(d)))) ** 2))
                 for a, b, c, d in zip(m, v, mr, vr)]
    assert float(predictive_wasserstein2(m, v, mr, vr)) == pytest.approx(np.mean(per_point), rel=1e-4)
    assert float(predictive_wasserstein2(m, v, m, v)) == 0.0


def test_predictive_wasserstein2_matches_mixtures_by_their_moments():
    g = torch.Generator().manual_seed(4)
    means = torch.randn(6, 10, generator=g, dtype=torch.float64)  # S = 6 components at N = 10 points
    vars_ = torch.rand(6, 10, generator=g, dtype=torch.float64) + 0.1
    mix_mean = means.numpy().mean(0)
    mix_var = (vars_.numpy() + means.numpy() ** 2).mean(0) - mix_mean ** 2  # E[y^2] - E[y]^2
    ref_m, ref_v = torch.zeros(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64)
    expected = np.mean(np.sqrt(mix_mean ** 2 + (np.sqrt(mix_var) - 1) ** 2))
    assert float(predictive_wasserstein2(means, vars_, ref_m, ref_v)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("value, curve, expected", [
    (-1.0, [-1.0, -0.8, -0.7], 1.0),       # equal to one member
    (-1.2, [-1.0, -0.8, -0.7], 1.0),       # worse than one member
    (-0.8, [-1.0, -0.8, -0.7], 2.0),       # exactly two members
    (-0.75, [-1.0, -0.8, -0.7], 2.5),      # halfway between two and three
    (-0.6, [-1.0, -0.8, -0.7], math.inf),  # better than every size measured
    (-0.9, [-1.0, -0.85, -0.95, -0.7], 1 + 2 / 3),  # the first crossing of a curve that is not monotone
])
def test_deep_ensemble_equivalent_interpolates_the_curve(value, curve, expected):
    assert deep_ensemble_equivalent(value, curve) == pytest.approx(expected)


def test_deep_ensemble_equivalent_of_a_metric_to_minimise():
    nll = [1.0, 0.8, 0.7]  # Ashukha et al.'s DEE on the NLL: 0.75 lies halfway between 2 and 3 members
    assert deep_ensemble_equivalent(0.75, nll, higher_is_better=False) == pytest.approx(2.5)
    assert deep_ensemble_equivalent(0.75, torch.tensor(nll), higher_is_better=False) == pytest.approx(2.5)


# ---------------------------------------------------------------- input checks
def test_probabilities_are_checked():
    p = _random_probs(5, 3, 0)
    with pytest.raises(ValueError, match=r"agreement: probs and ref_probs must have the same shape"):
        agreement(p, _random_probs(5, 4, 1))
    with pytest.raises(ValueError, match=r"total_variation: probs must sum to 1"):
        total_variation(p * 0.5, p)
    nan = p.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"agreement: ref_probs must be finite"):
        agreement(p, nan)
    with pytest.raises(TypeError, match=r"total_variation: probs must be a torch.Tensor"):
        total_variation(p.numpy(), p)
    with pytest.raises(ValueError, match=r"agreement: probs must have shape"):
        agreement(p[0], p[0])


def test_samples_and_moments_are_checked():
    a = torch.randn(4, 10, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"competition_wasserstein: samples and ref_samples must have the same "
                                         r"number of test points"):
        competition_wasserstein(a, a[:3])
    with pytest.raises(ValueError, match=r"competition_wasserstein: samples must have shape \(N, S\)"):
        competition_wasserstein(a[0], a)
    bad = a.clone()
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match=r"competition_wasserstein: ref_samples must be finite"):
        competition_wasserstein(a, bad)
    with pytest.raises(TypeError, match=r"competition_wasserstein: ref_samples must be floating point"):
        competition_wasserstein(a, a.long())
    with pytest.raises(TypeError, match=r"competition_wasserstein: samples must be a torch.Tensor"):
        competition_wasserstein([[0.0]], a)
    m, v = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"predictive_wasserstein2: var must be non-negative"):
        predictive_wasserstein2(m, -v, m, v)
    with pytest.raises(ValueError, match=r"predictive_wasserstein2: ref_var must have the shape of ref_mean"):
        predictive_wasserstein2(m, v, m, v[:2])
    with pytest.raises(ValueError, match=r"predictive_wasserstein2: mean and ref_mean must have the same number"):
        predictive_wasserstein2(m, v, m[:2], v[:2])
    with pytest.raises(ValueError, match=r"predictive_wasserstein2: mean must have shape \(N,\) or \(S, N\)"):
        predictive_wasserstein2(m.reshape(1, 1, 3), v.reshape(1, 1, 3), m, v)
    with pytest.raises(ValueError, match=r"predictive_wasserstein2: ref_mean must be finite"):
        predictive_wasserstein2(m, v, m * float("nan"), v)
    with pytest.raises(TypeError, match=r"predictive_wasserstein2: var must be a torch.Tensor"):
        predictive_wasserstein2(m, 1.0, m, v)
    with pytest.raises(TypeError, match=r"predictive_wasserstein2: mean must be floating point"):
        predictive_wasserstein2(m.long(), v, m, v)


def test_deep_ensemble_equivalent_checks():
    with pytest.raises(ValueError, match=r"deep_ensemble_equivalent: value must be a finite number"):
        deep_ensemble_equivalent(float("nan"), [1.0])
    with pytest.raises(TypeError, match=r"deep_ensemble_equivalent: value must be a finite number"):
        deep_ensemble_equivalent("high", [1.0])
    with pytest.raises(ValueError, match=r"deep_ensemble_equivalent: ensemble_curve must be 1-D with M >= 1"):
        deep_ensemble_equivalent(1.0, [])
    with pytest.raises(ValueError, match=r"deep_ensemble_equivalent: ensemble_curve must be finite"):
        deep_ensemble_equivalent(1.0, [1.0, float("inf")])
    with pytest.raises(TypeError, match=r"deep_ensemble_equivalent: ensemble_curve must be a 1-D sequence"):
        deep_ensemble_equivalent(1.0, ["a", "b"])
