"""SWAG / MultiSWAG: classic moments vs dense, FA vs OnlineFactorAnalysis, hooks, Predictive, state, errors."""
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from torch import nn

from pyro_fa import GaussianPrior, MultiSWAG, OnlineFactorAnalysis, SWAG


def _iterates(T=60, D=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(D, 2, generator=g)
    return torch.randn(T, 2, generator=g) @ F.T + 0.3 * torch.randn(T, D, generator=g) + 1.0


def _feed(swag, params, thetas):
    for theta in thetas:
        with torch.no_grad():
            params[0].copy_(theta[:3].reshape(3))
            params[1].copy_(theta[3:].reshape(2, 2))
        swag.collect()


def _params(device="cpu"):
    return [torch.zeros(3, device=device, requires_grad=True), torch.zeros(2, 2, device=device, requires_grad=True)]


# ------------------------------------------------------------------ exact tier
@pytest.mark.parametrize("T", [3, 5, 40])
def test_classic_swag_moments_match_dense(T, device):
    K = 5
    params = _params(device)
    swag = SWAG(params, rank=K, method="swag")
    thetas = _iterates(T).to(device)
    _feed(swag, params, thetas)
    mean = thetas.mean(0)
    var = thetas.var(0, unbiased=False)
    running = torch.cumsum(thetas, 0) / torch.arange(1, T + 1, device=device).unsqueeze(-1)
    devs = (thetas - running)[-K:]
    k = devs.shape[0]
    cov = 0.5 * (torch.diag(var) + devs.T @ devs / max(k - 1, 1))
    q = swag.get_posterior()
    assert torch.allclose(q.loc, mean)
    assert torch.allclose(q.covariance_matrix, cov, atol=1e-12)
    # samples: moments within Monte-Carlo error, no D x D matrix needed
    S = 40000
    draws = swag.sample(S)
    assert draws.shape == (S, 7)
    se = (cov.diagonal() / S).sqrt()
    assert ((draws.mean(0) - mean).abs() < 5 * se).all()
    assert torch.allclose(torch.cov(draws.T), cov, atol=6 * cov.diagonal().max().item() * math.sqrt(2 / S))


def test_em_and_sga_match_online_factor_analysis():
    thetas = _iterates(150)
    for method in ("em", "sga"):
        params = _params()
        swag = SWAG(params, rank=2, method=method, warmup=20, seed=3)
        fa = OnlineFactorAnalysis(7, 2, method, warmup=20, seed=3, step_scale=1.0, lr=1e-3)  # SWAG's SGA rate
        _feed(swag, params, thetas)
        for theta in thetas:
            fa.update(theta)
        q = swag.get_posterior()
        assert torch.allclose(q.loc, fa.loc) and torch.allclose(q.loc, thetas.mean(0))
        assert torch.allclose(q.cov_factor, fa.cov_factor)
        assert torch.allclose(q.cov_diag, fa.cov_diag)


def test_window_averaging_feeds_window_means():
    thetas = _iterates(40)
    params = _params()
    swag = SWAG(params, rank=2, method="swag", window=4)
    _feed(swag, params, thetas)
    means = thetas.reshape(10, 4, 7).mean(1)
    assert swag.n_collected == 10
    assert torch.allclose(swag.loc, means.mean(0))
    assert torch.allclose(swag.cov_diag, 0.5 * means.var(0, unbiased=False))


# ------------------------------------------------------------------ hooks
@pytest.mark.parametrize("start_after,collect_every", [(0, 1), (3, 1), (2, 4)])
def test_attach_collects_per_schedule(start_after, collect_every):
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    swag = SWAG(net, rank=2, method="swag", start_after=start_after, collect_every=collect_every)
    handle = swag.attach(opt)
    collected = []
    for t in range(1, 21):
        opt.zero_grad()
        net(torch.randn(8, 3)).pow(2).mean().backward()
        opt.step()
        if t > start_after and (t - start_after) % collect_every == 0:
            collected.append(torch.cat([net.weight.detach().flatten(), net.bias.detach()]))
    assert swag.n_steps == 20 and swag.n_collected == len(collected)
    assert torch.allclose(swag.loc, torch.stack(collected).mean(0))
    handle.remove()
    opt.step()
    assert swag.n_steps == 20


def test_sampled_weights_restore_and_predict_and_update_bn():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    swag = SWAG(net, rank=3, method="em", warmup=5, seed=0)
    swag.attach(opt)
    X = torch.randn(64, 3)
    for _ in range(30):
        opt.zero_grad()
        (net(X) - X[:, :1]).pow(2).mean().backward()
        opt.step()
    net.eval()
    before = [p.detach().clone() for p in net.parameters()]
    bn_before = net[1].running_mean.clone()
    loader = [X[:32], X[32:]]
    with swag.sampled_weights(loader=loader) as theta:
        assert torch.allclose(net[0].bias, theta[12:16])
        assert not torch.allclose(net[1].running_mean, bn_before)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert torch.equal(net[1].running_mean, bn_before)
    with pytest.raises(RuntimeError, match="boom"):
        with swag.sampled_weights():
            raise RuntimeError("boom")
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    pred = swag.predict(X, num_samples=5)
    assert pred.shape == (64, 1)
    g = torch.Generator().manual_seed(1)
    thetas = swag.sample(5, generator=torch.Generator().manual_seed(1))
    manual = torch.stack([torch.func.functional_call(net, dict(zip([n for n, _ in net.named_parameters()],
                                                                     swag._split(t))), (X,)) for t in thetas]).mean(0)
    assert torch.allclose(swag.predict(X, num_samples=5, generator=g), manual)


# ------------------------------------------------------------------ Pyro
def _linreg(N=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 2, generator=g)
    y = X @ torch.tensor([1.0, -2.0]) + 0.5 * torch.randn(N, generator=g)
    return X, y


def test_predictive_through_to_guide_bayesianized_module():
    X, y = _linreg()
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    swag = SWAG(net, rank=2, method="swag", start_after=50)
    swag.attach(opt)
    for _ in range(150):
        idx = torch.randint(50, (10,))
        opt.zero_grad()
        (net(X[idx]).squeeze(-1) - y[idx]).pow(2).mean().backward()
        opt.step()
    bnet = GaussianPrior(1.0).bayesianize(net)

    def model(X, y=None):
        mean = bnet(X).squeeze(-1)
        with pyro.plate("data", X.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)

    S = 4000
    pred = Predictive(model, guide=swag.to_guide(model), num_samples=S, return_sites=["weight", "bias", "obs"])(X)
    # Predictive's own layout: (S, 1 per plate dim, *site shape)
    assert pred["weight"].shape == (S, 1, 1, 2) and pred["bias"].shape == (S, 1, 1) and pred["obs"].shape == (S, 50)
    draws = torch.cat([pred["weight"].reshape(S, 2), pred["bias"].reshape(S, 1)], -1)
    q = swag.get_posterior()
    cov = q.covariance_matrix
    assert ((draws.mean(0) - q.loc).abs() < 5 * (cov.diagonal() / S).sqrt()).all()
    assert torch.allclose(torch.cov(draws.T), cov, atol=6 * cov.diagonal().max().item() * math.sqrt(2 / S))


def test_pyro_autodelta_one_line_and_constrained_site():
    X, y = _linreg()

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 10.0).to_event(1))
        s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
        with pyro.plate("data", X.shape[0]):
            return pyro.sample("obs", dist.Normal((w * X).sum(-1), s), obs=y)

    pyro.set_rng_seed(0)
    guide = AutoDelta(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO())
    swag = SWAG.from_param_store(rank=2, method="em", warmup=20, start_after=300, seed=0)
    for _ in range(500):
        svi.step(X, y)
        swag.step()  # the one added line
    assert swag.n_collected == 200 and swag.dim == 3 and swag.site_names() == ["w", "s"]
    pred = Predictive(model, guide=swag.to_guide(model), num_samples=200)(X)
    assert pred["w"].shape == (200, 1, 2) and pred["s"].shape == (200, 1) and (pred["s"] > 0).all()
    assert pred["obs"].shape == (200, 50)
    q = swag.get_posterior()
    se = (q.variance[:2] / 200).sqrt()
    assert ((pred["w"].mean(0).squeeze() - q.loc[:2]).abs() < 5 * se).all()
    assert torch.allclose(q.loc[:2], torch.tensor([1.0, -2.0]), atol=0.2)
    # the context manager writes unconstrained values into the store and restores them
    before = pyro.param("AutoDelta.s").detach().clone()
    with swag.sampled_weights() as theta:
        assert torch.allclose(pyro.param("AutoDelta.s"), theta[2].exp())
    assert torch.equal(pyro.param("AutoDelta.s").detach(), before)


def test_state_dict_round_trip_and_resume():
    thetas = _iterates(80)
    for method in ("em", "sga", "swag"):
        p1, p2, p3 = _params(), _params(), _params()
        full = SWAG(p1, rank=2, method=method, warmup=10, seed=0, window=2)
        half = SWAG(p2, rank=2, method=method, warmup=10, seed=0, window=2)
        _feed(full, p1, thetas)
        _feed(half, p2, thetas[:41])
        resumed = SWAG(p3, rank=2, method=method, warmup=10, seed=5, window=2)
        resumed.load_state_dict(half.state_dict())
        _feed(resumed, p3, thetas[41:])
        assert resumed.n_collected == full.n_collected == 40
        for a, b in ((resumed.loc, full.loc), (resumed.cov_factor, full.cov_factor),
                     (resumed.cov_diag, full.cov_diag)):
            assert torch.allclose(a, b)


# ------------------------------------------------------------------ MultiSWAG
def test_multiswag_mixture_predict_and_predictive():
    X, y = _linreg()

    def train(net, swag):
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        swag.attach(opt)
        for _ in range(60):
            idx = torch.randint(50, (10,))
            opt.zero_grad()
            (net(X[idx]).squeeze(-1) - y[idx]).pow(2).mean().backward()
            opt.step()

    ms = MultiSWAG.from_training(lambda: nn.Linear(2, 1), train, num_models=3, rank=2, method="swag", start_after=20)
    assert len(ms) == 3
    locs = torch.stack([m.loc for m in ms.members])
    assert not torch.allclose(locs[0], locs[1])
    mix = ms.get_posterior()
    assert torch.allclose(mix.mean, locs.mean(0))
    draws = ms.sample(6000)
    assert ((draws.mean(0) - locs.mean(0)).abs() < 5 * (mix.variance / 6000).sqrt()).all()
    pred = ms.predict(X, num_samples=4)
    assert pred.shape == (50, 1)
    bnet = GaussianPrior(1.0).bayesianize(ms.members[0]._source.module)

    def model(X):
        return pyro.sample("out", dist.Delta(bnet(X).squeeze(-1)).to_event(1))

    out = Predictive(model, guide=ms.to_guide(model), num_samples=30)(X)
    assert out["weight"].shape == (30, 1, 2) and out["out"].shape == (30, 50)  # no plate in this model


# ------------------------------------------------------------------ bad input
def test_errors():
    net = nn.Linear(3, 1)
    with pytest.raises(ValueError, match=r"SWAG: method must be one of"):
        SWAG(net, method="laplace")
    with pytest.raises(ValueError, match=r"SWAG: rank must be < the number of parameters D=4, got 4"):
        SWAG(net, rank=4)
    with pytest.raises(ValueError, match=r"SWAG: rank must be an integer >= 1, got 0"):
        SWAG(net, rank=0)
    with pytest.raises(ValueError, match=r"SWAG: collect_every must be an integer >= 1"):
        SWAG(net, rank=2, collect_every=0)
    with pytest.raises(ValueError, match=r"SWAG: warmup must be >= rank=3 for method 'em', got 2"):
        SWAG(nn.Linear(5, 1), rank=3, warmup=2)
    with pytest.raises(ValueError, match=r"SWAG: on_nonfinite must be one of"):
        SWAG(net, rank=2, on_nonfinite="ignore")
    w = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match=r"SWAG: parameters must be leaf tensors.*non-leaf tensor '0'"):
        SWAG([w * 2], rank=1)
    with pytest.raises(TypeError, match=r"SWAG: module_or_params must be an nn.Module or an iterable"):
        SWAG(torch.zeros(3), rank=1)
    with pytest.raises(TypeError, match=r"SWAG: parameters must share one dtype"):
        SWAG([torch.zeros(3), torch.zeros(3, dtype=torch.float32)], rank=1)
    with pytest.raises(TypeError, match=r"SWAG: optimizer must be a torch.optim.Optimizer"):
        SWAG(net, rank=2).attach(pyro.optim.Adam({"lr": 0.1}))
    swag = SWAG(net, rank=2, method="em", warmup=3)
    with pytest.raises(RuntimeError, match=r"SWAG: sample\(\) needs at least one collected"):
        swag.sample()
    swag.collect()
    with pytest.raises(RuntimeError, match=r"SWAG: get_posterior\(\) needs more than warmup=3 collected"):
        swag.get_posterior()
    with pytest.raises(RuntimeError, match=r"Pyro's param store must hold parameters named 'AutoDelta.\*'"):
        SWAG.from_param_store(rank=1).collect()
    with pytest.raises(ValueError, match=r"SWAG: theta must be a tensor of shape \(4,\)"):
        with SWAG(net, rank=2, method="swag").sampled_weights(torch.zeros(3)):
            pass
    with pytest.raises(ValueError, match=r"SWAG: loader needs a SWAG built from an nn.Module"):
        s = SWAG([torch.zeros(3)], rank=1, method="swag")
        s.collect()
        with s.sampled_weights(loader=[torch.zeros(1, 3)]):
            pass


def test_shape_change_device_dtype_mix_and_nonfinite_leave_state_unchanged():
    net = nn.Linear(3, 1)
    swag = SWAG(net, rank=2, method="swag")
    swag.collect()
    state = {k: v.clone() for k, v in swag.state_dict().items() if torch.is_tensor(v)}

    def unchanged():
        return all(torch.equal(v, swag.state_dict()[k]) for k, v in state.items()) and swag.n_collected == 1

    with torch.no_grad():
        net.bias.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"SWAG: the parameter vector must be finite, got NaN or inf in 1 entries"):
        swag.collect()
    assert unchanged()
    swag.on_nonfinite = "skip"
    with pytest.warns(RuntimeWarning, match="must be finite"):
        assert swag.collect() is False
    assert unchanged()
    net.float()
    with pytest.raises(ValueError, match=r"SWAG: parameters must be on cpu with dtype torch.float64 like the posterior"):
        swag.collect()
    assert unchanged()
    net.double()
    net.weight = nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"SWAG: parameter shapes must stay \[\(1, 3\), \(1,\)\]"):
        swag.collect()
    assert unchanged()
    with pytest.raises(ValueError, match=r"SWAG: state_dict must come from parameters of shapes"):
        SWAG(nn.Linear(2, 1), rank=1, method="swag").load_state_dict(swag.state_dict())


def test_multiswag_errors():
    with pytest.raises(ValueError, match=r"MultiSWAG: members must hold at least one SWAG"):
        MultiSWAG([])
    with pytest.raises(TypeError, match=r"MultiSWAG: members must be SWAG posteriors, got Linear"):
        MultiSWAG([nn.Linear(2, 1)])
    with pytest.raises(ValueError, match=r"MultiSWAG: members must share \(dim, rank\)"):
        MultiSWAG([SWAG(nn.Linear(2, 1), rank=1), SWAG(nn.Linear(3, 1), rank=1)])
    with pytest.raises(ValueError, match=r"MultiSWAG: num_models must be an integer >= 1"):
        MultiSWAG.from_training(lambda: nn.Linear(2, 1), lambda n, s: None, num_models=0)


def test_to_guide_site_mismatch():
    net = nn.Linear(2, 1)
    swag = SWAG(net, rank=1, method="swag")
    swag.collect()

    def model(X):
        pyro.sample("other", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match=r"FactorPosteriorGuide: the posterior's sites must be latent sites of the model, got \['weight', 'bias'\]"):
        swag.to_guide(model)(torch.zeros(1, 2))


# ------------------------------------------------------------------ experiments (smoke)
def _args(tmp_path, **kw):
    from types import SimpleNamespace

    return SimpleNamespace(quick=True, output_dir=str(tmp_path), seed=0, no_progress=True, **kw)


def test_sgd_iterates_experiment_smoke(tmp_path, capsys):
    import json

    from pyro_fa.experiments import sgd_iterates

    args = _args(tmp_path, trials=1, pretrain_epochs=3, epochs=12, window=5, window_batch=50)
    assert sgd_iterates.run(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["settings"]) == {"lr=0.1,lambda=0.1", "lr=0.1,lambda=0.001", "lr=0.01,lambda=0.1",
                                    "lr=0.01,lambda=0.001"}
    assert (tmp_path / "figure_6_1.png").exists() and (tmp_path / "figure_6_2.png").exists()
    assert "(0.0666 ± 0.0078)" in capsys.readouterr().out


def test_linreg_ensembles_experiment_smoke(tmp_path, capsys):
    import json
    import os

    from pyro_fa.experiments import linreg_ensembles

    if not os.environ.get("PYRO_FA_DATA"):
        pytest.skip("needs the UCI data (PYRO_FA_DATA)")
    args = _args(tmp_path, data_dir=None, datasets=["yacht"], folds=1, pretrain_epochs=5, epochs=15)
    assert linreg_ensembles.run(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["yacht"]["ours"]) == {"pretrained", "swa", "sga_fa", "em_fa", "swag"}
    assert "(82.83 ± 7.42)" in capsys.readouterr().out


def test_em_default_fits_equally_weighted_moments_of_drifting_iterates():
    # SWAG's posterior is the equally weighted moments of the collected iterates; a
    # trajectory whose mean drifts is where weighting late iterates more (step_scale=2)
    # describes a different, wider distribution. Measured: 0.025 (default), 0.25 (2),
    # batch FA of the same vectors 0.001.
    g = torch.Generator().manual_seed(0)
    D, K, T = 50, 3, 3000
    F = torch.randn(D, K, generator=g, dtype=torch.float64)
    psi = 0.1 + 0.1 * torch.rand(D, generator=g, dtype=torch.float64)
    drift = 3 * torch.randn(D, generator=g, dtype=torch.float64)
    X = torch.linspace(0, 1, T, dtype=torch.float64)[:, None] * drift
    X += torch.randn(T, K, generator=g, dtype=torch.float64) @ F.T
    X += torch.randn(T, D, generator=g, dtype=torch.float64) * psi.sqrt()
    empirical = torch.cov(X.T, correction=0)

    def distance(step_scale=None):
        params = [torch.zeros(D, dtype=torch.float64)]
        kwargs = {} if step_scale is None else {"step_scale": step_scale}
        swag = SWAG(params, rank=K + 1, method="em", seed=0, **kwargs)
        for x in X:
            params[0].copy_(x)
            swag.collect()
        cov = swag.get_posterior().covariance_matrix
        return float(torch.linalg.norm(cov - empirical) / torch.linalg.norm(empirical))

    default = distance()
    assert default < 0.05
    assert distance(step_scale=2.0) > 4 * default
