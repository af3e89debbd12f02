"""BatchedFactorIVON: replica by replica, FactorIVON's run (means, curvature, low-rank part, draws) given the same
standard normals, at rank 0 (IVON) and rank > 0 with the low-rank part refreshed every other step; a diverged
replica is frozen without touching the others; bad input refused."""
import math

import pytest
import torch

from pyro_fa.nn.batched import BatchedMLP
from pyro_fa.optim import BatchedFactorIVON, FactorIVON

SPEC = BatchedMLP(3, (6,), activation="tanh")
LRS, HESS, ESS = [0.05, 0.2, 0.6], [0.3, 1.0, 2.0], [20.0, 30.0, 40.0]


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g, dtype=torch.float64)
    return x, torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(20, generator=g, dtype=torch.float64)


def _loss(theta, x, y):
    """The mean squared error of each replica, summed: the gradient of row r is replica r's."""
    return (SPEC(theta, x) - y).square().mean(-1).sum()


def _eps(t, r, j=0):
    """The standard normals of replica r's j-th draw at step t, as FactorIVON draws them (global generator)."""
    torch.manual_seed(1000 * t + 10 * r + j)
    return torch.randn(SPEC.dim, dtype=torch.float64)


def _dense(q):
    """The precision of a LowRankPrecisionNormal, dense (D is small)."""
    return torch.diag(q.prec_diag) + q.prec_factor @ q.prec_factor.T


def _runs(rank, steps=12, draws=1, **kw):
    x, y = _data()
    loc = SPEC.init(3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = [torch.nn.Parameter(loc[r].clone()) for r in range(3)]
    per = {k: kw.pop(k) for k in [k for k, v in kw.items() if isinstance(v, list)]}  # one value per replica
    batched = BatchedFactorIVON(loc, lr=LRS, ess=ESS, hess_init=torch.tensor(HESS, dtype=torch.float64), rank=rank,
                                **per, **kw)
    single = [FactorIVON([p], lr=LRS[r], ess=ESS[r], hess_init=HESS[r], rank=rank,
                         **{k: v[r] for k, v in per.items()}, **kw) for r, p in enumerate(params)]
    history = []
    for t in range(steps):
        thetas, grads = [], []
        for j in range(draws):
            theta = batched.draw(torch.stack([_eps(t, r, j) for r in range(3)])).requires_grad_()
            grads.append(torch.autograd.grad(_loss(theta, x, y), theta)[0])
            thetas.append(theta.detach())
        batched.step(grads[0] if draws == 1 else torch.stack(grads))
        drawn = []
        for r, (p, opt) in enumerate(zip(params, single)):
            for j in range(draws):
                torch.manual_seed(1000 * t + 10 * r + j)  # _eps's numbers, drawn by FactorIVON itself
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    _loss(p, x, y).backward()
                    drawn.append(p.detach().clone())
            opt.step()
        history.append((torch.stack(thetas, 0), torch.stack(drawn).reshape(3, draws, -1).transpose(0, 1)))
    return batched, single, params, history


@pytest.mark.parametrize("rank,draws,wd,fisher,b2", [
    (0, 1, 1e-2, False, 0.99), (2, 1, 1e-2, False, 0.99), (3, 1, 1e-2, False, 0.99), (2, 2, 1e-2, False, 0.99),
    (0, 1, [1e-3, 1e-2, 0.1], False, 0.99), (3, 1, [1e-3, 1e-2, 0.1], False, 0.99), (2, 2, 1e-2, True, 0.99),
    (0, 1, 1e-2, False, [0.99, 0.9, 0.999]), (3, 1, 1e-2, False, [0.99, 0.9, 0.999])])
def test_each_replica_is_factor_ivons_run(rank, draws, wd, fisher, b2):
    """Also with a weight decay (prior precision) and a Hessian decay of its own per replica, and with the
    Fisher-fed low-rank part."""
    kw = dict(beta1=0.8, beta2=b2, weight_decay=wd, clip_radius=2.0, update_every=2)
    if fisher:
        kw.update(curvature="fisher", batch_size=20)
    batched, single, params, history = _runs(rank, draws=draws, **kw)
    for ours, theirs in history:
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)  # the draws, step by step
    for r, (p, opt) in enumerate(zip(params, single)):
        torch.testing.assert_close(batched.loc[r], p.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(batched.hess[r], opt.state["hess"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(batched.momentum[r], opt.state["momentum"], rtol=1e-12, atol=1e-12)
        q, q_ref = batched.get_posterior(r), opt.get_posterior()
        torch.testing.assert_close(q.prec_diag, q_ref.prec_diag, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(_dense(q), _dense(q_ref), rtol=1e-12, atol=1e-10)  # the low-rank part, any sign
        assert q.prec_factor.shape == (SPEC.dim, rank)
    if rank == 0:  # IVON's arithmetic, operation for operation: bit for bit (FactorIVON's rank 0 is ivon-opt's)
        assert all(torch.equal(ours, theirs) for ours, theirs in history)
        assert all(torch.equal(batched.loc[r], p.detach()) for r, p in enumerate(params))
        assert all(torch.equal(batched.hess[r], opt.state["hess"]) for r, opt in enumerate(single))
    else:
        low = torch.stack([batched.get_posterior(r).prec_factor.norm() for r in range(3)])
        assert bool((low > 0).all())  # the low-rank part was refreshed and is not empty
    assert not bool(batched.diverged.any())
    assert not torch.allclose(batched.loc[0], batched.loc[1])


def test_a_diverged_replica_is_frozen_and_the_others_go_on_unchanged():
    x, y = _data()
    loc = SPEC.init(3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    runs = [BatchedFactorIVON(loc, lr=LRS, ess=ESS, hess_init=HESS, rank=2, update_every=2) for _ in range(2)]
    frozen = None
    for t in range(6):
        eps = torch.stack([_eps(t, r) for r in range(3)])
        for k, opt in enumerate(runs):
            theta = opt.draw(eps).requires_grad_()
            grad = torch.autograd.grad(_loss(theta, x, y), theta)[0]
            if k == 1 and t == 3:
                grad[1, 0] = math.nan  # replica 1 of the second run diverges here
                frozen = (opt.loc[1].clone(), opt.hess[1].clone(), opt.basis[1].clone())
            opt.step(grad)
    plain, hit = runs
    assert hit.diverged.tolist() == [False, True, False] and not bool(plain.diverged.any())
    for r in (0, 2):
        assert torch.equal(hit.loc[r], plain.loc[r]) and torch.equal(hit.basis[r], plain.basis[r])
    assert torch.equal(hit.loc[1], frozen[0]) and torch.equal(hit.hess[1], frozen[1])
    assert torch.equal(hit.basis[1], frozen[2])
    assert bool(torch.isfinite(hit.sample(4)).all())


def test_predictive_draws_have_the_posteriors_covariance():
    batched, *_ = _runs(2, steps=6, update_every=2, beta2=0.99)
    draws = batched.sample(20000, generator=torch.Generator().manual_seed(3))
    for r in range(3):
        z = draws[:, r] - batched.loc[r]
        cov = torch.linalg.inv(_dense(batched.get_posterior(r)))
        emp = z.T @ z / z.shape[0]
        se = (cov.diagonal().outer(cov.diagonal()) + cov.square()).div(z.shape[0]).sqrt()
        assert bool(((emp - cov).abs() < 5 * se + 1e-12).all())


def test_float32_keeps_float32_and_follows_the_float64_run():
    x, y = _data()
    loc = SPEC.init(3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    runs = [BatchedFactorIVON(loc.to(dtype), lr=LRS, ess=ESS, hess_init=HESS, rank=2, update_every=2, beta2=0.99)
            for dtype in (torch.float32, torch.float64)]
    for t in range(8):
        eps = torch.stack([_eps(t, r) for r in range(3)])
        for opt in runs:
            theta = opt.draw(eps.to(opt.loc.dtype)).requires_grad_()
            opt.step(torch.autograd.grad(_loss(theta, x.to(theta.dtype), y.to(theta.dtype)), theta)[0])
    single, double = runs
    assert single.loc.dtype == single.hess.dtype == single.basis.dtype == single.sample(2).dtype == torch.float32
    torch.testing.assert_close(single.loc.double(), double.loc, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(single.hess.double(), double.hess, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(loc=torch.zeros(5)), r"BatchedFactorIVON: loc must be a floating-point Tensor of shape \(R, D\)"),
    (dict(lr=[0.1, 0.2]), r"BatchedFactorIVON: lr must be a number or 3 numbers \(one per replica\)"),
    (dict(ess=torch.ones(3, 1)), r"BatchedFactorIVON: ess must be a number or 3 numbers"),
    (dict(lr=[0.1, -1.0, 0.2]), r"BatchedFactorIVON: lr must be a finite number >= 0, got -1.0"),
    (dict(hess_init=0.0), r"BatchedFactorIVON: hess_init must be a positive finite number"),
    (dict(beta2=1.5), r"BatchedFactorIVON: beta2 must be a number in \[0, 1\]"),
    (dict(beta2=[0.9, 0.99]), r"BatchedFactorIVON: beta2 must be a number or 3 numbers \(one per replica\)"),
    (dict(rank=-1), r"BatchedFactorIVON: rank must be an integer >= 0"),
    (dict(update_every=0), r"BatchedFactorIVON: update_every must be an integer >= 1"),
    (dict(rank=9, loc=torch.zeros(3, 10, dtype=torch.float64)), r"rank \+ 2 \* \(draws per step\) must be at most"),
    (dict(curvature="fisher"), r"BatchedFactorIVON: curvature='fisher' needs batch_size, the number of examples"),
    (dict(curvature="ggn"), r"BatchedFactorIVON: curvature must be one of \('stein', 'fisher'\), got 'ggn'"),
])
def test_bad_arguments_are_refused(kwargs, match):
    args = {**dict(loc=torch.zeros(3, 10, dtype=torch.float64), lr=0.1, ess=10.0, rank=2), **kwargs}
    with pytest.raises(ValueError, match=match):
        BatchedFactorIVON(**args)


def test_bad_calls_are_refused():
    opt = BatchedFactorIVON(torch.zeros(3, 10, dtype=torch.float64), lr=0.1, ess=10.0, rank=3)
    with pytest.raises(TypeError, match=r"BatchedFactorIVON: lr must be a real number, got 'a'"):
        BatchedFactorIVON(torch.zeros(3, 10), lr=["a", 1, 2], ess=1.0, rank=2)
    with pytest.raises(RuntimeError, match=r"BatchedFactorIVON: step\(\) needs the gradient at a draw"):
        opt.step(torch.zeros(3, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"BatchedFactorIVON: eps must be a Tensor of shape \(3, 10\)"):
        opt.draw(torch.zeros(10))
    opt.draw()
    with pytest.raises(ValueError, match=r"BatchedFactorIVON: grad must be a Tensor of shape \(3, 10\)"):
        opt.step(torch.zeros(2, 3, 10))
    opt.draw()
    opt.draw()
    with pytest.raises(ValueError, match=r"rank \+ 2 \* \(draws per step\) must be at most the number of weights"):
        opt.draw()
    with pytest.raises(ValueError, match=r"BatchedFactorIVON: replica must be an integer in \[0, 3\), got 3"):
        opt.get_posterior(3)
    with pytest.raises(ValueError, match=r"BatchedFactorIVON: num_samples must be an integer >= 1, got 0"):
        opt.sample(0)


def test_the_doctests():
    import doctest

    import pyro_fa.optim.batched as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_kept_replicas_go_on_as_they_would_have_in_the_whole_batch():
    """keep([2, 0]) between steps (mid-way between refreshes, P lagging h): replicas 2 and 0 then follow the run
    of all three, given the same standard normals."""
    x, y = _data()
    loc = SPEC.init(3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    full, part = (BatchedFactorIVON(loc, lr=LRS, ess=ESS, hess_init=HESS, beta2=[0.99, 0.9, 0.999], rank=2,
                                    update_every=3) for _ in range(2))
    for t in range(10):
        if t == 4:
            part.keep([2, 0])
        eps = torch.stack([_eps(t, r) for r in range(3)])
        for opt, rows in ((full, [0, 1, 2]), (part, [0, 1, 2] if t < 4 else [2, 0])):
            theta = opt.draw(eps[rows]).requires_grad_()
            opt.step(torch.autograd.grad(_loss(theta, x, y), theta)[0])
    for name in ("loc", "hess", "momentum", "basis", "eigvals", "beta2", "lr"):
        torch.testing.assert_close(getattr(part, name), getattr(full, name)[[2, 0]], rtol=1e-12, atol=1e-12)
    assert part.replicas == 2 and part.sample(4).shape == (4, 2, SPEC.dim)


def test_keep_refuses_bad_input():
    opt = BatchedFactorIVON(torch.zeros(3, 10, dtype=torch.float64), lr=0.1, ess=10.0, rank=2)
    for bad in ([], [0, 0], [3], [0.5], torch.tensor([True, False, True]), [[0, 1]]):
        with pytest.raises(ValueError, match=r"BatchedFactorIVON: index must hold distinct replica numbers in "
                                             r"\[0, 3\), at least one"):
            opt.keep(bad)
    opt.draw()
    with pytest.raises(RuntimeError, match=r"BatchedFactorIVON: keep\(\) is called between steps"):
        opt.keep([0])
    assert opt.replicas == 3
