import math

import pyro
import pytest
import torch
from pyro.infer import SVI
from pyro.optim import Adam

from pyro_fa import FactorELBO, GaussianPrior, LaplacePrior, metrics
from pyro_fa.nn import BayesianNetwork

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _loader(x, y, batch=50):
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True)


@pytest.mark.slow
def test_gaussian_regression_learns_and_evaluates():
    x = torch.linspace(-2, 2, 128).unsqueeze(-1)
    y = torch.sin(2 * x).squeeze(-1) + 0.1 * torch.randn(128)
    net = torch.nn.Sequential(torch.nn.Linear(1, 20), torch.nn.Tanh(), torch.nn.Linear(20, 1))
    bnn = BayesianNetwork(net, GaussianPrior(1.0), rank=4)
    hist = bnn.fit(_loader(x, y, batch=64), Adam({"lr": 0.02}), epochs=80, progress=False)
    assert hist[-1] < hist[0]
    out = bnn.predict(x, num_samples=7)
    assert out.shape == (7, 128, 1)
    res = bnn.evaluate(x, y, num_samples=30)
    baseline = float(y.std())
    assert res["rmse"] < 0.5 * baseline
    assert res["log_likelihood"] > -1.5
    assert bnn.learned_noise_scale.item() < 0.5
    assert pyro.param(f"{bnn.name}.noise_scale").item() == bnn.learned_noise_scale.item()


@pytest.mark.slow
def test_two_networks_keep_their_own_parameters():
    """Each network has its own guide and noise in Pyro's param store: fitting B leaves A as it was."""
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 100).unsqueeze(-1)
    y1 = 3 * x.squeeze(-1) + 0.1 * torch.randn(100)
    y2 = 2 * torch.randn(100)
    a = BayesianNetwork(torch.nn.Linear(1, 1), GaussianPrior(1.0), rank=1, name="a")
    a.fit(_loader(x, y1), Adam({"lr": 0.05}), epochs=60, progress=False)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    rmse_a = a.evaluate(x, y1, num_samples=20)["rmse"]
    b = BayesianNetwork(torch.nn.Linear(1, 1), GaussianPrior(1.0), rank=1)
    b.fit(_loader(x, y2), Adam({"lr": 0.05}), epochs=20, progress=False)
    assert b.name != "a" and all(k.startswith(("a.", b.name + ".")) for k in pyro.get_param_store().keys())
    for k, v in before.items():
        assert torch.equal(pyro.param(k).detach(), v), k
    assert a.evaluate(x, y1, num_samples=20)["rmse"] == pytest.approx(rmse_a, rel=0.3) and rmse_a < 0.5 * y1.std()
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        BayesianNetwork(torch.nn.Linear(1, 1), GaussianPrior(1.0), name="")


@pytest.mark.slow
def test_classification_bernoulli_and_categorical():
    x = torch.randn(100, 2)
    y = (x[:, 0] + x[:, 1] > 0).float()
    net = torch.nn.Sequential(torch.nn.Linear(2, 1))
    bnn = BayesianNetwork(net, LaplacePrior(1.0), likelihood="bernoulli", rank=2)
    bnn.fit(_loader(x, y), Adam({"lr": 0.05}), epochs=15, progress=False)
    assert bnn.evaluate(x, y, num_samples=20)["accuracy"] > 0.85
    pyro.clear_param_store()
    yc = y.long()
    bnn = BayesianNetwork(torch.nn.Linear(2, 2), GaussianPrior(1.0), likelihood="categorical", rank=2)
    bnn.fit(_loader(x, yc), Adam({"lr": 0.05}), epochs=15, progress=False)
    res = bnn.evaluate(x, yc, num_samples=20)
    assert res["accuracy"] > 0.85 and res["log_likelihood"] < 0


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"net": 3}, TypeError, r"BayesianNetwork: net must be a torch\.nn\.Module, got 3\."),
        ({"prior": 1.0}, TypeError, r"BayesianNetwork: prior must be a pyro_fa\.infer\.priors\.FactorisedPrior "
                                       r"\(GaussianPrior, LaplacePrior or any subclass\), got 1\.0\."),
        ({"likelihood": "poisson"}, ValueError, r"BayesianNetwork: likelihood must be one of .*, got 'poisson'\."),
        ({"noise_scale": -1.0}, ValueError, r"BayesianNetwork: noise_scale must be a positive finite float, got -1\.0\."),
        ({"noise_scale": float("inf")}, ValueError, r"BayesianNetwork: noise_scale must be a positive finite float, got inf\."),
        ({"num_particles": 0}, ValueError, r"BayesianNetwork: num_particles must be an integer >= 1, got 0\."),
        ({"likelihood": "bernoulli", "noise_scale": 1.0}, ValueError, r"BayesianNetwork: noise_scale must be None for likelihood='bernoulli', got 1\.0\."),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    args = {"net": torch.nn.Linear(2, 1), "prior": GaussianPrior()}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        BayesianNetwork(**args)


def test_use_errors():
    bnn = BayesianNetwork(torch.nn.Linear(2, 1), GaussianPrior(), noise_scale=0.5)
    with pytest.raises(RuntimeError, match=r"BayesianNetwork\.predict: the guide must be trained first, got one "
                       r"with no parameters .*'BayesianNetwork(_\d+)?\.guide\.\*'.*Call fit\(\)"):
        bnn.predict(torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"BayesianNetwork\.predict: num_samples must be a positive int, got 0\."):
        bnn.predict(torch.randn(3, 2), num_samples=0)
    with pytest.raises(ValueError, match=r"BayesianNetwork\.fit: epochs must be a positive int, got 0\."):
        bnn.fit([], Adam({"lr": 0.1}), epochs=0)


# ------------------------------------------------------------------ prediction helpers and bad targets
def _trained(likelihood, n=40, steps=30, seed=0, device="cpu", **kwargs):
    """A small network trained by a user's own SVI loop (not fit()); returns (bnn, x, y)."""
    torch.manual_seed(seed)
    x = torch.randn(n, 3, device=device)
    if likelihood == "gaussian":
        y, out = x.sum(-1) + 0.1 * torch.randn(n, device=device), 1
    elif likelihood == "bernoulli":
        y, out = (x[:, 0] > 0).float(), 1
    else:
        y, out = (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), 3
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, out)).to(device)
    bnn = BayesianNetwork(net, GaussianPrior(1.0), likelihood, rank=2, **kwargs)
    svi = SVI(bnn.model, bnn.guide, Adam({"lr": 0.05}), FactorELBO())
    for _ in range(steps):
        svi.step(x, y)
    return bnn, x, y


def test_predict_accepts_a_network_trained_by_the_users_own_svi_loop():
    bnn, x, y = _trained("gaussian", noise_scale=0.1)
    assert not bnn._fitted and bnn.guide.prototype_trace is not None
    torch.manual_seed(1)
    out = bnn.predict(x, num_samples=5)
    assert out.shape == (5, 40, 1)
    # the same draws as the guide's own: predict conditions the module on them
    torch.manual_seed(1)
    w = bnn.guide()
    assert torch.allclose(out[0], pyro.poutine.condition(bnn.module, data=w)(x))
    assert bnn.evaluate(x, y, num_samples=20)["rmse"] < 0.5 * float(y.std())


def test_predict_builds_the_guide_from_parameters_in_the_param_store(tmp_path):
    """A fresh network whose guide's parameters were loaded into Pyro's param store predicts with them."""
    bnn, x, y = _trained("categorical", name="digits")
    path = tmp_path / "params.pt"
    pyro.get_param_store().save(path)
    torch.manual_seed(2)
    expected = bnn.predict_proba(x, num_samples=6)
    pyro.clear_param_store()
    fresh = BayesianNetwork(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)),
                            GaussianPrior(1.0), "categorical", rank=2, name="digits")
    with pytest.raises(RuntimeError, match=r"BayesianNetwork\.predict_proba: the guide must be trained first.*"
                                           r"'digits\.guide\.\*'"):
        fresh.predict_proba(x)
    pyro.get_param_store().load(path)
    torch.manual_seed(2)
    got = fresh.predict_proba(x, num_samples=6)
    assert torch.allclose(got, expected)
    assert torch.equal(pyro.param("digits.guide.loc").detach(), bnn.guide.loc.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_categorical_samples_and_probabilities(device):
    bnn, x, y = _trained("categorical", device=device)
    torch.manual_seed(3)
    logits = bnn.predict(x, num_samples=7)
    torch.manual_seed(3)
    samples = bnn.predictive_samples(x, num_samples=7)
    torch.manual_seed(3)
    proba = bnn.predict_proba(x, num_samples=7)
    assert samples.shape == (7, 40, 3) and proba.shape == (40, 3) and samples.device == x.device
    assert torch.allclose(samples, logits.softmax(-1))
    assert torch.allclose(samples.sum(-1), torch.ones(7, 40, device=device))
    assert torch.allclose(proba, samples.mean(0))
    # a loader's batches go through the same draws, and are moved to the guide's device
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=7)
    torch.manual_seed(3)
    assert torch.allclose(bnn.predictive_samples(loader, num_samples=7), samples, atol=1e-6)
    torch.manual_seed(3)
    res = bnn.evaluate(loader, num_samples=7)
    # oracle: the log of the averaged probabilities, in float64, by hand
    p = logits.double().softmax(-1).mean(0).cpu()
    ll = p[torch.arange(40), y.cpu()].log().mean()
    assert res["log_likelihood"] == pytest.approx(float(ll), abs=1e-5)
    assert res["log_likelihood"] == pytest.approx(-float(metrics.negative_log_likelihood(samples, y)), abs=1e-5)
    assert res["accuracy"] == pytest.approx(float((p.argmax(-1) == y.cpu()).double().mean()))
    assert res["brier"] == pytest.approx(float((p - torch.nn.functional.one_hot(y.cpu(), 3)).pow(2).sum(-1).mean()),
                                         abs=1e-5)
    assert res["ece"] == pytest.approx(float(metrics.expected_calibration_error(samples, y)), abs=1e-5)


def test_bernoulli_samples_and_probabilities():
    bnn, x, y = _trained("bernoulli")
    torch.manual_seed(4)
    logits = bnn.predict(x, num_samples=5).squeeze(-1)
    torch.manual_seed(4)
    samples = bnn.predictive_samples(x, num_samples=5)
    assert samples.shape == (5, 40, 2)
    assert torch.allclose(samples[..., 1], logits.sigmoid()) and torch.allclose(samples.sum(-1), torch.ones(5, 40))
    torch.manual_seed(4)
    assert torch.allclose(bnn.predict_proba(x, num_samples=5), samples.mean(0))
    torch.manual_seed(4)
    res = bnn.evaluate(x, y, num_samples=5)
    p1 = logits.double().sigmoid().mean(0)
    ll = torch.where(y.bool(), p1, 1 - p1).log().mean()
    assert res["log_likelihood"] == pytest.approx(float(ll), abs=1e-5)
    assert res["accuracy"] == pytest.approx(float(((p1 > 0.5).double() == y).double().mean()))


@pytest.mark.parametrize("learned_noise", [False, True])
def test_gaussian_log_likelihood_is_that_of_the_model_average(learned_noise):
    """evaluate's log-likelihood is log (1/S) sum_s N(y; f_s(x), sigma^2), not the average of per-draw ones."""
    bnn, x, y = _trained("gaussian", **({} if learned_noise else {"noise_scale": 0.3}))
    sigma = bnn.learned_noise_scale.item() if learned_noise else 0.3
    torch.manual_seed(5)
    means = bnn.predictive_samples(x, num_samples=9)
    torch.manual_seed(5)
    res = bnn.evaluate(x, y, num_samples=9)
    assert means.shape == (9, 40)
    oracle = metrics.gaussian_log_likelihood(means.double(), sigma ** 2, y.double())
    assert res["log_likelihood"] == pytest.approx(float(oracle), abs=1e-5)
    per_draw = torch.distributions.Normal(means.double(), sigma).log_prob(y.double()).mean()
    assert res["log_likelihood"] >= float(per_draw)  # Jensen: the mixture is at least the average
    assert res["rmse"] == pytest.approx(float(metrics.rmse(means, y)), rel=1e-5)


def test_evaluate_refuses_a_column_target_instead_of_broadcasting():
    """The new-user trial of issue 17: a (N, 1) target gave RMSE 2.75 by broadcasting where 0.135 was right."""
    bnn, x, y = _trained("gaussian", noise_scale=0.1, steps=60)
    with pytest.raises(ValueError, match=r"BayesianNetwork\.evaluate: y must have shape \(40,\), one target per "
                                         r"input like the prediction of shape \(40,\), got \(40, 1\)\. Flatten it"):
        bnn.evaluate(x, y.unsqueeze(-1))
    torch.manual_seed(0)
    right = bnn.evaluate(x, y, num_samples=10)["rmse"]
    torch.manual_seed(0)
    broadcast = (bnn.predictive_samples(x, num_samples=10).mean(0) - y.unsqueeze(-1)).pow(2).mean().sqrt()
    assert right < 0.5 * float(broadcast)


@pytest.mark.parametrize("likelihood", ["gaussian", "bernoulli", "categorical"])
def test_evaluate_refuses_targets_of_another_shape(likelihood):
    bnn, x, y = _trained(likelihood, steps=1)
    pred = r"\(40, 3\)" if likelihood == "categorical" else r"\(40,\)"
    for bad, got in ((y.unsqueeze(-1), r"\(40, 1\)\. Flatten it"), (y[:39], r"\(39,\)\."),
                     (y.unsqueeze(0).expand(2, -1), r"\(2, 40\)\.")):
        with pytest.raises(ValueError, match=rf"BayesianNetwork\.evaluate: y must have shape \(40,\), one target "
                                             rf"per input like the prediction of shape {pred}, got {got}"):
            bnn.evaluate(x, bad, num_samples=2)
    loader = [(x[:20], y[:20]), (x[20:], y[20:].unsqueeze(-1))]
    with pytest.raises(ValueError, match=r"the targets of batch 1 must have shape \(20,\).*got \(20, 1\)"):
        bnn.evaluate(loader, num_samples=2)
    with pytest.raises(ValueError, match=r"BayesianNetwork\.model: y must have shape \(40,\), one target per row "
                                         r"of x, got \(40, 1\)\. Flatten it"):
        bnn.fit([(x, y.unsqueeze(-1))], Adam({"lr": 0.01}), epochs=1, progress=False)


@pytest.mark.parametrize(
    "likelihood, make_y, exc, match",
    [
        ("categorical", lambda y: y.float(), TypeError, r"y must hold integer class labels for "
                                                        r"likelihood='categorical', got dtype torch\.float32\."),
        ("categorical", lambda y: y + 1, ValueError, r"y must be class labels in \[0, 3\), got values from 1 to 3\."),
        ("bernoulli", lambda y: 2 * y, ValueError, r"y must hold 0/1 labels for likelihood='bernoulli'"),
        ("gaussian", lambda y: y.index_fill(0, torch.tensor([3]), math.nan), ValueError,
         r"y must be finite, got NaN or inf in 1 entries\."),
        ("gaussian", lambda y: None, ValueError, r"y must be given: targets of shape \(40,\), got None\."),
        ("gaussian", lambda y: y.tolist(), TypeError, r"y must be a torch\.Tensor of shape \(40,\), got list\."),
    ],
)
def test_evaluate_refuses_bad_targets(likelihood, make_y, exc, match):
    bnn, x, y = _trained(likelihood, steps=1)
    with pytest.raises(exc, match=r"BayesianNetwork\.evaluate: " + match):
        bnn.evaluate(x, make_y(y), num_samples=2)


def test_bad_data_and_outputs():
    bnn, x, y = _trained("categorical", steps=1)
    with pytest.raises(ValueError, match=r"BayesianNetwork\.evaluate: y must be None when data is a loader of "
                                         r"\(x, y\) batches, got a Tensor\."):
        bnn.evaluate([(x, y)], y)
    with pytest.raises(TypeError, match=r"BayesianNetwork\.predict: data must be a Tensor of inputs or an iterable "
                                        r"of \(x, y\) batches \(e\.g\. a DataLoader\), got float\."):
        bnn.predict(1.0)
    with pytest.raises(TypeError, match=r"BayesianNetwork\.predict: data's batches must be Tensors or \(x, y\) "
                                        r"pairs of Tensors, got str\."):
        bnn.predict(["x"])
    with pytest.raises(ValueError, match=r"BayesianNetwork\.predictive_samples: data must hold at least one batch, "
                                         r"got none\."):
        bnn.predictive_samples([])
    assert bnn.predict([x[:5], (x[5:],)], num_samples=2).shape == (2, 40, 3)  # input-only batches
    # two outputs for two inputs: the model's plate does not notice, the prediction must
    gauss = BayesianNetwork(torch.nn.Linear(3, 2), GaussianPrior(), noise_scale=1.0, name="two_outputs")
    gauss.guide(x[:2])  # built by a first call, as one SVI step builds it
    with pytest.raises(ValueError, match=r"BayesianNetwork\.evaluate: the network's output must have shape \(N, 1\) "
                                         r"or \(N,\) for likelihood='gaussian', got \(2, 2\)\."):
        gauss.evaluate(x[:2], y[:2].float(), num_samples=2)
    with pytest.raises(ValueError, match=r"BayesianNetwork\.predict_proba: likelihood must be 'categorical' or "
                                         r"'bernoulli', got 'gaussian'\. Use predictive_samples\(\)"):
        gauss.predict_proba(x)
    binary = BayesianNetwork(torch.nn.Linear(3, 1), GaussianPrior(), "categorical", rank=2, name="one_logit")
    binary.guide(x, torch.zeros(40, dtype=torch.long))
    with pytest.raises(ValueError, match=r"BayesianNetwork\.predictive_samples: the network's output must be logits "
                                         r"of shape \(N, C\) with C >= 2 for likelihood='categorical', got \(40, 1\)\."):
        binary.predictive_samples(x, num_samples=2)


def test_learned_noise_must_be_in_the_param_store():
    bnn, x, y = _trained("gaussian", name="noisy")
    pyro.get_param_store().__delitem__("noisy.noise_scale")
    with pytest.raises(RuntimeError, match=r"BayesianNetwork\.evaluate: the learned noise scale must be in Pyro's "
                                           r"param store as 'noisy\.noise_scale', got none there"):
        bnn.evaluate(x, y, num_samples=2)


def test_fit_on_an_empty_loader_and_zero_particles_refused():
    net = torch.nn.Linear(2, 1)
    bnn = BayesianNetwork(net, GaussianPrior(1.0), noise_scale=0.1, name="empty_loader")
    with pytest.raises(ValueError, match=r"BayesianNetwork.fit: loader must yield at least one \(x, y\) batch"):
        bnn.fit([], Adam({"lr": 0.01}), epochs=1, progress=False)
    with pytest.raises(ValueError, match=r"FactorELBO: num_particles must be an integer >= 1, got 0"):
        FactorELBO(num_particles=0)


# ------------------------------------------------------------------ many copies in one batch (fit_many)
def _grid_problem(device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(30, 2, device=device)
    y = x[:, 0] - 0.5 * x[:, 1] + 0.1 * torch.randn(30, device=device)
    net = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).to(device)
    return net, x, y


def test_fit_many_returns_the_batched_fits_as_networks(device):
    """Each network's guide holds its replica's q (per site: means, variances; the spectrum of the covariance)
    and learned noise, exactly as the same fit through BatchedVI + fit_batched; the networks then predict."""
    from pyro_fa.nn import BatchedMLP, BatchedVI, fit_batched

    net, x, y = _grid_problem(device)
    cpu = x.device.type == "cpu"
    torch.manual_seed(1)
    bnns = BayesianNetwork.fit_many(net, [GaussianPrior(0.5), GaussianPrior(2.0)], x, y, 15, copies=2, lr=1e-2,
                                    rank=2, batch_size=10, generator=torch.Generator().manual_seed(3), progress=False,
                                    name="grid")
    mlp = BatchedMLP.from_module(net)
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(1)
    vi = BatchedVI(mlp, "fa", "gaussian", x.new_tensor([0.5, 0.5, 2.0, 2.0]), 1e-2, rank=2, generator=gen,
                   dtype=x.dtype, device=x.device)
    fit_batched(vi, x, y, 15, batch_size=10, generator=gen if cpu else None)
    q = vi.distribution()
    assert [b.name for b in bnns] == ["grid_0", "grid_1", "grid_2", "grid_3"]
    assert [b.prior.precision for b in bnns] == [0.5, 0.5, 2.0, 2.0]
    for r, bnn in enumerate(bnns):
        post = bnn.guide.get_posterior()
        for site, value in bnn.guide._unpack_latent(post.mean):
            torch.testing.assert_close(value, mlp.unflatten(q.mean[r])[site["name"]])
        for site, value in bnn.guide._unpack_latent(post.variance):
            torch.testing.assert_close(value, mlp.unflatten(q.variance[r])[site["name"]])
        torch.testing.assert_close(torch.linalg.eigvalsh(post.covariance_matrix),
                                   torch.linalg.eigvalsh(q.covariance_matrix[r]))
        assert float(bnn.learned_noise_scale) == pytest.approx(float(vi.likelihood_scale()[r].detach()), rel=1e-6)
        # the network at the posterior mean is the batched network at replica r's mean
        out = pyro.poutine.condition(bnn.module, data=bnn.guide.median())(x).squeeze(-1)
        torch.testing.assert_close(out, mlp(q.mean[r], x))
    res = bnns[1].evaluate(x, y, num_samples=10)
    assert set(res) == {"rmse", "log_likelihood"} and bnns[1].predict(x, num_samples=3).shape == (3, 30, 1)
    assert not torch.equal(bnns[0].guide.loc, bnns[1].guide.loc)  # two copies, two initialisations


def test_fit_many_from_the_modules_weights_with_a_laplace_prior_and_fixed_noise():
    from pyro_fa.nn import BatchedMLP

    net, x, y = _grid_problem()
    bnns = BayesianNetwork.fit_many(net, LaplacePrior(0.5), x, y, 1, copies=3, lr=1e-9, rank=2, noise_scale=0.2,
                                    init="module", progress=False)
    start = BatchedMLP.from_module(net).flatten(net)
    for bnn in bnns:
        assert bnn.learned_noise_scale is None and bnn.noise_scale == 0.2 and isinstance(bnn.prior, LaplacePrior)
        means = {site["name"]: value for site, value in bnn.guide._unpack_latent(bnn.guide.loc)}
        for name, value in net.named_parameters():
            torch.testing.assert_close(means[name], value.detach(), atol=1e-7, rtol=0)
    assert bnns[0].evaluate(x, y, num_samples=4)["rmse"] > 0
    assert start.shape == (21,)


def test_fit_many_takes_a_column_of_targets_as_the_flat_targets():
    """(N, 1), the shape of the network's output that the SWAG quick start trains on, gives the (N,) fit exactly."""
    net, x, y = _grid_problem()
    fits = []
    for target in (y, y.unsqueeze(-1)):
        torch.manual_seed(3)
        fits.append(BayesianNetwork.fit_many(net, GaussianPrior(1.0), x, target, 20, copies=2, lr=1e-2, rank=2,
                                             generator=torch.Generator().manual_seed(3), progress=False))
    for flat, column in zip(*fits):
        torch.testing.assert_close(column.guide.loc, flat.guide.loc, rtol=0, atol=0)
        torch.testing.assert_close(column.guide.factor, flat.guide.factor, rtol=0, atol=0)
        torch.testing.assert_close(column.learned_noise_scale, flat.learned_noise_scale, rtol=0, atol=0)
    assert fits[0][0].guide.loc.shape == (21,)

@pytest.mark.parametrize("change, exc, match", [
    (dict(net=torch.nn.Linear(2, 1)), TypeError, r"BayesianNetwork\.fit_many: net must be an nn\.Sequential of "
                                                 r"nn\.Linear layers .* got Linear\."),
    (dict(net=torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Dropout(0.1), torch.nn.Linear(5, 1))),
     ValueError, r"BayesianNetwork\.fit_many: layer 1 of net must be nn\.ReLU or nn\.Tanh .*got Dropout.*"
                 r"BayesianNetwork\.fit"),
    (dict(net=torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))), ValueError,
     r"fit_many: net must have one output"),
    (dict(priors=1.0), TypeError, r"fit_many: priors must be a registered pyro_fa\.infer\.priors\.FactorisedPrior "
                                  r"\(GaussianPrior, LaplacePrior or a subclass\), or a non-empty sequence of them, "
                                  r"got 1\.0\."),
    (dict(priors=[]), TypeError, r"fit_many: priors must be a registered pyro_fa\.infer\.priors\.FactorisedPrior"),
    (dict(priors=[GaussianPrior(), LaplacePrior()]), ValueError,
     r"fit_many: priors must all be of one class \(one batched prior for every copy\), got \['GaussianPrior', "
     r"'LaplacePrior'\]\."),
    (dict(steps=0), ValueError, r"fit_many: steps must be a positive int, got 0\."),
    (dict(copies=0), ValueError, r"fit_many: copies must be a positive int, got 0\."),
    (dict(rank=22), ValueError, r"fit_many: rank must be at most the number of weights D=21, got 22\."),
    (dict(batch_size=0), ValueError, r"fit_many: batch_size must be a positive int or None, got 0\."),
    (dict(lr=-1.0), ValueError, r"fit_many: lr must be a positive finite float, got -1\.0\."),
    (dict(noise_scale=0.0), ValueError, r"fit_many: noise_scale must be a positive finite float, got 0\.0\."),
    (dict(init="zeros"), ValueError, r"fit_many: init must be 'random' or 'module', got 'zeros'\."),
    (dict(generator=3), ValueError, r"fit_many: generator must be a CPU torch\.Generator, got int\."),
    (dict(x="x"), TypeError, r"fit_many: x must be a torch\.Tensor, got str\."),
    (dict(x=torch.zeros(30, 3)), ValueError, r"fit_many: x must have shape \(N, 2\) with N >= 1, got \(30, 3\)\."),
    (dict(y=torch.zeros(30, 2)), ValueError, r"fit_many: y must have shape \(30,\) or \(30, 1\), one target per row "
                                             r"of x, got \(30, 2\)\."),
    (dict(y=torch.zeros(1, 30)), ValueError, r"fit_many: y must have shape \(30,\) or \(30, 1\), one target per row "
                                             r"of x, got \(1, 30\)\. Flatten it"),
    (dict(x=torch.zeros(30, 2, dtype=torch.float32)), ValueError,
     r"fit_many: x must have net's dtype torch\.float64 and device cpu, got torch\.float32 on cpu\."),
])
def test_fit_many_refuses_what_it_cannot_train(change, exc, match):
    net, x, y = _grid_problem()
    args = dict(net=net, priors=GaussianPrior(1.0), x=x, y=y, steps=2, rank=2, progress=False)
    args.update(change)
    with pytest.raises(exc, match=match):
        BayesianNetwork.fit_many(args.pop("net"), args.pop("priors"), args.pop("x"), args.pop("y"),
                                 args.pop("steps"), **args)


def test_fit_many_example_runs():
    import doctest

    torch.set_default_dtype(torch.float32)  # a user's session
    finder = doctest.DocTestFinder()
    globs = {"torch": torch, "BayesianNetwork": BayesianNetwork}
    [test] = finder.find(BayesianNetwork.fit_many, "fit_many", globs=globs)
    assert doctest.DocTestRunner().run(test).failed == 0
