"""MC dropout's column of ``pyro-fa uci`` (Gal & Ghahramani 2016's UCI protocol)."""
import dataclasses
import json
import math

import pytest
import torch
from scipy import stats
from torch import nn

from pyro_fa import cli
from pyro_fa.datasets import load_uci
from pyro_fa.experiments.uci import mc_dropout as mcd
from pyro_fa.experiments.uci.protocol import METHODS, Budget, SplitData, evaluate
from pyro_fa.nn.batched import BatchedMLP


def _replicas(rates, taus, n=40, p=3, width=6, seed=0, dtype=torch.float64):
    mlp = BatchedMLP(p, (width,))
    return mcd.DropoutReplicas(mlp, torch.tensor(rates, dtype=dtype), torch.tensor(taus, dtype=dtype), n,
                               torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1))


def test_weight_decay_is_the_papers_formula():
    """reg = l^2 (1 - p) / (2 N tau), l = 1e-2 (the authors' net.py): for p = 0.05, tau = 10, N = 400."""
    assert mcd.LENGTHSCALE == 1e-2
    assert mcd.weight_decay(0.05, 10.0, 400) == pytest.approx(1e-4 * 0.95 / 8000, rel=1e-12)
    assert mcd.weight_decay(0.1, 0.5, 300, lengthscale=0.1) == pytest.approx(0.01 * 0.9 / 300, rel=1e-12)
    model = _replicas([0.05, 0.1], [10.0, 0.5], n=400)
    assert torch.allclose(model.decay, torch.tensor([1e-4 * 0.95 / 8000, 1e-4 * 0.9 / 400], dtype=torch.float64))


def test_loss_at_rate_zero_is_the_mean_squared_error_plus_the_decay_of_the_weights():
    """Against torch's own network and mse_loss: the biases are not decayed; one loss per replica."""
    g = torch.Generator().manual_seed(3)
    model = _replicas([0.0, 0.0], [2.0, 20.0], n=40)
    x = torch.randn(2, 40, 3, generator=g, dtype=torch.float64)
    y = torch.randn(2, 40, generator=g, dtype=torch.float64)
    got = model.loss(x, y).detach()
    assert got.shape == (2,)
    for r in range(2):
        net = model.mlp.to_module(model.theta[r].detach())
        with torch.no_grad():
            decay = net[0].weight.square().sum() + net[2].weight.square().sum()
            want = nn.functional.mse_loss(net(x[r]).squeeze(-1), y[r]) + mcd.weight_decay(0.0, [2.0, 20.0][r], 40) * decay
        assert float(got[r]) == pytest.approx(float(want), rel=1e-12)


def test_predictive_at_rate_zero_is_the_gaussian_of_the_net_and_tau():
    """Dropout rate 0: every pass is the network's output, and the test log-likelihood (original units) that of
    N(f(x) y_std + y_mean, y_std^2 / tau), scipy's."""
    g = torch.Generator().manual_seed(1)
    model = _replicas([0.0], [4.0])
    x = torch.randn(1, 25, 3, generator=g, dtype=torch.float64)
    y = torch.randn(1, 25, generator=g, dtype=torch.float64)
    means, nv = model.predict(x, 7)
    assert means.dtype == torch.float64 and means.shape == (7, 1, 25) and nv.shape == (1, 1)
    with torch.no_grad():
        f = model.mlp.to_module(model.theta[0].detach())(x[0]).squeeze(-1)
    assert torch.allclose(means, f.expand(7, 1, 25), rtol=1e-12, atol=1e-12)
    y_mean, y_std = 3.0, 2.5
    data = SplitData(x, y, x, y, torch.tensor([y_std], dtype=torch.float64))
    ll = evaluate(means, nv, data)["ll"]
    want = stats.norm.logpdf((y[0] * y_std + y_mean).numpy(), (f * y_std + y_mean).numpy(), y_std / math.sqrt(4.0))
    assert float(ll[0]) == pytest.approx(want.mean(), rel=1e-10)


def test_passes_are_torch_dropout_on_input_and_hidden_layer():
    """At rate 0.2, the passes' mean and variance per point are those of torch's nn.Dropout before each linear
    layer (train mode), each side from 20 000 passes: within 5 standard errors."""
    torch.set_num_threads(1)
    model = _replicas([0.2], [1.0], width=8)
    x = torch.randn(1, 5, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ours = model.predict(x, 20000)[0][:, 0]
    lin = model.mlp.to_module(model.theta[0].detach())
    net = nn.Sequential(nn.Dropout(0.2), lin[0], nn.ReLU(), nn.Dropout(0.2), lin[2]).train()
    torch.manual_seed(0)
    with torch.no_grad():
        theirs = net(x[0].expand(20000, 5, 3)).squeeze(-1)
    se = (ours.var(0) / 20000 + theirs.var(0) / 20000).sqrt()
    assert ((ours.mean(0) - theirs.mean(0)).abs() < 5 * se).all()
    assert torch.allclose(ours.var(0), theirs.var(0), rtol=0.06)
    assert bool((ours.var(0) > 0).all())


def _yacht(n, dtype=torch.float32):
    return [load_uci("yacht", s, dtype=dtype) for s in range(n)]


def test_choice_ignores_the_test_parts(monkeypatch):
    """The search sees the tuning splits' training parts only: test targets replaced by noise leave the choice,
    its validation log-likelihood and the search table unchanged, and change the test scores."""
    torch.set_num_threads(1)
    monkeypatch.setattr(mcd, "DROPOUT_RATES", (0.01, 0.1))
    monkeypatch.setattr(mcd, "TAUS", (1.0, 10.0))
    budget = Budget(steps=60, checkpoints=3, lrs=(3e-3, 1e-2), tune_splits=2, eval_samples=4, test_samples=5)
    splits = _yacht(2)
    g = torch.Generator().manual_seed(1)
    other = [dataclasses.replace(d, y_test=torch.randn(d.y_test.shape, generator=g)) for d in splits]
    method = METHODS["mcdropout-1x50"]
    a = mcd.run_mc_dropout(method, splits, budget, 0)
    b = mcd.run_mc_dropout(method, other, budget, 0)
    assert len(a["search"]) == 4 * 3  # 4 settings x 3 checkpoints
    assert a["choice"] == b["choice"] and a["val_ll"] == b["val_ll"] and a["search"] == b["search"]
    assert a["choice"]["dropout"] in (0.01, 0.1) and a["choice"]["tau"] in (1.0, 10.0)
    assert a["choice"]["steps"] in (20, 40, 60) and a["tune_splits"] == 2
    assert a["val_ll"] == max(row["val_ll"] for row in a["search"])
    assert a["ll"] != b["ll"] and len(a["ll"]) == 2 and all(math.isfinite(v) for v in a["ll"] + a["rmse"])
    y_std = [d.y_std for d in splits]
    assert a["noise_scale"] == pytest.approx([s / math.sqrt(a["choice"]["tau"]) for s in y_std], rel=1e-6)
    n = splits[0].x_train.shape[0]
    assert a["weight_decay"] == pytest.approx([mcd.weight_decay(a["choice"]["dropout"], a["choice"]["tau"], n)] * 2)


def test_uci_quick_runs_the_column_and_scores_it_against_a_reference(tmp_path, capsys):
    """``pyro-fa uci --quick`` runs the column (its one setting); with a reference the split that has one is
    scored, the results themselves unchanged to the bit."""
    from test_uci_fidelity import _yacht_reference

    torch.set_num_threads(1)
    refs, out = tmp_path / "refs", tmp_path / "uci"
    _yacht_reference(refs)
    args = ["uci", "--quick", "--datasets", "yacht", "--methods", "mcdropout-1x50", "--steps", "40",
            "--output-dir", str(out), "--no-progress"]
    assert cli.main(args) == 0
    plain = json.loads((out / "results.json").read_text())["results"]["yacht"]["mcdropout-1x50"]
    assert len(plain["ll"]) == 2 and all(math.isfinite(v) for v in plain["ll"])
    assert {k: plain["choice"][k] for k in ("dropout", "tau")} == {"dropout": 0.05, "tau": 10.0}
    assert plain["seconds"] > 0
    assert "MC dropout 1×50" in capsys.readouterr().out
    assert cli.main(args + ["--hmc-reference", str(refs)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["results"]["yacht"]["mcdropout-1x50"]["ll"] == plain["ll"]
    rec = res["fidelity"]["yacht"]["mcdropout-1x50"]["0"]
    assert rec["w1"] > 0 and rec["seconds"] > 0 and rec["precision"] == pytest.approx(1e-4)
    assert rec["noise"] == pytest.approx(10.0 ** -0.5) and rec["ll"] == pytest.approx(plain["ll"][0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_column_runs_on_the_data_device():
    splits = [load_uci("yacht", s, dtype=torch.float64, device="cuda") for s in range(2)]
    budget = Budget(steps=30, checkpoints=3, lrs=(1e-2,), tune_splits=1, eval_samples=4, test_samples=5)
    out = mcd.run_mc_dropout(METHODS["mcdropout-1x50"], splits, budget, 0)
    assert all(math.isfinite(v) for v in out["ll"] + out["rmse"])
