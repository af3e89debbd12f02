"""FactorLaplace at its edges: one-shot loaders, output shapes, train mode, grad contexts, tuple inputs, the
prior-precision search from far starts, state from another architecture, and laplace-torch's argument names."""
import math
import warnings

import pytest
import torch
from torch import nn

from pyro_fa.laplace import FactorLaplace


def _data(seed=0, N=40, d=2, C=3):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, d, generator=g, dtype=torch.float64)
    return X, torch.randint(C, (N,), generator=g)


def _net(seed=0, d=2, h=5, C=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, C)).double()


def _batches(X, y, size=10):
    return [(X[i:i + size], y[i:i + size]) for i in range(0, len(X), size)]


def _fitted(**kw):
    net = _net()
    X, y = _data()
    return net, FactorLaplace(net, "classification", rank=3, **kw).fit(_batches(X, y))


# --------------------------------------------------------------------------- one-shot loaders
def test_gridsearch_reads_a_one_shot_loader_once_and_scores_every_grid_value():
    _, la = _fitted()
    Xv, yv = _data(1, N=30)
    grid = [0.01, 1.0, 100.0]
    la.optimize_prior_precision("gridsearch", val_loader=_batches(Xv, yv), grid=grid)
    expected = la.grid_scores_[1]
    chosen = la.optimize_prior_precision("gridsearch", val_loader=iter(_batches(Xv, yv)), grid=grid)
    assert la.grid_scores_[1] == pytest.approx(expected, rel=1e-12)
    assert all(s > 0 for s in la.grid_scores_[1])
    assert float(chosen) == grid[min(range(3), key=expected.__getitem__)]
    # with the temperature too
    la.optimize_prior_precision("gridsearch", val_loader=(b for b in _batches(Xv, yv)), grid=grid, temperature=True)
    assert la.grid_scores_[1] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("loader", [[], iter([])], ids=["list", "iterator"])
def test_gridsearch_refuses_an_empty_loader_naming_it(loader):
    _, la = _fitted()
    before = la.prior_precision.clone()
    with pytest.raises(ValueError, match=r"FactorLaplace: val_loader must yield at least one batch, got none"):
        la.optimize_prior_precision("gridsearch", val_loader=loader, grid=[0.1, 1.0])
    assert torch.equal(la.prior_precision, before)


@pytest.mark.parametrize("curvature_fit", ["randomized", "online", "sketch", "scatter"])
def test_fit_reads_a_one_shot_train_loader_as_a_list(curvature_fit):
    net = _net(h=8)
    X, y = _data()
    kw = dict(rank=2, curvature_fit=curvature_fit, seed=3)
    ref = FactorLaplace(net, "classification", **kw).fit(_batches(X, y))
    one_shot = FactorLaplace(net, "classification", **kw).fit(b for b in _batches(X, y))
    assert int(one_shot.n_data) == 40
    torch.testing.assert_close(one_shot.cov_diag, ref.cov_diag, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(one_shot.cov_factor, ref.cov_factor, rtol=1e-12, atol=1e-14)


def test_fit_refuses_an_empty_loader_naming_it():
    net = _net()
    with pytest.raises(ValueError, match=r"FactorLaplace: train_loader must yield at least one example, got none"):
        FactorLaplace(net, "classification", rank=2, curvature_fit="randomized").fit(iter([]))


# --------------------------------------------------------------------------- output shapes
def test_fit_refuses_outputs_of_more_than_two_dimensions():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6), nn.Unflatten(-1, (2, 3))).double()
    X = torch.randn(20, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"FactorLaplace: the model's outputs must have shape \(B, C\) or \(B,\), "
                                         r"got \(10, 2, 3\).*nn.Flatten"):
        FactorLaplace(net, "regression", rank=2).fit([(X[:10], torch.randn(10, 2, 3)), (X[10:], torch.randn(10, 2, 3))])
    with pytest.raises(ValueError, match=r"FactorLaplace: the model's outputs must have shape \(B, C\) or \(B,\), "
                                         r"got \(10, 2, 3\)"):
        FactorLaplace(net, "classification", rank=2).fit([(X[:10], torch.randint(3, (10,)))])


def test_flattened_outputs_count_every_output_in_the_evidence():
    """The same model flattened: the Gaussian log-likelihood counts C = 6 outputs (against the closed form)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6)).double()
    X, Y = torch.randn(20, 2, dtype=torch.float64), torch.randn(20, 6, dtype=torch.float64)
    la = FactorLaplace(net, "regression", rank=4, sigma_noise=0.5).fit([(X, Y)])
    with torch.no_grad():
        r = (Y - net(X)).pow(2).sum()
    expected = -r / (2 * 0.25) - 0.5 * 20 * 6 * math.log(2 * math.pi * 0.25)
    torch.testing.assert_close(la.train_log_likelihood(), expected)


# --------------------------------------------------------------------------- train mode
def test_sampled_predictive_refuses_a_model_in_train_mode_and_keeps_its_buffers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).double().eval()
    X, y = _data()
    la = FactorLaplace(net, "classification", rank=2).fit([(X, y)])
    net.train()
    mean = net[1].running_mean.clone()
    with pytest.raises(ValueError, match=r"FactorLaplace: model must be in eval mode.*BatchNorm1d"):
        la.predict_proba(X[:5], pred_type="nn", num_samples=3)
    assert torch.equal(net[1].running_mean, mean)
    net.eval()
    assert la.predict_proba(X[:5], pred_type="nn", num_samples=3).shape == (5, 3)


# --------------------------------------------------------------------------- grad contexts
def test_marglik_under_no_grad_equals_it_outside():
    _, la = _fitted()
    ref = la.optimize_prior_precision("marglik")
    la.load_state_dict({**la.state_dict(), "prior_precision": torch.ones(1, dtype=torch.float64)})
    with torch.no_grad():
        chosen = la.optimize_prior_precision("marglik")
    torch.testing.assert_close(chosen, ref)
    assert not chosen.requires_grad


def test_fit_under_inference_mode_equals_it_outside():
    net, ref = _fitted()
    X, y = _data()
    with torch.inference_mode():
        la = FactorLaplace(net, "classification", rank=3).fit(_batches(X, y))
        p = la.predict_proba(X[:4], pred_type="glm")
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(la.state_dict()[key], value, msg=key)
    torch.testing.assert_close(p, ref.predict_proba(X[:4], pred_type="glm"))
    # the state is usable with gradients afterwards
    la.optimize_prior_precision("marglik")


# --------------------------------------------------------------------------- tuple and dict inputs
class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 3), nn.Linear(1, 3)

    def forward(self, x1, x2):
        return torch.tanh(self.a(x1)) + self.b(x2)


class _Concat(nn.Module):
    def __init__(self, two):
        super().__init__()
        self.two = two

    def forward(self, x):
        return self.two(x[:, :2], x[:, 2:])


def test_tuple_inputs_fit_and_predict_as_the_concatenated_model():
    torch.manual_seed(0)
    two = _TwoInputs().double()
    one = _Concat(two)
    X, y = _data(N=30)
    X = torch.cat([X, torch.randn(30, 1, dtype=torch.float64)], 1)
    ref = FactorLaplace(one, "classification", rank=3).fit(_batches(X, y))
    la = FactorLaplace(two, "classification", rank=3).fit([((x[:, :2], x[:, 2:]), t) for x, t in _batches(X, y)])
    for key, value in ref.state_dict().items():
        if key != "parameter_layout":  # the names differ: "two.a.weight" against "a.weight"
            torch.testing.assert_close(la.state_dict()[key], value, msg=key)
    torch.testing.assert_close(la.predict_proba((X[:4, :2], X[:4, 2:]), pred_type="glm"), ref.predict_proba(X[:4], pred_type="glm"))
    torch.manual_seed(1)
    a = la.predict_proba((X[:4, :2], X[:4, 2:]), pred_type="nn", num_samples=4)
    torch.manual_seed(1)
    torch.testing.assert_close(a, ref.predict_proba(X[:4], pred_type="nn", num_samples=4))


def test_dict_inputs_are_refused_in_one_line():
    net, la = _fitted()
    X, y = _data()
    with pytest.raises(TypeError, match=r"FactorLaplace: inputs must be a Tensor or a tuple of Tensors"):
        FactorLaplace(net, "classification", rank=3).fit([({"x": X}, y)])
    with pytest.raises(TypeError, match=r"FactorLaplace: inputs must be a Tensor or a tuple of Tensors"):
        FactorLaplace(net, "classification", rank=3).fit([{"input_ids": X, "labels": y}])
    with pytest.raises(TypeError, match=r"FactorLaplace: inputs must be a Tensor or a tuple of Tensors"):
        la.predict_proba({"x": X}, pred_type="glm")


# --------------------------------------------------------------------------- the marginal-likelihood search
def _evidence_grid_optimum(la, lo=-12.0, hi=12.0, n=4801):
    logs = torch.linspace(lo, hi, n, dtype=torch.float64)
    with torch.no_grad():
        vals = torch.stack([la.log_marginal_likelihood(prior_precision=torch.exp(u).reshape(1)) for u in logs])
    k = int(vals.argmax())
    return float(logs[k]), float(logs[1] - logs[0])


@pytest.mark.parametrize("start", [1e12, 1e-12, 1.0])
def test_marglik_reaches_the_dense_grid_optimum_from_any_start(start):
    _, la = _fitted(prior_precision=start)
    best, step = _evidence_grid_optimum(la)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = la.optimize_prior_precision("marglik")
    assert abs(math.log(float(chosen)) - best) <= step


def test_marglik_per_layer_reaches_a_stationary_point_from_far_starts():
    _, la = _fitted(prior_precision=torch.tensor([1e12, 1e-12, 1.0, 1e8], dtype=torch.float64))
    chosen = la.optimize_prior_precision("marglik")
    u = chosen.log().clone().requires_grad_(True)
    g, = torch.autograd.grad(la.log_marginal_likelihood(prior_precision=u.exp()), u)
    assert float(g.abs().max()) < 1e-6


def test_marglik_warns_naming_the_gradient_when_it_stops_early():
    _, la = _fitted(prior_precision=1e12)
    with pytest.warns(UserWarning, match=r"FactorLaplace: optimize_prior_precision\('marglik'\) stopped after "
                                         r"n_steps=2 .*gradient"):
        la.optimize_prior_precision("marglik", n_steps=2)


# --------------------------------------------------------------------------- state from another architecture
def test_load_state_dict_refuses_another_architecture_with_as_many_weights():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()   # 12 + 15 = 27 weights
    b = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 4)).double()   # 12 + 16 = 28
    c = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()  # 9+12+4=25
    X, y = _data()
    la_a = FactorLaplace(a, "classification", rank=2).fit([(X, y)])
    d = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 0)).double()
    # another network with the same 27 weights: Linear(2, 6) (18) and Linear(6, 1) ... + Linear(1, 1)? use a flat one
    e = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 2)).double()  # 15 + 12 = 27
    assert sum(p.numel() for p in e.parameters()) == sum(p.numel() for p in a.parameters())
    la_e = FactorLaplace(e, "classification", rank=2)
    with pytest.raises(ValueError, match=r"FactorLaplace: state_dict must come from parameters named and shaped as "
                                         r"this one's \(4 tensors; at position 0: '0.weight' of shape \(5, 2\)\), got "
                                         r"shape \(4, 2\) \(4 tensors\)"):
        la_e.load_state_dict(la_a.state_dict())
    assert int(la_e.n_data) == 0
    # the same architecture loads
    la_a2 = FactorLaplace(a, "classification", rank=2)
    la_a2.load_state_dict(la_a.state_dict())
    torch.testing.assert_close(la_a2.cov_factor, la_a.cov_factor)
    del b, c, d


# --------------------------------------------------------------------------- construction-time refusals
def test_sketch_with_a_process_group_is_refused_at_construction():
    net = _net()
    with pytest.raises(ValueError, match=r"FactorLaplace: curvature_fit='sketch' cannot be sharded; with a "
                                         r"process_group use curvature_fit="):
        FactorLaplace(net, "classification", rank=2, curvature_fit="sketch", process_group=object())


# --------------------------------------------------------------------------- laplace-torch's names
def test_laplace_torch_names_that_mean_the_same_are_accepted():
    net = _net()
    X, y = _data()
    ref = FactorLaplace(net, "classification", rank=3, subset="last_layer").fit([(X, y)])
    la = FactorLaplace(net, "classification", "last_layer", rank=3).fit([(X, y)])
    assert la.dim == ref.dim == 18
    la2 = FactorLaplace(net, "classification", subset_of_weights="last_layer", hessian_structure="lowrank",
                        rank=3).fit([(X, y)])
    torch.testing.assert_close(la2.cov_factor, ref.cov_factor)
    la3 = FactorLaplace(net, "classification", subset_of_weights="all", rank=3, prior_structure="layerwise")
    assert la3.prior_precision.shape == (4,)
    # the whole network with "all", laplace-torch's value; our default stays every weight (laplace-torch's is the
    # last layer)
    assert FactorLaplace(net, "classification", "all").dim == FactorLaplace(net, "classification").dim == 33
    # grid_size for gridsearch: laplace-torch's log-spaced grid of 1e-4 ... 1e4
    ref.optimize_prior_precision("gridsearch", val_loader=[(X, y)], grid_size=5)
    assert ref.grid_scores_[0] == pytest.approx([1e-4, 1e-2, 1.0, 1e2, 1e4])
    # link_approx="bridge" is laplace-torch's too, but not ours
    with pytest.raises(ValueError, match=r"FactorLaplace: link_approx must be one of \('mc', 'probit'\), got 'bridge'"):
        ref.predict_proba(X[:3], link_approx="bridge")


@pytest.mark.parametrize("kw, match", [
    (dict(hessian_structure="kron"), r"FactorLaplace: hessian_structure='kron' is not available; pyro_fa's "
                                     r"curvature is low-rank plus diagonal: use rank=K"),
    (dict(hessian_structure="diag"), r"hessian_structure='diag' is not available.*rank"),
    (dict(subset_of_weights="subnetwork"), r"subset_of_weights='subnetwork' is not available.*subset="),
    (dict(prior_structure="diag"), r"prior_structure='diag' is not available.*'scalar' or 'layerwise'"),
    (dict(backend=object), r"FactorLaplace: backend is laplace-torch's.*curvature="),
    (dict(temperature=0.5), r"FactorLaplace: temperature is laplace-torch's.*"),
])
def test_laplace_torch_names_that_differ_are_refused_naming_ours(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FactorLaplace(_net(), "classification", **kw)


def test_posterior_precision_and_covariance_are_the_dense_matrices_for_small_d():
    _, la = _fitted()
    P = la.posterior_precision
    S = la.posterior_covariance
    assert P.shape == S.shape == (33, 33)
    # P = diag(delta) + N (F F^T + diag psi), against the buffers directly
    N = float(la.n_data)
    dense = torch.diag(la.prior_precision.expand(33)) + N * (la.cov_factor @ la.cov_factor.T + torch.diag(la.cov_diag))
    torch.testing.assert_close(P, dense)
    torch.testing.assert_close(S, torch.linalg.inv(dense))


def test_posterior_precision_refuses_a_large_d():
    la = FactorLaplace(nn.Linear(200, 101), "regression", rank=2)  # D = 20 301
    for what in ("posterior_precision", "posterior_covariance"):
        with pytest.raises(ValueError, match=rf"FactorLaplace: {what} is a dense \(D, D\) matrix, here "
                                             r"D=20301 > 20000; use get_posterior\(\)"):
            getattr(la, what)


# --------------------------------------------------------------------------- the refusals of the above, one by one
def test_malformed_or_foreign_parameter_layouts_are_refused():
    _, la = _fitted()
    state = la.state_dict()
    fresh = FactorLaplace(_net(), "classification", rank=3)
    with pytest.raises(ValueError, match=r"state_dict\['parameter_layout'\] must be an int64 Tensor of shape"):
        fresh.load_state_dict({**state, "parameter_layout": state["parameter_layout"].double()})
    bad = state["parameter_layout"].clone()
    bad[0, 1] = 9
    with pytest.raises(ValueError, match=r"state_dict\['parameter_layout'\] holds a row .* ndim out of range"):
        fresh.load_state_dict({**state, "parameter_layout": bad})
    renamed = state["parameter_layout"].clone()
    renamed[2, 0] += 1
    with pytest.raises(ValueError, match=r"at position 2: '2.weight' of shape \(3, 5\)\), got shape \(3, 5\) and "
                                         r"another name"):
        fresh.load_state_dict({**state, "parameter_layout": renamed})
    assert int(fresh.n_data) == 0
    # a state saved before the layout was kept still loads
    old = {k: v for k, v in state.items() if k != "parameter_layout"}
    fresh.load_state_dict(old)
    torch.testing.assert_close(fresh.cov_factor, la.cov_factor)


def test_laplace_torch_argument_clashes_and_unknown_keywords_are_refused():
    net = _net()
    with pytest.raises(ValueError, match=r"subset and subset_of_weights \(laplace-torch's name\) must agree"):
        FactorLaplace(net, "classification", subset="last_layer", subset_of_weights="all")
    with pytest.raises(ValueError, match=r"hessian_structure='full' keeps the curvature exactly \(rank=D\); pass it "
                                         r"or rank, got rank=3 too"):
        FactorLaplace(net, "classification", rank=3, hessian_structure="full")
    assert FactorLaplace(net, "classification", hessian_structure="full").rank == 33
    with pytest.raises(ValueError, match=r"prior_precision must have shape \(1,\) for prior_structure='scalar', got "
                                         r"shape \(4,\)"):
        FactorLaplace(net, "classification", prior_precision=torch.ones(4), prior_structure="scalar")
    with pytest.raises(TypeError, match=r"FactorLaplace: __init__\(\) got an unexpected keyword argument 'ranks'"):
        FactorLaplace(net, "classification", ranks=3)
    with pytest.raises(TypeError):  # laplace-torch's fourth positional (hessian_structure) is keyword-only here
        FactorLaplace(net, "classification", "all", "kron")


def test_optimize_prior_precision_refuses_laplace_torch_only_arguments():
    _, la = _fitted()
    X, y = _data(1)
    with pytest.raises(ValueError, match=r"FactorLaplace: init_prior_prec is laplace-torch's argument of "
                                         r"optimize_prior_precision, not available here: the search starts from"):
        la.optimize_prior_precision("marglik", init_prior_prec=1.0)
    with pytest.raises(ValueError, match=r"method must be one of \('marglik', 'gridsearch'\), got 'glm' "
                                         r"\(laplace-torch's first argument is pred_type"):
        la.optimize_prior_precision("glm")
    with pytest.raises(ValueError, match=r"grid and grid_size are two ways of giving the grid; pass one, got both"):
        la.optimize_prior_precision("gridsearch", val_loader=[(X, y)], grid=[1.0], grid_size=3)
    with pytest.raises(ValueError, match=r"log_prior_prec_min must be <= log_prior_prec_max, both finite, got 2 and 1"):
        la.optimize_prior_precision("gridsearch", val_loader=[(X, y)], grid_size=3, log_prior_prec_min=2,
                                    log_prior_prec_max=1)


def test_malformed_inputs_and_loaders_are_refused():
    net, la = _fitted()
    X, y = _data()
    with pytest.raises(ValueError, match=r"the inputs of a tuple must share their first \(batch\) dimension, got "
                                         r"shapes \[\(40, 2\), \(39, 1\)\]"):
        la.predict_proba((X, X[1:, :1]), pred_type="glm")
    with pytest.raises(TypeError, match=r"FactorLaplace: train_loader must be an iterable of batches \(a list or a "
                                        r"DataLoader\), got int"):
        FactorLaplace(net, "classification", rank=3).fit(3)
    with pytest.raises(TypeError, match=r"FactorLaplace: val_loader must be an iterable of batches"):
        la.optimize_prior_precision("gridsearch", val_loader=3)


def test_get_posterior_and_sample_follow_the_scale_as_swags_do():
    """At scale s the posterior is N(theta_*, s P^{-1}) (SWAG's convention), the mean's point mass at s = 0."""
    from pyro_fa.distributions import PointMassNormal

    g = torch.Generator().manual_seed(3)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = (X[:, 0] > 0).long()
    net = nn.Linear(3, 2).double()
    la = FactorLaplace(net, "classification", rank=2).fit([(X, y)])
    dense = la.get_posterior().covariance_matrix
    la.scale = 0.3
    torch.testing.assert_close(la.get_posterior().covariance_matrix, 0.3 * dense)
    draws = la.sample(40000, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(draws.var(0), 0.3 * dense.diagonal(), rtol=0.05, atol=1e-6)
    la.scale = 0.0
    assert isinstance(la.get_posterior(), PointMassNormal)
    assert torch.equal(la.sample(3), la.loc.expand(3, -1))


def test_optimize_prior_precision_takes_laplace_torchs_n_samples():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(60, 3, generator=g, dtype=torch.float64)
    y = (X[:, 0] > 0).long()
    la = FactorLaplace(nn.Linear(3, 2).double(), "classification", rank=2).fit([(X[:40], y[:40])])
    kw = dict(val_loader=[(X[40:], y[40:])], grid=[0.1, 1.0, 10.0], pred_type="nn")
    torch.manual_seed(0)
    a = la.optimize_prior_precision("gridsearch", num_samples=7, **kw).clone()
    torch.manual_seed(0)
    b = la.optimize_prior_precision("gridsearch", n_samples=7, **kw)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="pass num_samples or laplace-torch's n_samples, not both"):
        la.optimize_prior_precision("gridsearch", num_samples=7, n_samples=7, **kw)
