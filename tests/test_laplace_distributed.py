"""FactorLaplace(process_group=...) in 2 gloo processes on the CPU, each holding half the data and its rows of
the approximation, against one process holding all of it (the pattern of tests/test_distributed.py)."""
import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pyro_fa.distributed import shard_bounds
from pyro_fa.distributions import FactorNormal
from pyro_fa.laplace import FactorLaplace

from _ranks import run_ranks

WORLD_SIZE = 2
TIMEOUT = 120


def _net():
    torch.manual_seed(0)
    f32 = dict(dtype=torch.float32)  # the same draws whatever the default dtype
    return nn.Sequential(nn.Linear(3, 6, **f32), nn.Tanh(), nn.Linear(6, 3, **f32)).double()


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(80, 3, generator=g, dtype=torch.float64), torch.randint(3, (80,), generator=g)


def _batches(x, y, size=20):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def _test_inputs():
    return torch.randn(7, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _probe(D):
    """A whole weight vector at which log_prob is compared."""
    return torch.linspace(-1, 1, D, dtype=torch.float64)


def _low_rank_data():
    """Softmax regression on inputs in a 2-dimensional subspace of R^6: a GGN of rank <= 9 of D = 21."""
    g = torch.Generator().manual_seed(4)
    X = torch.randn(80, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 6, generator=g, dtype=torch.float64)
    return X, torch.randint(3, (80,), generator=g)


def _linear():
    torch.manual_seed(1)
    return nn.Linear(6, 3, dtype=torch.float32).double()


def _regression_batches(rank=None):
    """Targets of the network's 3 outputs; rank r's half, or (rank None) both halves joined in gather order."""
    X, _ = _data()
    Y = torch.sin(X @ torch.ones(3, 3, dtype=torch.float64))
    halves = [_batches(X[:40], Y[:40]), _batches(X[40:], Y[40:])]
    if rank is not None:
        return halves[rank]
    return [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*halves)]


def _entry(rank, world_size, init_file, out_dir):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    try:
        X, y = _data()
        mine = _batches(X[rank * 40:(rank + 1) * 40], y[rank * 40:(rank + 1) * 40])
        out = {}
        for fit in ("scatter", "online", "exact"):
            la = FactorLaplace(_net(), "classification", rank=3, curvature_fit=fit, chunk_size=1000,
                               process_group=dist.group.WORLD).fit(mine)
            lo, hi = la._rows
            res = {k: v.clone() for k, v in la.state_dict().items()}
            res["lml"] = la.log_marginal_likelihood().detach()
            res["lml_layers"] = la.log_marginal_likelihood(torch.tensor([0.5, 1.0, 2.0, 3.0])).detach()
            pp = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
            res["grad_layers"] = torch.autograd.grad(la.log_marginal_likelihood(pp), pp)[0]
            lin = la.log_marginal_likelihood(pp, mode="linearized")
            res["lin_layers"], res["lin_grad"] = lin.detach(), torch.autograd.grad(lin, pp)[0]
            res["variance"] = la.posterior_variance.clone()
            res["log_prob"] = la.get_posterior().log_prob(_probe(la.dim)[lo:hi]).detach()
            res["entropy"] = la.get_posterior().entropy().detach()
            res["matvec"] = la.get_posterior().covariance_matvec(_probe(la.dim)[lo:hi]).detach()
            res["family"] = isinstance(la.get_posterior(), FactorNormal)
            res["glm"] = la.predict_proba(_test_inputs(), pred_type="glm")
            res["glm_mc"] = la.predict_proba(_test_inputs(), pred_type="glm", link_approx="mc", num_samples=50)
            res["nn"] = la.predict_proba(_test_inputs(), pred_type="nn", num_samples=5)
            res["draws"] = la.sample(4000, generator=torch.Generator().manual_seed(0))
            # a saved shard loads back on its rank; another rank's place is refused
            state = la.state_dict()
            fresh = FactorLaplace(_net(), "classification", rank=3, process_group=dist.group.WORLD)
            fresh.load_state_dict(state)
            res["reloaded_lml"] = fresh.log_marginal_likelihood().detach()
            wrong = {k: v.clone() for k, v in state.items()}
            wrong["shard"][2] = 1 - rank
            try:
                fresh.load_state_dict(wrong)
            except ValueError as exc:
                res["wrong_shard"] = str(exc)
            # the predictive scale is saved with each rank's shard: reloaded, the same sampled predictive
            la.scale = 0.3
            fresh.load_state_dict(la.state_dict())
            res["reloaded_scale"] = fresh.scale
            res["scaled_nn"], res["reloaded_scaled_nn"] = (
                m.predict_proba(_test_inputs(), num_samples=5, generator=torch.Generator().manual_seed(7))
                for m in (la, fresh))
            la.scale = 1.0
            res["marglik_pp"] = la.optimize_prior_precision("marglik", n_steps=30)
            out[fit] = res
        # regression: the noise enters every rank's partial sums too; its gradient is summed over the ranks
        reg = FactorLaplace(_net(), "regression", rank=3, curvature_fit="online", chunk_size=1000,
                            process_group=dist.group.WORLD).fit(_regression_batches(rank))
        pp = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
        sigma = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        lml = reg.log_marginal_likelihood(pp, sigma)
        lin = reg.log_marginal_likelihood(pp, sigma, mode="linearized")
        out["regression"] = {"lml": lml.detach(), "grads": torch.autograd.grad(lml, (pp, sigma)),
                             "lin": lin.detach(), "lin_grads": torch.autograd.grad(lin, (pp, sigma)),
                             "predict": reg.predict(_test_inputs(), pred_type="glm", return_var=True),
                             "predict_nn": reg.predict(_test_inputs(), pred_type="nn", return_var=True, num_samples=5)}
        # the randomized fit, sharded, on a curvature of rank 9 < its 12 columns: captured exactly
        Xl, yl = _low_rank_data()
        la = FactorLaplace(_linear(), "classification", rank=4, curvature_fit="randomized", chunk_size=1000,
                           process_group=dist.group.WORLD).fit(_batches(Xl[rank * 40:(rank + 1) * 40],
                                                                        yl[rank * 40:(rank + 1) * 40]))
        out["randomized"] = {**{k: v.clone() for k, v in la.state_dict().items()},
                             "lml": la.log_marginal_likelihood().detach()}
        # a network with dropout in train mode is refused by the sharded GLM predictive before any collective
        torch.manual_seed(0)
        drop = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 3)).double().eval()
        la = FactorLaplace(drop, "classification", rank=2, curvature_fit="scatter",
                           process_group=dist.group.WORLD).fit(mine)
        drop.train()
        try:
            la.predict_proba(_test_inputs(), pred_type="glm")
        except ValueError as exc:
            out["train_mode"] = str(exc)
        bad = FactorLaplace(_net(), "classification", rank=3, process_group=dist.group.WORLD)
        try:  # rank 1's labels are out of range: both ranks raise, neither hangs
            bad.fit([(X[:10], y[:10] + (5 if rank == 1 else 0))])
        except ValueError as exc:
            out["refused"] = str(exc)
        # finite float32 vectors whose sketch overflows on rank 1's rows only (its columns are the huge ones):
        # both ranks raise, neither waits in the next collective
        from pyro_fa.laplace import fit_second_moment

        g = torch.Generator().manual_seed(10 + rank)
        huge = [torch.randn(20, 10, generator=g, dtype=torch.float32) * torch.tensor([1.0] * 5 + [1e20] * 5)
                for _ in range(2)]
        try:
            fit_second_moment(lambda: iter(huge), 10, 2, method="randomized", dtype=torch.float32,
                              process_group=dist.group.WORLD)
        except ValueError as exc:
            out["overflow"] = str(exc)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("laplace_dist")
    return run_ranks(_entry, (WORLD_SIZE, str(tmp / "store"), str(tmp)), WORLD_SIZE, tmp, TIMEOUT)


def _single(fit):
    X, y = _data()
    # one process fed the blocks in the order the ranks gather them: rank 0's batch i, then rank 1's
    r0, r1 = _batches(X[:40], y[:40]), _batches(X[40:], y[40:])
    joined = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(r0, r1)]
    return FactorLaplace(_net(), "classification", rank=3, curvature_fit=fit, chunk_size=1000).fit(joined)


@pytest.mark.slow
@pytest.mark.parametrize("fit", ["scatter", "online", "exact"])
def test_two_ranks_equal_one_process_on_all_the_data(results, fit):
    single = _single(fit)
    D, K = single.dim, single.cov_factor.shape[1]
    states = [r[fit] for r in results]
    for r, state in enumerate(states):
        lo, hi = shard_bounds(D, WORLD_SIZE, r)
        assert [int(v) for v in state["shard"]] == [D, WORLD_SIZE, r, lo, hi]
        assert int(state["n_data"]) == 80
        torch.testing.assert_close(state["loc"], single.loc[lo:hi])
        torch.testing.assert_close(state["loss"], single.loss)
        torch.testing.assert_close(state["lml"], single.log_marginal_likelihood().detach(), rtol=1e-5, atol=0)
    # each rank holds its rows only: about 1 / world_size of the D x K factor
    assert [s["cov_factor"].shape for s in states] == [(hi - lo, K) for lo, hi in
                                                       (shard_bounds(D, WORLD_SIZE, r) for r in range(WORLD_SIZE))]
    assert max(s["cov_factor"].numel() for s in states) <= -(-D // WORLD_SIZE) * K
    # the fitted curvature from the gathered shards (F is identified up to rotation; summation order moves the
    # EM's last digits)
    F = torch.cat([s["cov_factor"] for s in states])
    psi = torch.cat([s["cov_diag"] for s in states])
    ours = F @ F.T + torch.diag(psi)
    ref = single.cov_factor @ single.cov_factor.T + torch.diag(single.cov_diag)
    assert float((ours - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("fit", ["scatter", "online", "exact"])
def test_sharded_posterior_equals_one_process(results, fit):
    single = _single(fit)
    D = single.dim
    post = single.get_posterior()
    tol = dict(rtol=1e-5, atol=1e-9)
    for r, res in enumerate(r[fit] for r in results):
        lo, hi = shard_bounds(D, WORLD_SIZE, r)
        torch.testing.assert_close(res["variance"], post.variance[lo:hi], **tol)
        torch.testing.assert_close(res["log_prob"], post.log_prob(_probe(D)).detach(), **tol)
        torch.testing.assert_close(res["entropy"], post.entropy().detach(), **tol)
        # the sharded precision form is a member of the family; Sigma v against the dense covariance
        assert res["family"]
        dense = torch.linalg.inv(post.precision_matrix)
        torch.testing.assert_close(res["matvec"], (dense @ _probe(D).detach())[lo:hi], **tol)
        torch.testing.assert_close(res["lml_layers"], single.log_marginal_likelihood(
            torch.tensor([0.5, 1.0, 2.0, 3.0])).detach(), **tol)
        pp = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
        torch.testing.assert_close(res["grad_layers"], torch.autograd.grad(single.log_marginal_likelihood(pp), pp)[0],
                                   **tol)
        # the linearised evidence: the loss gradients summed over the ranks, b^T P^-1 b over all rows
        lin = single.log_marginal_likelihood(pp, mode="linearized")
        torch.testing.assert_close(res["lin_layers"], lin.detach(), **tol)
        torch.testing.assert_close(res["lin_grad"], torch.autograd.grad(lin, pp)[0], **tol)
        torch.testing.assert_close(res["loss_grad"], single.loss_grad[lo:hi], **tol)
        torch.testing.assert_close(res["glm"], single.predict_proba(_test_inputs(), pred_type="glm"), **tol)
        torch.testing.assert_close(res["reloaded_lml"], res["lml"])
        assert "must come from rank" in res["wrong_shard"]
        assert res["reloaded_scale"] == 0.3
        assert torch.equal(res["scaled_nn"], res["reloaded_scaled_nn"])
        # the draws: this rank's rows, with the posterior's mean and variances (4000 draws: 5 standard errors)
        draws = res["draws"]
        assert draws.shape == (4000, hi - lo)
        se = (post.variance[lo:hi] / 4000).sqrt()
        assert bool(((draws.mean(0) - single.loc[lo:hi]).abs() < 5 * se + 1e-12).all())
        rel = draws.var(0) / post.variance[lo:hi]
        assert bool(((rel - 1).abs() < 5 * (2 / 4000) ** 0.5).all())
    # the prior precision chosen by the sharded marginal likelihood is the one process's
    single.optimize_prior_precision("marglik", n_steps=30)
    for res in (r[fit] for r in results):
        torch.testing.assert_close(res["marglik_pp"], single.prior_precision, rtol=1e-5, atol=0)
    # sampled predictives: the same on every rank (one draw of the whole vector), and probabilities
    for key in ("glm_mc", "nn"):
        torch.testing.assert_close(results[0][fit][key], results[1][fit][key])
        torch.testing.assert_close(results[0][fit][key].sum(-1), torch.ones(7, dtype=torch.float64))


@pytest.mark.slow
def test_sharded_regression_evidence_gradients_and_predictive_equal_one_process(results):
    single = FactorLaplace(_net(), "regression", rank=3, curvature_fit="online", chunk_size=1000).fit(
        _regression_batches())
    pp = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    sigma = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    lml = single.log_marginal_likelihood(pp, sigma)
    grads = torch.autograd.grad(lml, (pp, sigma))
    lin = single.log_marginal_likelihood(pp, sigma, mode="linearized")
    lin_grads = torch.autograd.grad(lin, (pp, sigma))
    mean, var = single.predict(_test_inputs(), pred_type="glm", return_var=True)
    for res in (r["regression"] for r in results):
        torch.testing.assert_close(res["lml"], lml.detach(), rtol=1e-5, atol=0)
        torch.testing.assert_close(res["lin"], lin.detach(), rtol=1e-5, atol=0)
        for ours, ref in zip(res["lin_grads"], lin_grads):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-9)
        for ours, ref in zip(res["grads"], grads):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(res["predict"][0], mean)
        torch.testing.assert_close(res["predict"][1], var, rtol=1e-5, atol=1e-9)
    for a, b in zip(results[0]["regression"]["predict_nn"], results[1]["regression"]["predict_nn"]):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_sharded_randomized_fit_equals_one_process_where_the_range_is_exact(results):
    X, y = _low_rank_data()
    r0, r1 = _batches(X[:40], y[:40]), _batches(X[40:], y[40:])
    joined = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(r0, r1)]
    single = FactorLaplace(_linear(), "classification", rank=4, curvature_fit="randomized",
                           chunk_size=1000).fit(joined)
    states = [r["randomized"] for r in results]
    D = single.dim
    assert [s["cov_factor"].shape for s in states] == [(hi - lo, 4) for lo, hi in
                                                       (shard_bounds(D, WORLD_SIZE, r) for r in range(WORLD_SIZE))]
    F = torch.cat([s["cov_factor"] for s in states])
    psi = torch.cat([s["cov_diag"] for s in states])
    ours = F @ F.T + torch.diag(psi)
    ref = single.cov_factor @ single.cov_factor.T + torch.diag(single.cov_diag)
    assert float((ours - ref).norm() / ref.norm()) < 1e-6
    for s in states:
        torch.testing.assert_close(s["lml"], single.log_marginal_likelihood().detach(), rtol=1e-6, atol=0)


@pytest.mark.slow
def test_an_overflowing_sketch_raises_on_every_rank(results):
    for r in range(WORLD_SIZE):
        assert "the curvature's sketch overflowed torch.float32" in results[r]["overflow"]


def test_refused_input_raises_on_every_rank(results):
    assert all("train mode" in r["train_mode"] for r in results), [r.get("train_mode") for r in results]
    assert "classification targets must be labels in [0, 3)" in results[1]["refused"]
    assert "another rank" in results[0]["refused"]
