"""The peer methods of ``pyro-fa classify``: laplace-torch's last-layer KFAC Laplace and IVON.

Each test needs its package (the ``peers`` extra) and skips cleanly when it does not import. The
problem: three Gaussian blobs in 2-D (300 training points), a 2-32-3 tanh MLP trained
to MAP by full-batch Adam in well under a second.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyro_fa.experiments.classify import baselines as peers


def _need(key):
    """Skip unless the peer imports: like ``pytest.importorskip``, but also for an installed package that fails
    to import (e.g. RuntimeError from a torchvision wheel that does not match torch), which importorskip lets through."""
    reason = peers.unavailable_reasons()[key]
    if reason is not None:
        pytest.skip(f"{key} does not import ({reason}); install the `peers` extra")


def _blobs(n, generator):
    centers = torch.tensor([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
    y = torch.randint(0, 3, (n,), generator=generator)
    return centers[y] + 1.2 * torch.randn(n, 2, generator=generator), y


def _make_net():
    return nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 3))


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(0)
    train, val, test = _blobs(300, g), _blobs(100, g), _blobs(200, g)
    far = 6.0 * torch.randn(50, 2, generator=g)  # mostly away from the data
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = _make_net()
        opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
        for _ in range(300):
            opt.zero_grad()
            F.cross_entropy(net(train[0]), train[1]).backward()
            opt.step()
    return {"train": train, "val": val, "test": test, "far": far, "net": net}


def _assert_probs(p, shape):
    assert p.shape == shape
    assert torch.isfinite(p).all() and (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(shape[:-1], dtype=p.dtype), atol=1e-5, rtol=0)


def test_available_reports_booleans_and_reasons():
    flags, reasons = peers.available(), peers.unavailable_reasons()
    assert set(flags) == set(reasons) == {"laplace", "ivon"}
    assert all(isinstance(v, bool) for v in flags.values())
    assert all(flags[k] == (reasons[k] is None) for k in flags)


def test_missing_package_is_reported_not_raised(monkeypatch, problem):
    monkeypatch.setitem(peers._MODULES, "laplace", "pyro_fa_no_such_module")
    peers._import_error.cache_clear()
    try:
        assert peers.available()["laplace"] is False
        assert "ModuleNotFoundError" in peers.unavailable_reasons()["laplace"]
        with pytest.raises(ImportError, match="laplace_probs: the package for 'laplace' does not import.*--no-deps"):
            peers.laplace_probs(problem["net"], problem["train"], problem["val"], [problem["test"][0]])
    finally:
        monkeypatch.undo()
        peers._import_error.cache_clear()


# --------------------------------------------------------------------------- Laplace


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_laplace_probs_shapes_widening_and_map_limit(problem, dtype):
    _need("laplace")
    net = copy.deepcopy(problem["net"]).to(dtype)
    (x_te, y_te) = problem["test"]
    params_before = [p.detach().clone() for p in net.parameters()]
    net.train()
    info = {}
    p_te, p_far = peers.laplace_probs(net, problem["train"], problem["val"], [x_te, problem["far"]], info=info)
    _assert_probs(p_te, (200, 3))
    _assert_probs(p_far, (50, 3))
    assert p_te.dtype == dtype
    assert info["link_approx"] == "probit" and info["prior_precision"][0] > 0
    # the caller's network is left as it was
    assert net.training
    assert all(torch.equal(a, b) for a, b in zip(params_before, net.parameters()))

    with torch.no_grad():
        p_map = F.softmax(net(x_te.to(dtype)), -1)
    assert (p_te.argmax(1) == y_te).float().mean() > 0.7
    # Laplace widens: its predictive is less confident than the MAP's softmax, on average
    assert p_te.max(1).values.mean() < p_map.max(1).values.mean() - 0.01
    # ... and a huge prior precision shrinks the posterior onto the MAP
    (p_sharp,) = peers.laplace_probs(net, problem["train"], problem["val"], [x_te], prior_precision=1e8)
    torch.testing.assert_close(p_sharp, p_map, atol=1e-4, rtol=0)


def test_laplace_probs_mc_and_gridsearch(problem):
    _need("laplace")
    args = (problem["net"], problem["train"], problem["val"], [problem["test"][0]])
    (p_mc,) = peers.laplace_probs(*args, link_approx="mc", n_samples=50)
    _assert_probs(p_mc, (200, 3))
    (p_mc2,) = peers.laplace_probs(*args, link_approx="mc", n_samples=50)
    torch.testing.assert_close(p_mc, p_mc2)  # seeded
    info = {}
    (p_grid,) = peers.laplace_probs(*args, prior_method="gridsearch", info=info)
    _assert_probs(p_grid, (200, 3))
    assert 1e-4 <= info["prior_precision"][0] <= 1e8 and info["prior_method"] == "gridsearch"
    # the grid reaches the MAP limit: on a range of only huge precisions the search returns the MAP's softmax
    (p_top,) = peers.laplace_probs(*args, prior_method="gridsearch", log_prior_prec_range=(7.0, 8.0))
    with torch.no_grad():
        p_map = problem["net"](problem["test"][0]).softmax(-1)
    torch.testing.assert_close(p_top, p_map, atol=1e-4, rtol=0)


def test_laplace_probs_all_weights_diagonal(problem):
    """All-weights diagonal Laplace: widens the MAP's softmax, and collapses onto it at a huge prior precision."""
    _need("laplace")
    x_te = problem["test"][0]
    args = (problem["net"], problem["train"], problem["val"], [x_te])
    options = {"subset_of_weights": "all", "hessian_structure": "diag"}
    (p,) = peers.laplace_probs(*args, **options)
    _assert_probs(p, (200, 3))
    with torch.no_grad():
        p_map = problem["net"](x_te).softmax(-1)
    assert p.max(1).values.mean() < p_map.max(1).values.mean() - 0.01
    (p_sharp,) = peers.laplace_probs(*args, prior_precision=1e8, **options)
    torch.testing.assert_close(p_sharp, p_map, atol=1e-4, rtol=0)


def _dense_glm_probit(net, x_train, x_test, prior_precision):
    """The all-weights full-GGN Laplace's GLM probit predictive, computed densely here: Jacobians by
    ``torch.func``, H = sum_n J_n^T (diag p_n - p_n p_n^T) J_n, Sigma = (H + delta I)^-1, and
    softmax(f / sqrt(1 + pi/8 diag J Sigma J^T)) (MacKay 1992)."""
    import math

    from torch.func import functional_call, jacrev

    names = [n for n, _ in net.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).double()
    shapes = [p.shape for p in net.parameters()]
    net64 = copy.deepcopy(net).double()

    def f(flat, x):
        parts, i = {}, 0
        for n, shape in zip(names, shapes):
            k = math.prod(shape)
            parts[n] = flat[i : i + k].reshape(shape)
            i += k
        return functional_call(net64, parts, (x,))

    def jac(x):
        return jacrev(f)(theta, x.double())  # (N, C, D)

    J = jac(x_train)
    p = f(theta, x_train.double()).softmax(-1)
    lam = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    H = torch.einsum("ncd,nck,nke->de", J, lam, J)
    sigma = torch.linalg.inv(H + prior_precision * torch.eye(theta.numel(), dtype=torch.float64))
    Jt = jac(x_test)
    var = torch.einsum("ncd,de,nce->nc", Jt, sigma, Jt)
    logits = f(theta, x_test.double())
    return (logits / torch.sqrt(1 + math.pi / 8 * var)).softmax(-1)


def test_laplace_probs_all_weights_full_matches_a_dense_computation(problem):
    """All-weights full-GGN Laplace at a fixed prior precision: laplace-torch's probabilities equal the dense
    GGN, its inverse and the probit predictive computed here."""
    _need("laplace")
    x_tr, x_te = problem["train"][0], problem["test"][0]
    (p,) = peers.laplace_probs(problem["net"], problem["train"], None, [x_te], prior_precision=2.0,
                               subset_of_weights="all", hessian_structure="full")
    want = _dense_glm_probit(problem["net"], x_tr, x_te, 2.0)
    torch.testing.assert_close(p.double(), want, atol=2e-4, rtol=0)
    info = {}
    (p_ml,) = peers.laplace_probs(problem["net"], problem["train"], None, [x_te], subset_of_weights="all",
                                  hessian_structure="full", info=info)
    _assert_probs(p_ml, (200, 3))
    assert info["prior_method"] == "marglik" and info["prior_precision"][0] > 0


def test_eigen_log_det_equals_laplace_torchs_logdet(problem):
    """The full-GGN Laplace's log det of its posterior precision from the GGN's eigenvalues (computed once)
    equals laplace-torch's factorisation at every prior precision, with the same gradient in it."""
    _need("laplace")
    import laplace

    la = laplace.Laplace(copy.deepcopy(problem["net"]).double(), "classification", subset_of_weights="all",
                         hessian_structure="full")
    x, y = problem["train"]
    la.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.double(), y), batch_size=100))
    peers._eigen_log_det(la)
    assert type(la).__name__ == "EigenLogDetFullLaplace" and isinstance(la, laplace.FullLaplace)
    for delta in (1e-3, 0.5, 30.0, 1e6):
        log_delta = torch.tensor(math.log(delta), dtype=torch.float64, requires_grad=True)
        la.prior_precision = log_delta.exp()
        ours = la.log_det_posterior_precision
        (g_ours,) = torch.autograd.grad(ours, log_delta, retain_graph=True)
        want = la.posterior_precision.logdet()
        (g_want,) = torch.autograd.grad(want, log_delta)
        torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-8)
        torch.testing.assert_close(g_ours, g_want, rtol=1e-8, atol=1e-8)
    la.prior_precision = torch.full((la.n_params,), 2.0, dtype=torch.float64)  # diagonal: laplace-torch's own
    torch.testing.assert_close(la.log_det_posterior_precision, la.posterior_precision.logdet())
    # laplace-torch's factory still builds its own class, and a second wrap reuses the one subclass
    again = laplace.Laplace(copy.deepcopy(problem["net"]), "classification", subset_of_weights="all",
                            hessian_structure="full")
    assert type(again) is laplace.FullLaplace
    again.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=100))
    peers._eigen_log_det(again)
    assert type(again) is type(la)


def test_laplace_probs_all_weights_kron_between_map_and_full(problem):
    """All-weights KFAC: widens the MAP's softmax, collapses onto it at a huge prior precision, and at the same
    prior precision lies closer to the full GGN's predictive than the MAP does."""
    _need("laplace")
    x_te = problem["test"][0]
    args = (problem["net"], problem["train"], None, [x_te])
    (p,) = peers.laplace_probs(*args, prior_precision=2.0, subset_of_weights="all", hessian_structure="kron")
    (p_full,) = peers.laplace_probs(*args, prior_precision=2.0, subset_of_weights="all", hessian_structure="full")
    _assert_probs(p, (200, 3))
    with torch.no_grad():
        p_map = problem["net"](x_te).softmax(-1)
    assert p.max(1).values.mean() < p_map.max(1).values.mean() - 0.01
    assert (p - p_full).abs().mean() < (p_map - p_full).abs().mean()
    (p_sharp,) = peers.laplace_probs(*args, prior_precision=1e8, subset_of_weights="all", hessian_structure="kron")
    torch.testing.assert_close(p_sharp, p_map, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"prior_method": "cv"}, ValueError, "prior_method must be 'marglik' or 'gridsearch', got 'cv'"),
        ({"link_approx": "bridge"}, ValueError, "link_approx must be 'probit' or 'mc', got 'bridge'"),
        ({"prior_precision": 0.0}, ValueError, "prior_precision must be a finite number > 0 or None, got 0.0"),
        ({"n_samples": 0}, ValueError, "n_samples must be a positive integer, got 0"),
        ({"batch_size": 2.5}, ValueError, "batch_size must be a positive integer, got 2.5"),
        ({"subset_of_weights": "subnetwork"}, ValueError,
         "subset_of_weights must be 'last_layer' or 'all', got 'subnetwork'"),
        ({"hessian_structure": "lowrank"}, ValueError,
         "hessian_structure must be 'kron', 'diag' or 'full', got 'lowrank'"),
        ({"log_prior_prec_range": (4, -4)}, ValueError, r"log_prior_prec_range must be two finite numbers"),
    ],
)
def test_laplace_probs_refuses_bad_options(problem, kwargs, error, match):
    _need("laplace")
    with pytest.raises(error, match=f"laplace_probs: {match}"):
        peers.laplace_probs(problem["net"], problem["train"], problem["val"], [problem["test"][0]], **kwargs)


def test_laplace_probs_refuses_bad_data(problem):
    _need("laplace")
    net, (x, y), x_te = problem["net"], problem["train"], [problem["test"][0]]
    with pytest.raises(TypeError, match="train_xy must be a pair"):
        peers.laplace_probs(net, x, None, x_te)
    with pytest.raises(ValueError, match=r"train_xy must be X of shape \(N, ...\) and integer labels y of shape"):
        peers.laplace_probs(net, (x, y[:, None]), None, x_te)
    with pytest.raises(TypeError, match="train_xy's labels must be an integer tensor, got torch.float32"):
        peers.laplace_probs(net, (x, y.float()), None, x_te)
    with pytest.raises(TypeError, match="test_inputs must be a list of tensors"):
        peers.laplace_probs(net, (x, y), None, x_te[0])
    with pytest.raises(ValueError, match="val_xy is required for prior_method='gridsearch'"):
        peers.laplace_probs(net, (x, y), None, x_te, prior_method="gridsearch")


# --------------------------------------------------------------------------- IVON


def test_ivon_probs_samples_and_accuracy(problem):
    _need("ivon")
    x_te, y_te = problem["test"]
    state = torch.random.get_rng_state()
    info = {}
    p_te, p_far = peers.ivon_probs(
        _make_net, problem["train"], problem["val"], [x_te, problem["far"]],
        epochs=30, batch_size=32, num_samples=8, info=info,
    )
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's generator is untouched
    _assert_probs(p_te, (8, 200, 3))
    _assert_probs(p_far, (8, 50, 3))
    assert info["lr"] in peers.IVON_LR_GRID and info["hess_init"] == 0.5
    assert set(info["val_nll"]) == {repr((r, 0.5)) for r in peers.IVON_LR_GRID}
    assert (p_te.mean(0).argmax(1) == y_te).float().mean() > 0.7  # chance is 1/3
    assert (p_te.std(0) > 0).any()  # the draws differ


def test_ivon_probs_fixed_lr_is_reproducible(problem):
    _need("ivon")
    args = (_make_net, problem["train"], None, [problem["test"][0]])
    info = {}
    (a,) = peers.ivon_probs(*args, epochs=5, batch_size=64, num_samples=3, lr=0.1, info=info)
    (b,) = peers.ivon_probs(*args, epochs=5, batch_size=64, num_samples=3, lr=0.1)
    assert info == {"lr": 0.1, "hess_init": 0.5, "val_nll": {}}
    torch.testing.assert_close(a, b)
    (c,) = peers.ivon_probs(*args, epochs=5, batch_size=64, num_samples=3, lr=0.1, seed=1)
    assert not torch.equal(a, c)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"epochs": 0}, "epochs must be a positive integer, got 0"),
        ({"num_samples": -1}, "num_samples must be a positive integer, got -1"),
        ({"lr": -0.1}, r"lr and lr_grid must hold finite numbers > 0, got lr=-0.1"),
        ({"lr_grid": ()}, r"lr and lr_grid must hold finite numbers > 0, got lr=None, lr_grid=\(\)"),
        ({"hess_init_grid": (0.5, -1.0)}, r"hess_init and hess_init_grid must hold finite numbers > 0"),
    ],
)
def test_ivon_probs_refuses_bad_options(problem, kwargs, match):
    _need("ivon")
    base = {"epochs": 1, "batch_size": 32}
    with pytest.raises(ValueError, match=f"ivon_probs: {match}"):
        peers.ivon_probs(_make_net, problem["train"], problem["val"], [problem["test"][0]], **{**base, **kwargs})


def test_ivon_index_loader_draws_the_tensor_loaders_batches():
    """IVON's minibatches are gathered by index (one operation per batch on a GPU) in the very order the shuffled
    ``DataLoader(TensorDataset(x, y))`` gave them, epoch after epoch, so the recorded IVON rows stand."""
    from torch.utils.data import DataLoader, TensorDataset

    x, y = torch.randn(103, 3), torch.arange(103)

    def tensor_loader(seed):  # what IVON iterated before
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed))

    old, new = tensor_loader(7), peers._index_loader(103, 16, 7)
    for _ in range(3):  # every epoch draws from the same generator, in the same way
        got = [(x[i], y[i]) for i in new]
        want = list(old)
        assert len(got) == len(want) == 7
        for (xa, ya), (xb, yb) in zip(got, want):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other = [y[i] for i in peers._index_loader(103, 16, 8)]
    assert not all(torch.equal(a, b) for a, b in zip(other, [b for _, b in tensor_loader(7)]))
