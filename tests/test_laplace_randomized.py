"""FactorLaplace(curvature_fit="randomized"): the randomized range finder and Nyström approximation of the
uncentred curvature moment, refitted by batch FA, against the exact scatter and its batch FA."""
import pytest
import torch
from torch import nn

from pyro_fa.laplace import FactorLaplace, fit_second_moment
from pyro_fa.laplace.moment import _fa_low_rank


def _low_rank_data(n=300, seed=0):
    """Softmax regression on inputs in a 2-dimensional subspace of R^6: the GGN has rank <= 3 * 3 = 9 of D = 21."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 6, generator=g, dtype=torch.float64)
    y = torch.randint(3, (n,), generator=g)
    torch.manual_seed(seed)
    return X, y, nn.Linear(6, 3).double()


def _cov(la):
    return la.cov_factor @ la.cov_factor.T + torch.diag(la.cov_diag)


def test_a_curvature_of_rank_below_the_sketch_is_captured_exactly():
    X, y, net = _low_rank_data()
    batches = [(X[:150], y[:150]), (X[150:], y[150:])]
    exact = FactorLaplace(net, "classification", rank=10 ** 6, curvature_fit="scatter").fit(batches)  # exact G / N
    G = _cov(exact)
    assert torch.linalg.matrix_rank(G) <= 9
    rand = FactorLaplace(net, "classification", rank=4, curvature_fit="randomized").fit(batches)
    assert rand.fit_info["method"] == "randomized" and rand.fit_info["passes"] == 2
    assert rand.fit_info["converged"]
    # the sketch (width 12 >= rank 9) holds G exactly: the fit is batch FA of the exact moment, the same model
    # as the scatter fit's (both stop when the log-likelihood gains little, so up to their tolerances)
    scatter = FactorLaplace(net, "classification", rank=4, curvature_fit="scatter").fit(batches)
    assert float((_cov(rand) - _cov(scatter)).norm() / _cov(scatter).norm()) < 2e-3
    # and its diagonal is the moment's, exactly where psi is above its floor (1e-4 of the diagonal), else by
    # the floor
    torch.testing.assert_close(torch.diag(_cov(rand)), torch.diag(G), rtol=1.01e-4, atol=1e-12)


def test_low_rank_fa_equals_its_dense_iteration():
    """``_fa_low_rank`` equals Barber's iteration written densely: eigenpairs of Psi^-1/2 (E E^T / n) Psi^-1/2,
    F = Psi^1/2 U_K (Lambda_K - 1)_+^1/2, psi = s - diag(F F^T) floored, with s the exact diagonal."""
    g = torch.Generator().manual_seed(2)
    E = torch.randn(15, 6, generator=g, dtype=torch.float64)
    diag = E.pow(2).sum(-1) + torch.rand(15, generator=g, dtype=torch.float64)  # a diagonal above E E^T's
    n, K = 10, 2
    F, psi, n_iter, converged = _fa_low_rank(E, diag, n, K)
    M, s = E @ E.T / n, diag / n
    psi_ref = s.clone()
    for _ in range(n_iter):
        lam, U = torch.linalg.eigh(M / psi_ref.sqrt().outer(psi_ref.sqrt()))
        lam_k, U_k = lam[-K:].flip(-1), U[:, -K:].flip(-1)
        F_ref = psi_ref.sqrt().unsqueeze(-1) * U_k * (lam_k - 1).clamp_min(0).sqrt()
        psi_ref = torch.maximum(s - F_ref.pow(2).sum(-1), 1e-4 * s)
    assert converged and 1 < n_iter < 1000
    torch.testing.assert_close(F @ F.T, F_ref @ F_ref.T)
    torch.testing.assert_close(psi, psi_ref)


@pytest.mark.slow
def test_randomized_fit_approaches_the_exact_fa_of_a_trained_mlp():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(400, 8, generator=g)
    y = (X[:, :3].sum(-1) > 0).long() + (X[:, 3] > 1).long()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(200):
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    batches = [(X[i:i + 100], y[i:i + 100]) for i in range(0, 400, 100)]
    S = _cov(FactorLaplace(net, "classification", rank=10 ** 6, curvature_fit="scatter").fit(batches)).double()
    best = _cov(FactorLaplace(net, "classification", rank=5, curvature_fit="scatter").fit(batches)).double()
    errors = {}
    for fit, passes in (("sketch", 1), ("randomized", 2), ("randomized", 3)):
        la = FactorLaplace(net, "classification", rank=5, curvature_fit=fit, num_passes=passes).fit(batches)
        errors[fit, passes] = float((_cov(la).double() - S).norm() / S.norm())
    e_best = float((best - S).norm() / S.norm())
    # as close to the moment as the exact FA fit and the sketch (measured: all within 1 % of each other)
    for key, err in errors.items():
        assert err < 1.1 * e_best + 0.01, (key, err, e_best, errors)


def test_refusals_name_the_argument():
    X, y, net = _low_rank_data(40)
    with pytest.raises(ValueError, match="rank must be < dim=21 for curvature_fit='randomized'"):
        FactorLaplace(net, "classification", rank=21, curvature_fit="randomized").fit([(X, y)])
    bad = FactorLaplace(nn.Linear(6, 3).double(), "classification", rank=2, curvature_fit="randomized")
    with torch.no_grad():
        bad.model.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        bad.fit([(X, y)])

    def nan_blocks():
        yield torch.full((3, 5), float("nan"), dtype=torch.float64)

    with pytest.raises(ValueError, match="curvature vectors must be finite"):
        fit_second_moment(nan_blocks, 5, 2, method="randomized", dtype=torch.float64, device=torch.device("cpu"))

    def wrong_shape():
        yield torch.zeros(3, 4, dtype=torch.float64)

    with pytest.raises(ValueError, match=r"must have shape \(V, 5\)"):
        fit_second_moment(wrong_shape, 5, 2, method="randomized", dtype=torch.float64, device=torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_randomized_fit_on_cuda_equals_the_cpu_one_where_the_range_is_exact():
    X, y, net = _low_rank_data()
    cpu = FactorLaplace(net, "classification", rank=4, curvature_fit="randomized").fit([(X, y)])
    gpu_net = _low_rank_data()[2].cuda()
    gpu = FactorLaplace(gpu_net, "classification", rank=4, curvature_fit="randomized").fit([(X.cuda(), y.cuda())])
    assert gpu.cov_factor.is_cuda
    torch.testing.assert_close(_cov(gpu).cpu(), _cov(cpu), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(gpu.log_marginal_likelihood().cpu(), cpu.log_marginal_likelihood(), rtol=1e-8, atol=0)
    torch.testing.assert_close(gpu.predict_proba(X[:5].cuda(), pred_type="glm").cpu(), cpu.predict_proba(X[:5], pred_type="glm"))


@pytest.mark.parametrize("method", ["scatter", "online", "sketch", "randomized"])
def test_fit_second_moment_defaults_to_the_default_dtype_on_the_cpu(method):
    """Without ``dtype`` and ``device`` the factors come in torch's default dtype on the CPU, equal to those of
    an explicit ``dtype=torch.get_default_dtype(), device="cpu"`` (the randomized fit once failed on ``None``)."""
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(40, 3, generator=g) @ torch.randn(3, 12, generator=g) + 0.1 * torch.randn(40, 12, generator=g)
              for _ in range(3)]
    got = fit_second_moment(lambda: iter(blocks), 12, 2, method=method)
    want = fit_second_moment(lambda: iter(blocks), 12, 2, method=method, dtype=torch.get_default_dtype(),
                             device="cpu")
    for a, b in zip(got[:2], want[:2]):
        assert a.dtype == torch.get_default_dtype() and a.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the fit is of the moment: its diagonal, F F^T + psi, equals the blocks' mean square to the FA's floor
    S = torch.cat(blocks).pow(2).mean(0)
    torch.testing.assert_close(got[0].pow(2).sum(-1) + got[1], S, rtol=0.05, atol=1e-4)


def test_randomized_fit_refuses_nonfinite_vectors_and_an_overflowing_sketch():
    """A NaN among the vectors is named as such (found through its row of V Q); finite vectors whose products
    overflow float32 are refused too, not handed to the QR as inf."""
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(20, 30, generator=g, dtype=torch.float32) for _ in range(3)]
    bad = [b.clone() for b in blocks]
    bad[1][4, 7] = float("nan")
    with pytest.raises(ValueError, match="curvature vectors must be finite, got NaN or inf"):
        fit_second_moment(lambda: iter(bad), 30, 2, method="randomized")
    inf = [b.clone() for b in blocks]
    inf[2][0, 0] = float("inf")
    with pytest.raises(ValueError, match="curvature vectors must be finite"):
        fit_second_moment(lambda: iter(inf), 30, 2, method="randomized")
    huge = [b * 1e20 for b in blocks]
    assert all(bool(torch.isfinite(b).all()) for b in huge)
    with pytest.raises(ValueError, match="overflowed torch.float32"):
        fit_second_moment(lambda: iter(huge), 30, 2, method="randomized", dtype=torch.float32)
    # the same vectors in float64 fit
    F, psi, _ = fit_second_moment(lambda: iter(b.double() for b in huge), 30, 2, method="randomized",
                                  dtype=torch.float64)
    assert bool(torch.isfinite(F).all() and torch.isfinite(psi).all())
