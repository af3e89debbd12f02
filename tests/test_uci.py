"""The UCI benchmark: the vectorised trainer against Pyro's own classes, the protocol, the command."""
import json
import math
import os

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoLowRankMultivariateNormal, AutoNormal

from pyro_fa import AutoLowRankFactorGuide, FactorELBO, cli, metrics
from pyro_fa.datasets import load_uci
from pyro_fa.experiments import uci
from pyro_fa.experiments._bnn import MLPSpec, ReplicaVI


def _toy(N=40, p=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, p, generator=g)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(N, generator=g)
    return x, y


# ------------------------------------------------------------------ the network


def test_mlp_forward_matches_nn_sequential():
    spec = MLPSpec(3, (5, 4))
    theta = spec.init(2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 7, 3)
    out = spec.forward(theta.unsqueeze(0).expand(3, -1, -1), x)
    assert out.shape == (3, 2, 7) and spec.dim == 3 * 5 + 5 + 5 * 4 + 4 + 4 + 1
    for r in range(2):
        net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4), torch.nn.ReLU(),
                                  torch.nn.Linear(4, 1))
        i = 0
        with torch.no_grad():
            for lin in (net[0], net[2], net[4]):
                n = lin.in_features * lin.out_features
                lin.weight.copy_(theta[r, i:i + n].reshape(lin.in_features, lin.out_features).T)
                lin.bias.copy_(theta[r, i + n:i + n + lin.out_features])
                i += n + lin.out_features
        torch.testing.assert_close(out[1, r], net(x[r]).squeeze(-1))


def test_mlp_init_is_nn_linear_default():
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases, as nn.Linear's reset_parameters."""
    spec = MLPSpec(4, (50,))
    theta = spec.init(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    first = theta[:, :4 * 50 + 50]
    assert first.abs().max() <= 0.5 and first.abs().max() > 0.49
    # variance of U(-b, b) is b^2 / 3
    assert abs(float(first.var()) - 0.25 / 3) < 0.003


# ------------------------------------------------- one replica == the Pyro classes


def _pyro_model(spec, prior, precision):
    scale = precision ** -0.5 if prior == "gaussian" else (2 * precision) ** -0.5

    def model(x, y):
        base = dist.Normal(0.0, scale) if prior == "gaussian" else dist.Laplace(0.0, scale)
        w = pyro.sample("w", base.expand([spec.dim]).to_event(1))
        noise = pyro.param("noise", torch.tensor(0.7), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(spec.forward(w, x.unsqueeze(0)).squeeze(0), noise), obs=y)

    return model


def _copy_into_guide(guide, family, p):
    """Write the replica's parameters into the Pyro guide (same parameterisation)."""
    store = pyro.get_param_store()
    p = {k: v.detach() for k, v in p.items()}
    with torch.no_grad():
        if family in ("fa", "ppca"):
            guide.loc.copy_(p["loc"][0])
            guide.factor.copy_(p["factor"][0])
            guide.scale = p["log_scale"][0].exp().squeeze() if family == "ppca" else p["log_scale"][0].exp()
        elif family == "lowrank":
            guide.loc.copy_(p["loc"][0])
            guide.cov_factor.copy_(p["cov_factor"][0])
            guide.scale = torch.nn.functional.softplus(p["scale_u"][0])
        elif family == "normal":
            guide.locs.w = p["loc"][0].clone()
            guide.scales.w = torch.nn.functional.softplus(p["scale_u"][0])
        else:
            guide.w = p["loc"][0].clone()
    if "noise" in store:
        del store["noise"]
    pyro.param("noise", p["log_noise"][0].exp(), constraint=dist.constraints.positive)  # unconstrained: log sigma


CASES = [
    ("fa", "gaussian", lambda m: AutoLowRankFactorGuide(m, rank=3), FactorELBO),
    ("fa", "laplace", lambda m: AutoLowRankFactorGuide(m, rank=3), FactorELBO),
    ("ppca", "gaussian", lambda m: AutoLowRankFactorGuide(m, rank=3, noise="isotropic"), FactorELBO),
    ("lowrank", "gaussian", lambda m: AutoLowRankMultivariateNormal(m, rank=3), Trace_ELBO),
    ("normal", "laplace", AutoNormal, Trace_ELBO),
    ("delta", "gaussian", AutoDelta, Trace_ELBO),
]


@pytest.mark.parametrize("family,prior,make_guide,elbo_cls", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_replica_loss_and_gradients_equal_pyro(family, prior, make_guide, elbo_cls):
    """Same parameters, same random draws: the replica's loss and gradients are Pyro's, to rounding."""
    torch.set_default_dtype(torch.float64)
    x, y = _toy()
    spec = MLPSpec(3, (6,))
    vi = ReplicaVI(spec, family, prior, torch.tensor([0.8]), torch.tensor([1e-2]), rank=3,
                   generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():  # a non-trivial q and noise
        g = torch.Generator().manual_seed(2)
        for v in vi.params().values():
            v.add_(0.2 * torch.randn(v.shape, generator=g, dtype=v.dtype))
    model = _pyro_model(spec, prior, 0.8)
    guide = make_guide(model)
    guide(x, y)
    _copy_into_guide(guide, family, vi.params())

    torch.manual_seed(5)
    ours = vi.loss(x.unsqueeze(0), y.unsqueeze(0), x.shape[0])[0]
    ours.backward()
    elbo = elbo_cls()
    elbo.differentiable_loss(model, guide, x, y)  # FactorELBO inspects the model once (and draws) on first use
    pyro.get_param_store().clear()
    _copy_into_guide(guide, family, vi.params())
    for q in guide.parameters():
        q.grad = None
    torch.manual_seed(5)
    theirs = elbo.differentiable_loss(model, guide, x, y)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-8)
    grads = {n: p.grad for n, p in pyro.get_param_store().named_parameters()}
    p = vi.params()
    torch.testing.assert_close(p["log_noise"].grad[0], grads["noise"])  # unconstrained noise = log sigma
    # every variational parameter, in the guide's unconstrained coordinates (log or inverse-softplus scale)
    names = {"fa": {"loc": ".loc", "factor": ".factor", "log_scale": ".scale"},
             "ppca": {"loc": ".loc", "factor": ".factor", "log_scale": ".scale"},
             "lowrank": {"loc": ".loc", "cov_factor": ".cov_factor", "scale_u": ".scale"},
             "normal": {"loc": "locs.w", "scale_u": "scales.w"},
             "delta": {"loc": "AutoDelta.w"}}[family]
    assert set(names) | {"log_noise"} == set(p)
    for ours_name, suffix in names.items():
        key = next(k for k in grads if k.endswith(suffix))
        torch.testing.assert_close(p[ours_name].grad[0].reshape(grads[key].shape), grads[key], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("family,estimator", [("fa", "factor"), ("ppca", "factor"), ("lowrank", "trace"),
                                              ("lowrank", "factor"), ("fa", "trace")])
def test_whitened_loss_equals_torch_lowrank_mvn_for_many_replicas(family, estimator):
    """Several replicas and particles: the whitened-form ELBO equals the one built from torch's
    LowRankMultivariateNormal (entropy, variances, log_prob) at the same draws, replica by replica."""
    torch.set_default_dtype(torch.float64)
    x, y = _toy(N=30)
    R, S = 3, 2
    spec = MLPSpec(3, (5,))
    sigma = torch.tensor([0.05, math.nan, 0.2]) if family == "ppca" else None
    vi = ReplicaVI(spec, family, "laplace", torch.tensor([0.5, 1.0, 2.0]), torch.full((R,), 1e-2), rank=2,
                   noise_scale=sigma, estimator=estimator, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for v in vi.params().values():
            v.add_(0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype))
    xs, ys = x.expand(R, -1, -1), y.expand(R, -1)
    torch.manual_seed(3)
    ours = vi.loss(xs, ys, 60, particles=S)
    p = vi.params()
    q = vi.distribution(p)
    torch.manual_seed(3)
    theta = q.rsample((S,))  # the same noise in the same order
    loglik = vi._loglik(p, theta, xs, ys, 60)
    if estimator == "trace":
        ref = -(loglik + vi._prior_log_prob(theta) - q.log_prob(theta)).mean(0)
    else:
        ref = -(loglik.mean(0) + vi._expected_prior(q.mean, q.variance) + q.entropy())
    assert ours.shape == (R,)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-9)
    # and every gradient (the factor's through the fused backward of the FactorELBO path)
    leaves = [t for t in p.values() if t.requires_grad]
    for a, b in zip(torch.autograd.grad(ours.sum(), leaves, retain_graph=True, allow_unused=True),
                    torch.autograd.grad(ref.sum(), leaves, allow_unused=True)):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_replicas_are_independent_and_lrs_make_param_groups():
    """The loss of each replica depends only on its parameters; one Adam group per learning rate."""
    x, y = _toy()
    spec = MLPSpec(3, (6,))
    vi = ReplicaVI(spec, "fa", "gaussian", torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1e-2, 3e-3, 1e-2]), rank=2,
                   generator=torch.Generator().manual_seed(0))
    opt = vi.optimizer()
    assert sorted(g["lr"] for g in opt.param_groups) == [3e-3, 1e-2]
    assert [len(g["params"][0]) for g in sorted(opt.param_groups, key=lambda g: g["lr"])] == [1, 2]
    vi.loss(x.expand(3, -1, -1), y.expand(3, -1), 40)[1].backward()  # replica 1 alone (the lr 3e-3 group)
    small, large = sorted(opt.param_groups, key=lambda g: g["lr"])
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in small["params"][:1])
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in large["params"])
    before = vi.state()
    opt.step()
    after = vi.state()
    assert torch.equal(before["loc"][0], after["loc"][0]) and torch.equal(before["loc"][2], after["loc"][2])
    assert not torch.equal(before["loc"][1], after["loc"][1])


def test_replica_rejects_bad_options():
    spec = MLPSpec(2, (3,))
    with pytest.raises(ValueError, match="family must be one of"):
        ReplicaVI(spec, "flow", "gaussian", torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match="prior must be one of"):
        ReplicaVI(spec, "fa", "horseshoe", torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match="lr must have one entry per replica"):
        ReplicaVI(spec, "fa", "gaussian", torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError, match="noise_scale must be None"):
        ReplicaVI(spec, "fa", "gaussian", torch.ones(1), torch.ones(1), noise_scale=torch.ones(1))


# ------------------------------------------------------------------ the protocol


def test_validation_split_is_inside_the_training_part():
    """The search sees only the training part: 80 % / 20 % of it, re-standardised on the 80 %."""
    d = load_uci("yacht", split=3)
    x_tr, y_tr, x_va, y_va, y_std = uci._validation_split(d, 0.2, 3)
    n_val = round(0.2 * 277)
    assert x_tr.shape[0] + x_va.shape[0] == 277 and x_va.shape[0] == n_val
    torch.testing.assert_close(x_tr.mean(0), torch.zeros(6, dtype=x_tr.dtype), atol=1e-10, rtol=0)
    torch.testing.assert_close(y_tr.std(unbiased=False), torch.tensor(1.0, dtype=y_tr.dtype))
    # the rows are the training part's, permuted: undo the affine re-standardisation and compare
    perm = torch.randperm(277, generator=torch.Generator().manual_seed(10_003))
    val, sub = d.x_train[perm[:n_val]], d.x_train[perm[n_val:]]
    mean, std = sub.mean(0), sub.std(0, unbiased=False)
    torch.testing.assert_close(x_va * std + mean, val)
    torch.testing.assert_close(y_va * d.y_train[perm[n_val:]].std(unbiased=False) + d.y_train[perm[n_val:]].mean(),
                               d.y_train[perm[:n_val]])
    # no test row anywhere in the search data
    train_rows = {tuple(np.round(r, 8)) for r in d.x_train.numpy()}
    test_only = {tuple(np.round(r, 8)) for r in d.x_test.numpy()} - train_rows
    assert test_only and not ({tuple(np.round(r, 8)) for r in val.numpy()} & test_only)
    assert y_std == pytest.approx(float(d.y_train[perm[n_val:]].std(unbiased=False)) * d.y_std)


@pytest.mark.parametrize("n_train, expected", [(277, 5), (455, 4), (691, 3), (927, 2), (1439, 2), (7373, 1),
                                               (41157, 1)])
def test_search_uses_enough_splits_for_300_validation_points(n_train, expected):
    """Yacht, Boston, Energy, Concrete, Wine, Kin8nm, Protein training parts: ceil(300 / (0.2 n)), at most 5."""
    assert uci.n_tune_splits(n_train, uci.Budget()) == expected
    assert uci.n_tune_splits(n_train, uci.Budget(tune_splits=2)) == 2


def test_search_grid_per_architecture_and_family():
    """One hidden layer: precision x ``lrs``; two: precision x ``deep_lrs``; VIPPCA: precision x sigma at ``ppca_lr``."""
    b = uci.Budget(precisions=(0.1, 1.0), lrs=(3e-3, 1e-2), deep_lrs=(5e-3,), ppca_lr=2e-3, ppca_scales=(None, 0.01))
    for name in ("vifa-gaussian-1x50", "autonormal-1x50", "lowrank-1x50"):
        assert uci._configs(uci.METHODS[name], b) == [{"precision": a, "lr": lr} for a in (0.1, 1.0)
                                                       for lr in (3e-3, 1e-2)]
    for name in ("vifa-laplace-2x50", "lowrank-2x50"):
        assert uci._configs(uci.METHODS[name], b) == [{"precision": 0.1, "lr": 5e-3}, {"precision": 1.0, "lr": 5e-3}]
    for name in ("vippca-gaussian-1x50", "vippca-laplace-2x50"):
        assert uci._configs(uci.METHODS[name], b) == [{"precision": a, "lr": 2e-3, "sigma": s} for a in (0.1, 1.0)
                                                       for s in (None, 0.01)]
    full = uci.Budget()  # the default grid: 8 points for the 1x50 VI guides, 4 for 2x50 VIFA, 8 for VIPPCA
    assert [len(uci._configs(uci.METHODS[n], full)) for n in ("vifa-gaussian-1x50", "vifa-gaussian-2x50",
                                                             "vippca-gaussian-2x50")] == [8, 4, 8]
    assert None not in full.ppca_scales


def test_tuning_data_stacks_the_first_splits_validation_parts():
    splits = [load_uci("yacht", s, dtype=torch.float32) for s in range(6)]
    tune = uci.tuning_data(splits, uci.Budget())
    assert tune.y.shape == (5, 277 - 55) and tune.y_eval.shape == (5, 55)
    for s in range(5):  # replica s is split s's own validation cut
        torch.testing.assert_close(tune.y_eval[s], uci._validation_split(splits[s], 0.2, s)[3])
    assert uci.tuning_data(splits[:2], uci.Budget()).y.shape[0] == 2  # never more splits than were loaded


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_train_follows_the_rate_schedule_of_the_budgets_steps(monkeypatch, schedule):
    """The rate at step t is lr (1 + cos(pi t / T)) / 2 over the budget's T steps, also in a fit stopped at t < T:
    a final fit that stops at the chosen step has seen the search's rates."""
    x, y = _toy()
    data = uci.SplitData(x.expand(2, -1, -1), y.expand(2, -1), x.expand(2, -1, -1), y.expand(2, -1), torch.ones(2))
    seen = []
    make = ReplicaVI.optimizer

    def recording(self, **kw):
        opt = make(self, **kw)
        opt.register_step_pre_hook(lambda o, *_: seen.append(sorted(g["lr"] for g in o.param_groups)))
        return opt

    monkeypatch.setattr(ReplicaVI, "optimizer", recording)
    vi = ReplicaVI(MLPSpec(3, (6,)), "fa", "gaussian", torch.ones(2), torch.tensor([3e-3, 1e-2]), rank=2,
                   generator=torch.Generator().manual_seed(0))
    budget = uci.Budget(steps=40, lr_schedule=schedule)
    uci.train(vi, data, 25, budget, torch.Generator().manual_seed(0))
    assert len(seen) == 25
    for t, rates in enumerate(seen):
        f = (1 + math.cos(math.pi * t / 40)) / 2 if schedule == "cosine" else 1.0
        assert rates == pytest.approx([3e-3 * f, 1e-2 * f], rel=1e-12)


def test_heldout_ll_equals_metrics_per_replica():
    g = torch.Generator().manual_seed(0)
    means = torch.randn(7, 3, 5, generator=g, dtype=torch.float64)
    nv = torch.rand(3, 1, generator=g, dtype=torch.float64) + 0.1
    data = uci.SplitData(torch.zeros(3, 1, 1), torch.zeros(3, 1), torch.zeros(3, 5, 1),
                         torch.randn(3, 5, generator=g, dtype=torch.float64), torch.tensor([1.0, 2.0, 0.5]))
    ll = uci.heldout_ll(means, nv, data)
    full = uci.evaluate(means, nv, data)
    for r in range(3):
        ref = metrics.gaussian_log_likelihood(means[:, r], nv[r], data.y_eval[r], y_std=float(data.y_std[r]))
        torch.testing.assert_close(ll[r], ref)
        torch.testing.assert_close(full["ll"][r], ref)
        torch.testing.assert_close(full["rmse"][r], metrics.rmse(means[:, r], data.y_eval[r], float(data.y_std[r])))
    bad = means.clone()
    bad[0, 1, 0] = float("nan")
    assert uci.heldout_ll(bad, nv, data)[1] == -math.inf and torch.isfinite(uci.heldout_ll(bad, nv, data)[0])
    with pytest.raises(FloatingPointError, match="diverged"):
        uci.evaluate(bad, nv, data)


def test_choose_takes_the_best_mean_over_tuning_splits():
    configs = [{"precision": 1.0, "lr": 0.1}, {"precision": 10.0, "lr": 0.1}]
    curves = [(10, torch.tensor([-2.0, -2.0, -1.0, -4.0])), (20, torch.tensor([-1.5, -1.6, -3.0, -3.0]))]
    choice, val, table = uci._choose(curves, configs, 2)
    assert choice == {"precision": 1.0, "lr": 0.1, "steps": 20} and val == pytest.approx(-1.55)
    assert len(table) == 4


@pytest.mark.slow
def test_vi_fit_learns_a_regression():
    """A few hundred full-batch steps on yacht: far better than predicting the training mean."""
    splits = [load_uci("yacht", s, dtype=torch.float32) for s in range(2)]
    budget = uci.Budget(steps=600, precisions=(1.0,), lrs=(1e-2,), tune_splits=1, checkpoints=4, test_samples=20)
    res = uci.run_vi(uci.METHODS["vifa-gaussian-1x50"], splits, budget, seed=0)
    # predicting the mean: RMSE = std of y (about 15 in original units), LL about -4.1
    assert max(res["rmse"]) < 5 and min(res["ll"]) > -3.2
    assert res["choice"]["steps"] in {150, 300, 450, 600} and len(res["search"]) == 4


# ------------------------------------------------------------------ the command


@pytest.mark.slow
def test_uci_command_writes_complete_results(tmp_path, capsys):
    out = tmp_path / "uci"
    code = cli.main(["uci", "--quick", "--datasets", "yacht", "--methods", "vifa-gaussian-1x50", "swag-em-1x50",
                     "multiswag-1x50", "--steps", "40", "--output-dir", str(out), "--no-progress"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    got = res["results"]["yacht"]
    assert set(got) == {"vifa-gaussian-1x50", "swag-em-1x50", "multiswag-1x50"}
    for r in got.values():
        assert len(r["ll"]) == 2 and len(r["rmse"]) == 2 and all(math.isfinite(v) for v in r["ll"])
        assert r["choice"]["precision"] in (0.1, 1.0, 10.0)
    table = (out / "table.md").read_text()
    assert "VIFA Gaussian 1×50" in table and "-2.36 ± 0.06" in table  # seed 003's number beside ours
    assert (out / "ll.png").stat().st_size > 0 and (out / "rmse.png").stat().st_size > 0
    # unit file names carry a hash of everything the results depend on (budget, seed, splits, protocol)
    assert len(list((out / "units").glob("yacht__vifa-gaussian-1x50__*.json"))) == 1
    assert not list(out.rglob("*.part"))
    [swag_unit] = (out / "units").glob("yacht__swag-family__*.json")
    assert json.loads(swag_unit.read_text())["cpu_seconds"] > 0
    # CPU cells add up their process time; CUDA cells (none here) their wall time, apart
    assert res["datasets"]["yacht"]["cpu_seconds"] > 0 and res["datasets"]["yacht"]["cuda_wall_seconds"] == 0
    printed = capsys.readouterr().out
    assert "test LL" in printed
    # the compute line adds up the units' process time; a run this short prints it in seconds
    assert f"compute: {res['datasets']['yacht']['cpu_seconds']:.0f} CPU-seconds in the cells" in printed
    # a second run reuses the units of the same budget, and the report is the same
    cli.main(["uci", "--quick", "--datasets", "yacht", "--methods", "vifa-gaussian-1x50", "swag-em-1x50",
              "multiswag-1x50", "--steps", "40", "--output-dir", str(out), "--no-progress"])
    assert "done before" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["results"] == res["results"]


def test_report_amounts_read_at_every_scale():
    assert uci._amount(6732.3, "CPU-") == "1.87 CPU-hours" and uci._amount(3366.2) == "0.94 hours"
    assert uci._amount(14.6, "CPU-") == "15 CPU-seconds" and uci._amount(359.4) == "359 seconds"


def test_uci_command_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["uci", "--datasets", "titanic"])
    assert "invalid choice: 'titanic'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["uci", "--methods", "mcmc"])
    assert "invalid choice: 'mcmc'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--splits must be in 1\.\.20 for 'yacht', got 25"):
        cli.main(["uci", "--datasets", "yacht", "--splits", "25", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--steps must be >= 10"):
        cli.main(["uci", "--quick", "--steps", "5", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--tune-splits must be at most the 2 splits"):
        cli.main(["uci", "--quick", "--tune-splits", "3", "--output-dir", str(tmp_path), "--no-progress"])
    with pytest.raises(SystemExit, match="no results of this budget"):
        cli.main(["uci", "--quick", "--report-only", "--output-dir", str(tmp_path / "empty")])
    assert not (tmp_path / "empty").exists()
    with pytest.raises(SystemExit, match=r"missing file .*bostonHousing.*PYRO_FA_DATA"):
        cli.main(["uci", "--quick", "--datasets", "boston", "--data-dir", str(tmp_path / "nowhere"),
                  "--output-dir", str(tmp_path)])


def test_ppca_replicas_mix_fixed_and_learned_sigma():
    """noise_scale: a fixed sigma per replica (NaN: learned); fixed replicas get no gradient on it."""
    spec = MLPSpec(3, (4,))
    vi = ReplicaVI(spec, "ppca", "gaussian", torch.ones(2), torch.full((2,), 1e-2), rank=2,
                   noise_scale=torch.tensor([math.nan, 0.05]), generator=torch.Generator().manual_seed(0))
    q = vi.distribution()
    assert torch.allclose(q.cov_diag[1], torch.full((spec.dim,), 0.05**2))
    assert torch.allclose(q.cov_diag[0], torch.full((spec.dim,), 0.01**2 / 2))  # init_scale / sqrt(2), squared
    x, y = _toy()
    vi.loss(x.expand(2, -1, -1), y.expand(2, -1), 40).sum().backward()
    g = vi.params()["log_scale"].grad
    assert g[0].abs().sum() > 0 and g[1].abs().sum() == 0
    with pytest.raises(ValueError, match="noise_scale must be positive or NaN"):
        ReplicaVI(spec, "ppca", "gaussian", torch.ones(1), torch.ones(1), noise_scale=torch.tensor([-1.0]))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process table from /proc")
def test_parallel_workers_exit_when_the_command_is_killed(tmp_path):
    """`pyro-fa uci --jobs 2` killed outright: its pool's workers stop too, instead of training on unseen."""
    import signal
    import subprocess
    import sys
    import time

    code = ("from pyro_fa import cli; cli.main(['uci', '--quick', '--datasets', 'yacht', '--methods', "
            "'vifa-gaussian-1x50', 'autonormal-1x50', '--steps', '1000000', '--jobs', '2', '--no-progress', "
            f"'--output-dir', {str(tmp_path)!r}])")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def workers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if stat[0] != "Z" and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                found.append((int(pid), int(stat[1])))
        return found

    try:
        deadline = time.time() + 120
        while len([w for w, ppid in workers() if ppid == parent.pid]) < 2:
            assert parent.poll() is None and time.time() < deadline, "the workers never started"
            time.sleep(0.5)
        pids = [w for w, ppid in workers() if ppid == parent.pid]
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 30
        while any(w in pids for w, _ in workers()) and time.time() < deadline:
            time.sleep(0.5)
        alive = [w for w, _ in workers() if w in pids]
        for w in alive:
            os.kill(w, signal.SIGKILL)
        assert not alive, "pool workers outlived the killed command"
    finally:
        if parent.poll() is None:
            parent.kill()
    assert not list(tmp_path.glob("units/*.json"))  # nothing half-way, and no late unit from an orphan
