"""FactorIVON: rank 0 is ivon-opt's IVON bit for bit; the Woodbury algebra and the low-rank sketch against dense
torch.linalg; the learned posterior against the exact Bayesian linear-regression posterior; the posterior's
predictions against dense closed forms; bad input refused before it touches the state."""
import math

import pytest
import torch
from torch import nn

from pyro_fa.distributions import LowRankPrecisionNormal
from pyro_fa.optim import FactorIVON, WeightPosterior
from pyro_fa.optim._lowrank import (Woodbury, _orthonormalise_rows, factorise, row_squares, sketch_update,
                                    sketch_update_stacked)


def _mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)


def _data(dtype=torch.float64, n=40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=g, dtype=dtype), torch.randn(n, 2, generator=g, dtype=dtype)


def _draw_and_step(opt, net, X, y, draws=1):
    for _ in range(draws):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            nn.functional.mse_loss(net(X), y).backward()
    opt.step()


def _flat(net):
    return torch.cat([p.detach().flatten() for p in net.parameters()])


# ----------------------------------------------------------------------------- rank 0 is IVON
@pytest.mark.parametrize("groups", [1, 2])
def test_rank_0_reproduces_ivon_to_the_bit_over_20_steps(groups):
    ivon = pytest.importorskip("ivon")  # ivon-opt, the reference implementation (the "peers" extra)
    a, b = _mlp(), _mlp()
    X, y = _data()

    def params(net):
        if groups == 1:
            return net.parameters()
        return [{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.02, "ess": 80.0,
                                                  "weight_decay": 1e-3, "hess_init": 2.0}]

    kw = dict(lr=0.05, ess=40.0, hess_init=0.5, beta1=0.8, beta2=0.99, weight_decay=1e-2, clip_radius=0.3)
    reference = ivon.IVON(params(a), **kw)
    ours = FactorIVON(params(b), **kw, rank=0)
    for t in range(20):
        for opt, net in ((reference, a), (ours, b)):
            torch.manual_seed(100 + t)  # the same global generator state: the same draws
            for _ in range(2):
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    nn.functional.mse_loss(net(X), y).backward()
                    drawn = _flat(net)
            opt.step()
            if opt is reference:
                drawn_ref = drawn
        assert torch.equal(drawn, drawn_ref)  # the weights inside sampled_params
        assert torch.equal(_flat(a), _flat(b))  # m
        hess = torch.cat([g["hess"] for g in reference.param_groups])
        momentum = torch.cat([g["momentum"] for g in reference.param_groups])
        assert torch.equal(ours.state["hess"], hess) and torch.equal(ours.state["momentum"], momentum)
    assert not torch.equal(_flat(a), _flat(_mlp()))  # it moved
    q = ours.get_posterior()
    ess = torch.cat([torch.full((sum(p.numel() for p in g["params"]),), g["ess"], dtype=torch.float64)
                     for g in reference.param_groups])
    wd = torch.cat([torch.full((sum(p.numel() for p in g["params"]),), g["weight_decay"], dtype=torch.float64)
                    for g in reference.param_groups])
    torch.testing.assert_close(q.variance, 1 / (ess * (hess + wd)), rtol=1e-14, atol=0)


# ----------------------------------------------------------------------------- the linear algebra
def test_woodbury_solve_and_inverse_root_against_dense():
    g = torch.Generator().manual_seed(0)
    D, K = 12, 3
    psi = torch.rand(D, generator=g, dtype=torch.float64) + 0.5
    U = torch.randn(D, K, generator=g, dtype=torch.float64)
    wb = Woodbury.of(psi, U.T.contiguous(), 1.0)
    P = torch.diag(psi) + U @ U.T
    v = torch.randn(D, generator=g, dtype=torch.float64)
    torch.testing.assert_close(wb.solve(v), torch.linalg.solve(P, v), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wb.matvec(v), P @ v, rtol=1e-12, atol=1e-12)
    draws = [wb.draw(e) for e in torch.eye(D, dtype=torch.float64)]
    R = torch.stack([z for z, _ in draws], 1)  # z = R eps
    torch.testing.assert_close(R @ R.T, torch.linalg.inv(P), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.stack([pz for _, pz in draws], 1), P @ R, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(row_squares(U.T.contiguous()), U.square().sum(-1), rtol=1e-14, atol=0)
    for e in (torch.eye(D, dtype=torch.float64)[3], v):  # into given storage: the same numbers
        z, pz = wb.draw(e, (torch.empty(D, dtype=torch.float64), torch.empty(D, dtype=torch.float64)))
        assert all(torch.equal(x, y) for x, y in zip((z, pz), wb.draw(e)))
    assert torch.equal(wb.solve(v.clone(), overwrite=True, out=torch.empty(D, dtype=torch.float64)), wb.solve(v))


def test_gram_schmidt_on_rows_is_the_thin_qr():
    g = torch.Generator().manual_seed(2)
    R = torch.randn(4, 50, generator=g, dtype=torch.float64)
    Q = R.clone()
    R2 = _orthonormalise_rows(Q)
    torch.testing.assert_close(R2.T @ Q, R, rtol=0, atol=1e-12)  # R = R2^T Q2^T
    torch.testing.assert_close(R2.diagonal(), torch.linalg.qr(R.T)[1].diagonal().abs(), rtol=0, atol=1e-12)
    torch.testing.assert_close(Q @ Q.T, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(R2, R2.triu())
    R[2] = R[0] - 2 * R[1]  # dependent: a tiny diagonal entry, still a QR factorisation
    Q = R.clone()
    R2 = _orthonormalise_rows(Q)
    torch.testing.assert_close(R2.T @ Q, R, rtol=0, atol=1e-12)
    assert float(R2[2, 2]) < 1e-12
    torch.testing.assert_close(Q @ Q.T, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-10)
    torch.testing.assert_close(R2.diagonal()[:2], torch.linalg.qr(R.T)[1].diagonal()[:2].abs(), rtol=0, atol=1e-12)


def test_the_refresh_by_chunks_of_columns_against_a_dense_computation_in_the_span():
    # D over the chunk sizes: the rotation in place, the cap's sums and the fused factorisation cross chunks
    g = torch.Generator().manual_seed(3)
    D, r, M = 3 * 2 ** 15 + 5, 3, 2
    Q = torch.linalg.qr(torch.randn(D, r, generator=g, dtype=torch.float64))[0].T.contiguous()
    lam = torch.tensor([3.0, 2.0, 0.5], dtype=torch.float64)
    V = torch.randn(2 * M, D, generator=g, dtype=torch.float64)
    w = torch.rand(D, generator=g, dtype=torch.float64)
    basis = Q.clone()
    new, lam2, sums = sketch_update_stacked(basis, lam, V.clone(), 0.9, out=basis, cap_weights=w)
    assert new is basis
    B = torch.linalg.qr(torch.cat([Q, V]).T)[0]  # (D, r + 2M), independent of Gram-Schmidt and of the chunks
    S = 0.9 * (B.T @ Q.T) @ torch.diag(lam) @ (Q @ B)
    for u, a in zip(V[:M], V[M:]):
        S = S + 0.1 / M * 0.5 * (torch.outer(B.T @ u, B.T @ a) + torch.outer(B.T @ a, B.T @ u))
    ev, vec = torch.linalg.eigh(S)
    torch.testing.assert_close(lam2, ev.flip(0)[:r], rtol=1e-10, atol=1e-12)
    top = vec[:, -r:] @ torch.diag(ev[-r:]) @ vec[:, -r:].T
    torch.testing.assert_close((new @ B).T @ torch.diag(lam2) @ (new @ B), top, rtol=0, atol=1e-10)
    torch.testing.assert_close(new @ new.T, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(sums, new.abs() @ w, rtol=1e-12, atol=0)
    # the factorisation against its definition, dense; then the same buffers again, other inputs
    buffers = {}
    for eig, floor in ((lam2, 0.25), (torch.tensor([1e4, 1.0, 0.0], dtype=torch.float64), 0.5)):
        total = w + 0.1
        U_t = new * eig.sqrt().unsqueeze(-1)
        rows, room = U_t.square().sum(0), (1 - floor) * total
        U_t = U_t * torch.where(rows > room, (room / rows).sqrt(), torch.ones_like(rows))
        want = Woodbury.of(total - torch.minimum(rows, room), U_t, 7.0)
        got = factorise(new, eig, total, floor, 7.0, buffers)
        for name in ("psi", "factor_t", "inv_psi", "root", "inv_root", "gram", "eigvals"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-12, atol=1e-12)
        assert got.factor_t is buffers["factor_t"]


def test_sketch_update_is_the_top_eigenpairs_of_the_dense_update():
    g = torch.Generator().manual_seed(1)
    D, r = 10, 3
    Q = torch.linalg.qr(torch.randn(D, r, generator=g, dtype=torch.float64))[0].T.contiguous()  # Q^T
    lam = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    pairs = [(torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64))
             for _ in range(2)]
    Q2, lam2 = sketch_update(Q, lam, pairs, 0.9)
    S = 0.9 * Q.T @ torch.diag(lam) @ Q
    for u, a in pairs:
        S = S + 0.1 / 2 * 0.5 * (torch.outer(u, a) + torch.outer(a, u))
    ev, vec = torch.linalg.eigh(S)
    torch.testing.assert_close(lam2, ev.flip(0)[:r], rtol=1e-12, atol=1e-12)
    top = vec[:, -r:] @ torch.diag(ev[-r:]) @ vec[:, -r:].T
    torch.testing.assert_close(Q2.T @ torch.diag(lam2) @ Q2, top, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(Q2 @ Q2.T, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-12)
    empty, lam0 = sketch_update(torch.zeros(r, D, dtype=torch.float64), torch.zeros(r, dtype=torch.float64),
                                pairs[:1], 0.9)  # from empty slots: the positive eigenpair of the first term
    u, a = pairs[0]
    want = 0.1 * 0.5 * (u @ a + u.norm() * a.norm())
    torch.testing.assert_close(lam0[0], want, rtol=1e-12, atol=0)
    assert torch.equal(lam0[1:], torch.zeros(r - 1, dtype=torch.float64))


def test_the_precision_has_ivons_diagonal_and_a_low_rank_part():
    net = _mlp()
    X, y = _data()
    opt = FactorIVON(net.parameters(), lr=0.05, ess=40.0, beta2=0.99, weight_decay=1e-2, rank=3)
    for _ in range(15):
        _draw_and_step(opt, net, X, y)
    q = opt.get_posterior()
    assert isinstance(q, LowRankPrecisionNormal) and q.prec_factor.shape == (opt.dim, 3)
    torch.testing.assert_close(q.precision_matrix.diagonal(), 40.0 * (opt.state["hess"] + 1e-2), rtol=1e-12, atol=0)
    assert q.prec_factor.abs().sum() > 0
    assert (q.prec_diag >= 0.25 * 40.0 * (opt.state["hess"] + 1e-2) * (1 - 1e-12)).all()  # the floor
    torch.testing.assert_close(q.mean, _flat(net))


def test_the_fisher_fed_low_rank_part_is_the_top_of_the_dense_moving_average():
    """curvature='fisher': the refresh folds B (g_j - b)(g_j - b)^T into the sketch, b the previous step's
    debiased momentum, against a dense eigendecomposition (the cap not binding: h + delta large)."""
    net = _mlp()
    X, y = _data()
    B, beta1, beta2, r = 40, 0.8, 0.9, 3
    opt = FactorIVON(net.parameters(), lr=1e-3, ess=40.0, hess_init=1e4, beta1=beta1, beta2=beta2, rank=r,
                     curvature="fisher", batch_size=B)
    _draw_and_step(opt, net, X, y)
    Q, lam, b = opt.state["basis"].clone(), opt.state["eigvals"].clone(), opt.state["momentum"] / (1 - beta1)
    S = beta2 * Q.T @ torch.diag(lam) @ Q
    for _ in range(2):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            nn.functional.mse_loss(net(X), y).backward()
            g = torch.cat([p.grad.flatten() for p in net.parameters()])
        S = S + (1 - beta2) / 2 * B * torch.outer(g - b, g - b)
    opt.step()
    ev, vec = torch.linalg.eigh(S)
    torch.testing.assert_close(opt.state["eigvals"], ev.flip(0)[:r], rtol=1e-10, atol=1e-12)
    top = vec[:, -r:] @ torch.diag(ev[-r:]) @ vec[:, -r:].T
    Q2 = opt.state["basis"]
    torch.testing.assert_close(Q2.T @ torch.diag(opt.state["eigvals"]) @ Q2, top, rtol=0, atol=1e-10)
    assert (opt.state["eigvals"] >= 0).all()  # positive semi-definite, unlike Stein's estimate


@pytest.mark.slow
def test_the_draws_have_the_posteriors_covariance_within_five_standard_errors():
    net = nn.Linear(3, 1).double()
    X, y = _data(n=30)
    opt = FactorIVON(net.parameters(), lr=0.05, ess=30.0, beta2=0.95, rank=1)
    for _ in range(30):
        _draw_and_step(opt, net, X, y[:, :1])
    q = opt.get_posterior()
    torch.manual_seed(0)
    draws = []
    for _ in range(20_000):
        with opt.sampled_params():
            draws.append(_flat(net))
    x = torch.stack(draws)
    N = x.shape[0]
    dev = x - q.mean
    for v in (torch.ones(4, dtype=torch.float64), torch.tensor([1.0, -2.0, 0.5, 1.0], dtype=torch.float64)):
        proj = dev @ v
        want = v @ q.covariance_matvec(v)
        assert abs(float(proj.square().mean() - want)) <= 5 * float(proj.square().std() / math.sqrt(N))
    assert ((dev.mean(0)).abs() <= 5 * x.std(0) / math.sqrt(N)).all()


# ----------------------------------------------------------------------------- against the exact posterior
def _regression(D=30, K=3, N=500):
    g = torch.Generator().manual_seed(0)
    d = torch.rand(D, generator=g, dtype=torch.float64) + 1.0
    V = 0.8 * torch.randn(D, K, generator=g, dtype=torch.float64)
    X = torch.randn(N, D, generator=g, dtype=torch.float64) * d.sqrt() + torch.randn(
        N, K, generator=g, dtype=torch.float64) @ V.T
    y = X @ torch.randn(D, generator=g, dtype=torch.float64) + torch.randn(N, generator=g, dtype=torch.float64)
    return X, y


def _fit_regression(X, y, rank, wd, steps=2500):
    N, D = X.shape
    torch.manual_seed(1)
    w = torch.zeros(D, dtype=torch.float64, requires_grad=True)
    opt = FactorIVON([w], lr=0.1, ess=float(N), beta2=0.999, weight_decay=wd, rank=rank)
    for t in range(steps):
        if t == steps - 500:  # a smaller step at the end: the mean's fluctuation shrinks with lr
            opt.param_groups[0]["lr"] = 0.02
        with opt.sampled_params(train=True):
            opt.zero_grad()
            (0.5 * (y - X @ w).square().mean()).backward()
        opt.step()
    return opt.get_posterior()


def _kl(q, mean, precision):
    """KL(q || N(mean, precision^{-1})), dense."""
    D = mean.shape[0]
    Sq = q.covariance_matrix
    dm = mean - q.mean
    return 0.5 * (torch.trace(precision @ Sq) - D + dm @ precision @ dm
                  - torch.logdet(precision) - torch.logdet(Sq))


@pytest.mark.slow
def test_bayesian_linear_regression_the_low_rank_part_brings_the_exact_posterior_closer():
    # loss = mean of 0.5 (y - x w)^2, ess = N, weight decay wd: the posterior N(m, P^{-1}) with
    # P = X^T X + N wd I, m = P^{-1} X^T y; X^T X / N is about diag + rank 3 (strong correlations)
    X, y = _regression()
    N, D = X.shape
    wd = 1e-2
    P = X.T @ X + N * wd * torch.eye(D, dtype=torch.float64)
    m = torch.linalg.solve(P, X.T @ y)
    sd = torch.linalg.inv(P).diagonal().sqrt()
    errors, kls = {}, {}
    for rank in (0, 3):
        q = _fit_regression(X, y, rank, wd)
        kls[rank] = float(_kl(q, m, P))
        errors[rank] = float((q.precision_matrix - P).norm() / P.norm())
        assert ((q.mean - m).abs() / sd).max() < 0.5  # the mean within half a posterior sd per weight
    assert errors[3] < 0.15 and errors[0] > 0.8  # the precision within 15 % (Frobenius); mean field cannot
    assert kls[3] < 0.25 * kls[0] and kls[3] < 1.5  # KL(q || exact): about 0.8 against 8.3


# ----------------------------------------------------------------------------- state and bad input
def test_a_state_dict_round_trip_continues_the_same_run():
    X, y = _data()
    a, b = _mlp(), _mlp(seed=3)
    opt_a = FactorIVON(a.parameters(), lr=0.05, ess=40.0, beta2=0.99, rank=2)
    for _ in range(5):
        _draw_and_step(opt_a, a, X, y)
    b.load_state_dict(a.state_dict())
    opt_b = FactorIVON(b.parameters(), lr=0.05, ess=40.0, beta2=0.99, rank=2)
    opt_b.load_state_dict(opt_a.state_dict())
    qa, qb = opt_a.get_posterior(), opt_b.get_posterior()
    assert torch.equal(qa.prec_factor, qb.prec_factor) and torch.equal(qa.prec_diag, qb.prec_diag)
    for opt, net in ((opt_a, a), (opt_b, b)):
        torch.manual_seed(9)
        _draw_and_step(opt, net, X, y)
    assert torch.equal(_flat(a), _flat(b))


def test_a_saved_or_loaded_state_is_not_shared_with_its_source():
    # the basis is rotated in place: a state_dict, or a copy loaded from another optimizer, must not move with it
    X, y = _data()
    a, b = _mlp(), _mlp()
    opt_a = FactorIVON(a.parameters(), lr=0.05, ess=40.0, beta2=0.99, rank=2)
    _draw_and_step(opt_a, a, X, y)
    opt_b = FactorIVON(b.parameters(), lr=0.05, ess=40.0, beta2=0.99, rank=2)
    saved = opt_a.state_dict()
    opt_b.load_state_dict(saved)
    loaded = opt_b.state["basis"].clone()
    for _ in range(3):
        _draw_and_step(opt_a, a, X, y)
    assert torch.equal(opt_b.state["basis"], loaded) and not torch.equal(opt_a.state["basis"], loaded)
    assert torch.equal(saved["state"]["basis"], loaded)  # a state_dict is a snapshot


def test_the_mean_follows_weights_changed_outside_the_optimizer():
    # the mean is read from the parameters without a copy while they are views of the optimizer's vector
    X, y = _data()
    net = _mlp()
    opt = FactorIVON(net.parameters(), lr=0.05, ess=40.0, beta2=0.99, rank=2)
    _draw_and_step(opt, net, X, y)
    first, last = list(net.parameters())[0], list(net.parameters())[-1]
    with torch.no_grad():
        first.add_(1.0)  # in place: still a view
    last.data = last.data.clone() - 1.0  # replaced: no longer a view
    torch.testing.assert_close(opt.get_posterior().mean, _flat(net), rtol=0, atol=0)
    want = _flat(net)
    with opt.sampled_params():
        pass
    torch.testing.assert_close(_flat(net), want, rtol=0, atol=0)  # restored to the changed weights


def test_nan_gradients_are_refused_and_the_state_is_unchanged():
    net = _mlp()
    X, y = _data()
    opt = FactorIVON(net.parameters(), lr=0.05, ess=40.0, rank=2)
    _draw_and_step(opt, net, X, y)
    before = {k: v.clone() for k, v in opt.state.items() if torch.is_tensor(v)}
    mean = _flat(net)
    with pytest.raises(ValueError, match=r"FactorIVON: the gradients must be finite, got NaN or inf"):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            (net(X).sum() * float("nan")).backward()
    assert torch.equal(_flat(net), mean) and opt.state["count"] == 0
    for k, v in before.items():
        assert torch.equal(opt.state[k], v)
    with pytest.raises(RuntimeError, match=r"FactorIVON: step\(\) needs the gradient of at least one draw"):
        opt.step()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lr=-1.0), ValueError, r"FactorIVON: lr must be a finite number >= 0, got -1.0."),
    (dict(ess=0.0), ValueError, r"FactorIVON: ess must be a positive finite number, got 0.0."),
    (dict(ess="a"), TypeError, r"FactorIVON: ess must be a real number, got 'a'."),
    (dict(hess_init=0.0), ValueError, r"FactorIVON: hess_init must be a positive finite number, got 0.0."),
    (dict(beta1=1.0), ValueError, r"FactorIVON: beta1 must be a number in \[0, 1\), got 1.0."),
    (dict(beta2=1.5), ValueError, r"FactorIVON: beta2 must be a number in \[0, 1\], got 1.5."),
    (dict(weight_decay=-1e-4), ValueError, r"FactorIVON: weight_decay must be a finite number >= 0"),
    (dict(clip_radius=0.0), ValueError, r"FactorIVON: clip_radius must be a positive number \(inf: no clipping\)"),
    (dict(diag_floor=0.0), ValueError, r"FactorIVON: diag_floor must be a number in \(0, 1\], got 0.0."),
    (dict(mc_samples=0), ValueError, r"FactorIVON: mc_samples must be an integer >= 1, got 0."),
    (dict(rank=-1), ValueError, r"FactorIVON: rank must be an integer >= 0, got -1."),
    (dict(rank=1.5), ValueError, r"FactorIVON: rank must be an integer >= 0, got 1.5."),
    (dict(curvature="fisher"), ValueError, r"FactorIVON: curvature='fisher' needs batch_size, the number of "
                                           r"examples each gradient averages over \(its estimate is scaled by it\), "
                                           r"got None."),
    (dict(curvature="fisher", batch_size=0), ValueError, r"FactorIVON: batch_size must be an integer >= 1, got 0."),
    (dict(batch_size=8), ValueError, r"FactorIVON: batch_size is used by curvature='fisher' only, got batch_size=8 "
                                     r"with curvature='stein'."),
    (dict(curvature="GGN"), ValueError, r"FactorIVON: curvature must be one of \('stein', 'fisher'\), got 'GGN'."),
    (dict(rank=37), ValueError, r"FactorIVON: rank \+ 2 \* \(draws per step\) must be at most the number of weights "
                                r"38, got rank=37 with 1 draw\(s\). Lower rank or mc_samples."),
])
def test_bad_hyperparameters_are_refused(kwargs, error, match):
    kw = dict(lr=0.1, ess=10.0, rank=2)
    kw.update(kwargs)
    with pytest.raises(error, match=match):
        FactorIVON(_mlp().parameters(), **kw)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match=r"FactorIVON: params must share one floating-point dtype, got "):
        FactorIVON([torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float32)], lr=0.1, ess=1.0,
                   rank=0)
    with pytest.raises(ValueError, match=r"FactorIVON: params must share one floating-point dtype"):
        FactorIVON([torch.zeros(3, dtype=torch.int64)], lr=0.1, ess=1.0, rank=0)
    net = _mlp()
    groups = [{"params": net[0].parameters()}, {"params": net[2].parameters(), "ess": 5.0}]
    with pytest.raises(ValueError, match=r"FactorIVON: ess must be the same in every param group when rank > 0"):
        FactorIVON(groups, lr=0.1, ess=1.0, rank=2)
    with pytest.raises(ValueError, match=r"FactorIVON: lr must be a finite number >= 0, got -2"):
        FactorIVON([{"params": _mlp().parameters(), "lr": -2}], lr=0.1, ess=1.0, rank=0)


def test_params_on_two_devices_are_refused():
    meta = torch.zeros(3, device="meta")
    with pytest.raises(ValueError, match=r"FactorIVON: params must be on one device, got \['cpu', 'meta'\]."):
        FactorIVON([torch.zeros(3), meta], lr=0.1, ess=1.0, rank=0)


def test_no_params_are_refused():
    with pytest.raises(ValueError, match=r"FactorIVON: params must hold at least one tensor, got none."):
        FactorIVON([{"params": []}], lr=0.1, ess=1.0, rank=0)


def test_float32_training_keeps_float32():
    net = _mlp(dtype=torch.float32)
    X, y = _data(torch.float32)
    opt = FactorIVON(net.parameters(), lr=0.05, ess=40.0, beta2=0.99, rank=2)
    for _ in range(5):
        _draw_and_step(opt, net, X, y)
    q = opt.get_posterior()
    assert q.mean.dtype == q.prec_factor.dtype == q.prec_diag.dtype == torch.float32
    assert torch.isfinite(q.variance).all()


# ----------------------------------------------------------------------------- the posterior's predictions
def _linear_posterior():
    net = nn.Linear(3, 1).double()
    X, y = _data(n=30)
    opt = FactorIVON(net.parameters(), lr=0.05, ess=30.0, beta2=0.95, rank=1)
    for _ in range(20):
        _draw_and_step(opt, net, X, y[:, :1])
    return net, opt, X


def test_glm_variance_of_a_linear_model_is_the_dense_j_sigma_j():
    net, opt, X = _linear_posterior()
    post = opt.posterior(net)
    q = opt.get_posterior()
    J = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], 1)  # weight then bias: parameter order
    mean, var = post.predict(X, pred_type="glm", return_var=True)
    torch.testing.assert_close(var.squeeze(-1), ((J @ q.covariance_matrix) * J).sum(-1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mean.squeeze(-1), J @ q.mean, rtol=1e-12, atol=1e-12)
    nn_mean = post.predict(X, num_samples=4000, generator=torch.Generator().manual_seed(0))
    se = var.sqrt() / math.sqrt(4000)
    assert ((nn_mean - mean).abs() <= 5 * se).all()  # linear: the sampled networks' mean is the GLM's
    post.scale = 0.0
    torch.testing.assert_close(post.predict(X), net(X).detach(), rtol=1e-12, atol=1e-12)


def test_the_posterior_refuses_bad_input():
    net, opt, X = _linear_posterior()
    q = opt.get_posterior()
    with pytest.raises(TypeError, match=r"WeightPosterior: module must be a torch.nn.Module, got str."):
        WeightPosterior("net", q)
    with pytest.raises(TypeError, match=r"WeightPosterior: distribution must be a pyro_fa.distributions.FactorNormal"):
        WeightPosterior(net, torch.distributions.Normal(0.0, 1.0))
    with pytest.raises(ValueError, match=r"WeightPosterior: params must be parameters of module, got tensors at "):
        WeightPosterior(net, q, [torch.zeros(4)])
    with pytest.raises(ValueError, match=r"WeightPosterior: distribution must be over the 4 weights of params, got "
                                         r"event shape \(3,\)."):
        WeightPosterior(net, LowRankPrecisionNormal(torch.zeros(3), torch.zeros(3, 1), torch.ones(3)))
    post = opt.posterior(net)
    with pytest.raises(ValueError, match=r"WeightPosterior: scale must be a finite number >= 0, got -1.0."):
        post.scale = -1.0
    with pytest.raises(ValueError, match=r"WeightPosterior: loader must be None"):
        post.predictive(loader=[X])


def test_update_every_refreshes_the_precision_every_t_steps_only():
    net = _mlp()
    X, y = _data()
    opt = FactorIVON(net.parameters(), lr=0.05, ess=40.0, beta2=0.99, rank=2, update_every=3)
    seen = [opt.get_posterior()]
    for _ in range(6):
        _draw_and_step(opt, net, X, y)
        seen.append(opt.get_posterior())
    same = [torch.equal(a.prec_diag, b.prec_diag) and torch.equal(a.prec_factor, b.prec_factor)
            for a, b in zip(seen, seen[1:])]
    assert same == [True, True, False, True, True, False]  # refreshed at steps 3 and 6
    assert not torch.equal(seen[1].mean, seen[2].mean)  # the mean and h learn at every step
    torch.testing.assert_close(seen[-1].precision_matrix.diagonal(), 40.0 * (opt.state["hess"] + 1e-4),
                               rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"FactorIVON: update_every must be an integer >= 1, got 0."):
        FactorIVON(net.parameters(), lr=0.05, ess=40.0, rank=2, update_every=0)


@pytest.mark.parametrize("module", ["factor_ivon", "posterior"])
def test_the_doctests(module):
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(f"pyro_fa.optim.{module}")).failed == 0


def test_a_refresh_that_fails_leaves_the_state_unchanged(monkeypatch):
    """Where the low-rank refresh cannot be computed (its eigenproblem or P's factorisation fails, or a draw's
    precision times noise overflowed), step() refuses with a ValueError naming the divergence, drops the step's
    draws and leaves every state tensor as it was; the next step runs as if the failed one had not been taken."""
    from pyro_fa.optim import factor_ivon as module

    torch.manual_seed(0)
    net = torch.nn.Linear(6, 1)
    x, y = torch.randn(32, 6), torch.randn(32, 1)
    opt = FactorIVON(net.parameters(), lr=0.1, ess=32, hess_init=0.5, rank=2, update_every=1)

    def one_step():
        with opt.sampled_params(train=True):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()

    def fails_once(real):
        calls = []

        def fake(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
            return real(*args, **kwargs)

        return fake

    for target in ("sketch_update_stacked", "factorise"):  # the refresh's eigenproblem, then P's factorisation
        one_step()  # a step that succeeds: P factorised, ready for the next draw
        before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state.items() if k != "avg_grad"}
        mean = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()
        monkeypatch.setattr(module, target, fails_once(getattr(module, target)))
        with pytest.raises(ValueError, match=r"FactorIVON: the update of the curvature's low-rank part is not "
                                             r"finite \(linalg.eigh: .*\): the run has diverged"):
            one_step()
        for k, v in before.items():
            if torch.is_tensor(v):
                assert torch.equal(opt.state[k], v), (target, k)
            else:
                assert opt.state[k] == v, (target, k)
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in net.parameters()]), mean)
        assert opt.state["count"] == 0  # the failed step's draws are dropped
        monkeypatch.undo()
        one_step()  # and training goes on
        assert opt.state["step"] == before["step"] + 1


def test_the_refresh_writes_the_new_basis_into_the_previous_one_s_storage():
    """The refresh rotates into a second (K, D) buffer and keeps the old basis until P is factorised, then hands the
    old one over as the next refresh's buffer: two storages alternate, no new (K, D) tensor per refresh, and the
    trajectory is the one of an optimizer whose every refresh writes a new tensor."""

    def run(keep):
        torch.manual_seed(0)
        net = torch.nn.Linear(6, 1)
        x, y = torch.randn(32, 6), torch.randn(32, 1)
        opt = FactorIVON(net.parameters(), lr=0.1, ess=32, hess_init=0.5, rank=2, update_every=1)
        pointers = []
        for _ in range(6):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            if not keep:
                opt._factor_buffers.pop("basis", None)  # a fresh buffer at every refresh
            pointers.append(opt.state["basis"].data_ptr())
        return opt, pointers

    kept, pointers = run(True)
    fresh, _ = run(False)
    assert len(set(pointers)) == 2 and pointers[0::2] == [pointers[0]] * 3 and pointers[1::2] == [pointers[1]] * 3
    assert kept._factor_buffers["basis"].data_ptr() == pointers[-2]
    for k in ("basis", "eigvals", "hess", "momentum"):
        assert torch.equal(kept.state[k], fresh.state[k]), k
