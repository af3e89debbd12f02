import pyro
import pytest
import torch
from pyro.optim import Adam

from pyro_fa import GaussianPrior, LaplacePrior
from pyro_fa.nn import BayesianNetwork


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
        ({"prior": 1.0}, TypeError, r"BayesianNetwork: prior must be a GaussianPrior or LaplacePrior, got 1\.0\."),
        ({"likelihood": "poisson"}, ValueError, r"BayesianNetwork: likelihood must be one of .*, got 'poisson'\."),
        ({"noise_scale": -1.0}, ValueError, r"BayesianNetwork: noise_scale must be a positive float, got -1\.0\."),
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
    with pytest.raises(RuntimeError, match=r"BayesianNetwork\.predict: the network must be fitted first"):
        bnn.predict(torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"BayesianNetwork\.predict: num_samples must be a positive int, got 0\."):
        bnn.predict(torch.randn(3, 2), num_samples=0)
    with pytest.raises(ValueError, match=r"BayesianNetwork\.fit: epochs must be a positive int, got 0\."):
        bnn.fit([], Adam({"lr": 0.1}), epochs=0)
