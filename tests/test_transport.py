"""Scores between draws: exact W1 against brute force and the 1-D closed form; k-hat against ArviZ."""
import itertools

import numpy as np
import pytest
import torch

from pyro_fa.metrics.transport import (
    debiased_wasserstein1,
    marginal_errors,
    pareto_khat,
    psis_log_weights,
    wasserstein1,
    wasserstein1_floor,
)


def test_wasserstein1_matches_exhaustive_permutations():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 3)), rng.normal(size=(6, 3)) + 0.5
    cost = np.linalg.norm(x[:, None] - y[None], axis=-1)
    brute = min(cost[np.arange(6), list(p)].mean() for p in itertools.permutations(range(6)))
    assert wasserstein1(x, y) == pytest.approx(brute, rel=1e-12)


def test_wasserstein1_one_dimension_is_sorted_matching():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=200), rng.standard_t(3, size=200)
    closed = np.abs(np.sort(x) - np.sort(y)).mean()
    assert wasserstein1(x, y) == pytest.approx(closed, rel=1e-12)
    from scipy.stats import wasserstein_distance

    assert wasserstein1(x, y) == pytest.approx(wasserstein_distance(x, y), rel=1e-10)


def test_wasserstein1_accepts_tensors_and_refuses_shapes():
    x = torch.randn(5, 2, dtype=torch.float64)
    assert wasserstein1(x, x) == 0.0
    with pytest.raises(ValueError, match="wasserstein1: x and y must have the same shape"):
        wasserstein1(np.zeros((4, 2)), np.zeros((5, 2)))
    with pytest.raises(ValueError, match="wasserstein1: draws must be finite"):
        wasserstein1(np.full((2, 2), np.nan), np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"wasserstein1: draws must be an array of shape \(N, D\)"):
        wasserstein1(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)))


def test_floor_and_debiased_w1_do_not_reward_narrow_fits():
    rng = np.random.default_rng(2)
    D, N = 30, 400
    p = rng.normal(size=(N, D))
    exact = rng.normal(size=(N, D))
    narrow = 0.6 * rng.normal(size=(N, D))
    floor = wasserstein1_floor(p)
    # the biased plain W1 of a too-narrow q is below the floor of the reference against itself
    assert wasserstein1(narrow[: N // 2], p[: N // 2]) < floor
    good = debiased_wasserstein1(exact, p)["w1_debiased"]
    bad = debiased_wasserstein1(narrow, p)["w1_debiased"]
    assert abs(good) < 0.1 * floor
    assert bad > 5 * abs(good)
    with pytest.raises(ValueError, match="wasserstein1_floor: n must be an integer from 1 to"):
        wasserstein1_floor(p, n=N)
    with pytest.raises(ValueError, match="debiased_wasserstein1: approx and reference must have the same dimension"):
        debiased_wasserstein1(p[:, :2], p)


def test_marginal_errors_against_direct_moments():
    rng = np.random.default_rng(3)
    p = rng.normal(size=(5000, 2)) * [1.0, 2.0]
    q = rng.normal(size=(5000, 2)) * [1.0, 1.0] + [0.5, 0.0]
    out = marginal_errors(q, p)
    np.testing.assert_allclose(out["mean_error"], [0.5, 0.0], atol=0.06)
    np.testing.assert_allclose(out["sd_ratio"], [1.0, 0.5], atol=0.03)
    with pytest.raises(ValueError, match="marginal_errors: approx and reference must have the same dimension"):
        marginal_errors(q[:, :1], p)


def test_khat_matches_arviz_and_separates_heavy_tails():
    from arviz import psislw
    from scipy import stats

    rng = np.random.default_rng(4)
    z = rng.normal(size=4000)
    # q = N(0, 1), p = Student-t(2): the ratios p/q have a heavy right tail
    lr_t = stats.t(df=2).logpdf(z) - stats.norm.logpdf(z)
    k_t = pareto_khat(lr_t)
    assert k_t == pytest.approx(float(psislw(lr_t - lr_t.max())[1]), abs=1e-12)
    assert k_t > 0.5
    # q = N(0, 1) wider than p = N(0, 0.9^2): bounded ratios
    lr_ok = stats.norm.logpdf(z, scale=0.9) - stats.norm.logpdf(z)
    assert pareto_khat(lr_ok) < 0.5
    lw, k = psis_log_weights(torch.as_tensor(lr_t))
    assert np.logaddexp.reduce(lw) == pytest.approx(0.0, abs=1e-10)
    with pytest.raises(ValueError, match="psis_log_weights: log_ratios must be a 1-D array"):
        psis_log_weights(np.zeros((3, 2)))
