"""pyro_fa.metrics against independent numbers: scipy, a dense numpy log-sum-exp, Monte Carlo."""
import doctest
import math

import numpy as np
import pytest
import torch
from scipy import stats

from pyro_fa import metrics
from pyro_fa.fa import linalg
from pyro_fa.metrics import calibration, gaussian_log_likelihood, mixture_cdf, rmse


def _problem(S=7, N=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(S, N, generator=g)
    variances = 0.1 + torch.rand(S, N, generator=g)
    y = torch.randn(N, generator=g) * 1.5
    return means, variances, y


def test_doctests():
    assert doctest.testmod(metrics).failed == 0


def test_rmse_in_original_units(device):
    means, _, y = _problem()
    means, y = means.to(device), y.to(device)
    ref = np.sqrt(np.mean((means[0].cpu().numpy() - y.cpu().numpy()) ** 2)) * 3.5
    assert float(rmse(means[0], y, y_std=3.5)) == pytest.approx(ref, rel=1e-12)
    ref_bma = np.sqrt(np.mean((means.cpu().numpy().mean(0) - y.cpu().numpy()) ** 2))
    assert float(rmse(means, y)) == pytest.approx(ref_bma, rel=1e-12)


def _dense_bma_loglik(means, variances, y, y_mean, y_std):
    """Per-point log of the mixture density in original units: scipy logpdf and a plain numpy log-sum-exp."""
    m, v, t = means.numpy(), variances.numpy(), y.numpy()
    logpdf = stats.norm.logpdf(t * y_std + y_mean, loc=m * y_std + y_mean, scale=np.sqrt(v) * y_std)  # (S, N)
    top = logpdf.max(0)
    return top + np.log(np.mean(np.exp(logpdf - top), axis=0))


@pytest.mark.parametrize("y_mean, y_std", [(0.0, 1.0), (22.5, 9.3), (-3.0, 0.01)])
def test_log_likelihood_matches_dense_reference(y_mean, y_std):
    means, variances, y = _problem()
    ref = _dense_bma_loglik(means, variances, y, y_mean, y_std)
    per_point = gaussian_log_likelihood(means, variances, y, y_mean=y_mean, y_std=y_std, reduction="none")
    assert per_point.shape == (50,)
    np.testing.assert_allclose(per_point.numpy(), ref, rtol=1e-10, atol=1e-10)
    mean_ll = gaussian_log_likelihood(means, variances, y, y_mean=y_mean, y_std=y_std)
    assert float(mean_ll) == pytest.approx(ref.mean(), rel=1e-10)
    # the shift y_mean does not change it; the scale only through -log(y_std)
    assert float(mean_ll) == pytest.approx(float(gaussian_log_likelihood(means, variances, y)) - math.log(y_std))


def test_log_likelihood_single_sample_broadcast_and_stability():
    means, variances, y = _problem(S=4)
    # one sample, shape (N,): scipy's logpdf
    ll = gaussian_log_likelihood(means[0], variances[0], y, reduction="none")
    np.testing.assert_allclose(ll.numpy(), stats.norm.logpdf(y, means[0], variances[0].sqrt()), rtol=1e-12)
    # a scalar noise variance and a per-sample (S, 1) noise broadcast over the test points
    ref = _dense_bma_loglik(means, torch.full_like(means, 0.3), y, 0.0, 1.0)
    np.testing.assert_allclose(gaussian_log_likelihood(means, 0.3, y, reduction="none").numpy(), ref, rtol=1e-12)
    noise = torch.tensor([[0.2], [0.3], [0.4], [0.5]])
    ref = _dense_bma_loglik(means, noise.expand_as(means), y, 0.0, 1.0)
    np.testing.assert_allclose(gaussian_log_likelihood(means, noise, y, reduction="none").numpy(), ref, rtol=1e-12)
    # far outliers: exp underflows in every component, the log-sum-exp does not
    far = gaussian_log_likelihood(means, 1e-4, y + 1e3, reduction="none")
    assert torch.isfinite(far).all()
    np.testing.assert_allclose(far.numpy(), _dense_bma_loglik(means, torch.full_like(means, 1e-4), y + 1e3, 0, 1),
                               rtol=1e-12)
    # float32 in, float32 out
    assert gaussian_log_likelihood(means.float(), variances.float(), y.float()).dtype == torch.float32


def test_mixture_cdf_matches_scipy(device):
    means, variances, y = _problem(S=5)
    ref = stats.norm.cdf(y.numpy(), means.numpy(), np.sqrt(variances.numpy())).mean(0)
    got = mixture_cdf(means.to(device), variances.to(device), y.to(device)).cpu()
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12, atol=1e-15)


def _bisect(cdf, p, lo=-50.0, hi=50.0, iters=200):
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return 0.5 * (lo + hi)


def test_coverage_matches_intervals_found_by_bisection():
    means, variances, y = _problem(S=3, N=40, seed=1)
    levels = [0.2, 0.5, 0.8, 0.95]
    cal = calibration(means, variances, y, levels=levels)
    m, s = means.numpy(), np.sqrt(variances.numpy())
    for j, p in enumerate(levels):
        inside = 0
        for n in range(y.shape[0]):
            cdf = lambda t: stats.norm.cdf(t, m[:, n], s[:, n]).mean()  # noqa: E731
            lo, hi = _bisect(cdf, (1 - p) / 2), _bisect(cdf, (1 + p) / 2)
            inside += lo <= float(y[n]) <= hi
        assert float(cal.coverage[j]) == inside / y.shape[0]
    assert float(cal.error) == pytest.approx(np.mean(np.abs(cal.coverage.numpy() - np.array(levels))))


def test_calibrated_mixture_covers_at_nominal_rates():
    """Targets drawn from the predictive mixture itself: coverage = level within 4 Monte Carlo standard errors."""
    S, N = 3, 100_000
    g = torch.Generator().manual_seed(2)
    means = torch.randn(S, N, generator=g) * 2
    variances = 0.05 + torch.rand(S, N, generator=g)
    comp = torch.randint(S, (N,), generator=g)
    pick = lambda t: t.gather(0, comp.unsqueeze(0)).squeeze(0)  # noqa: E731
    y = pick(means) + pick(variances).sqrt() * torch.randn(N, generator=g)
    cal = calibration(means, variances, y)
    assert cal.levels.shape == cal.coverage.shape == (19,)
    se = (cal.levels * (1 - cal.levels) / N).sqrt()
    assert ((cal.coverage - cal.levels).abs() <= 4 * se).all()
    assert float(cal.error) < 4e-3
    # one Gaussian, over-confident by a factor 2 in scale: coverage 2 Phi(z_p / 2) - 1 < p
    z = torch.randn(N, generator=g)
    over = calibration(torch.zeros(N), torch.full((N,), 0.25), z)
    expected = 2 * stats.norm.cdf(stats.norm.ppf((1 + over.levels.numpy()) / 2) / 2) - 1
    assert (np.abs(over.coverage.numpy() - expected) <= 4 * se.numpy()).all()
    assert (over.coverage < over.levels).all() and float(over.error) > 0.1


def test_reexports_are_the_foundations():
    assert metrics.relative_frobenius_distance is linalg.relative_frobenius_distance
    assert metrics.gaussian_wasserstein2 is linalg.gaussian_wasserstein2


# ---------------------------------------------------------------------------------------
# bad input


def test_bad_input():
    means, variances, y = _problem(S=2, N=5)
    with pytest.raises(TypeError, match="rmse: pred_mean must be a torch.Tensor, got list"):
        rmse([1.0], y)
    with pytest.raises(TypeError, match="calibration: y must be a torch.Tensor, got ndarray"):
        calibration(means, variances, y.numpy())
    with pytest.raises(ValueError, match=r"rmse: y_std must be a positive finite number, got 0\.0"):
        rmse(means[0], y, y_std=0)
    with pytest.raises(ValueError, match=r"gaussian_log_likelihood: y_std must be a positive finite number, got nan"):
        gaussian_log_likelihood(means, variances, y, y_std=float("nan"))
    with pytest.raises(ValueError, match=r"rmse: pred_mean must have shape \(N,\) or \(S, N\) matching y"):
        rmse(means[0, :4], y)
    with pytest.raises(ValueError, match=r"gaussian_log_likelihood: y must have shape \(N,\), got \(1, 5\)"):
        gaussian_log_likelihood(means, variances, y.unsqueeze(0))
    with pytest.raises(ValueError, match=r"mixture_cdf: pred_means must have shape \(S, N\) or \(N,\) with N = 5, "
                                         r"got \(2, 4\)"):
        mixture_cdf(means[:, :4], variances[:, :4], y)
    with pytest.raises(ValueError, match=r"pred_vars must broadcast to pred_means' shape \(2, 5\), got \(3,\)"):
        gaussian_log_likelihood(means, torch.ones(3), y)
    with pytest.raises(ValueError, match=r"calibration: pred_vars must be positive; got a minimum of 0\.0"):
        calibration(means, torch.zeros(2, 5), y)
    with pytest.raises(ValueError, match=r"reduction must be 'mean' or 'none', got 'sum'"):
        gaussian_log_likelihood(means, variances, y, reduction="sum")
    with pytest.raises(ValueError, match=r"calibration: levels must be a non-empty set of probabilities in \(0, 1\)"):
        calibration(means, variances, y, levels=[0.5, 1.0])
    with pytest.raises(ValueError, match=r"levels must be a non-empty set"):
        calibration(means, variances, y, levels=[])


# ---------------------------------------------------------------------------------------
# non-finite input: every public metric refuses NaN and inf in every tensor argument, naming it


def _finite_cases():
    """For each public metric: a function of its valid keyword arguments, and those arguments."""
    means, variances, y = _problem(S=3, N=6)
    g = torch.Generator().manual_seed(1)
    probs = torch.rand(4, 6, 3, generator=g).softmax(-1)
    labels = torch.randint(0, 3, (6,), generator=g)
    F1, F2 = torch.randn(5, 2, generator=g), torch.randn(5, 3, generator=g)
    p1, p2 = torch.rand(5, generator=g) + 0.1, torch.rand(5, generator=g) + 0.1
    S1, S2 = F1 @ F1.T + torch.diag(p1), F2 @ F2.T + torch.diag(p2)
    mixture = dict(pred_means=means, pred_vars=variances, y=y)
    return {
        "rmse": (rmse, dict(pred_mean=means, y=y)),
        "gaussian_log_likelihood": (gaussian_log_likelihood, mixture),
        "calibration": (calibration, mixture),
        "mixture_cdf": (mixture_cdf, mixture),
        "relative_frobenius_distance": (
            metrics.relative_frobenius_distance, dict(cov_factor1=F1, cov_diag1=p1, cov_factor2=F2, cov_diag2=p2)),
        "gaussian_wasserstein2": (
            metrics.gaussian_wasserstein2, dict(loc1=torch.zeros(5), cov1=S1, loc2=torch.ones(5), cov2=S2)),
        "bma_probs": (metrics.bma_probs, dict(probs=probs)),
        "accuracy": (metrics.accuracy, dict(probs=probs, targets=labels)),
        "negative_log_likelihood": (metrics.negative_log_likelihood, dict(probs=probs, targets=labels)),
        "brier_score": (metrics.brier_score, dict(probs=probs, targets=labels)),
        "expected_calibration_error": (metrics.expected_calibration_error, dict(probs=probs, targets=labels)),
        "predictive_entropy": (metrics.predictive_entropy, dict(probs=probs)),
        "mutual_information": (metrics.mutual_information, dict(samples=probs)),
        "ood_auroc": (
            metrics.ood_auroc, dict(scores_in=torch.randn(5, generator=g), scores_out=torch.randn(4, generator=g))),
        "agreement": (metrics.agreement, dict(probs=probs, ref_probs=probs.flip(0))),
        "total_variation": (metrics.total_variation, dict(probs=probs, ref_probs=probs.flip(0))),
        "competition_wasserstein": (metrics.competition_wasserstein,
                                    dict(samples=torch.randn(4, 6, generator=g), ref_samples=torch.randn(4, 7, generator=g))),
        "predictive_wasserstein2": (metrics.predictive_wasserstein2,
                                    dict(mean=torch.randn(4, generator=g), var=torch.rand(4, generator=g) + 0.1,
                                         ref_mean=torch.randn(4, generator=g), ref_var=torch.rand(4, generator=g) + 0.1)),
        "deep_ensemble_equivalent": (metrics.deep_ensemble_equivalent,
                                     dict(value=0.5, ensemble_curve=torch.tensor([0.4, 0.6, 0.7]))),
    }


def test_every_public_metric_is_checked_for_non_finite_input():
    functions = {n for n in metrics.__all__ if callable(getattr(metrics, n)) and n != "Calibration"}
    assert functions == set(_finite_cases())


@pytest.mark.parametrize("metric", sorted(_finite_cases()))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_metrics_refuse_non_finite_input(metric, bad):
    fn, kwargs = _finite_cases()[metric]
    assert torch.isfinite(torch.as_tensor(fn(**kwargs)[0] if metric == "calibration" else fn(**kwargs))).all()
    for name, value in kwargs.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue  # integer class labels cannot hold NaN; a plain number is checked on its own below
        spoiled = value.clone()
        spoiled.view(-1)[1] = bad
        with pytest.raises(ValueError, match=rf"{metric}: {name} must be finite, got NaN or inf in 1 of "):
            fn(**{**kwargs, name: spoiled})


def test_calibration_with_nan_targets_or_infinite_means_is_refused_not_a_number():
    """The reported failure: a NaN target or an infinite mean used to give a finite calibration error."""
    means, variances, y = _problem(S=1, N=4)
    y[0] = float("nan")
    with pytest.raises(ValueError, match=r"calibration: y must be finite, got NaN or inf in 1 of 4 entries\."):
        calibration(means, variances, y)
    means[0, 1] = float("inf")
    with pytest.raises(ValueError, match=r"rmse: pred_mean must be finite"):
        rmse(means, y)
    with pytest.raises(ValueError, match=r"gaussian_log_likelihood: y_mean must be a finite number, got inf"):
        gaussian_log_likelihood(means.nan_to_num(posinf=0.0), variances, y.nan_to_num(), y_mean=float("inf"))
    with pytest.raises(TypeError, match=r"rmse: y_std must be a positive finite number, got 'big'"):
        rmse(means[0].nan_to_num(posinf=0.0), y.nan_to_num(), y_std="big")
