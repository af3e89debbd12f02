"""FactorLaplace's fitted state: refused hyperparameters leave it exactly as it was, and what it hands out
(a posterior, a state_dict, its attributes) is a snapshot that a later fit, prior-precision choice or load leaves
unchanged."""
import pytest
import torch
from torch import nn

from pyro_fa.laplace import MOMENT_FITS, FactorLaplace, fit_second_moment


def _data(seed, N=40, C=3):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 2, generator=g, dtype=torch.float64)
    return X, torch.randint(C, (N,), generator=g)


def _fitted(rank=3, prior_precision=1.0):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = _data(0)
    return net, FactorLaplace(net, "classification", rank=rank, prior_precision=prior_precision).fit([(X, y)])


def _state(la):
    return {k: v.clone() for k, v in la.state_dict().items()}


def _assert_same(la, before):
    after = la.state_dict()
    assert set(after) == set(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k


# --------------------------------------------------------------------------- refused hyperparameters
@pytest.mark.parametrize("per_layer", [False, True])
def test_marglik_refuses_a_non_finite_evidence_and_a_bad_lr_and_keeps_the_state(per_layer):
    _, la = _fitted(prior_precision=torch.ones(4) if per_layer else 1.0)
    before = _state(la)
    for lr in (0.0, float("nan"), -1.0):
        with pytest.raises(ValueError, match=r"lr must be a positive finite float, got"):
            la.optimize_prior_precision("marglik", lr=lr)
    _assert_same(la, before)
    # steps of up to 1e4 e-folds: exp(u) overflows at the trial points, which the line search halves away
    huge = la.optimize_prior_precision("marglik", lr=1e4)
    la.load_state_dict(before)
    chosen = la.optimize_prior_precision("marglik")
    torch.testing.assert_close(huge, chosen, rtol=1e-6, atol=0)
    assert bool(torch.isfinite(chosen).all() and (chosen > 0).all())
    assert torch.equal(la.prior_precision, chosen)
    # an evidence that is not finite where the search starts (a non-finite loss) is refused, nothing stored
    la._replace(loss=torch.tensor(float("inf")))
    before = _state(la)
    with pytest.raises(ValueError, match=r"marglik.*not finite at the prior precision .* it starts from.*left as it was"):
        la.optimize_prior_precision("marglik")
    _assert_same(la, before)


def test_gridsearch_refuses_a_non_finite_validation_nll_and_keeps_the_state():
    _, la = _fitted()
    before = _state(la)
    X, y = _data(1)
    X[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"validation NLL is not finite at prior precision\(s\) \[0.1, 1.0, 10.0\]"):
        la.optimize_prior_precision("gridsearch", val_loader=[(X, y)], grid=[0.1, 1.0, 10.0])
    _assert_same(la, before)


@pytest.mark.parametrize("value, match", [
    (torch.tensor([-1.0]), r"prior_precision must be positive and finite, got \[-1.0\]"),
    (torch.tensor([float("nan")]), r"prior_precision must be positive and finite, got \[nan\]"),
    (torch.tensor([float("inf")]), r"prior_precision must be positive and finite, got \[inf\]"),
    (torch.ones(3), r"prior_precision must be a scalar or have one value per parameter tensor \(shape \(1,\) or \(4,\)\), got shape \(3,\)"),
])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_log_marginal_likelihood_checks_the_prior_precision_even_with_a_graph(value, match, requires_grad):
    _, la = _fitted()
    before = _state(la)
    with pytest.raises(ValueError, match=match):
        la.log_marginal_likelihood(prior_precision=value.double().requires_grad_(requires_grad))
    _assert_same(la, before)


def test_log_marginal_likelihood_checks_sigma_noise_even_with_a_graph():
    _, la = _fitted()
    for value, match in ((float("inf"), r"sigma_noise must be a positive finite scalar, got \[inf\]"),
                         (-2.0, r"sigma_noise must be a positive finite scalar, got \[-2.0\]"),
                         (2.0, r"sigma_noise must be 1 for likelihood='classification', got \[2.0\]")):
        with pytest.raises(ValueError, match=match):
            la.log_marginal_likelihood(sigma_noise=torch.tensor(value, dtype=torch.float64, requires_grad=True))
    # valid values keep their graph: the gradient reaches them
    pp = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    la.log_marginal_likelihood(prior_precision=pp).backward()
    assert pp.grad is not None and bool(torch.isfinite(pp.grad).all())


def test_load_state_dict_refuses_non_positive_hyperparameters_and_loads_nothing():
    _, la = _fitted()
    _, other = _fitted(prior_precision=2.0)
    before = _state(other)
    for key, bad in (("prior_precision", torch.tensor([-1.0], dtype=torch.float64)),
                     ("cov_diag", -la.cov_diag - 1.0)):
        sd = _state(la)
        sd[key] = bad
        with pytest.raises(ValueError, match=rf"state_dict\['{key}'\] must be .*nothing was loaded"):
            other.load_state_dict(sd)
        _assert_same(other, before)


# --------------------------------------------------------------------------- snapshots
def test_a_kept_posterior_is_unchanged_by_a_later_fit_and_prior_precision():
    net, la = _fitted()
    post = la.get_posterior()
    kept = {"loc": post.loc.clone(), "prec_factor": post.prec_factor.clone(), "prec_diag": post.prec_diag.clone(),
            "variance": post.variance.clone()}
    # retrain (other weights) and refit on other data, then choose another prior precision
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3)
    X, y = _data(2)
    la.fit([(X, y)])
    la.optimize_prior_precision("marglik", n_steps=10)
    assert not torch.equal(la.loc, kept["loc"])  # the refit moved the approximation...
    for k, v in kept.items():  # ...but not the posterior taken before it
        assert torch.equal(getattr(post, k), v), k
    # and the other way round: changing a posterior in place does not reach the approximation
    loc = la.loc.clone()
    la.get_posterior().loc.add_(1.0)
    assert torch.equal(la.loc, loc)


def test_state_dict_is_a_snapshot_that_round_trips_after_a_refit():
    net, la = _fitted()
    X_test, _ = _data(3, N=6)
    p_first = la.predict_proba(X_test, pred_type="glm")
    saved = la.state_dict()  # not cloned by the caller
    copy = _state(la)
    pp_before = la.prior_precision
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(1.5)
    la.fit([_data(4)])
    la.optimize_prior_precision("marglik", n_steps=10)
    assert torch.equal(pp_before, copy["prior_precision"])  # an attribute taken earlier is left alone
    for k, v in copy.items():
        assert torch.equal(saved[k], v), k
    # loading the earlier fit (into a fresh approximation, at the earlier weights) gives its predictions back
    with torch.no_grad():
        for p in net.parameters():
            p.div_(1.5)
    fresh = FactorLaplace(net, "classification", rank=3)
    fresh.load_state_dict(saved)
    torch.testing.assert_close(fresh.predict_proba(X_test, pred_type="glm"), p_first, rtol=1e-12, atol=1e-12)
    # load_state_dict does not write into the tensors of a state_dict taken before it
    refit_state = la.state_dict()
    refit_copy = _state(la)
    la.load_state_dict(saved)
    for k, v in refit_copy.items():
        assert torch.equal(refit_state[k], v), k
    _assert_same(la, copy)


# --------------------------------------------------------------------------- the curvature fits by name
def test_an_unknown_curvature_fit_names_the_valid_ones():
    def passes():
        yield torch.randn(4, 3, dtype=torch.float64)

    with pytest.raises(ValueError, match=r"curvature_fit must be one of \('auto', 'scatter', 'online', 'sketch', "
                       r"'randomized', 'exact'\), got 'svd'"):
        fit_second_moment(passes, 3, 1, method="svd", dtype=torch.float64, device="cpu")
    for method in MOMENT_FITS:  # every name listed is served
        F, psi, info = fit_second_moment(passes, 3, 1, method=method, dtype=torch.float64, device="cpu")
        assert F.shape == (3, 1) and psi.shape == (3,) and info["n_vectors"] == 4
        assert info["method"] == ("exact" if method == "auto" else method)
