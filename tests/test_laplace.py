"""FactorLaplace (the Laplace approximation with a factor-analysis curvature) against independent computations:
Bayesian linear regression in closed form, the dense Laplace approximation from torch.autograd.functional.hessian,
dense GGNs from torch.autograd.functional.jacobian, and the Monte Carlo Fisher's convergence."""
import math

import pytest
import torch
from torch import nn
from torch.distributions import MultivariateNormal

from pyro_fa.laplace import FactorLaplace, curvature_vectors, flat_network, select_parameters


# --------------------------------------------------------------------------- Bayesian linear regression
def _blr(N=40, d=3, sigma=0.4, prior=(2.0, 0.5), seed=0):
    """Data, a Linear(d, 1) at the exact MAP for the per-layer prior precisions (weight, bias), the dense posterior."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, d, generator=g)
    y = X @ torch.randn(d, generator=g) + 0.3 + sigma * torch.randn(N, generator=g)
    Z = torch.cat([X, torch.ones(N, 1)], 1)
    delta = torch.tensor([prior[0]] * d + [prior[1]])
    P = torch.diag(delta) + Z.T @ Z / sigma ** 2
    m = torch.linalg.solve(P, Z.T @ y / sigma ** 2)
    net = nn.Linear(d, 1)
    with torch.no_grad():
        net.weight.copy_(m[:d][None])
        net.bias.copy_(m[d:])
    evidence = MultivariateNormal(torch.zeros(N), Z @ torch.diag(1 / delta) @ Z.T + sigma ** 2 * torch.eye(N))
    return X, y, Z, net, torch.tensor(prior), P, m, evidence.log_prob(y)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_bayesian_linear_regression_is_exact_at_full_rank():
    X, y, Z, net, prior, P, m, log_evidence = _blr()
    la = FactorLaplace(net, "regression", rank=4, prior_precision=prior, sigma_noise=0.4)
    la.fit([(X[:15], y[:15]), (X[15:], y[15:])])
    S = torch.linalg.inv(P)
    assert _rel(la.get_posterior().covariance_matrix, S) < 1e-6
    assert _rel(la.get_posterior().mean, m) < 1e-12
    assert abs(float(la.log_marginal_likelihood()) / float(log_evidence) - 1) < 1e-6
    # GLM predictive of a linear model: z^T S z + sigma^2, exactly
    mean, var = la.predict(X[:5], pred_type="glm", return_var=True)
    torch.testing.assert_close(mean[:, 0], Z[:5] @ m)
    torch.testing.assert_close(var[:, 0], (Z[:5] @ S * Z[:5]).sum(-1) + 0.16)


def test_blr_evidence_and_its_gradients_equal_the_closed_form_at_other_hyperparameters():
    X, y, Z, net, prior, P, m, _ = _blr()
    la = FactorLaplace(net, "regression", rank=4, prior_precision=prior, sigma_noise=0.4).fit([(X, y)])
    pp = torch.tensor([1.5, 3.0], requires_grad=True)
    sg = torch.tensor(0.7, requires_grad=True)
    ours = la.log_marginal_likelihood(pp, sg)
    # the same formula, densely: log p(y|m) + log p(m) + D/2 log 2pi - 1/2 log det P  (theta fixed at m)
    delta = torch.cat([pp[0].expand(3), pp[1:]])
    r = y - Z @ m
    dense = (MultivariateNormal(Z @ m, sg ** 2 * torch.eye(len(y))).log_prob(y)
             + MultivariateNormal(torch.zeros(4), precision_matrix=torch.diag(delta)).log_prob(m)
             + 2 * math.log(2 * math.pi) - 0.5 * torch.logdet(torch.diag(delta) + Z.T @ Z / sg ** 2))
    torch.testing.assert_close(ours, dense)
    g1 = torch.autograd.grad(ours, (pp, sg))
    g2 = torch.autograd.grad(dense, (pp, sg))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    assert float(r.pow(2).sum()) == pytest.approx(float(la.loss))


def test_marglik_prior_precision_is_a_stationary_point_of_the_dense_evidence():
    X, y, Z, net, _, _, m, _ = _blr()
    la = FactorLaplace(net, "regression", rank=4, prior_precision=1.0, sigma_noise=0.4).fit([(X, y)])
    delta = float(la.optimize_prior_precision("marglik", n_steps=300, lr=0.1))
    # d/d delta of [ -1/2 (log det(delta I + H) - D log delta + delta |m|^2) ] = 0
    H = Z.T @ Z / 0.16
    grad = -0.5 * (torch.linalg.inv(delta * torch.eye(4) + H).trace() - 4 / delta + m.pow(2).sum())
    assert abs(float(grad)) < 1e-4
    assert la.prior_precision.shape == (1,)


def test_gridsearch_picks_the_smallest_validation_nll():
    X, y, Z, net, _, _, _, _ = _blr(N=60)
    la = FactorLaplace(net, "regression", rank=4, prior_precision=1.0, sigma_noise=0.4).fit([(X[:40], y[:40])])
    grid = [1e-3, 1e-1, 1e1, 1e3, 1e5]
    chosen = float(la.optimize_prior_precision("gridsearch", val_loader=[(X[40:], y[40:])], grid=grid))
    values, scores = la.grid_scores_
    nll = []
    for v in grid:  # the Gaussian predictive NLL, densely
        S = torch.linalg.inv(v * torch.eye(4) + Z[:40].T @ Z[:40] / 0.16)
        var = (Z[40:] @ S * Z[40:]).sum(-1) + 0.16
        mean = net(X[40:]).detach()[:, 0]
        nll.append(float(0.5 * ((y[40:] - mean) ** 2 / var + var.log() + math.log(2 * math.pi)).mean()))
    assert scores == pytest.approx(nll, rel=1e-8)
    assert chosen == grid[min(range(len(grid)), key=nll.__getitem__)]


# --------------------------------------------------------------------------- logistic / softmax regression
@pytest.fixture(scope="module")
def breast_cancer():
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = torch.tensor((X - X.mean(0)) / X.std(0), dtype=torch.float64)
    return X, torch.tensor(y)


def _map_and_dense_laplace(X, y, C, delta):
    def neg_log_joint(theta):
        z = X @ theta[:30 * C].view(C, 30).T + theta[30 * C:]
        nll = (nn.functional.binary_cross_entropy_with_logits(z[:, 0], y.double(), reduction="sum") if C == 1
               else nn.functional.cross_entropy(z, y, reduction="sum"))
        return nll + 0.5 * delta * theta.pow(2).sum()

    theta = torch.zeros(31 * C, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], max_iter=500, tolerance_grad=1e-11, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = neg_log_joint(theta)
        loss.backward()
        return loss

    opt.step(closure)
    theta = theta.detach()
    net = nn.Linear(30, C).double()
    with torch.no_grad():
        net.weight.copy_(theta[:30 * C].view(C, 30))
        net.bias.copy_(theta[30 * C:])
    H = torch.autograd.functional.hessian(neg_log_joint, theta)
    return net, theta, H, neg_log_joint(theta)


@pytest.mark.parametrize("C", [1, 2])
def test_logistic_and_softmax_regression_match_the_dense_laplace_at_rank_d_minus_1(breast_cancer, C):
    X, y = breast_cancer
    net, theta, H, nlj = _map_and_dense_laplace(X, y, C, delta=1.0)
    D = 31 * C
    la = FactorLaplace(net, "classification", rank=D - 1, prior_precision=1.0, chunk_size=200)
    la.fit([(X[:300], y[:300]), (X[300:], y[300:])])
    S = torch.linalg.inv(H)
    assert _rel(la.get_posterior().covariance_matrix, S) < 0.01
    assert la.fit_info["method"] == "exact" and la.fit_info["converged"]
    # the Laplace evidence with the dense Hessian: -nlj + D/2 log delta - 1/2 log det H
    dense = -nlj + 0.5 * D * math.log(1.0) - 0.5 * torch.logdet(H)
    assert float(la.log_marginal_likelihood()) == pytest.approx(float(dense), rel=1e-3)
    # the GLM predictive's logit variances: x^T S x for a model linear in its weights
    Zx = torch.cat([X[:4], torch.ones(4, 1, dtype=X.dtype)], 1)
    if C == 1:
        var = (Zx @ S * Zx).sum(-1)
        mean = net(X[:4]).detach()[:, 0]
        p1 = torch.sigmoid(mean / (1 + math.pi / 8 * var).sqrt())
        torch.testing.assert_close(la.predict_proba(X[:4], pred_type="glm")[:, 1], p1, rtol=1e-4, atol=1e-6)
    else:
        proba = la.predict_proba(X[:4], pred_type="glm")
        assert proba.shape == (4, 2) and torch.allclose(proba.sum(-1), torch.ones(4, dtype=X.dtype))


def test_lower_ranks_are_worse_but_bounded(breast_cancer):
    X, y = breast_cancer
    net, theta, H, _ = _map_and_dense_laplace(X, y, 1, delta=1.0)
    S = torch.linalg.inv(H)
    errs = [_rel(FactorLaplace(net, "classification", rank=K).fit([(X, y)]).get_posterior().covariance_matrix, S)
            for K in (2, 20)]
    assert errs[1] < errs[0] < 1.0


# --------------------------------------------------------------------------- curvature vectors
def _mlp(seed=0, C=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, C)).double()


def _dense_ggn(net, X, likelihood):
    named = select_parameters(net, "all", "test")
    f = flat_network(net, named)
    theta = torch.cat([p.detach().reshape(-1) for _, p in named])
    G = torch.zeros(theta.numel(), theta.numel(), dtype=theta.dtype)
    for x in X:
        J = torch.autograd.functional.jacobian(lambda t: f(t, x[None])[0], theta)  # (C, D)
        if likelihood == "regression":
            lam = torch.eye(J.shape[0], dtype=J.dtype)
        else:
            p = f(theta, x[None])[0].softmax(-1)
            lam = torch.diag(p) - torch.outer(p, p)
        G += J.T @ lam @ J
    return f, theta, G


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_ggn_vectors_sum_to_the_dense_ggn(likelihood):
    net = _mlp()
    X = torch.randn(12, 2, dtype=torch.float64)
    f, theta, G = _dense_ggn(net, X, likelihood)
    V = torch.cat([curvature_vectors(f, theta, X[:5], likelihood), curvature_vectors(f, theta, X[5:], likelihood)])
    assert V.shape == (12 * 3, theta.numel())
    torch.testing.assert_close(V.T @ V, G)


@pytest.mark.slow
def test_mc_fisher_converges_to_the_ggn_like_one_over_sqrt_samples():
    net = _mlp()
    X = torch.randn(20, 2, dtype=torch.float64)
    f, theta, G = _dense_ggn(net, X, "classification")
    errors = []
    for M in (4, 16, 64):
        sq = []
        for seed in range(6):
            g = torch.Generator().manual_seed(seed)
            V = curvature_vectors(f, theta, X, "classification", "mc", num_samples=M, generator=g)
            sq.append(_rel(V.T @ V, G) ** 2)
        errors.append(math.sqrt(sum(sq) / len(sq)))
    # the root-mean-square error halves (within Monte Carlo spread) with each fourfold of samples
    for a, b in zip(errors, errors[1:]):
        assert 1.5 < a / b < 2.7, errors
    # and the whole pipeline: FactorLaplace with the MC Fisher at full rank approaches the exact-GGN one
    exact = FactorLaplace(net, "classification", rank=theta.numel()).fit([(X, torch.zeros(20, dtype=torch.long))])
    mc = FactorLaplace(net, "classification", rank=theta.numel(), curvature="mc", mc_samples=256)
    mc.fit([(X, torch.zeros(20, dtype=torch.long))])
    assert _rel(mc.get_posterior().precision_matrix, exact.get_posterior().precision_matrix) < 0.15


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_mc_fisher_of_one_output_is_unbiased_for_the_ggn(likelihood):
    # one output: a Gaussian mean, or a Bernoulli logit (GGN factor sqrt(p(1-p)) J)
    torch.manual_seed(0)
    net = nn.Linear(3, 1).double()
    X = torch.randn(10, 3, dtype=torch.float64)
    named = select_parameters(net, "all", "test")
    f = flat_network(net, named)
    theta = torch.cat([p.detach().reshape(-1) for _, p in named])
    exact = curvature_vectors(f, theta, X, likelihood)
    G = exact.T @ exact
    Z = torch.cat([X, torch.ones(10, 1, dtype=X.dtype)], 1)
    if likelihood == "regression":
        torch.testing.assert_close(G, Z.T @ Z)
    else:
        p = torch.sigmoid(net(X).detach()[:, 0])
        torch.testing.assert_close(G, Z.T @ (Z * (p * (1 - p))[:, None]))
    V = curvature_vectors(f, theta, X, likelihood, "mc", num_samples=4000, generator=torch.Generator().manual_seed(0))
    assert V.shape == (40_000, 4)
    assert _rel(V.T @ V, G) < 0.05  # about sqrt(2 / 4000) per entry


# --------------------------------------------------------------------------- subsets, online fit, predictives
def test_last_layer_subset_is_the_last_linear_and_equals_passing_its_parameters():
    net = _mlp()
    X, y = torch.randn(30, 2, dtype=torch.float64), torch.randint(3, (30,))
    a = FactorLaplace(net, "classification", rank=4, subset="last_layer").fit([(X, y)])
    b = FactorLaplace(net, "classification", rank=4, subset=list(net[2].parameters())).fit([(X, y)])
    assert a.dim == 5 * 3 + 3
    torch.testing.assert_close(a.get_posterior().covariance_matrix, b.get_posterior().covariance_matrix)
    f, theta, G = _dense_ggn(net, X, "classification")
    last = slice(theta.numel() - 18, theta.numel())
    exact = FactorLaplace(net, "classification", rank=18, subset="last_layer").fit([(X, y)])
    torch.testing.assert_close(exact.get_posterior().precision_matrix, torch.eye(18, dtype=G.dtype) + G[last, last])


@pytest.mark.parametrize("fit", ["online", "sketch"])
def test_online_fits_approach_the_exact_scatter_fit(fit):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(400, 12, generator=g, dtype=torch.float64) @ torch.randn(12, 12, generator=g, dtype=torch.float64)
    y = torch.randn(400, generator=g, dtype=torch.float64)
    net = nn.Linear(12, 1, bias=False).double()
    scatter = FactorLaplace(net, "regression", rank=3, curvature_fit="scatter").fit([(X, y)])
    online = FactorLaplace(net, "regression", rank=3, curvature_fit=fit).fit([(X[:200], y[:200]), (X[200:], y[200:])])
    G = X.T @ X
    e_scatter = _rel(scatter.get_posterior().precision_matrix - torch.eye(12), G)
    e_online = _rel(online.get_posterior().precision_matrix - torch.eye(12), G)
    assert online.fit_info["method"] == fit
    assert e_online < 1.5 * e_scatter + 0.02, (e_online, e_scatter)


def test_sampled_predictive_agrees_with_the_glm_one_for_a_linear_model():
    X, y, Z, net, prior, P, m, _ = _blr()
    la = FactorLaplace(net, "regression", rank=4, prior_precision=prior, sigma_noise=0.4).fit([(X, y)])
    torch.manual_seed(0)
    mean_nn, var_nn = la.predict(X[:3], pred_type="nn", return_var=True, num_samples=20_000)
    mean_glm, var_glm = la.predict(X[:3], pred_type="glm", return_var=True)
    sd = (var_glm - 0.16).sqrt()
    assert bool(((mean_nn - mean_glm).abs() < 4.5 * sd / math.sqrt(20_000)).all())
    assert bool(((var_nn / var_glm - 1).abs() < 0.05).all())
    probs = FactorLaplace(_mlp(), "classification", rank=3).fit([(X[:, :2], torch.randint(3, (40,)))])
    for kw in (dict(pred_type="glm", link_approx="mc"), dict(pred_type="nn"), dict()):
        p = probs.predict_proba(X[:5, :2], num_samples=50, **kw)
        assert p.shape == (5, 3) and torch.allclose(p.sum(-1), torch.ones(5, dtype=p.dtype))


# --------------------------------------------------------------------------- state, dtype, device, errors
def test_state_dict_round_trip_and_refusal():
    X, y, Z, net, prior, P, m, _ = _blr()
    la = FactorLaplace(net, "regression", rank=2, prior_precision=prior, sigma_noise=0.4).fit([(X, y)])
    other = FactorLaplace(net, "regression", rank=2, prior_precision=prior, sigma_noise=0.4)
    other.load_state_dict(la.state_dict())
    torch.testing.assert_close(other.get_posterior().covariance_matrix, la.get_posterior().covariance_matrix)
    assert float(other.log_marginal_likelihood()) == float(la.log_marginal_likelihood())
    wrong = FactorLaplace(net, "regression", rank=3, prior_precision=prior, sigma_noise=0.4)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(ValueError, match="cov_factor"):
        wrong.load_state_dict(la.state_dict())
    for k, v in wrong.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_buffers_follow_the_model_dtype_and_device(dtype, device):
    net = _mlp().to(device=device, dtype=dtype)
    X, y = torch.randn(20, 2), torch.randint(3, (20,))
    la = FactorLaplace(net, "classification", rank=3).fit([(X, y)])
    for t in (la.loc, la.cov_factor, la.cov_diag, la.prior_precision, la.get_posterior().variance,
              la.predict_proba(X[:2], pred_type="glm"), la.log_marginal_likelihood()):
        assert t.dtype == dtype and t.device.type == torch.device(device).type


def test_clear_errors_naming_the_argument():
    net = _mlp()
    X, y = torch.randn(10, 2, dtype=torch.float64), torch.randint(3, (10,))
    with pytest.raises(ValueError, match=r"FactorLaplace: likelihood must be one of 'classification', 'regression', got 'poisson'\."):
        FactorLaplace(net, "poisson")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        FactorLaplace("net", "regression")
    with pytest.raises(ValueError, match="subset must be 'all', 'last_layer' or an iterable .* got 'first'"):
        FactorLaplace(net, "regression", subset="first")
    with pytest.raises(ValueError, match="subset must hold parameters of the model"):
        FactorLaplace(net, "regression", subset=[torch.zeros(2)])
    with pytest.raises(ValueError, match=r"prior_precision must be a scalar or have one value per parameter tensor \(shape \(1,\) or \(4,\)\), got shape \(3,\)"):
        FactorLaplace(net, "regression", prior_precision=torch.ones(3))
    with pytest.raises(ValueError, match="prior_precision must be positive and finite, got -1.0"):
        FactorLaplace(net, "regression", prior_precision=-1.0)
    with pytest.raises(ValueError, match="sigma_noise must be 1 for likelihood='classification', got 2.0"):
        FactorLaplace(net, "classification", sigma_noise=2.0)
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 0"):
        FactorLaplace(net, "regression", rank=0)
    with pytest.raises(ValueError, match=r"curvature must be one of \('ggn', 'mc'\), got 'kfac'"):
        FactorLaplace(net, "regression", curvature="kfac")
    with pytest.raises(ValueError, match=r"curvature_fit must be one of \('auto', 'scatter', 'online', 'sketch', "
                       r"'randomized', 'exact'\), got 'svd'"):
        FactorLaplace(net, "regression", curvature_fit="svd")
    la = FactorLaplace(net, "classification", rank=2)
    with pytest.raises(RuntimeError, match=r"FactorLaplace: the GLM predictive needs a fitted Laplace approximation; "
                                           r"call fit"):
        la.predict_proba(X, pred_type="glm")
    with pytest.raises(RuntimeError, match=r"FactorLaplace: predictive\(\) needs a fitted Laplace approximation"):
        la.predict_proba(X)
    with pytest.raises(RuntimeError, match=r"log_marginal_likelihood\(\) needs a fitted"):
        la.log_marginal_likelihood()
    with pytest.raises(ValueError, match=r"classification targets must be labels in \[0, 3\)"):
        la.fit([(X, y + 5)])
    with pytest.raises(ValueError, match="train_loader must yield at least one example, got none"):
        la.fit([])
    with pytest.raises(ValueError, match=r"train_loader must yield \(inputs, targets\) pairs, got Tensor"):
        la.fit([X])
    with pytest.raises(ValueError, match="curvature vectors must be finite, got NaN or inf"):
        la.fit([(torch.full((4, 2), float("inf"), dtype=torch.float64), y[:4])])
    with pytest.raises(ValueError, match=r"rank must be < dim=33 for curvature_fit='online', got 33"):
        FactorLaplace(net, "classification", rank=33, curvature_fit="online").fit([(X, y)])
    assert int(la.n_data) == 0  # nothing was fitted by the refused calls
    la.fit([(X, y)])
    assert la.predict(X, pred_type="glm").shape == (len(X), 3)  # a classifier's predict: the mean logits
    with pytest.raises(ValueError, match=r"FactorLaplace: scale must be a finite number >= 0, got -1.0"):
        la.scale = -1.0
    with pytest.raises(ValueError, match=r"FactorLaplace: loader must be None \(the model is in eval mode"):
        la.predictive(loader=[(X, y)])
    with pytest.raises(ValueError, match=r"pred_type must be one of \('nn', 'glm'\), got 'exact'"):
        la.predict_proba(X, pred_type="exact")
    with pytest.raises(ValueError, match=r"method must be one of \('marglik', 'gridsearch'\), got 'bayes'"):
        la.optimize_prior_precision("bayes")
    with pytest.raises(ValueError, match="method='gridsearch' needs val_loader, got None"):
        la.optimize_prior_precision("gridsearch")
    with pytest.raises(ValueError, match=r"grid must be a non-empty sequence of positive finite floats, got \[0.0\]"):
        la.optimize_prior_precision("gridsearch", val_loader=[(X, y)], grid=[0.0])
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    before = la.cov_factor.clone()
    with pytest.raises(ValueError, match="the model's weights must be finite"):
        la.fit([(X, y)])
    assert torch.equal(la.cov_factor, before)
