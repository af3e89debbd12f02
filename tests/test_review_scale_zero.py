"""Scale 0 (the mean, which tune_scale may choose) and the GLM predictive, kept consistent across the API."""
import math

import pytest
import torch
from torch import nn

from pyro_fa import SWAG


def _swag(T=60, seed=0):
    torch.manual_seed(seed)
    net = nn.Linear(2, 1).double()
    swag = SWAG(net, rank=1, method="em", warmup=10, seed=seed, max_deviation=None)
    g = torch.Generator().manual_seed(seed)
    for _ in range(T):
        with torch.no_grad():
            net.weight.copy_(1.0 + 0.1 * torch.randn(1, 2, generator=g, dtype=torch.float64))
            net.bias.copy_(0.1 * torch.randn(1, generator=g, dtype=torch.float64))
        swag.collect()
    return net, swag


def test_a_posterior_at_scale_0_round_trips_through_its_state_dict():
    net, swag = _swag()
    swag.scale = 0.0  # what tune_scale sets when the mean wins
    state = swag.state_dict()
    other_net = nn.Linear(2, 1).double()
    other = SWAG(other_net, rank=1, method="em", warmup=10, max_deviation=None)
    other.load_state_dict(state)
    assert other.scale == 0.0
    torch.testing.assert_close(other.sample(2), swag.loc.expand(2, -1), rtol=0, atol=0)
    state["_extra_state"] = dict(state["_extra_state"], scale=-1.0)
    with pytest.raises(ValueError, match=r"'scale' must be a finite number >= 0, got -1.0"):
        other.load_state_dict(state)
    assert other.scale == 0.0


def _bn_swag(extra):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), extra, nn.Linear(4, 2)).double()
    swag = SWAG(net, rank=1, warmup=5, max_deviation=None, seed=0)
    for _ in range(30):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01 * torch.randn_like(p))
        swag.collect()
    return net, swag


@pytest.mark.parametrize("extra", [nn.BatchNorm1d(4), nn.Dropout(0.5)], ids=["batchnorm", "dropout"])
def test_the_glm_predictive_refuses_a_module_in_train_mode_and_leaves_its_buffers(extra):
    net, swag = _bn_swag(extra)
    x = torch.randn(8, 3, dtype=torch.float64)
    buffers = {k: b.clone() for k, b in net.named_buffers()}
    calls = [lambda: swag.predict(x, pred_type="glm"),
             lambda: swag.predict_proba(x, pred_type="glm", link_approx="probit"),
             lambda: swag.predict_proba(x, pred_type="glm", num_samples=3),
             lambda: swag.linearized_moments(x)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"module must be in eval mode where it has dropout or batch norm .*got "
                                             rf"{type(extra).__name__} '1' in train mode. Call module.eval\(\)"):
            call()
        for k, b in net.named_buffers():
            assert torch.equal(b, buffers[k]), k  # num_batches_tracked too
    assert net.training
    net.eval()
    mean, var = swag.predict(x, pred_type="glm", return_var=True)
    # the linearised network's variances against a dense J Sigma J^T (Jacobian by autograd, Sigma dense)
    loc = swag.loc
    J = torch.autograd.functional.jacobian(
        lambda th: torch.func.functional_call(net, dict(zip([n for n, _ in net.named_parameters()],
                                                            _split(net, th))), (x,)), loc)  # (N, C, D)
    Sigma = swag.scale * (swag.cov_factor @ swag.cov_factor.T + torch.diag(swag.cov_diag))
    dense = torch.einsum("ncd,de,nce->nc", J, Sigma, J)
    torch.testing.assert_close(var, dense, rtol=1e-8, atol=1e-12)


def _split(net, theta):
    out, i = [], 0
    for p in net.parameters():
        out.append(theta[i:i + p.numel()].view_as(p))
        i += p.numel()
    return out


def test_laplace_gridsearch_scores_the_sampled_predictive_with_the_default_link_approx():
    from pyro_fa.laplace import FactorLaplace

    g = torch.Generator().manual_seed(1)
    X = torch.randn(60, 2, generator=g, dtype=torch.float64)
    y = (X[:, 0] + 0.5 * torch.randn(60, generator=g, dtype=torch.float64) > 0).long()
    net = nn.Linear(2, 2).double()
    la = FactorLaplace(net, "classification", rank=2).fit([(X[:40], y[:40])])
    grid = [1e-2, 1.0, 1e2]
    torch.manual_seed(0)  # predict_proba('nn') draws from the global generator: the same draws below
    chosen = float(la.optimize_prior_precision("gridsearch", val_loader=[(X[40:], y[40:])], grid=grid,
                                               pred_type="nn", num_samples=20))
    torch.manual_seed(0)
    nll = []
    for v in grid:  # the sampled predictive's NLL, by drawing weights from the dense posterior covariance
        la.prior_precision.fill_(v)
        thetas = la.get_posterior().rsample((20,))
        p = torch.stack([torch.func.functional_call(net, dict(zip(["weight", "bias"], (t[:4].view(2, 2), t[4:]))),
                                                    (X[40:],)).softmax(-1) for t in thetas]).mean(0)
        nll.append(float(-p.gather(1, y[40:, None]).log().mean()))
    assert la.grid_scores_[1] == pytest.approx(nll, rel=1e-10)
    assert chosen == grid[min(range(3), key=nll.__getitem__)]


def test_probit_refuses_keyword_inputs_in_predict_log_proba_as_in_predict_proba():
    torch.manual_seed(0)
    net = nn.Linear(2, 3).double()
    swag = SWAG(net, rank=1, warmup=5, max_deviation=None, seed=0)
    for _ in range(20):
        with torch.no_grad():
            net.weight.add_(0.05 * torch.randn_like(net.weight))
        swag.collect()
    x = torch.randn(4, 2, dtype=torch.float64)
    for method in (swag.predict_proba, swag.predict_log_proba):  # inputs are positional only (x or a tuple)
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'mask'"):
            method(x, pred_type="glm", link_approx="probit", mask=x)
    # and without keywords, the log of the probit probabilities: softmax of the moderated mean logits, densely
    logp = swag.predict_log_proba(x, pred_type="glm", link_approx="probit")
    mean = torch.func.functional_call(
        net, {"weight": swag.loc[:6].view(3, 2), "bias": swag.loc[6:]}, (x,))
    Sigma = swag.scale * (swag.cov_factor @ swag.cov_factor.T + torch.diag(swag.cov_diag))
    J = torch.zeros(4, 3, 9, dtype=torch.float64)  # d logits / d (weight, bias) of a linear layer
    for c in range(3):
        J[:, c, 2 * c:2 * c + 2] = x
        J[:, c, 6 + c] = 1.0
    var = torch.einsum("ncd,de,nce->nc", J, Sigma, J)
    expected = (mean / torch.sqrt(1 + math.pi / 8 * var)).log_softmax(-1)
    torch.testing.assert_close(logp, expected, rtol=1e-10, atol=1e-12)


def _cauchy_model(X, y=None, sigma=1.0):
    import pyro
    import pyro.distributions as dist

    w = pyro.sample("w", dist.Cauchy(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("n", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def test_pyro_laplace_keeps_its_fit_after_a_refused_refit_and_its_draws_follow_the_generator():
    import pyro

    from pyro_fa.laplace import PyroFactorLaplace

    pyro.clear_param_store()
    g = torch.Generator().manual_seed(0)
    X2 = torch.randn(10, 2, generator=g, dtype=torch.float64)
    pyro.param("AutoDelta.w", torch.zeros(2, dtype=torch.float64))
    la = PyroFactorLaplace(_cauchy_model, rank=1, num_samples=20).fit(X2, torch.zeros(10, dtype=torch.float64))
    # prior curvature of -log Cauchy at 0: 2; posterior precision 2 + the (positive) Fisher
    torch.testing.assert_close(la.prior_curvature, torch.full((2,), 2.0, dtype=torch.float64))
    state = (la.site_names(), list(la._shapes), la.fit_info, la.get_posterior(), la.loc)
    # at w = 10 the Cauchy prior's curvature is 2 (1 - 100) / 101^2 < 0 and a noise of 100 leaves the Fisher tiny
    X3 = torch.randn(2, 3, generator=g, dtype=torch.float64)
    pyro.clear_param_store()
    pyro.param("AutoDelta.w", torch.full((3,), 10.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"must be positive definite, got a diagonal of -[0-9.e-]+ at \['w\[0\]', 'w\[1\]', 'w\[2\]'\]: the prior and the likelihood give no positive curvature"):
        la.fit(X3, torch.zeros(2, dtype=torch.float64), sigma=100.0)
    assert (la.site_names(), list(la._shapes), la.fit_info, la.get_posterior(), la.loc) == state
    assert la.sample(4).shape == (4, 2)
    # draws follow the generator, and leave the global generator alone
    torch.manual_seed(123)
    a = la.sample(3, generator=torch.Generator().manual_seed(7))
    after = torch.rand(())
    torch.manual_seed(123)
    b = la.sample(3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and torch.equal(torch.rand(()), after)
    assert not torch.equal(a, la.sample(3, generator=torch.Generator().manual_seed(8)))
    with pytest.raises(ValueError, match=r"num_samples must be an integer >= 1 or None, got 0"):
        la.sample(0)
    pyro.clear_param_store()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_laplace_draws_take_a_generator_on_the_models_device():
    from pyro_fa.laplace import FactorLaplace

    net = nn.Linear(2, 1).double().cuda()
    X = torch.randn(30, 2, dtype=torch.float64, device="cuda")
    la = FactorLaplace(net, "regression", rank=1).fit([(X, X.sum(1))])
    a = la.sample(4, generator=torch.Generator(device="cuda").manual_seed(3))
    b = la.sample(4, generator=torch.Generator(device="cuda").manual_seed(3))
    assert a.device.type == "cuda" and torch.equal(a, b)


def test_laplace_draws_follow_a_cpu_generator():
    from pyro_fa.laplace import FactorLaplace

    net = nn.Linear(2, 1).double()
    X = torch.randn(30, 2, dtype=torch.float64)
    la = FactorLaplace(net, "regression", rank=1).fit([(X, X.sum(1))])
    a = la.sample(4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, la.sample(4, generator=torch.Generator().manual_seed(3)))
    assert not torch.equal(a, la.sample(4, generator=torch.Generator().manual_seed(4)))


def test_multiswag_log_likelihood_refuses_members_at_different_scales_instead_of_using_the_first():
    from pyro_fa import MultiSWAG
    from pyro_fa.predictive import bma_log_likelihood

    members = [_swag(seed=s)[1] for s in range(2)]
    ms = MultiSWAG(members)
    x = torch.randn(20, 2, dtype=torch.float64)
    y = x.sum(1)
    members[1].scale = 4.0
    with pytest.raises(ValueError, match=r"bma_log_likelihood: the members' scales differ, got \[1.0, 4.0\]"):
        ms.log_likelihood(x, y, "gaussian", noise_std=0.5)
    ms.scale = 0.0  # a common scale: the ensemble of the members' means, by hand
    ll = torch.stack([torch.distributions.Normal(x @ m.loc[:2] + m.loc[2], 0.5).log_prob(y) for m in members])
    expected = float((torch.logsumexp(ll, 0) - math.log(2)).mean())
    assert ms.log_likelihood(x, y, "gaussian", noise_std=0.5) == pytest.approx(expected, rel=1e-12)
    assert bma_log_likelihood(members[0], x, y, "gaussian", noise_std=0.5) == pytest.approx(
        float(ll[0].mean()), rel=1e-12)


@pytest.mark.parametrize("extra", [nn.BatchNorm1d(4), nn.Dropout(0.5)], ids=["batchnorm", "dropout"])
def test_laplace_fit_refuses_a_model_in_train_mode_and_leaves_its_buffers(extra):
    from pyro_fa.laplace import FactorLaplace

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), extra, nn.Linear(4, 2)).double()
    X = torch.randn(20, 3, dtype=torch.float64)
    y = torch.randint(2, (20,))
    buffers = {k: b.clone() for k, b in net.named_buffers()}
    la = FactorLaplace(net, "classification", rank=2)
    with pytest.raises(ValueError, match=rf"FactorLaplace: model must be in eval mode where it has dropout or batch "
                                         rf"norm .*got {type(extra).__name__} '1' in train mode. Call model.eval\(\)"):
        la.fit([(X, y)])
    for k, b in net.named_buffers():
        assert torch.equal(b, buffers[k]), k
    assert int(la.n_data) == 0
    net.eval()
    la.fit([(X, y)])
    assert int(la.n_data) == 20 and la.predict_proba(X).shape == (20, 2)
