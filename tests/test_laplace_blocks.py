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
    got = la.posterior.precision_matrix
    assert float((got - P).norm() / P.norm()) < 1e-6
    # and the covariance is its inverse, not the full GGN's: the blocks are uncorrelated
    cov = la.posterior.covariance_matrix
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
        assert "block_ranks" not in la.state_dict() and la._blocks is None
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
    # "auto" per block: 2 400 weights > 2048 fitted by "randomized", 1 803 by "scatter"
    big = nn.Sequential(nn.Linear(3, 600), nn.Tanh(), nn.Linear(600, 3)).double()
    Counting.runs = 0
    la = FactorLaplace(big, "classification", rank=[2, 2]).fit(Counting([(X[:20], y[:20])]))
    assert [b["method"] for b in la.fit_info["blocks"]] == ["randomized", "scatter"] and Counting.runs == 2


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
        torch.testing.assert_close(fresh.predict_proba(X[:5]), la.predict_proba(X[:5]), rtol=0, atol=0)
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
    assert la._blocks.names == ["2"] and la.cov_factor.shape == (15, 2)


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
    assert la._blocks.fit_ranks == [3, 3] and la.cov_factor.shape == (31, 6)
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
    torch.testing.assert_close(gpu.posterior.precision_matrix.cpu(), cpu.posterior.precision_matrix,
                               rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(gpu.predict_proba(X.cuda()).cpu(), cpu.predict_proba(X), rtol=1e-6, atol=1e-9)
    # the allocation's block index lives on the fit's device
    auto = FactorLaplace(copy.deepcopy(net).cuda(), "classification", rank="auto", rank_budget=6, **kw)
    assert auto.fit([(a.cuda(), b.cuda()) for a, b in data]).block_ranks.sum().item() == 6
