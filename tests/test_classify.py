"""The classification benchmark (``pyro-fa classify``): data splits, OOD sets, the command and its files."""
import json
import random

import numpy as np
import pytest
import torch

from pyro_fa import cli, metrics
from pyro_fa.experiments.classify import data as cdata
from pyro_fa.experiments.classify import report as rep
from pyro_fa.experiments.classify import command as classify
from pyro_fa.experiments.classify.methods import METHODS, Budget, make_network

pytest.importorskip("mnist1d")


def _rows(x):
    return {tuple(r) for r in x.tolist()}


@pytest.mark.parametrize("name, shapes", [
    ("mnist1d", {"train": (3600, 40), "val": (400, 40), "test": (1000, 40)}),
    ("digits", {"train": (1006, 64), "val": (251, 64), "test": (540, 64)}),
])
def test_splits_shapes_and_no_overlap(name, shapes):
    d = cdata.load_classify(name, seed=0)
    for part in ("train", "val", "test"):
        x, y = getattr(d, f"x_{part}"), getattr(d, f"y_{part}")
        assert x.shape == shapes[part] and x.dtype == torch.float32
        assert y.shape == shapes[part][:1] and y.dtype == torch.int64
        assert int(y.min()) >= 0 and int(y.max()) < d.num_classes
    assert d.in_features == shapes["train"][1]
    # train and validation partition the training part; the test part is apart
    tr, va, te = _rows(d.x_train), _rows(d.x_val), _rows(d.x_test)
    assert not tr & va and not tr & te and not va & te
    for ood in d.ood.values():
        assert ood.shape == d.x_test.shape and bool(torch.isfinite(ood).all())


def test_validation_cut_depends_on_seed_test_part_does_not():
    a, b = cdata.load_classify("digits", seed=0), cdata.load_classify("digits", seed=1)
    assert not torch.equal(a.x_val, b.x_val)
    torch.testing.assert_close(a.x_test, b.x_test)
    assert _rows(torch.cat([a.x_train, a.x_val])) == _rows(torch.cat([b.x_train, b.x_val]))


def test_mnist1d_is_generated_offline_and_restores_global_rng(monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("mnist1d tried to open a network connection")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    cdata.make_mnist1d.cache_clear()
    np.random.seed(7)
    random.seed(7)
    expect_np, expect_py = np.random.rand(), random.random()
    np.random.seed(7)
    random.seed(7)
    x, y, x_test, y_test = cdata.make_mnist1d()
    assert np.random.rand() == expect_np and random.random() == expect_py
    assert x.shape == (4000, 40) and x_test.shape == (1000, 40) and set(np.unique(y)) == set(range(10))


def test_ood_transforms():
    d = cdata.load_classify("mnist1d")
    torch.testing.assert_close(d.ood["reversed"], d.x_test.flip(-1))
    sh = d.ood["shuffled"]
    torch.testing.assert_close(sh.sort(-1).values, d.x_test.sort(-1).values)
    assert (sh != d.x_test).float().mean() > 0.9  # the order changed
    g = cdata.load_classify("digits")
    # undo the standardisation with the training statistics (train + validation parts = the training part)
    raw = torch.as_tensor(cdata._digits()[0])
    mean, std = raw.mean(0), raw.std(0, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))
    test_raw = (g.x_test * std + mean).reshape(-1, 8, 8)
    rot_raw = (g.ood["rotated"] * std + mean).reshape(-1, 8, 8)
    torch.testing.assert_close(rot_raw, torch.rot90(test_raw, 1, (1, 2)), atol=1e-4, rtol=0)
    shuf_raw = g.ood["shuffled"] * std + mean
    torch.testing.assert_close(shuf_raw.sort(-1).values, test_raw.reshape(-1, 64).sort(-1).values, atol=1e-4, rtol=0)


def test_load_classify_bad_input():
    with pytest.raises(ValueError, match="name must be one of"):
        cdata.load_classify("cifar10")
    with pytest.raises(ValueError, match="val_fraction must be in"):
        cdata.load_classify("digits", val_fraction=1.5)


def test_networks_output_logits():
    d = cdata.load_classify("mnist1d")
    for kind in ("mlp", "cnn"):
        assert make_network(kind, d)(d.x_test[:7]).shape == (7, 10)
    assert make_network("mlp", cdata.load_classify("digits"), dropout=0.1)(torch.zeros(3, 64, dtype=torch.float32)).shape == (3, 10)


def test_benchmark_files_and_metrics_recomputed(tmp_path):
    """Every method on a tiny budget: the files, and results.json's metrics equal pyro_fa.metrics recomputed."""
    torch.set_num_threads(1)
    budget = Budget(epochs=4, swag_epochs=3, rank=2, ensemble=2, samples=4)
    out = classify.run_benchmark([("digits", "mlp")], list(METHODS), budget, [0], tmp_path, progress=False,
                                 subset=(200, 120))
    for name in ("results.json", "table.md", "reliability.png", "entropy.png", "predictions.pt"):
        assert (tmp_path / name).stat().st_size > 0
    results = json.loads((tmp_path / "results.json").read_text())
    combo = results["combos"]["digits-mlp"]
    ran = set(combo["methods"])
    assert ran >= set(METHODS) - {"laplace", "ivon"}
    saved = torch.load(tmp_path / "predictions.pt")
    y = saved["targets"]["digits-mlp"]
    assert y.shape == (120,)
    for method in ("swag-em", "map"):
        probs = saved["probs"]["digits-mlp"][method]
        assert [p.shape for p in probs] == [(120, 10)] * 3
        got = combo["methods"][method]["per_seed"]
        p = probs[0].double()
        assert got["accuracy"][0] == pytest.approx(float(metrics.accuracy(p, y)), abs=1e-6)
        assert got["nll"][0] == pytest.approx(float(metrics.negative_log_likelihood(p, y)), abs=1e-5)
        assert got["ece"][0] == pytest.approx(float(metrics.expected_calibration_error(p, y, 15)), abs=1e-5)
        assert got["brier"][0] == pytest.approx(float(metrics.brier_score(p, y)), abs=1e-5)
        h = metrics.predictive_entropy(p)
        for name, q in zip(combo["ood"], probs[1:]):
            expect = float(metrics.ood_auroc(h, metrics.predictive_entropy(q.double())))
            assert got[f"auroc_{name}"][0] == pytest.approx(expect, abs=1e-6)
    assert combo["methods"]["swag-em"]["extra"][0]["scale"] > 0
    assert any(c["check"].startswith("SWAG-EM NLL") for c in results["bar"])
    assert "## The bars" in (tmp_path / "table.md").read_text()


def test_classify_command(tmp_path, capsys):
    code = cli.main(["classify", "--datasets", "digits", "--methods", "map", "swa", "swag-em", "--epochs", "4",
                     "--seeds", "1", "--no-progress", "--output-dir", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["combos"]) == {"digits-mlp"}
    assert set(results["combos"]["digits-mlp"]["methods"]) == {"map", "swa", "swag-em"}
    assert results["budget"]["epochs"] == 4
    printed = capsys.readouterr().out
    assert "SWAG-EM" in printed
    # a run smaller than the full one says so under its bars
    assert rep.SMALL_RUN_NOTE in printed and "says nothing about the bar" in printed


def test_classify_command_bad_input(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["classify", "--datasets", "cifar10"])
    with pytest.raises(SystemExit):
        cli.main(["classify", "--methods", "mcmc"])
    with pytest.raises(SystemExit, match="--epochs must be >= 4"):
        cli.main(["classify", "--epochs", "2", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--seeds must be >= 1"):
        cli.main(["classify", "--seeds", "0", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="no dataset"):
        cli.main(["classify", "--datasets", "digits", "--networks", "cnn", "--output-dir", str(tmp_path)])


def test_bar_checks():
    def combo(nll, ece, acc, auroc):
        return {"per_seed": {"nll": [nll], "ece": [ece], "accuracy": [acc], "auroc_x": [auroc]}}

    combos = {"d-mlp": {"ood": ["x"], "methods": {
        "map": combo(0.5, 0.05, 0.90, 0.5), "swa": combo(0.45, 0.04, 0.90, 0.5),
        "swag-em": combo(0.4, 0.03, 0.90, 0.6), "multiswag": combo(0.3, 0.02, 0.91, 0.7),
        "vifa": combo(0.35, 0.02, 0.80, 0.7), "dropout": combo(0.35, 0.01, 0.90, 0.6),
        "ensemble": combo(0.29, 0.02, 0.92, 0.7)}}}
    checks = {c["check"]: c["ok"] for c in rep.bar_checks(combos)}
    assert checks["SWAG-EM NLL < SWA"] and checks["SWAG-EM OOD AUROC (x) > MAP"]
    assert checks["MultiSWAG-EM (5) NLL < MC dropout"] and not checks["MultiSWAG-EM (5) ECE < MC dropout"]
    assert not checks["(stretch) MultiSWAG-EM (5) NLL < deep ensemble"]


def test_bar_rows_tell_close_values_apart_and_flag_aurocs_below_chance():
    """Values equal at the default rounding print with more digits; an AUROC below 0.5 is called below chance."""
    def combo(nll, ece, auroc):
        return {"per_seed": {"nll": [nll], "ece": [ece], "accuracy": [0.9], "auroc_rotated": [auroc]}}

    combos = {"digits-mlp": {"ood": ["rotated"], "methods": {
        "map": combo(0.5004, 0.05, 0.0598), "swag-em": combo(0.5001, 0.04, 0.0612),
        "swa": combo(0.45, 0.04, 0.7)}}}
    rows = {c["check"]: c for c in rep.bar_checks(combos)}
    auroc = rows["SWAG-EM OOD AUROC (rotated) > MAP"]
    assert auroc["ok"] and auroc["detail"] == "0.061 vs 0.060 (both below chance, 0.5)"
    nll = rows["SWAG-EM NLL < MAP (Adam)"]
    assert nll["ok"] and nll["detail"] == "0.5001 vs 0.5004"
    assert rows["SWAG-EM NLL < SWA"]["detail"] == "0.500 vs 0.450"  # apart at 3 decimals: 3 decimals
    assert rep.versus(0.25, 0.25, 2) == "0.25 vs 0.25"
    assert rep.versus(1.0, 1.0 + 1e-9) == "1.000000 vs 1.000000"  # at most 6 decimals
    above = {"digits-mlp": {"ood": ["rotated"], "methods": {"map": combo(0.5, 0.05, 0.40), "swag-em": combo(0.4, 0.04, 0.7)}}}
    (row,) = [c for c in rep.bar_checks(above) if "AUROC" in c["check"]]
    assert row["detail"] == "0.70 vs 0.40 (MAP below chance, 0.5)"
