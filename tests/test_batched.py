"""pyro_fa.nn.batched: the batched network against nn.Sequential, every replica against the Pyro class it
reproduces (loss and gradients), a batched fit against the same replicas fitted one by one, the scores
against pyro_fa.metrics, and the refusals."""
import doctest
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoLowRankMultivariateNormal, AutoNormal

from pyro_fa import AutoLowRankFactorGuide, FactorELBO, metrics
from pyro_fa.nn import BatchedMLP, BatchedVI, fit_batched, replica_log_likelihood, replica_metrics
from pyro_fa.nn.batched import evaluation, fit, mlp, vi as vi_module


def _toy(N=40, p=3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, p, generator=g)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(N, generator=g)
    return x.to(device), y.to(device)


@pytest.mark.parametrize("module", [mlp, vi_module, fit, evaluation])
def test_doctests(module):
    torch.set_default_dtype(torch.float32)  # the examples are a user's session
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


# ------------------------------------------------------------------ the network


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_mlp_forward_matches_nn_sequential(activation):
    net_mlp = BatchedMLP(3, (5, 4), activation)
    theta = net_mlp.init(2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 7, 3)
    out = net_mlp.forward(theta.unsqueeze(0).expand(3, -1, -1), x)
    assert out.shape == (3, 2, 7) and net_mlp.dim == 3 * 5 + 5 + 5 * 4 + 4 + 4 + 1
    act = torch.nn.ReLU if activation == "relu" else torch.nn.Tanh
    for r in range(2):
        net = torch.nn.Sequential(torch.nn.Linear(3, 5), act(), torch.nn.Linear(5, 4), act(), torch.nn.Linear(4, 1))
        i = 0
        with torch.no_grad():
            for lin in (net[0], net[2], net[4]):
                n = lin.in_features * lin.out_features
                lin.weight.copy_(theta[r, i:i + n].reshape(lin.in_features, lin.out_features).T)
                lin.bias.copy_(theta[r, i + n:i + n + lin.out_features])
                i += n + lin.out_features
        torch.testing.assert_close(out[1, r], net(x[r]).squeeze(-1))
        # to_module builds the same network, flatten reads it back
        torch.testing.assert_close(net_mlp.to_module(theta[r])(x[r]), net(x[r]))
        assert torch.equal(net_mlp.flatten(net), theta[r])
        assert BatchedMLP.from_module(net).__repr__() == net_mlp.__repr__()
    # shared inputs (N, p) broadcast over the replicas
    torch.testing.assert_close(net_mlp(theta, x[0]), net_mlp(theta, x[0].expand(2, -1, -1)))


def test_mlp_init_is_nn_linear_default():
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases, as nn.Linear's reset_parameters."""
    net_mlp = BatchedMLP(4, (50,))
    theta = net_mlp.init(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    first = theta[:, :4 * 50 + 50]
    assert first.abs().max() <= 0.5 and first.abs().max() > 0.49
    # variance of U(-b, b) is b^2 / 3
    assert abs(float(first.var()) - 0.25 / 3) < 0.003


def test_unflatten_names_and_shapes_are_those_of_the_module():
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    net_mlp = BatchedMLP.from_module(net)
    parts = net_mlp.unflatten(net_mlp.flatten(net))
    assert list(parts) == [name for name, _ in net.named_parameters()]
    for name, value in net.named_parameters():
        assert torch.equal(parts[name], value.detach())
    assert BatchedMLP(2, ()).dim == 3 and "linear" in repr(BatchedMLP(2, ()))


Lin, ReLU, Tanh = torch.nn.Linear, torch.nn.ReLU, torch.nn.Tanh


@pytest.mark.parametrize("net, exc, match", [
    (Lin(3, 1), TypeError, r"BatchedMLP\.from_module: net must be an nn\.Sequential .* got Linear\."),
    (torch.nn.Sequential(), ValueError, r"got an empty nn\.Sequential"),
    (torch.nn.Sequential(Lin(3, 4), torch.nn.Dropout(0.1), Lin(4, 1)), ValueError,
     r"layer 1 of net must be nn\.ReLU or nn\.Tanh .* got Dropout.*one at a time with BayesianNetwork\.fit"),
    (torch.nn.Sequential(Lin(3, 4), ReLU(), ReLU(), Lin(4, 1)), ValueError, r"layer 2 of net must be nn\.Linear"),
    (torch.nn.Sequential(Lin(3, 4), ReLU(), Lin(4, 4), Tanh(), Lin(4, 1)), ValueError,
     r"activations must all be of one kind, nn\.ReLU or nn\.Tanh, got \['ReLU', 'Tanh'\]"),
    (torch.nn.Sequential(Lin(3, 4), ReLU()), ValueError, r"the last layer of net must be nn\.Linear\(\.\.\., 1\)"),
    (torch.nn.Sequential(Lin(3, 4), ReLU(), Lin(4, 2)), ValueError, r"must have one output .* got 2 outputs"),
    (torch.nn.Sequential(Lin(3, 4, bias=False), ReLU(), Lin(4, 1)), ValueError, r"must have a bias"),
    (torch.nn.Sequential(Lin(3, 4), ReLU(), Lin(5, 1)), ValueError, r"net's layers must chain"),
])
def test_from_module_refuses_other_architectures(net, exc, match):
    with pytest.raises(exc, match=match):
        BatchedMLP.from_module(net)


def test_mlp_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"BatchedMLP: in_features must be a positive int, got 0\."):
        BatchedMLP(0, (3,))
    with pytest.raises(ValueError, match=r"BatchedMLP: hidden must be a sequence of positive ints, got \(3, 0\)\."):
        BatchedMLP(2, (3, 0))
    with pytest.raises(ValueError, match=r"BatchedMLP: hidden must be a sequence of positive ints, got 5\."):
        BatchedMLP(2, 5)
    with pytest.raises(ValueError, match=r"BatchedMLP: activation must be one of \('relu', 'tanh'\), got 'gelu'\."):
        BatchedMLP(2, (3,), "gelu")
    net_mlp = BatchedMLP(2, (3,))
    with pytest.raises(ValueError, match=r"BatchedMLP\.unflatten: theta must be a Tensor of shape \(\.\.\., 13\), "
                                         r"got \(12,\)\."):
        net_mlp.unflatten(torch.zeros(12))
    with pytest.raises(ValueError, match=r"BatchedMLP\.to_module: theta must be a Tensor of shape \(13,\), got "
                                         r"\(2, 13\)\."):
        net_mlp.to_module(torch.zeros(2, 13))
    with pytest.raises(ValueError, match=r"BatchedMLP\.flatten: net must have this architecture"):
        net_mlp.flatten(torch.nn.Sequential(Lin(2, 4), ReLU(), Lin(4, 1)))


# ------------------------------------------------- one replica == the Pyro classes


def _pyro_model(net_mlp, prior, precision):
    scale = precision ** -0.5 if prior == "gaussian" else (2 * precision) ** -0.5

    def model(x, y):
        base = dist.Normal(0.0, scale) if prior == "gaussian" else dist.Laplace(0.0, scale)
        w = pyro.sample("w", base.expand([net_mlp.dim]).to_event(1))
        noise = pyro.param("noise", torch.tensor(0.7), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(net_mlp.forward(w, x.unsqueeze(0)).squeeze(0), noise), obs=y)

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
    ("fa", "gaussian", lambda m: AutoLowRankFactorGuide(m, rank=3, init_scale=0.01), FactorELBO),
    ("fa", "laplace", lambda m: AutoLowRankFactorGuide(m, rank=3, init_scale=0.01), FactorELBO),
    ("ppca", "gaussian", lambda m: AutoLowRankFactorGuide(m, rank=3, init_scale=0.01, noise="isotropic"), FactorELBO),
    ("lowrank", "gaussian", lambda m: AutoLowRankMultivariateNormal(m, rank=3), Trace_ELBO),
    ("normal", "laplace", AutoNormal, Trace_ELBO),
    ("delta", "gaussian", AutoDelta, Trace_ELBO),
]


@pytest.mark.parametrize("family,prior,make_guide,elbo_cls", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_replica_loss_and_gradients_equal_pyro(family, prior, make_guide, elbo_cls):
    """Same parameters, same random draws: the replica's loss and gradients are Pyro's, to rounding."""
    x, y = _toy()
    net_mlp = BatchedMLP(3, (6,))
    vi = BatchedVI(net_mlp, family, prior, torch.tensor([0.8]), torch.tensor([1e-2]), rank=3,
                   generator=torch.Generator().manual_seed(1))
    assert vi.dtype == torch.float64  # the tests' default dtype, from the precision tensor
    with torch.no_grad():  # a non-trivial q and noise
        g = torch.Generator().manual_seed(2)
        for v in vi.params().values():
            v.add_(0.2 * torch.randn(v.shape, generator=g, dtype=v.dtype))
    model = _pyro_model(net_mlp, prior, 0.8)
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
    x, y = _toy(N=30)
    R, S = 3, 2
    net_mlp = BatchedMLP(3, (5,))
    sigma = torch.tensor([0.05, math.nan, 0.2]) if family == "ppca" else None
    vi = BatchedVI(net_mlp, family, "laplace", torch.tensor([0.5, 1.0, 2.0]), 1e-2, rank=2,
                   guide_noise_scale=sigma, estimator=estimator, generator=torch.Generator().manual_seed(0))
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
    vi = BatchedVI(BatchedMLP(3, (6,)), "fa", "gaussian", torch.tensor([0.5, 1.0, 2.0]),
                   torch.tensor([1e-2, 3e-3, 1e-2]), rank=2, generator=torch.Generator().manual_seed(0))
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


def test_ppca_replicas_mix_fixed_and_learned_sigma():
    """guide_noise_scale: a fixed sigma per replica (NaN: learned); fixed replicas get no gradient on it."""
    net_mlp = BatchedMLP(3, (4,))
    vi = BatchedVI(net_mlp, "ppca", "gaussian", 1.0, 1e-2, rank=2, guide_noise_scale=torch.tensor([math.nan, 0.05]),
                   generator=torch.Generator().manual_seed(0))
    assert vi.replicas == 2
    q = vi.distribution()
    assert torch.allclose(q.cov_diag[1], torch.full((net_mlp.dim,), 0.05**2))
    assert torch.allclose(q.cov_diag[0], torch.full((net_mlp.dim,), 0.01**2 / 2))  # init_scale / sqrt(2), squared
    x, y = _toy()
    vi.loss(x.expand(2, -1, -1), y.expand(2, -1), 40).sum().backward()
    g = vi.params()["log_scale"].grad
    assert g[0].abs().sum() > 0 and g[1].abs().sum() == 0


def test_fixed_likelihood_noise_and_initial_means():
    """noise_scale fixes sigma_y (no log_noise parameter); init_loc starts every replica at the given weights."""
    net = torch.nn.Sequential(Lin(3, 4), ReLU(), Lin(4, 1))
    net_mlp = BatchedMLP.from_module(net)
    vi = BatchedVI(net_mlp, "normal", noise_scale=torch.tensor([0.3, 0.5]), init_loc=net_mlp.flatten(net))
    assert "log_noise" not in vi.params() and torch.equal(vi.likelihood_scale(), torch.tensor([0.3, 0.5]))
    assert torch.equal(vi.params()["loc"], net_mlp.flatten(net).expand(2, -1))
    means, noise_var = vi.predict(torch.randn(6, 3), num_samples=4)
    assert means.shape == (4, 2, 6) and torch.allclose(noise_var, torch.tensor([[0.09], [0.25]]))


def test_batched_vi_rejects_bad_options():
    net_mlp = BatchedMLP(2, (3,))
    cases = [
        (dict(mlp=torch.nn.Linear(2, 1)), TypeError, r"BatchedVI: mlp must be a BatchedMLP, got Linear\."),
        (dict(family="flow"), ValueError, r"BatchedVI: family must be one of \('fa', .*\), got 'flow'\."),
        (dict(prior="horseshoe"), ValueError, r"BatchedVI: prior must be one of \('gaussian', 'laplace'\), got "
                                              r"'horseshoe'\."),
        (dict(estimator="iwae"), ValueError, r"BatchedVI: estimator must be one of \('factor', 'trace'\), got 'iwae'"),
        (dict(precision=torch.ones(2), lr=torch.ones(3)), ValueError,
         r"BatchedVI: lr must be a scalar or hold one entry per replica \(2, from precision\), got 3 entries\."),
        (dict(precision=torch.ones(2), replicas=3), ValueError,
         r"BatchedVI: precision must be a scalar or hold one entry per replica \(3, from replicas\), got 2"),
        (dict(replicas=0), ValueError, r"BatchedVI: replicas must be a positive int, got 0\."),
        (dict(precision=torch.tensor([1.0, -1.0])), ValueError,
         r"BatchedVI: precision must be positive and finite, got \[1\.0, -1\.0\]\."),
        (dict(lr=math.inf), ValueError, r"BatchedVI: lr must be positive and finite, got \[inf\]\."),
        (dict(precision="high"), TypeError, r"BatchedVI: precision must be a float or a Tensor of shape \(R,\), "
                                            r"got str\."),
        (dict(precision=torch.ones(2, 2)), ValueError, r"precision must be a float or a Tensor of shape \(R,\), "
                                                       r"got shape \(2, 2\)\."),
        (dict(rank=0), ValueError, r"BatchedVI: rank must be an int in \[1, D=13\], got 0\."),
        (dict(rank=14), ValueError, r"BatchedVI: rank must be an int in \[1, D=13\], got 14\."),
        (dict(init_scale=0.0), ValueError, r"BatchedVI: init_scale must be a positive finite float, got 0\.0\."),
        (dict(init_noise_scale=-1.0), ValueError, r"BatchedVI: init_noise_scale must be a positive finite float"),
        (dict(noise_scale=-0.1), ValueError, r"BatchedVI: noise_scale must be positive and finite, got \[-0\.1"),
        (dict(guide_noise_scale=0.1), ValueError, r"BatchedVI: guide_noise_scale must be None for family='fa', "
                                                  r"got 0\.1; it fixes the isotropic noise of family='ppca'\."),
        (dict(family="ppca", guide_noise_scale=torch.tensor([-1.0])), ValueError,
         r"BatchedVI: guide_noise_scale must be positive and finite, or NaN \(learned\), got \[-1\.0\]\."),
        (dict(init_loc=torch.zeros(12)), ValueError, r"BatchedVI: init_loc must be a Tensor of shape \(13,\) or "
                                                     r"\(R, 13\), got \(12,\)\."),
        (dict(init_loc=torch.full((13,), math.nan)), ValueError, r"BatchedVI: init_loc must be finite"),
    ]
    for kwargs, exc, match in cases:
        args = {"mlp": net_mlp, "rank": 2, **kwargs}
        with pytest.raises(exc, match=match):
            BatchedVI(args.pop("mlp"), **args)


# ------------------------------------------------- a batch of R fits == R fits one by one


class _Draws:
    """Record the random numbers of a batched fit; replay replica r's share of them to a one-replica fit."""

    def __init__(self, monkeypatch):
        self.real = {"randn": torch.randn, "randint": torch.randint,
                     "standard_normal": torch.distributions.normal._standard_normal}
        self.log, self.replica = [], None
        monkeypatch.setattr(torch, "randn", self._wrap("randn", -2))
        monkeypatch.setattr(torch, "randint", self._wrap("randint", 0))
        monkeypatch.setattr(torch.distributions.normal, "_standard_normal", self._wrap("standard_normal", -2))

    def _wrap(self, name, dim):
        def draw(*args, **kwargs):
            if self.replica is None:  # recording
                out = self.real[name](*args, **kwargs)
                self.log.append(out)
                return out
            out = self.log.pop(0)
            return out.narrow(dim % out.dim(), self.replica, 1).clone()
        return draw


@pytest.mark.parametrize("family", ["fa", "ppca", "lowrank", "normal", "delta"])
def test_a_batched_fit_equals_the_replicas_fitted_one_by_one(monkeypatch, family):
    """Minibatches, Monte Carlo draws, Adam, the cosine schedule: replica r of one batched fit is, to rounding,
    the one-replica fit of the same start with the same draws (each replica's own learning rate and prior)."""
    x, y = _toy(N=30)
    net_mlp = BatchedMLP(3, (5,))
    precision, lr = torch.tensor([0.3, 1.0, 3.0]), torch.tensor([1e-2, 3e-3, 1e-2])
    sigma = torch.tensor([math.nan, 0.05, math.nan]) if family == "ppca" else None
    kw = dict(rank=2) if family in ("fa", "ppca", "lowrank") else {}
    batched = BatchedVI(net_mlp, family, "laplace", precision, lr, guide_noise_scale=sigma,
                        generator=torch.Generator().manual_seed(0), **kw)
    start = batched.state()
    draws = _Draws(monkeypatch)
    losses = fit_batched(batched, x, y, 12, batch_size=8, particles=2, lr_schedule="cosine", total_steps=20,
                         generator=torch.Generator().manual_seed(1))
    log = list(draws.log)
    assert losses.shape == (12, 3) and len(log) >= 12  # a minibatch per step, at least
    for r in range(3):
        one = BatchedVI(net_mlp, family, "laplace", precision[r:r + 1], lr[r:r + 1],
                        guide_noise_scale=None if sigma is None else sigma[r:r + 1], **kw)
        with torch.no_grad():
            for k, v in one.params().items():
                v.copy_(start[k][r:r + 1])
        draws.log, draws.replica = list(log), r
        alone = fit_batched(one, x, y, 12, batch_size=8, particles=2, lr_schedule="cosine", total_steps=20)
        assert not draws.log  # the same number of draws, replayed in order
        draws.replica = None
        torch.testing.assert_close(alone[:, 0], losses[:, r], rtol=1e-9, atol=1e-9)
        for k, v in one.state().items():
            torch.testing.assert_close(v[0], batched.state()[k][r], rtol=1e-9, atol=1e-10)


def test_per_replica_data_equals_shared_data_and_callback_stops(device):
    x, y = _toy(device=device)

    def make():
        return BatchedVI(BatchedMLP(3, (4,)), "fa", precision=torch.tensor([1.0, 2.0], device=device), lr=1e-2,
                         rank=2, generator=torch.Generator().manual_seed(0))

    assert make().device == x.device
    a, b = make(), make()
    torch.manual_seed(0)
    la = fit_batched(a, x, y, 6, batch_size=10, generator=torch.Generator(device).manual_seed(2))
    torch.manual_seed(0)
    lb = fit_batched(b, x.expand(2, -1, -1), y.expand(2, -1), 6, batch_size=10,
                     generator=torch.Generator(device).manual_seed(2))
    torch.testing.assert_close(la, lb)
    seen = []
    stopped = fit_batched(make(), x, y, 50, callback=lambda step, model, loss: seen.append(loss.shape) or step == 4)
    assert stopped.shape == (4, 2) and seen == [(2,)] * 4
    counted = []
    fit_batched(make(), x, y, 7, progress=counted.append)
    assert sum(counted) == 7


def test_fit_batched_takes_columns_of_targets_as_the_flat_targets():
    """y of shape (N, 1) or (R, N, 1) trains exactly as (N,) or (R, N)."""
    x, y = _toy()
    per_replica = torch.stack([y, y.flip(0)])
    for flat, column in ((y, y.unsqueeze(-1)), (per_replica, per_replica.unsqueeze(-1))):
        runs = []
        for target in (flat, column):
            torch.manual_seed(1)
            model = BatchedVI(BatchedMLP(3, (4,)), "fa", precision=torch.ones(2), rank=2, lr=1e-2,
                              generator=torch.Generator().manual_seed(0))
            losses = fit_batched(model, x, target, steps=15, batch_size=16, progress=False,
                                 generator=torch.Generator().manual_seed(1))
            runs.append((losses, [v.detach().clone() for v in model.params().values()]))
        torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=0)
        for a, b in zip(runs[1][1], runs[0][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

def test_fit_batched_refuses_bad_input():
    x, y = _toy()
    model = BatchedVI(BatchedMLP(3, (4,)), "fa", precision=torch.ones(2), rank=2)
    bad = x.clone()
    bad[3, 1] = math.nan
    cases = [
        (dict(model=object()), TypeError, r"fit_batched: model must be a BatchedVI, got object\."),
        (dict(x=x.tolist()), TypeError, r"fit_batched: x must be a torch\.Tensor of shape \(M, 3\) or \(2, M, 3\), "
                                        r"got list\."),
        (dict(x=x[:, :2]), ValueError, r"fit_batched: x must have shape \(M, 3\) or \(2, M, 3\), got \(40, 2\)\."),
        (dict(x=x.expand(3, -1, -1)), ValueError, r"x must have shape \(M, 3\) or \(2, M, 3\), got \(3, 40, 3\)\."),
        (dict(x=x.float()), ValueError, r"fit_batched: x must have the model's dtype torch\.float64 and device cpu, "
                                        r"got torch\.float32 on cpu\. Move it"),
        (dict(y=y[:30]), ValueError, r"fit_batched: y must have shape \(40,\) or \(2, 40\) \(or those with a trailing "
                                     r"1\), one target per row of x of shape \(40, 3\), got \(30,\)\."),
        (dict(y=y.unsqueeze(-1).expand(40, 2)), ValueError, r"y must have shape \(40,\) or \(2, 40\).*got \(40, 2\)\."),
        (dict(y=y.expand(3, 40).unsqueeze(-1)), ValueError,
         r"y must have shape \(40,\) or \(2, 40\).*got \(3, 40, 1\)\."),
        (dict(y=y.float()), ValueError, r"fit_batched: y must have the model's dtype torch\.float64"),
        (dict(y=list(y)), TypeError, r"fit_batched: y must be a torch\.Tensor"),
        (dict(x=bad), ValueError, r"fit_batched: x must be finite, got NaN or inf in 1 entries; nothing was trained"),
        (dict(steps=0), ValueError, r"fit_batched: steps must be a positive int, got 0\."),
        (dict(batch_size=0), ValueError, r"fit_batched: batch_size must be a positive int, got 0\."),
        (dict(particles=True), ValueError, r"fit_batched: particles must be a positive int, got True\."),
        (dict(lr_schedule="step"), ValueError, r"fit_batched: lr_schedule must be one of \('constant', 'cosine'\) or "
                                               r"a callable optimizer -> scheduler, got 'step'\."),
        (dict(total_steps=3), ValueError, r"fit_batched: total_steps must be at least steps \(5\), got 3\."),
        (dict(generator=1), ValueError, r"fit_batched: generator must be a torch\.Generator \(on the CPU or on x's "
                                        r"device\), got int\."),
        (dict(callback=3), TypeError, r"fit_batched: callback must be callable, got int\."),
        (dict(progress="yes"), TypeError, r"fit_batched: progress must be a bool or a callable, got str\."),
    ]
    before = model.state()
    for kwargs, exc, match in cases:
        args = {"model": model, "x": x, "y": y, "steps": 5, **kwargs}
        with pytest.raises(exc, match=match):
            fit_batched(args.pop("model"), args.pop("x"), args.pop("y"), args.pop("steps"), **args)
    assert all(torch.equal(v, before[k]) for k, v in model.state().items())  # nothing was trained
    with pytest.raises(ValueError, match=r"BatchedVI\.predict: num_samples must be a positive int, got 0\."):
        model.predict(x, 0)
    with pytest.raises(ValueError, match=r"BatchedVI\.predict: x must have shape \(M, 3\) or \(2, M, 3\)"):
        model.predict(x.T)


def test_a_callable_schedule_is_stepped_once_per_step():
    x, y = _toy()
    model = BatchedVI(BatchedMLP(3, (4,)), "delta", lr=0.1)
    scheds = []

    def make(opt):
        scheds.append(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
        return scheds[-1]

    fit_batched(model, x, y, 5, lr_schedule=make)
    assert scheds[0].last_epoch == 5 and scheds[0].get_last_lr() == [pytest.approx(0.1 * 0.5 ** 2)]


# ------------------------------------------------------------------ the scores


def test_replica_scores_equal_metrics_per_replica():
    g = torch.Generator().manual_seed(0)
    means = torch.randn(7, 3, 5, generator=g)
    nv = torch.rand(3, 1, generator=g) + 0.1
    y = torch.randn(3, 5, generator=g)
    y_std = torch.tensor([1.0, 2.0, 0.5])
    ll = replica_log_likelihood(means, nv, y, y_std=y_std)
    full = replica_metrics(means, nv.squeeze(-1), y, y_std=y_std)
    for r in range(3):
        ref = metrics.gaussian_log_likelihood(means[:, r], nv[r], y[r], y_std=float(y_std[r]))
        torch.testing.assert_close(ll[r], ref)
        torch.testing.assert_close(full["log_likelihood"][r], ref)
        torch.testing.assert_close(full["rmse"][r], metrics.rmse(means[:, r], y[r], float(y_std[r])))
        torch.testing.assert_close(full["calibration_error"][r], metrics.calibration(means[:, r], nv[r], y[r]).error)
    # shared targets and a scalar scale; per-draw noise (S, R, 1)
    shared = replica_metrics(means, nv.expand(7, 3, 1), y[0], y_std=2.0)
    torch.testing.assert_close(shared["rmse"][1], metrics.rmse(means[:, 1], y[0], 2.0))
    bad = means.clone()
    bad[0, 1, 0] = math.nan
    scores = replica_log_likelihood(bad, nv, y)
    assert scores[1] == -math.inf and torch.isfinite(scores[[0, 2]]).all()
    with pytest.raises(FloatingPointError, match=r"replica_metrics: means and noise_var must be finite, got "
                                                 r"non-finite values in replicas \[1\] \(their fits diverged\)\."):
        replica_metrics(bad, nv, y)


def test_replica_scores_refuse_bad_shapes():
    means, nv, y = torch.zeros(4, 2, 3), torch.ones(2, 1), torch.zeros(2, 3)
    cases = [
        (dict(means=means[0]), ValueError, r"means must have shape \(S, R, M\), got \(2, 3\)\."),
        (dict(noise_var=torch.ones(3)), ValueError, r"noise_var must have shape \(2,\), \(2, 1\) or \(4, 2, 1\), "
                                                    r"got \(3,\)\."),
        (dict(y=torch.zeros(2, 4)), ValueError, r"y must have shape \(3,\) or \(2, 3\), one target per predicted "
                                                r"point, got \(2, 4\)\."),
        (dict(y_std=torch.tensor([1.0, 0.0])), ValueError, r"y_std must be a positive finite float or a Tensor of "
                                                           r"shape \(2,\) of them, got \[1\.0, 0\.0\]\."),
        (dict(y=[0.0]), TypeError, r"y must be a torch\.Tensor, got list\."),
    ]
    for fn in (replica_log_likelihood, replica_metrics):
        for kwargs, exc, match in cases:
            args = {"means": means, "noise_var": nv, "y": y, **kwargs}
            with pytest.raises(exc, match=rf"{fn.__name__}: {match}"):
                fn(args.pop("means"), args.pop("noise_var"), args.pop("y"), **args)


@pytest.mark.slow
def test_batched_fits_learn_a_regression():
    """Five seeds of a 1x20 network: all far better than predicting the mean, evaluated per replica."""
    torch.manual_seed(0)
    x = torch.randn(300, 2)
    y = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 0.1 * torch.randn(300)
    model = BatchedVI(BatchedMLP(2, (20,)), "fa", precision=1.0, lr=1e-2, replicas=5, rank=3,
                      generator=torch.Generator().manual_seed(0))
    fit_batched(model, x, y, 1500, batch_size=64, lr_schedule="cosine", generator=torch.Generator().manual_seed(1))
    scores = model.evaluate(x, y, num_samples=50)
    assert (scores["rmse"] < 0.3 * float(y.std())).all() and (scores["log_likelihood"] > -0.5).all()


@pytest.mark.slow
def test_the_docs_page_examples_run():
    """docs/batched_training.md's code runs as written (a grid x seeds through fit_many, then the batched API)."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "batched_training.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) == 2
    torch.set_default_dtype(torch.float32)  # a user's session
    for i, block in enumerate(blocks):
        namespace = {"__name__": "__docs__"}
        exec(compile(block, f"batched_training.md[python block {i}]", "exec"), namespace)
    assert namespace["losses"].shape == (300, 15) and len(namespace["history"]) == 3
