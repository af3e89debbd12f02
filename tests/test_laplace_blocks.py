"""FactorLaplace with a rank per layer (block): against the exact block-diagonal GGN from torch.autograd.functional,
the core's fit of each block's own curvature vectors, and the allocation's definition on a constructed spectrum."""
import datetime

import pytest
import torch
from torch import nn

from pyro_fa.laplace import FactorLaplace, curvature_vectors, fit_second_moment, flat_network
from pyro_fa.laplace._blocks import allocate, module_blocks


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _data(seed=1, n=60):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.randint(3, (n,), generator=g)
    return X, y, [(X[:25], y[:25]), (X[25:], y[25:])]


def _dense_ggn(net, X):
    """sum_n J_n^T (diag p_n - p_n p_n^T) J_n with J_n from torch.autograd.functional.jacobian (float64)."""
    params = [p.detach() for p in net.parameters()]
    names = [n for n, _ in net.named_parameters()]
    theta = torch.cat([p.reshape(-1) for p in params])
    sizes = [p.numel() for p in params]

    def f(th, x):
        pieces = torch.split(th, sizes)
        return torch.func.functional_call(net, {n: t.view(p.shape) for n, t, p in zip(names, pieces, params)},
                                          (x[None],))[0]

    G = torch.zeros(theta.numel(), theta.numel(), dtype=torch.float64)
    for x in X:
        J = torch.autograd.functional.jacobian(lambda th: f(th, x), theta)  # (C, D)
        p = f(theta, x).softmax(-1)
        G += J.T @ (torch.diag(p) - torch.outer(p, p)) @ J
    return G


def _mask(bounds, D):
    M = torch.zeros(D, D, dtype=torch.bool)
    for a, e in bounds:
        M[a:e, a:e] = True
    return M


def test_full_rank_blocks_give_the_exact_block_diagonal_ggn_precision():
    net = _net()
    X, y, data = _data()
    la = FactorLaplace(net, "classification", rank=[16, 40], curvature_fit="scatter", prior_precision=0.7).fit(data)
    assert la.block_ranks.tolist() == [16, 15] and la.cov_factor.shape == (31, 31)
    G = _dense_ggn(net, X)
    P = 0.7 * torch.eye(31, dtype=torch.float64) + torch.where(_mask([(0, 16), (16, 31)], 31), G, 0.0)
    got = la.get_posterior().precision_matrix
    assert float((got - P).norm() / P.norm()) < 1e-6
    # and the covariance is its inverse, not the full GGN's: the blocks are uncorrelated
    cov = la.get_posterior().covariance_matrix
    assert float(cov[:16, 16:].abs().max()) < 1e-12
    assert float((cov - torch.linalg.inv(P)).norm() / cov.norm()) < 1e-6


def test_each_block_is_the_core_fit_of_its_own_columns_of_the_one_stream_and_F_is_block_diagonal():
    net = _net()
    X, y, data = _data()
    la = FactorLaplace(net, "classification", rank={"0": 3, "2": 2}, curvature_fit="scatter", seed=4).fit(data)
    F, psi = la.cov_factor, la.cov_diag
    assert F.shape == (31, 5) and la.block_ranks.tolist() == [3, 2]
    assert torch.count_nonzero(F[:16, 3:]) == 0 and torch.count_nonzero(F[16:, :3]) == 0
    f = flat_network(net, list(net.named_parameters()))
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    V = torch.cat([curvature_vectors(f, theta, x, "classification") for x, _ in data])
    for (a, e), k, cols in (((0, 16), 3, slice(0, 3)), ((16, 31), 2, slice(3, 5))):
        Fb, pb, _ = fit_second_moment(lambda: iter([V[:, a:e]]), e - a, k, method="scatter", seed=4,
                                      dtype=torch.float64)
        ratio = V.shape[0] / 60  # G/V -> G/N
        torch.testing.assert_close(F[a:e, cols] @ F[a:e, cols].T, ratio * Fb @ Fb.T, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(psi[a:e], ratio * pb, rtol=1e-6, atol=1e-9)


def test_an_int_rank_is_the_core_fit_of_the_whole_stream_unchanged():
    net = _net()
    X, y, data = _data()
    for fit in ("scatter", "randomized", "online"):
        la = FactorLaplace(net, "classification", rank=3, curvature_fit=fit, seed=2).fit(data)
        assert "block_ranks" not in la.state_dict() and "block_factor_0" not in la.state_dict()
        f = flat_network(net, list(net.named_parameters()))
        theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        blocks = [curvature_vectors(f, theta, x[i:i + 32], "classification")
                  for x, _ in data for i in range(0, x.shape[0], 32)]
        F, psi, _ = fit_second_moment(lambda: iter(blocks), 31, 3, method=fit, seed=2, dtype=torch.float64)
        r = len(torch.cat(blocks)) / 60
        assert torch.equal(la.cov_factor, F * r ** 0.5) and torch.equal(la.cov_diag, psi * r)


def test_one_pass_over_the_data_feeds_every_block():
    net = _net()
    X, y, data = _data()

    class Counting(list):
        runs = 0

        def __iter__(self):
            Counting.runs += 1
            return super().__iter__()

    for fit, want in (("scatter", 1), ("randomized", 2), ("online", 4)):
        Counting.runs = 0
        la = FactorLaplace(net, "classification", rank=[2, 2], curvature_fit=fit).fit(Counting(data))
        assert Counting.runs == want == la.fit_info["passes"]
        assert [b["method"] for b in la.fit_info["blocks"]] == [fit, fit]
    # "auto" per block: 1 200 weights > 1024 fitted by "randomized", 903 by "exact"
    big = nn.Sequential(nn.Linear(3, 300), nn.Tanh(), nn.Linear(300, 3)).double()
    Counting.runs = 0
    la = FactorLaplace(big, "classification", rank=[2, 2]).fit(Counting([(X[:20], y[:20])]))
    assert [b["method"] for b in la.fit_info["blocks"]] == ["randomized", "exact"] and Counting.runs == 2


def test_auto_allocation_keeps_the_largest_values_of_the_exact_block_spectra():
    torch.manual_seed(0)
    # the first layer sees inputs 30 times larger: its curvature's eigenvalues are much larger
    net = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 3)).double()
    with torch.no_grad():
        net[0].weight.mul_(0.02)
    X, y, _ = _data(n=40)
    X = X * 30
    delta = 0.5
    # a budget of 9 >= both blocks' sizes (8, 9): each block is fitted exactly first (rank >= D_b, psi = 0)
    la = FactorLaplace(net, "classification", rank="auto", rank_budget=9, curvature_fit="scatter",
                       prior_precision=delta).fit([(X, y)])
    G = _dense_ggn(net, X) / 40  # per example
    lams = [torch.linalg.eigvalsh(G[a:e, a:e]) for a, e in ((0, 8), (8, 17))]
    # values log(1 + N lambda / delta), the top 9 kept
    vals = torch.cat([torch.log1p(40 * l.clamp_min(0) / delta) for l in lams])
    top = torch.argsort(vals, descending=True)[:9]
    want = [int((top < 8).sum()), int((top >= 8).sum())]
    assert la.block_ranks.tolist() == want and want[0] > want[1]
    # F F^T per block is the truncated eigendecomposition; psi holds the dropped directions' diagonal
    for (a, e), k, cols in (((0, 8), want[0], slice(0, want[0])), ((8, 17), want[1], slice(want[0], 9))):
        lam, U = torch.linalg.eigh(G[a:e, a:e])
        kept = (U[:, -k:] * lam[-k:]) @ U[:, -k:].T
        Fb = la.cov_factor[a:e, cols]
        torch.testing.assert_close(Fb @ Fb.T, kept, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(la.cov_diag[a:e], (G[a:e, a:e] - kept).diagonal(), rtol=1e-6, atol=1e-9)


def test_allocate_picks_the_blocks_with_the_larger_eigenvalues():
    g = torch.Generator().manual_seed(0)
    Q1 = torch.linalg.qr(torch.randn(6, 3, generator=g, dtype=torch.float64))[0]
    Q2 = torch.linalg.qr(torch.randn(5, 2, generator=g, dtype=torch.float64))[0]
    F1 = Q1 * torch.tensor([10.0, 5.0, 1.0]).sqrt() @ torch.linalg.qr(torch.randn(3, 3, generator=g,
                                                                                   dtype=torch.float64))[0]
    F2 = Q2 * torch.tensor([8.0, 0.1]).sqrt()
    zeros = [torch.zeros(6, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    prior = [torch.full((6,), 2.0, dtype=torch.float64), torch.full((5,), 2.0, dtype=torch.float64)]
    Fs, psis, ranks, values = allocate([F1, F2], zeros, 3, prior, scale=10.0)
    assert ranks == [2, 1]  # 10, 8, 5 beat 1 and 0.1
    torch.testing.assert_close(values[0], torch.log1p(10.0 * torch.tensor([10.0, 5.0, 1.0], dtype=torch.float64) / 2))
    torch.testing.assert_close(Fs[0].pow(2).sum(0), torch.tensor([10.0, 5.0], dtype=torch.float64))
    torch.testing.assert_close(psis[0], Q1[:, 2].pow(2) * 1.0)  # the dropped direction's diagonal
    # a large diagonal in the first block makes the same eigenvalues worth less there
    Fs, psis, ranks, _ = allocate([F1, F2], [torch.full((6,), 100.0, dtype=torch.float64), zeros[1]], 3, prior, 10.0)
    assert ranks == [1, 2]


def test_a_block_fit_round_trips_through_state_dict_and_refuses_another_layout():
    net = _net()
    X, y, data = _data()
    for rank, extra in (([3, 2], {}), ("auto", {"rank_budget": 4})):
        la = FactorLaplace(net, "classification", rank=rank, curvature_fit="scatter", **extra).fit(data)
        la.optimize_prior_precision("marglik", n_steps=20)
        state = la.state_dict()
        fresh = FactorLaplace(net, "classification", rank=rank, curvature_fit="scatter", **extra)
        fresh.load_state_dict(state)
        assert torch.equal(fresh.block_ranks, la.block_ranks)
        torch.testing.assert_close(fresh.predict_proba(X[:5], pred_type="glm"), la.predict_proba(X[:5], pred_type="glm"), rtol=0, atol=0)
        torch.testing.assert_close(fresh.log_marginal_likelihood(), la.log_marginal_likelihood(), rtol=0, atol=0)
        assert fresh.sample(3, generator=torch.Generator().manual_seed(1)).shape == (3, 31)
    other = FactorLaplace(net, "classification", rank=[2, 3], curvature_fit="scatter")
    with pytest.raises(ValueError, match=r"block_ranks'\] must be \[2, 3\].*got \[3, 2\]"):
        other.load_state_dict(FactorLaplace(net, "classification", rank=[3, 2]).fit(data).state_dict())
    assert int(other.n_data) == 0
    with pytest.raises(ValueError, match=r"one rank for all weights, like this one \(rank=5\), got a fit with a "
                                         r"rank per block \(block_ranks \[\d, \d\]\); nothing was loaded"):
        FactorLaplace(net, "classification", rank=5).load_state_dict(state)


@pytest.mark.parametrize("rank, extra, match", [
    ([3], {}, r"rank as a list must have one entry per block, 2 \('0' \(16 weights\), '2' \(15 weights\)\), got 1"),
    ([3, 0], {}, r"rank must give every block a positive int, got 0 for '2'"),
    ([3, 2.5], {}, r"positive int, got 2.5 for '2'"),
    ({"0": 3, "1": 2}, {}, r"exactly \['0', '2'\], got unknown names \['1'\] and missing names \['2'\]"),
    ("best", {}, r"rank must be a positive int, a list of 2 positive ints.*or 'auto', got 'best'"),
    ("auto", {}, r"rank='auto' needs rank_budget.*got None"),
    ("auto", {"rank_budget": 0}, r"rank='auto' needs rank_budget.*got 0"),
    (4, {"rank_budget": 4}, r"rank_budget is only used with rank='auto', got rank=4"),
    ([20, 2], {"curvature_fit": "randomized"}, r"rank for block '0' must be < its 16 weights.*got 20"),
])
def test_bad_rank_specs_are_refused_naming_what_was_given(rank, extra, match):
    with pytest.raises(ValueError, match=match):
        FactorLaplace(_net(), "classification", rank=rank, **extra)


def test_rank_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="rank must be a positive int.*got float"):
        FactorLaplace(_net(), "classification", rank=2.0)


def test_blocks_follow_the_owning_modules_and_the_subset():
    net = _net()
    assert module_blocks(list(net.named_parameters())) == (["0", "2"], [(0, 16), (16, 31)])
    lin = nn.Linear(3, 2).double()
    assert module_blocks(list(lin.named_parameters())) == ([""], [(0, 8)])
    la = FactorLaplace(net, "classification", rank={"2": 2}, subset=[net[2].weight, net[2].bias])
    assert la._structure.layout.names == ["2"] and la.cov_factor.shape == (15, 2)


def test_an_error_in_a_block_or_in_the_data_leaves_no_fitter_waiting():
    net = _net()
    X, y, data = _data()
    la = FactorLaplace(net, "classification", rank=[2, 2], curvature_fit="randomized")
    with pytest.raises(ValueError, match="at least one example"):
        la.fit([])
    with pytest.raises(ValueError, match="labels in"):
        la.fit([data[0], (X[:3], y[:3] + 7)])
    bad = _net()
    with torch.no_grad():
        bad[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        FactorLaplace(bad, "classification", rank=[2, 2], curvature_fit="scatter").fit(data)
    assert int(la.n_data) == 0
    la.fit(data)  # and the same object fits afterwards
    assert la.block_ranks.tolist() == [2, 2]


def test_the_block_form_refuses_a_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        with pytest.raises(ValueError, match=r"rank must be an int with a process_group.*got rank=\[2, 2\]"):
            FactorLaplace(_net(), "classification", rank=[2, 2], process_group=dist.group.WORLD)
        FactorLaplace(_net(), "classification", rank=2, process_group=dist.group.WORLD)  # an int still shards
    finally:
        dist.destroy_process_group()


def test_rank_max_caps_the_generous_fits_and_warns_where_it_binds():
    net = _net()
    X, y, data = _data()
    la = FactorLaplace(net, "classification", rank="auto", rank_budget=6, rank_max=3, curvature_fit="scatter")
    assert la._structure.layout.fit_ranks == [3, 3] and la.cov_factor.shape == (31, 6)
    with pytest.warns(RuntimeWarning, match=r"rank='auto' gave blocks \['0', '2'\] every column"):
        la.fit(data)
    assert la.block_ranks.tolist() == [3, 3]
    with pytest.raises(ValueError, match="rank_max is only used with rank='auto', got rank=\\[2, 2\\]"):
        FactorLaplace(net, "classification", rank=[2, 2], rank_max=3)
    with pytest.raises(ValueError, match="rank_max must be a positive int.*got 0"):
        FactorLaplace(net, "classification", rank="auto", rank_budget=4, rank_max=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_blocks_on_cuda_give_the_cpus_precision_and_predictions():
    import copy

    net = _net()
    X, y, data = _data()
    kw = dict(curvature_fit="scatter", prior_precision=0.7)
    cpu = FactorLaplace(net, "classification", rank=[16, 40], **kw).fit(data)
    gpu_net = copy.deepcopy(net).cuda()
    gpu = FactorLaplace(gpu_net, "classification", rank=[16, 40], **kw).fit([(a.cuda(), b.cuda()) for a, b in data])
    assert gpu.cov_factor.is_cuda and gpu.block_ranks.tolist() == cpu.block_ranks.tolist()
    torch.testing.assert_close(gpu.get_posterior().precision_matrix.cpu(), cpu.get_posterior().precision_matrix,
                               rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(gpu.predict_proba(X.cuda(), pred_type="glm").cpu(), cpu.predict_proba(X, pred_type="glm"), rtol=1e-6, atol=1e-9)
    # each block held on the device, and every verb there: the evidence, its gradient, the variances, draws
    assert all(F.is_cuda and F.dtype == torch.float64 for _, _, F in gpu.block_factors)
    post = gpu.get_posterior()
    assert type(post).__name__ == "BlockLowRankPrecisionNormal" and all(L.is_cuda for L in post._capacitance_trils)
    torch.testing.assert_close(post.variance.cpu(), cpu.get_posterior().variance, rtol=1e-6, atol=1e-9)
    pp = {}
    for name, obj in (("cpu", cpu), ("gpu", gpu)):
        t = torch.tensor([0.7], dtype=torch.float64, device=obj.loc.device, requires_grad=True)
        lml = obj.log_marginal_likelihood(prior_precision=t, mode="linearized")
        pp[name] = (lml.detach().cpu(), torch.autograd.grad(lml, t)[0].cpu())
    for a, b in zip(pp["cpu"], pp["gpu"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert gpu.sample(3).is_cuda
    # the allocation's block index lives on the fit's device
    auto = FactorLaplace(copy.deepcopy(net).cuda(), "classification", rank="auto", rank_budget=6, **kw)
    assert auto.fit([(a.cuda(), b.cuda()) for a, b in data]).block_ranks.sum().item() == 6


# --------------------------------------------------------------------------- held by blocks, equal to the dense layout
def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _mlp_data(likelihood, seed=1, n=70):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randint(3, (n,), generator=g) if likelihood == "classification" else \
        torch.randn(n, 3, generator=g, dtype=torch.float64)
    return X, [(X[:40], y[:40]), (X[40:], y[40:])]


def _block_and_dense(likelihood, rank=(3, 2, 4), **kw):
    """A fit with a rank per block, and the same fit in the dense layout: an int-rank FactorLaplace whose
    ``cov_factor`` is the blocks' D x sum(K_b) matrix with zeros off the blocks (the layout before blocks were held
    on their own)."""
    net = _mlp()
    X, data = _mlp_data(likelihood)
    kw = dict(curvature_fit="scatter", sigma_noise=1.0 if likelihood == "classification" else 0.7, **kw)
    la = FactorLaplace(net, likelihood, rank=list(rank), **kw).fit(data)
    state = {k: v for k, v in la.state_dict().items() if not k.startswith("block_")}
    state["cov_factor"] = la.cov_factor
    dense = FactorLaplace(net, likelihood, rank=sum(rank), **kw)
    dense.load_state_dict(state)
    return net, X, la, dense


EXACT = dict(rtol=1e-10, atol=1e-12)


def test_the_block_posterior_equals_the_dense_construction():
    net, X, la, dense = _block_and_dense("classification", prior_precision=0.8)
    q, p = la.get_posterior(), dense.get_posterior()
    assert type(q).__name__ == "BlockLowRankPrecisionNormal" and type(p).__name__ == "LowRankPrecisionNormal"
    assert [U.shape for _, _, U in q.prec_factors] == [(30, 3), (35, 2), (18, 4)]
    torch.testing.assert_close(q.prec_factor, p.prec_factor, rtol=0, atol=0)  # the dense U, formed on request
    torch.testing.assert_close(q.log_det_precision(), p.log_det_precision(), **EXACT)
    torch.testing.assert_close(q.log_det_precision(), torch.logdet(p.precision_matrix), **EXACT)
    torch.testing.assert_close(q.variance, p.variance, **EXACT)
    torch.testing.assert_close(q.entropy(), p.entropy(), **EXACT)
    g = torch.Generator().manual_seed(5)
    x = q.loc + torch.randn(4, la.dim, generator=g, dtype=torch.float64) * q.variance.sqrt()
    torch.testing.assert_close(q.log_prob(x), p.log_prob(x), **EXACT)
    v = torch.randn(2, la.dim, generator=g, dtype=torch.float64)
    torch.testing.assert_close(q.precision_matvec(v), p.precision_matvec(v), **EXACT)
    torch.testing.assert_close(q.covariance_matvec(v), p.covariance_matvec(v), **EXACT)
    torch.testing.assert_close(q.covariance_quadratic(v[0]), p.covariance_quadratic(v[0]), **EXACT)
    torch.testing.assert_close(q.cov_factor @ q.cov_factor.T, p.cov_factor @ p.cov_factor.T, **EXACT)
    torch.testing.assert_close(q.covariance_matrix, p.covariance_matrix, **EXACT)
    torch.testing.assert_close(q.precision_matrix, p.precision_matrix, **EXACT)
    # the same random numbers in the same order: the same draws
    torch.manual_seed(3)
    a = q.rsample((5,))
    torch.manual_seed(3)
    torch.testing.assert_close(a, p.rsample((5,)), **EXACT)
    torch.testing.assert_close(la.sample(4, generator=torch.Generator().manual_seed(2)),
                               dense.sample(4, generator=torch.Generator().manual_seed(2)), **EXACT)


def test_block_draws_have_the_dense_covariance():
    _, _, la, dense = _block_and_dense("classification", prior_precision=0.8)
    cov = dense.get_posterior().covariance_matrix
    torch.manual_seed(0)
    S = 100_000
    x = la.get_posterior().rsample((S,))
    emp = torch.cov(x.T)
    # each entry of the empirical covariance has standard error sqrt((s_ii s_jj + s_ij^2) / S)
    se = ((cov.diagonal()[:, None] * cov.diagonal()[None, :] + cov ** 2) / S).sqrt()
    assert float(((emp - cov).abs() / se).max()) < 5.0
    assert float(((x.mean(0) - la.loc).abs() / (cov.diagonal() / S).sqrt()).max()) < 5.0


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_the_evidence_and_its_gradient_equal_the_dense_layouts(likelihood, per_tensor):
    pp0 = torch.linspace(0.5, 2.0, 6, dtype=torch.float64) if per_tensor else 1.3
    _, _, la, dense = _block_and_dense(likelihood, prior_precision=pp0)
    for mode in ("map", "linearized"):
        grads = []
        for obj in (la, dense):
            pp = torch.as_tensor(pp0, dtype=torch.float64).reshape(-1).clone().requires_grad_(True)
            sg = torch.tensor(0.7 if likelihood == "regression" else 1.0, dtype=torch.float64,
                              requires_grad=likelihood == "regression")
            lml = obj.log_marginal_likelihood(prior_precision=pp, sigma_noise=sg, mode=mode)
            inputs = [pp, sg] if sg.requires_grad else [pp]
            grads.append((lml.detach(), *torch.autograd.grad(lml, inputs)))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, **EXACT)
    chosen = la.optimize_prior_precision("marglik", n_steps=30)
    torch.testing.assert_close(chosen, dense.optimize_prior_precision("marglik", n_steps=30), **EXACT)


def test_the_glm_predictive_equals_the_dense_layouts():
    _, X, la, dense = _block_and_dense("classification", prior_precision=0.5)
    torch.testing.assert_close(la.predict_proba(X[:9], pred_type="glm"), dense.predict_proba(X[:9], pred_type="glm"), **EXACT)
    torch.testing.assert_close(la._glm_moments(X[:9])[1], dense._glm_moments(X[:9])[1], **EXACT)
    _, X, la, dense = _block_and_dense("regression", prior_precision=0.5)
    for a, b in zip(la.predict(X[:9], pred_type="glm", return_var=True), dense.predict(X[:9], pred_type="glm", return_var=True)):
        torch.testing.assert_close(a, b, **EXACT)
    torch.manual_seed(4)
    a = la.predict(X[:9], pred_type="nn", return_var=True, num_samples=7)
    torch.manual_seed(4)
    for x, y in zip(a, dense.predict(X[:9], pred_type="nn", return_var=True, num_samples=7)):
        torch.testing.assert_close(x, y, **EXACT)


@pytest.mark.parametrize("diagonal", [False, True])
def test_linearized_moments_takes_a_factor_by_blocks(diagonal):
    from pyro_fa.predictive.glm import linearized_moments

    net = _mlp()
    X, _ = _mlp_data("classification")
    D = sum(p.numel() for p in net.parameters())
    g = torch.Generator().manual_seed(0)
    loc = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    psi = torch.rand(D, generator=g, dtype=torch.float64)
    # ranges inside one parameter tensor, across tensors and layers, overlapping, and a block of no columns
    blocks = [(2, 9, torch.randn(7, 2, generator=g, dtype=torch.float64)),
              (20, 70, torch.randn(50, 3, generator=g, dtype=torch.float64)),
              (60, D, torch.randn(D - 60, 1, generator=g, dtype=torch.float64)),
              (0, D, torch.zeros(D, 0, dtype=torch.float64))]
    F = torch.zeros(D, 6, dtype=torch.float64)
    col = 0
    for lo, hi, Fb in blocks:
        F[lo:hi, col:col + Fb.shape[1]] = Fb
        col += Fb.shape[1]
    for sign, scale in ((1.0, 1.0), (-1.0, 0.3)):
        kw = dict(cov_diag=psi, factor_sign=sign, scale=scale, chunk_size=16, diagonal=diagonal)
        m1, c1 = linearized_moments(net, loc, X[:20], cov_factor=blocks, **kw)
        m2, c2 = linearized_moments(net, loc, X[:20], cov_factor=F, **kw)
        torch.testing.assert_close(m1, m2, rtol=0, atol=0)
        torch.testing.assert_close(c1, c2, **EXACT)


def test_linearized_moments_refuses_bad_blocks():
    from pyro_fa.predictive.glm import linearized_moments

    net = _mlp()
    X, _ = _mlp_data("classification")
    D = 83
    loc, psi = torch.zeros(D, dtype=torch.float64), torch.ones(D, dtype=torch.float64)
    ok = torch.ones(3, 1, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"cov_factor must be a Tensor of shape \(83, K\) or a sequence of \(lo, hi, "
                                        r"F_b\) blocks, got list"):
        linearized_moments(net, loc, X, cov_diag=psi, cov_factor=[ok])
    with pytest.raises(ValueError, match=r"0 <= lo < hi <= 83 and F_b of shape \(hi - lo, K_b\), got \(80, 84, \(3, 1\)\)"):
        linearized_moments(net, loc, X, cov_diag=psi, cov_factor=[(80, 84, ok)])
    with pytest.raises(ValueError, match=r"got \(0, 2, \(3, 1\)\)"):
        linearized_moments(net, loc, X, cov_diag=psi, cov_factor=[(0, 2, ok)])
    with pytest.raises(ValueError, match=r"blocks must be on the module's dtype and device \(torch.float64, cpu\), "
                                         r"got \(torch.float32, cpu\) for \[0, 3\)"):
        linearized_moments(net, loc, X, cov_diag=psi, cov_factor=[(0, 3, ok.float())])


def test_block_posterior_refuses_a_layout_that_does_not_tile_the_weights():
    from pyro_fa.laplace import BlockLowRankPrecisionNormal

    loc, a = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    U = torch.ones(2, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"tiling \[0, 5\) in order, got \[\(0, 2, \(2, 1\)\), \(3, 5, \(2, 1\)\)\]"):
        BlockLowRankPrecisionNormal(loc, [(0, 2, U), (3, 5, U)], a)
    with pytest.raises(ValueError, match=r"must tile \[0, 5\) in order, got \[\(0, 2, \(2, 1\)\)\]"):
        BlockLowRankPrecisionNormal(loc, [(0, 2, U)], a)
    with pytest.raises(ValueError, match=r"must tile \[0, 5\) in order, got \[\]"):
        BlockLowRankPrecisionNormal(loc, [], a)
    with pytest.raises(ValueError, match=r"U_b of shape \(hi - lo, K_b\).*got \[\(0, 5, \(2, 1\)\)\]"):
        BlockLowRankPrecisionNormal(loc, [(0, 5, U)], a)
    with pytest.raises(ValueError, match=r"loc's dtype and device \(torch.float64, cpu\), got \(torch.float32, cpu\) "
                                         r"for block \[0, 2\)"):
        BlockLowRankPrecisionNormal(loc, [(0, 2, U.float()), (2, 5, torch.ones(3, 1, dtype=torch.float64))], a)
    with pytest.raises(ValueError, match=r"prec_diag must have shape \(5,\), got \(4,\)"):
        BlockLowRankPrecisionNormal(loc, [(0, 5, torch.ones(5, 1, dtype=torch.float64))], a[:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_posterior_follows_the_dtype_and_device(dtype, device):
    from pyro_fa.laplace import BlockLowRankPrecisionNormal, LowRankPrecisionNormal

    g = torch.Generator().manual_seed(0)
    loc = torch.randn(9, generator=g, dtype=dtype).to(device)
    a = (torch.rand(9, generator=g, dtype=dtype) + 0.5).to(device)
    U1, U2 = (torch.randn(n, k, generator=g, dtype=dtype).to(device) for n, k in ((4, 2), (5, 3)))
    q = BlockLowRankPrecisionNormal(loc, [(0, 4, U1), (4, 9, U2)], a)
    p = LowRankPrecisionNormal(loc, torch.block_diag(U1, U2), a)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for got, want in ((q.variance, p.variance), (q.log_det_precision(), p.log_det_precision()),
                      (q.log_prob(loc + 1), p.log_prob(loc + 1)), (q.covariance_quadratic(loc), p.covariance_quadratic(loc))):
        assert got.dtype == dtype and got.device == loc.device
        torch.testing.assert_close(got, want, **tol)
    assert all(t.dtype == dtype and t.device == loc.device for _, _, t in q.cov_factors)
    assert q.rsample((2,)).dtype == dtype and q.rsample((2,)).device == loc.device
    assert all(L.dtype == torch.float64 for L in q._capacitance_trils) or device.type == "mps"


def test_the_fit_holds_only_the_blocks_numbers_and_never_forms_the_dense_factor(monkeypatch):
    from pyro_fa.distributions import precision
    from pyro_fa.laplace import _blocks

    def refuse(*args, **kwargs):
        raise AssertionError("the dense D x sum(K_b) factor was formed")

    monkeypatch.setattr(_blocks.BlockRanks, "dense", refuse)
    monkeypatch.setattr(precision, "_dense", refuse)
    net = _mlp()
    X, data = _mlp_data("classification")
    sizes = [30, 35, 18]
    for rank, extra, want in (([3, 2, 4], {}, [3, 2, 4]), ("auto", {"rank_budget": 7, "rank_max": 6}, None)):
        la = FactorLaplace(net, "classification", rank=rank, curvature_fit="scatter", **extra).fit(data)
        ranks = la.block_ranks.tolist()
        assert want is None or ranks == want
        factor_numbers = sum(d * k for d, k in zip(sizes, ranks))
        D, width = 83, sum(ranks)
        # the state: loc, cov_diag, loss_grad (D each), the blocks' sum D_b K_b numbers in storage of their own
        # (not views of the generous fits of "auto"), ten scalars and block_ranks; nothing of D x width (and the
        # parameters' names and shapes, parameter_layout: L x 4 int64 here)
        buffers = dict(la.named_buffers())
        assert buffers.pop("parameter_layout").shape == (6, 4)
        factors = [buffers.pop(f"block_factor_{b}") for b in range(3)]
        assert sum(F.untyped_storage().nbytes() for F in factors) == 8 * factor_numbers
        assert sum(b.untyped_storage().nbytes() for b in buffers.values()) == 8 * (3 * D + 7 + 3)
        assert factor_numbers < D * width / 2
        assert "cov_factor" not in la.state_dict()
        assert [tuple(la.state_dict()[f"block_factor_{b}"].shape) for b in range(3)] == list(zip(sizes, ranks))
        # every verb runs without the dense factor
        la.get_posterior().variance
        la.log_marginal_likelihood(mode="linearized")
        la.optimize_prior_precision("marglik", n_steps=3)
        la.predict_proba(X[:5], pred_type="glm")
        la.predict_proba(X[:5], pred_type="nn", num_samples=3)
        la.sample(3)


def test_cov_factor_of_a_block_fit_is_the_dense_matrix_formed_on_request():
    net = _mlp()
    _, data = _mlp_data("classification")
    la = FactorLaplace(net, "classification", rank=[3, 2, 4], curvature_fit="scatter").fit(data)
    F = la.cov_factor
    assert F.shape == (83, 9)
    torch.testing.assert_close(F, torch.block_diag(*[Fb for _, _, Fb in la.block_factors]), rtol=0, atol=0)
    assert [(a, e) for a, e, _ in la.block_factors] == [(0, 30), (30, 65), (65, 83)]
    F.zero_()  # a copy: the fit is untouched
    assert float(la.cov_factor.abs().sum()) > 0
    with pytest.raises(ValueError, match=r"block_factors needs a rank per block \(a list, dict or 'auto'\), got "
                                         r"rank=3; use cov_factor"):
        FactorLaplace(net, "classification", rank=3).block_factors


def test_an_auto_fit_reloads_into_a_fresh_object_and_misfits_are_refused_whole():
    net = _mlp()
    X, data = _mlp_data("classification")
    kw = dict(rank="auto", rank_budget=7, rank_max=6, curvature_fit="scatter")
    la = FactorLaplace(net, "classification", **kw).fit(data)
    state = la.state_dict()
    fresh = FactorLaplace(net, "classification", **kw)
    assert [Fb.shape[1] for _, _, Fb in fresh.block_factors] == [0, 0, 0]
    # a misshapen factor: refused, nothing loaded, the buffers' shapes as they were
    bad = dict(state, block_factor_1=state["block_factor_1"][:, :0].clone() if state["block_factor_1"].shape[1]
               else torch.zeros(35, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"state_dict\['block_factor_1'\] must have shape \(35, \d\) like this "
                                         r"model's, got \(35, \d\).*nothing was loaded"):
        fresh.load_state_dict(bad)
    assert [Fb.shape[1] for _, _, Fb in fresh.block_factors] == [0, 0, 0] and int(fresh.n_data) == 0
    with pytest.raises(ValueError, match=r"must be finite"):
        fresh.load_state_dict(dict(state, loc=state["loc"] * float("nan")))
    assert [Fb.shape[1] for _, _, Fb in fresh.block_factors] == [0, 0, 0]
    fresh.load_state_dict(state)
    for (_, _, a), (_, _, b) in zip(fresh.block_factors, la.block_factors):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    torch.testing.assert_close(fresh.predict_proba(X[:5], pred_type="glm"), la.predict_proba(X[:5], pred_type="glm"), rtol=0, atol=0)
    # a state of the dense layout is refused by a block fit, naming both
    dense = FactorLaplace(net, "classification", rank=7).fit(data)
    with pytest.raises(ValueError, match=r"must come from a fit with a rank per block, like this one \(blocks "
                                         r"\['0', '2', '4'\]\), got a fit with one rank \(cov_factor of shape "
                                         r"\(83, 7\)\); nothing was loaded"):
        fresh.load_state_dict(dense.state_dict())
    torch.testing.assert_close(fresh.predict_proba(X[:5], pred_type="glm"), la.predict_proba(X[:5], pred_type="glm"), rtol=0, atol=0)
