"""The classification benchmark (``pyro-fa classify``): data splits, OOD sets, the command and its files."""
import contextlib
import json
import math
import random

import numpy as np
import pytest
import torch

from pyro_fa import cli, metrics
from pyro_fa.experiments.classify import data as cdata
from pyro_fa.experiments.classify import report as rep
from pyro_fa.experiments.classify import command as classify
from pyro_fa.experiments.classify.data import load_classify
from pyro_fa.experiments.classify.methods import METHODS, Budget, make_network, run_methods

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
    raw_test = torch.as_tensor(cdata._digits()[2])
    torch.testing.assert_close(g.x_test, raw_test / 16)  # intensities 0..16 -> [0, 1], no per-pixel statistics
    assert float(g.x_train.min()) == 0.0 and float(g.x_train.max()) == 1.0
    torch.testing.assert_close(g.ood["rotated"].reshape(-1, 8, 8), torch.rot90(g.x_test.reshape(-1, 8, 8), 1, (1, 2)))
    torch.testing.assert_close(g.ood["shuffled"].sort(-1).values, g.x_test.sort(-1).values)
    # the OOD sets sit at the test part's distance from the origin (rotation and shuffling keep each norm)
    for d in (cdata.load_classify("digits"), cdata.load_classify("mnist1d")):
        norms = cdata.median_norms(d)
        assert set(norms) == {"test", *d.ood}
        assert norms["test"] == pytest.approx(float(d.x_test.norm(dim=-1).median()))
        for name in d.ood:
            assert norms[name] == pytest.approx(norms["test"], rel=1e-5)


@pytest.mark.parametrize("name, n_test", [("digits-8", 540), ("mnist1d-8", 1000)])
def test_held_out_classes(name, n_test):
    """Classes 8 and 9 are out of every training / validation / test part and form the OOD set "heldout"."""
    d, full = cdata.load_classify(name), cdata.load_classify(name.split("-")[0])
    assert d.num_classes == 8 and d.base == name.split("-")[0]
    for y in (d.y_train, d.y_val, d.y_test):
        assert int(y.max()) <= 7 and int(y.min()) >= 0
    held = (full.y_test >= 8)
    torch.testing.assert_close(d.ood["heldout"], full.x_test[held])
    torch.testing.assert_close(d.x_test, full.x_test[~held])
    assert d.x_test.shape[0] + d.ood["heldout"].shape[0] == n_test
    n_train = int((torch.cat([full.y_train, full.y_val]) < 8).sum())
    assert d.x_train.shape[0] + d.x_val.shape[0] == n_train
    assert set(d.ood) == set(full.ood) | {"heldout"}
    assert make_network("mlp", d)(d.x_test[:3]).shape == (3, 8)


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


def test_benchmark_files_and_metrics_recomputed(tmp_path, monkeypatch):
    """Every method on a tiny budget: the files, and results.json's metrics equal pyro_fa.metrics recomputed.
    "laplace-full" is skipped with a warning naming the reason (its cap lowered below the MLP's 7 510 weights)."""
    from pyro_fa.experiments.classify import posthoc

    torch.set_num_threads(1)
    monkeypatch.setattr(posthoc, "FULL_MAX_WEIGHTS", 1000)
    budget = Budget(epochs=4, swag_epochs=3, rank=2, ensemble=2, samples=4, prior_precisions=(1.0, 10.0),
                    dropouts=(0.1,), swag_lrs=(3e-3,), vi_lrs=(3e-3,), ivon_lrs=(0.1,), ivon_hess_inits=(0.5,),
                    laplace_rank=8)
    with pytest.warns(UserWarning, match="laplace-full skipped: the network has 7510 weights, more than 1000") \
            if posthoc.peers_available()["laplace"] else contextlib.nullcontext():
        out = classify.run_benchmark([("digits", "mlp")], list(METHODS), budget, [0], tmp_path, progress=False,
                                     subset=(200, 120))
    for name in ("results.json", "table.md", "reliability.png", "entropy.png", "predictions.pt", "front_digits-mlp.png"):
        assert (tmp_path / name).stat().st_size > 0
    results = json.loads((tmp_path / "results.json").read_text())
    combo = results["combos"]["digits-mlp"]
    ran = set(combo["methods"])
    assert ran >= set(METHODS) - {"laplace", "laplace-grid", "laplace-diag", "laplace-kron", "laplace-full", "ivon"}
    assert "laplace-full" not in ran
    for row in ("factor-laplace", "factor-laplace-grid+T", "factor-laplace-lin+T") + (("laplace-kron", "laplace-diag+T")
                                                            if "laplace-kron" in ran else ()):
        peak = combo["methods"][row]["extra"][0]["fit_peak_mib"]
        assert peak is None or peak >= 0
    assert combo["methods"]["map"]["extra"][0]["prior_precision"] in (1.0, 10.0)  # chosen on validation
    assert set(combo["methods"]["map"]["extra"][0]["val_nll_tempered"]) == {"1.0", "10.0"}
    assert combo["norms"]["test"] > 0
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
    assert combo["methods"]["swag-em"]["extra"][0]["scale"] >= 0  # 0: the mean (SWA) was chosen
    # sampled methods are scored by mutual information too, deterministic ones are not
    assert "auroc_mi_rotated" in combo["methods"]["swag-em"]["per_seed"]
    assert "auroc_mi_rotated" not in combo["methods"]["map"]["per_seed"]
    assert any(c["check"].startswith("SWAG-EM NLL") for c in results["bar"])
    assert "## The bars" in (tmp_path / "table.md").read_text()


def test_classify_command(tmp_path, capsys):
    code = cli.main(["classify", "--datasets", "digits", "--methods", "map", "swa", "swag-em", "--epochs", "4",
                     "--seeds", "1", "--no-progress", "--device", "cpu", "--output-dir", str(tmp_path),
                     "--grid", "swag_lrs=2e-3", "--grid", "prior-precisions=0.5,2"])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    # --grid replaced the grids the rows ran on, and the budget records them
    assert results["budget"]["swag_lrs"] == [2e-3] and results["budget"]["prior_precisions"] == [0.5, 2.0]
    extra = results["combos"]["digits-mlp"]["methods"]
    assert extra["swa"]["extra"][0]["swag_lr"] == 2e-3
    assert set(extra["map"]["extra"][0]["val_nll_tempered"]) == {"0.5", "2.0"}
    assert set(results["combos"]) == {"digits-mlp"}
    assert set(results["combos"]["digits-mlp"]["methods"]) == {"map", "swa", "swag-em", "map+T", "swa+T", "swag-em+T"}
    assert results["combos"]["digits-mlp"]["methods"]["swag-em+T"]["extra"][0]["tempered_scale_choice"]
    assert results["budget"]["epochs"] == 4 and results["devices"] == ["cpu"]
    printed = capsys.readouterr().out
    assert "SWAG-EM" in printed
    # a run smaller than the full one says so under its bars
    assert rep.SMALL_RUN_NOTE in printed and "says nothing about the bar" in printed


def test_a_widened_grid_is_still_the_full_run():
    """The bars' note "this run is smaller" is for runs short of the full budget, not for grids widened by --grid."""
    from dataclasses import replace

    full = Budget()
    assert classify.is_full_budget(full)
    assert classify.is_full_budget(replace(full, vi_lrs=full.vi_lrs + (3e-2, 1e-1), laplace_rank=300))
    assert classify.is_full_budget(replace(full, ivon_lrs=tuple(reversed(full.ivon_lrs)) + (12.8,)))
    assert not classify.is_full_budget(replace(full, vi_lrs=full.vi_lrs[1:]))  # a point of the grid left out
    assert not classify.is_full_budget(replace(full, laplace_rank=20))
    assert not classify.is_full_budget(replace(full, epochs=12))
    assert not classify.is_full_budget(Budget.quick())


def test_merge_runs_equals_one_run_over_the_seeds(tmp_path):
    """Two one-seed runs merged give the per-seed numbers, means and bars of one two-seed run."""
    torch.set_num_threads(1)
    budget = Budget(epochs=4, swag_epochs=3, rank=2, samples=4, prior_precisions=(1.0,), swag_lrs=(3e-3,),
                    temperature=False)
    args = ([("digits", "mlp")], ["map", "swag-em"], budget)
    both = classify.run_benchmark(*args, [0, 1], tmp_path / "both", progress=False, subset=(150, 60))
    for s in (0, 1):
        classify.run_benchmark(*args, [s], tmp_path / f"s{s}", progress=False, subset=(150, 60))
    merged = classify.merge_runs([tmp_path / "s1", tmp_path / "s0"], tmp_path / "merged")
    a, b = both["combos"]["digits-mlp"]["methods"], merged["combos"]["digits-mlp"]["methods"]
    for m in ("map", "swag-em"):
        for k, v in a[m]["per_seed"].items():
            assert b[m]["per_seed"][k] == pytest.approx(v, abs=1e-12), (m, k)
        assert b[m]["mean"]["nll"] == pytest.approx(a[m]["mean"]["nll"], abs=1e-12)
    assert [c["verdict"] for c in merged["bar"]] == [c["verdict"] for c in both["bar"]]
    saved = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert saved["seeds_per_combo"] == {"digits-mlp": [0, 1]}
    assert (tmp_path / "merged" / "front_digits-mlp.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="seed"):
        classify.merge_runs([tmp_path / "s0", tmp_path / "both"], tmp_path / "bad")
    with pytest.raises(SystemExit, match="without results.json"):
        classify.merge_runs([tmp_path / "nothing"], tmp_path / "bad")
    # rows rerun for some seeds replace the rows of the same name there; a new row must cover every seed
    import shutil

    shutil.copytree(tmp_path / "s1", tmp_path / "rerun")
    rerun = json.loads((tmp_path / "rerun" / "results.json").read_text())
    row = rerun["combos"]["digits-mlp"]["methods"]["swag-em"]
    row["per_seed"]["nll"] = [2 * v for v in row["per_seed"]["nll"]]
    (tmp_path / "rerun" / "results.json").write_text(json.dumps(rerun))
    replaced = classify.merge_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "replaced",
                                   rows_from=[tmp_path / "rerun"])["combos"]["digits-mlp"]["methods"]
    assert replaced["swag-em"]["per_seed"]["nll"] == pytest.approx(
        [a["swag-em"]["per_seed"]["nll"][0], 2 * a["swag-em"]["per_seed"]["nll"][1]], abs=1e-12)
    assert replaced["map"]["per_seed"]["nll"] == pytest.approx(a["map"]["per_seed"]["nll"], abs=1e-12)
    assert replaced["swag-em"]["mean"]["nll"] == pytest.approx(np.mean(replaced["swag-em"]["per_seed"]["nll"]))
    # a published table keeps no predictions.pt: rows merged into it bring the first seed's predictions and
    # targets for the figures
    shutil.copytree(tmp_path / "replaced", tmp_path / "published")
    (tmp_path / "published" / "predictions.pt").unlink()
    classify.merge_runs([tmp_path / "published"], tmp_path / "republished", rows_from=[tmp_path / "s0"])
    saved = torch.load(tmp_path / "republished" / "predictions.pt")
    assert torch.equal(saved["targets"]["digits-mlp"], torch.load(tmp_path / "s0" / "predictions.pt")["targets"]["digits-mlp"])
    assert (tmp_path / "republished" / "reliability.png").is_file()
    rerun["combos"]["digits-mlp"]["methods"] = {"swa": row}
    (tmp_path / "rerun" / "results.json").write_text(json.dumps(rerun))
    with pytest.raises(SystemExit, match=r"the row 'swa' of digits-mlp added by --rows-from lacks seed\(s\) \[0\]"):
        classify.merge_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "bad", rows_from=[tmp_path / "rerun"])
    with pytest.raises(SystemExit, match=r"holds seed\(s\) \[1\] of digits-mlp, which the merged runs do not"):
        classify.merge_runs([tmp_path / "s0"], tmp_path / "bad", rows_from=[tmp_path / "rerun"])
    # a row rerun on a wider grid of its own (here MC dropout's rates) replaces that row on every seed and the
    # merged budget records the grid it ran on; any other difference of budget is refused
    for s in (0, 1):
        grid = json.loads((tmp_path / f"s{s}" / "results.json").read_text())
        grid["budget"]["dropouts"] = [0.3, 0.5]
        grid["combos"]["digits-mlp"]["methods"] = {"dropout": grid["combos"]["digits-mlp"]["methods"]["map"]}
        (tmp_path / f"grid{s}").mkdir()
        (tmp_path / f"grid{s}" / "results.json").write_text(json.dumps(grid))
    wider = classify.merge_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "wider",
                                rows_from=[tmp_path / "grid0", tmp_path / "grid1"])
    assert wider["combos"]["digits-mlp"]["methods"]["dropout"]["per_seed"]["nll"] == pytest.approx(
        a["map"]["per_seed"]["nll"], abs=1e-12)
    saved = json.loads((tmp_path / "wider" / "results.json").read_text())
    assert saved["budget"]["dropouts"] == [0.3, 0.5] and saved["budget"]["epochs"] == 4
    # the rows of one grid under two of its values (seed 0 on the wider grid, seed 1 on the merged runs')
    with pytest.raises(SystemExit, match=r"two values \(dropouts=\[0.3, 0.5\]: 'dropout' of digits-mlp; "
                                         r"dropouts=\[0.05, 0.1, 0.2\]: 'dropout' of digits-mlp\)"):
        classify.merge_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "bad",
                            rows_from=[tmp_path / "grid0", _relabel(tmp_path / "grid1", dropouts=[0.05, 0.1, 0.2])])
    # a grid that governs none of the rows brought changes nothing; another field is refused, named
    merge_runs = classify.merge_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "kept",
                                     rows_from=[_relabel(tmp_path / "s1", dropouts=[0.3])])
    assert merge_runs["combos"]["digits-mlp"]["methods"]["swag-em"]["per_seed"]["nll"] == pytest.approx(
        a["swag-em"]["per_seed"]["nll"], abs=1e-12)
    assert json.loads((tmp_path / "kept" / "results.json").read_text())["budget"]["dropouts"] == [0.05, 0.1, 0.2]
    with pytest.raises(SystemExit, match=r"ran under another budget than the merged runs \(epochs=5 against 4\)"):
        classify.merge_runs([tmp_path / "s0", tmp_path / "s1"], tmp_path / "bad",
                            rows_from=[_relabel(tmp_path / "s1", epochs=5)])


def test_prior_precision_from_an_earlier_run_reproduces_its_rows(tmp_path):
    """Rows added later with MAP's choice read from an earlier run equal the rows that run made itself (the
    MAP network retrained once at that value is the one the grid chose), without MAP's grid."""
    torch.set_num_threads(1)
    budget = Budget(epochs=4, swag_epochs=3, rank=2, samples=4, prior_precisions=(0.3, 30.0), ensemble=2,
                    temperature=False)
    first = classify.run_benchmark([("digits", "mlp")], ["map", "ensemble"], budget, [1], tmp_path / "first",
                                   progress=False, subset=(150, 60))
    chosen = first["combos"]["digits-mlp"]["methods"]["map"]["extra"][0]["prior_precision"]
    prior = classify.prior_precisions_from(tmp_path / "first", budget, [("digits", "mlp")], [1])
    assert prior == {"digits-mlp": {1: chosen}}
    later = classify.run_benchmark([("digits", "mlp")], ["ensemble"], budget, [1], tmp_path / "later",
                                   progress=False, subset=(150, 60), prior_precisions=prior)
    rows = later["combos"]["digits-mlp"]["methods"]
    assert set(rows) == {"ensemble"}
    for k, v in first["combos"]["digits-mlp"]["methods"]["ensemble"]["per_seed"].items():
        assert rows["ensemble"]["per_seed"][k] == pytest.approx(v, abs=1e-12), k
    with pytest.raises(SystemExit, match=r"holds no MAP row of digits-mlp for seed\(s\) \[2\] \(it holds \[1\]\)"):
        classify.prior_precisions_from(tmp_path / "first", budget, [("digits", "mlp")], [1, 2])
    with pytest.raises(SystemExit, match=r"--prior-precision-from .* ran under another budget than this one "
                                         r"\(epochs=4 against 5\)"):
        classify.prior_precisions_from(tmp_path / "first", Budget(**{**budget.__dict__, "epochs": 5}),
                                       [("digits", "mlp")], [1])
    with pytest.raises(SystemExit, match="makes no map row"):
        cli.main(["classify", "--datasets", "digits", "--methods", "map", "vifa", "--prior-precision-from",
                  str(tmp_path / "first"), "--output-dir", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="leave 'map' out of methods"):
        run_methods(["map"], "mlp", load_classify("digits", 1).subset(150, 60), budget, 1, prior_precision=1.0)


def _relabel(folder, **budget):
    """A copy of the run in ``folder`` whose recorded budget says ``budget``; returns the copy's folder."""
    result = json.loads((folder / "results.json").read_text())
    result["budget"].update(budget)
    out = folder.parent / f"{folder.name}-{'-'.join(f'{k}{v}' for k, v in budget.items())}"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(result))
    return out


def test_classify_command_bad_input(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["classify", "--datasets", "cifar10"])
    with pytest.raises(SystemExit):
        cli.main(["classify", "--methods", "mcmc"])
    with pytest.raises(SystemExit, match="--epochs must be >= 4"):
        cli.main(["classify", "--epochs", "2", "--output-dir", str(tmp_path)])
    for grid, says in (("vi_lr=1e-3", "--grid must be NAME=V1,V2,... with NAME of"), ("vi_lrs", "got 'vi_lrs'"),
                       ("vi_lrs=1e-3,x", "numbers separated by commas, got '1e-3,x'"),
                       ("vi_lrs=", "distinct positive finite"), ("ivon_lrs=0.4,nan", "distinct positive finite"),
                       ("swag_lrs=-1e-3", "distinct positive finite"), ("vi_lrs=1e-3,1e-3", "distinct"),
                       ("dropouts=0.1,1", r"--grid: Budget: dropouts must be rates in \(0, 1\), got \(0\.1, 1\.0\)"),
                       ("laplace_rank=20,40", "one positive integer"), ("laplace_rank=2.5", "one positive integer"),
                       ("laplace_rank=0", "laplace_rank must be a positive integer, got 0")):
        with pytest.raises(SystemExit, match=says):
            cli.main(["classify", "--grid", grid, "--output-dir", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    assert classify.parse_grid("laplace_rank=40") == ("laplace_rank", 40)
    assert classify.parse_grid("vi_lrs=3e-3, 1e-2") == ("vi_lrs", (3e-3, 1e-2))
    # the ranges are the Budget's own, whoever builds it
    for bad, says in (({"vi_lrs": (1e-3, -1e-3)}, r"vi_lrs must be distinct positive finite numbers, got \(0\.001, -0\.001\)"),
                      ({"ivon_hess_inits": ()}, r"ivon_hess_inits must be distinct positive finite numbers, got \(\)"),
                      ({"dropouts": (0.5, 1.5)}, r"dropouts must be rates in \(0, 1\)"),
                      ({"laplace_rank": 2.0}, "laplace_rank must be a positive integer, got 2.0")):
        with pytest.raises(ValueError, match=says):
            Budget(**bad)
    with pytest.raises(SystemExit, match="--seeds must be >= 1"):
        cli.main(["classify", "--seeds", "0", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="no dataset"):
        cli.main(["classify", "--datasets", "digits", "--networks", "cnn", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--rows-from needs --merge"):
        cli.main(["classify", "--rows-from", str(tmp_path), "--output-dir", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match=r"--device must be a torch device such as cpu, cuda or cuda:1, got 'gpu0'"):
        cli.main(["classify", "--device", "gpu0", "--output-dir", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match=r"--device must be cpu, cuda\[:N\] or mps, got 'meta'"):
        cli.main(["classify", "--device", "meta", "--output-dir", str(tmp_path / "x")])
    if torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"--device cuda:99: this machine has \d+ CUDA device"):
            cli.main(["classify", "--device", "cuda:99", "--output-dir", str(tmp_path / "x")])
    else:
        with pytest.raises(SystemExit, match=r"--device cuda needs a CUDA GPU .* torch.cuda.is_available\(\) is False"):
            cli.main(["classify", "--device", "cuda", "--output-dir", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()  # refused before anything is written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_run_methods_on_cuda_matches_the_cpu():
    """Every method family trains and predicts on the GPU (data, networks, posteriors, peers), returns its
    probabilities on the CPU, and scores what the same seed scores on the CPU: up to the GPU's round-off where
    every draw comes from a seeded CPU generator (MAP, the SWAG family and its scale choice, the Laplace rows),
    loosely where training draws from torch's global stream on the device, which differs from the CPU's (MC
    dropout's masks, the guides' SVI draws, IVON's weight noise)."""
    torch.set_num_threads(1)
    budget = Budget(epochs=6, swag_epochs=3, rank=2, samples=4, prior_precisions=(1.0,), dropouts=(0.1,),
                    swag_lrs=(3e-3,), vi_lrs=(3e-3,), ivon_lrs=(0.1,), ivon_hess_inits=(0.5,), laplace_rank=4)
    data = load_classify("digits", 0).subset(300, 100)
    methods = ["map", "dropout", "swag-em", "swag-em-glm", "vifa", "factor-laplace-grid", "laplace", "ivon"]
    on_cpu = run_methods(methods, "mlp", data, budget, 0)
    on_gpu = run_methods(methods, "mlp", data.to("cuda"), budget, 0)
    assert set(on_gpu) == set(on_cpu)
    for name, row in on_gpu.items():
        assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in row["probs"]), name
        nll = [rep.evaluate(r["probs"], data.y_test, list(data.ood))["nll"] for r in (on_cpu[name], row)]
        device_stream = name.split("+")[0] in ("dropout", "vifa", "ivon")
        assert nll[1] == pytest.approx(nll[0], rel=0.15 if device_stream else 0.01), name


def _combo(per_method, ood=("x",)):
    return {"ood": list(ood), "methods": {m: {"per_seed": v} for m, v in per_method.items()}}


def test_mutual_information_scores_against_a_dense_computation():
    """evaluate(): the MI AUROC equals the Mann-Whitney statistic of the MI computed by hand from the draws."""
    g = torch.Generator().manual_seed(0)
    draws_in = torch.softmax(torch.randn(6, 40, 3, generator=g) * 0.3 + 3 * torch.eye(3)[torch.arange(40) % 3], -1)
    draws_out = torch.softmax(torch.randn(6, 30, 3, generator=g) * 2.0, -1)
    y = torch.arange(40) % 3

    def mi(d):
        p = d.double()
        ent = lambda q: -(q * q.log()).sum(-1)  # noqa: E731
        return ent(p.mean(0)) - ent(p).mean(0)

    a, b = mi(draws_in), mi(draws_out)
    mann_whitney = float(((b[:, None] > a[None, :]).double() + 0.5 * (b[:, None] == a[None, :]).double()).mean())
    got = rep.evaluate([draws_in, draws_out], y, ["o"])
    assert got["auroc_mi_o"] == pytest.approx(mann_whitney, abs=1e-12)
    assert got["nll"] == pytest.approx(float(-draws_in.double().mean(0)[torch.arange(40), y].log().mean()), abs=1e-9)
    assert "auroc_mi_o" not in rep.evaluate([draws_in.mean(0), draws_out.mean(0)], y, ["o"])


def test_temperature_rows_minimise_the_validation_nll():
    """The "+T" row: the temperature is the validation-NLL minimiser (brute force over a fine grid), and the
    test probabilities are softmax(log p / T) of the row's model average."""
    from pyro_fa.experiments.classify.posthoc import tempered_rows

    g = torch.Generator().manual_seed(1)
    y_val = torch.randint(0, 4, (300,), generator=g)
    logits = 3.0 * torch.nn.functional.one_hot(y_val, 4) + 2.5 * torch.randn(300, 4, generator=g)  # overconfident
    draws_val = torch.softmax(logits[None] * torch.tensor([1.5, 2.5])[:, None, None], -1)  # (2, 300, 4)
    draws_test = torch.softmax(torch.randn(2, 50, 4, generator=g) * 4, -1)
    rows = tempered_rows({"swag-em": {"probs": [draws_val, draws_test], "seconds": 1.0, "extra": {"scale": 1.0}},
                          "swa": {"probs": [draws_val[0], draws_test[0]], "seconds": 1.0}}, y_val)
    assert set(rows) == {"swag-em+T", "swa+T"}
    row = rows["swag-em+T"]
    z = draws_val.double().mean(0).log()
    grid = torch.linspace(0.2, 10, 20001, dtype=torch.float64)
    nll = torch.stack([torch.nn.functional.cross_entropy(z / t, y_val) for t in grid])
    assert row["extra"]["temperature"] == pytest.approx(float(grid[nll.argmin()]), abs=1e-3)
    assert row["extra"]["temperature"] > 1  # overconfident: the temperature softens
    expect = (draws_test.double().mean(0).log() / row["extra"]["temperature"]).softmax(-1)
    torch.testing.assert_close(row["probs"][0].double(), expect, atol=1e-6, rtol=0)
    assert row["extra"]["scale"] == 1.0 and row["seconds"] >= 1.0
    # a row whose "+T" chose its own scale by the tempered validation NLL: tempered from those probabilities
    both = tempered_rows({"swag-em": {"probs": [draws_test, draws_test], "seconds": 1.0, "extra": {"scale": 9.0},
                                      "probs_T": [draws_val, draws_test], "seconds_T": 2.0,
                                      "extra_T": {"scale": 1.0}}}, y_val)["swag-em+T"]
    torch.testing.assert_close(both["probs"][0], row["probs"][0], atol=0, rtol=0)
    assert both["extra"]["scale"] == 1.0 and both["extra"]["temperature"] == row["extra"]["temperature"]
    assert both["seconds"] >= 2.0


def test_paired_verdicts():
    assert rep.paired([1.0, 2.0, 3.0], [0.5, 1.5, 2.7]) == pytest.approx((0.4333333, 0.0666667), abs=1e-6)
    assert rep.verdict(-0.1, 0.04) == "better" and rep.verdict(-0.1, 0.06) == "tie"
    assert rep.verdict(0.1, 0.01) == "worse" and rep.verdict(0.1, 0.01, lower_is_better=False) == "better"
    assert rep.verdict(-1.0, float("nan")) == "tie"


def test_bar_checks():
    combos = {"d-mlp": _combo({
        "map": {"nll": [0.50, 0.52, 0.51], "ece": [0.05] * 3, "accuracy": [0.9] * 3, "auroc_x": [0.50, 0.52, 0.51]},
        "swa": {"nll": [0.45, 0.47, 0.46], "ece": [0.04] * 3, "accuracy": [0.9] * 3, "auroc_x": [0.5] * 3},
        "swag-em": {"nll": [0.40, 0.41, 0.462], "ece": [0.03, 0.031, 0.029], "accuracy": [0.9] * 3,
                    "auroc_x": [0.60, 0.63, 0.61]},
        "dropout": {"nll": [0.35, 0.36, 0.37], "ece": [0.031, 0.028, 0.030], "accuracy": [0.9] * 3,
                    "auroc_x": [0.7, 0.7, 0.7]}})}
    checks = {c["check"]: c for c in rep.bar_checks(combos)}
    swa = checks["SWAG-EM NLL never > 1 % above SWA's on a seed"]
    assert swa["verdict"] == "met" and "worst seed +0.4 %" in swa["detail"]
    assert checks["SWAG-EM OOD AUROC (x) > MAP"]["verdict"] == "met"  # +0.103 ± 0.003
    assert checks["SWAG-EM NLL < MC dropout"]["verdict"] == "NOT met"  # +0.064 ± 0.014: worse by > 2 se
    assert checks["SWAG-EM ECE < MC dropout"]["verdict"] == "tie"
    front = checks["a factor-analysis posterior on the NLL / AUROC (x) front"]
    assert front["verdict"] == "NOT met" and front["detail"] == "front: MC dropout"
    combos["d-mlp"]["methods"]["swag-em"]["per_seed"]["nll"][2] = 0.47  # 2.2 % above SWA on one seed
    swa = {c["check"]: c for c in rep.bar_checks(combos)}["SWAG-EM NLL never > 1 % above SWA's on a seed"]
    assert swa["verdict"] == "NOT met" and "worst seed +2.2 %" in swa["detail"]


def test_bar_rows_tell_close_values_apart():
    """Values equal at the default rounding print with more digits."""
    assert rep.versus(0.0612, 0.0598, 2) == "0.061 vs 0.060"
    assert rep.versus(0.5001, 0.5004) == "0.5001 vs 0.5004"
    assert rep.versus(0.25, 0.25, 2) == "0.25 vs 0.25"
    assert rep.versus(1.0, 1.0 + 1e-9) == "1.000000 vs 1.000000"  # at most 6 decimals


def test_map_prior_precision_chosen_by_tempered_validation_nll():
    """MAP's grid score is the validation NLL at the best temperature (a dense grid of temperatures agrees)."""
    from pyro_fa.experiments.classify.methods import _choose, _nll, _tempered_nll

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 5, (300,), generator=g)
    logits = 4.0 * torch.randn(300, 5, generator=g) + 6.0 * torch.nn.functional.one_hot(y, 5)  # overconfident
    probs = logits.softmax(-1)
    grid = torch.logspace(-1, 1.5, 4001, dtype=torch.float64)
    dense = min(float(torch.nn.functional.cross_entropy(logits.double() / t, y)) for t in grid)
    assert _tempered_nll(probs, y) == pytest.approx(dense, rel=1e-4)
    assert _tempered_nll(probs, y) < _nll(probs, y) - 0.05
    sharp, blunt = probs, (logits / 8).softmax(-1)  # raw NLL prefers the blunt one, tempered sees them equal
    value, _, scores = _choose(["sharp", "blunt"], lambda v: (v, sharp if v == "sharp" else blunt), y, _tempered_nll)
    assert scores["'sharp'"] == pytest.approx(scores["'blunt'"], rel=1e-6)
    assert _choose(["sharp", "blunt"], lambda v: (v, sharp if v == "sharp" else blunt), y)[0] == "blunt"
    with pytest.raises(ValueError, match="map_select must be 'tempered' or 'nll', got 'accuracy'"):
        Budget(map_select="accuracy")


def test_a_peer_alone_runs_without_a_map_network_and_an_unsupported_layer_is_skipped(tmp_path):
    """``--methods ivon`` trains no MAP network (IVON has its own grid); laplace-torch's all-weights KFAC does not
    support the 1-D CNN's layers: the row is skipped with a warning naming the reason, the others still run."""
    from pyro_fa.experiments.classify import posthoc

    avail = posthoc.peers_available()
    torch.set_num_threads(1)
    budget = Budget(epochs=2, swag_epochs=1, rank=2, ensemble=2, samples=3, prior_precisions=(1.0,), dropouts=(0.1,),
                    swag_lrs=(3e-3,), vi_lrs=(3e-3,), ivon_lrs=(0.1,), ivon_hess_inits=(0.5,))
    if avail["ivon"]:
        out = classify.run_benchmark([("digits", "mlp")], ["ivon"], budget, [0], tmp_path / "ivon", progress=False,
                                     subset=(120, 60))
        assert set(out["combos"]["digits-mlp"]["methods"]) == {"ivon", "ivon+T"}
    if avail["laplace"]:
        with pytest.warns(UserWarning, match=r"laplace-kron skipped: laplace-torch cannot fit it on this network "
                                             r"\(NotImplementedError"):
            out = classify.run_benchmark([("mnist1d", "cnn")], ["map", "laplace-kron", "laplace-diag"], budget, [0],
                                         tmp_path / "cnn", progress=False, subset=(120, 60))
        assert {"map", "laplace-diag"} <= set(out["combos"]["mnist1d-cnn"]["methods"])
        assert "laplace-kron" not in out["combos"]["mnist1d-cnn"]["methods"]


def test_each_factor_laplace_row_starts_from_the_same_prior_precision():
    """A marginal-likelihood row's Adam starts from the prior precision it was given, never from the choice of a
    row run before it in the same process (the grid's can be 1e8, far from the optimum): the rows alone and all
    together give the same prior precisions."""
    from pyro_fa.experiments.classify import posthoc

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = cdata.load_classify("digits", seed=0)
    net = make_network("mlp", data)
    with torch.no_grad():  # far from any posterior mode: the linearised evidence's choice depends on where it starts
        for p in net.parameters():
            p.mul_(3.0)
    budget = Budget(laplace_rank=4, temperature=False)
    rows = ("factor-laplace", "factor-laplace-grid", "factor-laplace-lin")
    together: dict = {}
    posthoc.run_factor_laplace(rows, net, data, budget, 0, [data.x_test[:50]], together, 0.0)
    # the grid's choice is far from 1, where the marginal-likelihood rows start
    assert abs(math.log10(together["factor-laplace-grid"]["extra"]["prior_precision"])) >= 2
    for name in ("factor-laplace", "factor-laplace-lin"):
        alone: dict = {}
        posthoc.run_factor_laplace([name], net, data, budget, 0, [data.x_test[:50]], alone, 0.0)
        assert together[name]["extra"]["prior_precision"] == pytest.approx(alone[name]["extra"]["prior_precision"],
                                                                          rel=1e-6)
