"""pyro-fa classify --hmc-reference: each row's test predictive scored against an HMC reference (agreement, total
variation), its cost in MAP trainings and the deep-ensemble equivalent of its NLL; a reference that is not of the
run refused naming what differs. Methods are stood in by a fake that trains nothing; the reference file is written
by pyro-fa hmc-reference's own summarize from made-up draws on the digits test part."""
import json
from dataclasses import replace

import pytest
import torch

from pyro_fa import cli
from pyro_fa.experiments import hmc_reference as hmc
from pyro_fa.experiments.classify import command as classify
from pyro_fa.experiments.classify import fidelity as fid
from pyro_fa.experiments.classify.data import load_classify
from pyro_fa.experiments.classify.networks import make_network


def _ref(probs, **kw):
    return fid.Reference(path=kw.pop("path", "ref.pt"), probs=torch.as_tensor(probs, dtype=torch.float64), **kw)


# ----------------------------------------------------------------------------- the scores
def test_a_predictive_equal_to_the_reference_agrees_everywhere_at_total_variation_zero():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]], dtype=torch.float64)
    assert fid.fidelity(p, _ref(p)) == {"hmc_agreement": 1.0, "hmc_total_variation": 0.0}
    # draws (S, N, C) whose average is the reference: the model average is what is compared
    d = torch.tensor([0.05, -0.05, 0.0], dtype=torch.float64)
    draws = torch.stack([p + d, p - d, p])
    assert fid.fidelity(draws, _ref(draws.mean(0))) == {"hmc_agreement": 1.0, "hmc_total_variation": 0.0}


def test_agreement_and_total_variation_by_hand():
    ref = [[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]]
    p = torch.tensor([[0.5, 0.4, 0.1], [0.6, 0.2, 0.2]], dtype=torch.float64)
    # argmax (0, 0) against (0, 1): one of two; TV (0.1 + 0.1 + 0) / 2 = 0.1 and (0.4 + 0.3 + 0.1) / 2 = 0.4
    got = fid.fidelity(p, _ref(ref))
    assert got["hmc_agreement"] == 0.5
    assert got["hmc_total_variation"] == pytest.approx(0.25, abs=1e-15)


def test_size_curve_cost_and_deep_ensemble_equivalent_by_hand():
    members = torch.tensor([[[0.5, 0.5]], [[0.9, 0.1]]], dtype=torch.float64)  # 2 members, 1 point, label 0
    curve = fid.size_curve(members, torch.tensor([0]))
    assert curve == pytest.approx([-torch.tensor(0.5).log().item(), -torch.tensor(0.7).log().item()], abs=1e-15)
    rows = {"map": {"scores": {"nll": 0.30}, "seconds": 10.0, "extra": {}},  # a grid of 5: one training 2 s
            "ensemble": {"scores": {"nll": 0.22}, "seconds": 9.0, "extra": {"size_curve_nll": [0.30, 0.25, 0.22]}},
            "swag-em": {"scores": {"nll": 0.27}, "seconds": 3.0, "extra": {}},
            "swag-em+T": {"scores": {"nll": 0.20}, "seconds": 3.5, "extra": {}}}
    probs = {"map": torch.tensor([[0.6, 0.4], [0.4, 0.6]]), "swag-em": torch.tensor([[0.4, 0.6], [0.1, 0.9]])}
    out = fid.seed_extras(rows, probs, _ref([[0.6, 0.4], [0.3, 0.7]]), grid_size=5)
    assert out["map"] == {"hmc_agreement": 1.0, "hmc_total_variation": pytest.approx(0.05), "map_trainings": 5.0,
                          "dee_nll": 1.0}
    # NLL 0.27 between 1 member (0.30) and 2 (0.25): 1 + 0.03 / 0.05 members; beyond the curve: inf
    assert out["swag-em"]["dee_nll"] == pytest.approx(1.6) and out["swag-em"]["map_trainings"] == 1.5
    assert out["swag-em"]["hmc_agreement"] == 0.5 and out["swag-em"]["hmc_total_variation"] == pytest.approx(0.2)
    assert out["swag-em+T"] == {"map_trainings": 1.75, "dee_nll": float("inf")}  # no probabilities given: no fidelity
    assert out["ensemble"]["dee_nll"] == pytest.approx(3.0)
    # no map row: no cost; no size curve: no DEE; no reference: no fidelity
    assert fid.seed_extras({"vifa": rows["swag-em"]}, None, None, 5) == {"vifa": {}}


# ----------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def digits0():
    data = load_classify("digits", 0)
    return data, make_network("mlp", data)


def _checked(data, net, precision=1.0):
    p = torch.full((len(data.y_test), data.num_classes), 1.0 / data.num_classes, dtype=torch.float64)
    return _ref(p, precision=precision, shapes=fid.parameter_shapes(net), digest=fid.digest_of(data.x_test, data.y_test),
                train_digest=fid.digest_of(data.x_train, data.y_train))


def test_a_reference_of_the_run_passes_its_checks(digits0):
    data, net = digits0
    ref = _checked(data, net)
    fid.check_reference(ref, data, net)
    fid.check_precision(ref, 1.0, "digits-mlp seed 0")


def test_a_reference_of_another_test_part_network_or_prior_is_refused(digits0):
    data, net = digits0
    ref = _checked(data, net)
    y = data.y_test
    with pytest.raises(SystemExit, match=r"--hmc-reference ref.pt: not a reference of this run: its test predictive "
                                         rf"has {len(y)} points, this run's test part {len(y) - 1}\."):
        fid.check_reference(ref, data.subset(len(data.y_train), len(y) - 1), net)
    with pytest.raises(SystemExit, match=rf"its test predictive has {data.num_classes} classes, this run's data 8"):
        fid.check_reference(ref, replace(data, num_classes=8), net)
    order = torch.arange(len(y)).roll(1)
    with pytest.raises(SystemExit, match=r"its test part \(SHA-256 [0-9a-f]{12}\.\.\.\) is not this run's "
                                         r"\([0-9a-f]{12}\.\.\.\): other points or another order"):
        fid.check_reference(ref, replace(data, x_test=data.x_test[order], y_test=y[order]), net)
    with pytest.raises(SystemExit, match=r"not a reference of this run: its training part is not this run's \(another "
                                         r"seed's validation cut\?\)\.$"):
        fid.check_reference(ref, load_classify("digits", 1), net)  # the same test part, another training part
    wider = torch.nn.Sequential(torch.nn.Linear(64, 50), torch.nn.ReLU(), torch.nn.Linear(50, 10))
    with pytest.raises(SystemExit, match=r"its network's weight shapes are \[\[100, 64\], \[100\], \[10, 100\], "
                                         r"\[10\]\], this run's \[\[50, 64\], \[50\], \[10, 50\], \[10\]\]"):
        fid.check_reference(ref, data, wider)
    with pytest.raises(SystemExit, match=r"its prior precision is 1.0, this run's MAP chose 0.01 for digits-mlp "
                                         r"seed 0\.$"):
        fid.check_precision(ref, 0.01, "digits-mlp seed 0")
    with pytest.raises(SystemExit, match=r"this run's prior precision of digits-mlp seed 0 is unknown \(no map "
                                         r"row\): add map to --methods"):
        fid.check_precision(ref, None, "digits-mlp seed 0")


def test_an_older_reference_is_checked_by_its_recorded_scores_and_size(digits0):
    """References written before ``checks`` was recorded: the test part by the NLL and accuracy the reference's
    diagnostics record, the network by its number of weights, the prior precision from the diagnostics."""
    from pyro_fa.metrics import accuracy, negative_log_likelihood

    data, net = digits0
    g = torch.Generator().manual_seed(0)
    p = torch.rand(len(data.y_test), data.num_classes, generator=g, dtype=torch.float64).softmax(-1)
    scores = {"nll": float(negative_log_likelihood(p, data.y_test)), "accuracy": float(accuracy(p, data.y_test))}
    old = _ref(p, precision=0.01, dim=7510, scores=scores)
    fid.check_reference(old, data, net)
    order = torch.arange(len(data.y_test)).flip(0)
    with pytest.raises(SystemExit, match=r"its test NLL / accuracy on this run's test labels are .* its diagnostics "
                                         r"record .*: other test labels or another order"):
        fid.check_reference(old, replace(data, x_test=data.x_test[order], y_test=data.y_test[order]), net)
    with pytest.raises(SystemExit, match=r"its network has 7510 weights, this run's 3760"):
        fid.check_reference(old, data, torch.nn.Sequential(torch.nn.Linear(64, 50), torch.nn.Linear(50, 10)))
    with pytest.raises(SystemExit, match=r"it records neither a digest of its test part nor its test scores, so the "
                                         r"test parts cannot be compared; it records neither its network's weight "
                                         r"shapes nor their number; it records no prior precision\.$"):
        fid.check_reference(_ref(p), data, net)


def test_files_that_are_not_references_are_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--hmc-reference must be a folder of pyro-fa hmc-reference, got '.*nope', "
                                         r"which is not a folder\."):
        fid.find_references(tmp_path / "nope", [("digits", "mlp")], [0])
    (tmp_path / "digits-split0.pt").write_bytes(b"not a torch file")
    with pytest.raises(SystemExit, match=r"digits-split0.pt: not a reference written by pyro-fa hmc-reference"):
        fid.load_reference(tmp_path / "digits-split0.pt")
    torch.save({"reference": {"mean": torch.zeros(3), "var": torch.ones(3)}, "likelihood": "regression"},
               tmp_path / "digits-split0.pt")
    with pytest.raises(SystemExit, match=r"must be a classification reference with test probabilities \(N, C\), got "
                                         r"likelihood 'regression'"):
        fid.load_reference(tmp_path / "digits-split0.pt")


# ----------------------------------------------------------------------------- the command
class FakeMethods:
    """``run_methods`` without training: rows of fixed probabilities per seed; ``swag-em`` at seed 0 is
    ``exact`` (the reference's predictive), every row's prior precision ``prior``."""

    def __init__(self, exact=None, prior=1.0):
        self.calls, self.exact, self.prior = [], exact, prior

    def __call__(self, methods, network, data, budget, seed, tick=lambda k: None, prior_precision=None):
        self.calls.append(seed)
        g = torch.Generator().manual_seed(seed)
        inputs = [data.x_test, *data.ood.values()]
        rows = {}
        for name in methods:
            probs = [torch.randn(len(x), 10, generator=g, dtype=torch.float64).softmax(-1) for x in inputs]
            if name == "swag-em" and seed == 0 and self.exact is not None:
                probs[0] = self.exact
            if name == "ensemble":
                probs = [torch.stack([p, p.roll(1, -1), p.roll(2, -1)]) for p in probs]
            rows[name] = {"probs": probs, "seconds": 5.0 * (1 + (name == "ensemble")),
                          "extra": {"prior_precision": self.prior}}
        rows.update({f"{name}+T": dict(row) for name, row in list(rows.items())})
        return rows


def _write_reference(folder, seed=0, precision=1.0, dataset="digits"):
    """A reference file as pyro-fa hmc-reference writes it (its summarize), from made-up draws of 2 chains."""
    data = load_classify(dataset, seed)
    task = hmc.Task(dataset, seed, lambda: make_network("mlp", data).double(), data.x_train.double(), data.y_train,
                    data.x_test.double(), data.y_test, "classification", precision, None,
                    {"num_classes": data.num_classes})
    g = torch.Generator().manual_seed(7)
    chains = [{"draws": torch.randn(6, len(data.y_test), 10, generator=g).softmax(-1), "accept_rate": 0.8,
               "warmup_accept": 0.8, "step_size": 0.01, "divergences": 0, "seconds": 1.0, "ran_with": [0, 1],
               "dim": 7510} for _ in range(2)]
    reference, diag = hmc.summarize(task, chains)
    folder.mkdir(exist_ok=True)
    hmc._save_pt(folder / f"{task.label}.pt", reference)
    (folder / f"{task.label}.json").write_text(json.dumps(diag))
    return reference["reference"]["probs"]


ARGS = ["classify", "--datasets", "digits", "--networks", "mlp", "--methods", "map", "ensemble", "swag-em",
        "--seeds", "2", "--epochs", "4", "--no-progress"]


def test_hmc_reference_writes_the_checks_classify_compares(tmp_path, digits0):
    data, net = digits0
    _write_reference(tmp_path / "refs", precision=0.5)
    saved = torch.load(tmp_path / "refs" / "digits-split0.pt", weights_only=True)
    assert saved["checks"] == {"precision": 0.5, "parameter_shapes": fid.parameter_shapes(net),
                               "test_digest": fid.digest_of(data.x_test, data.y_test),
                               "train_digest": fid.digest_of(data.x_train, data.y_train)}


def test_classify_scores_each_row_against_the_reference_of_its_seeds(tmp_path, monkeypatch):
    ref_probs = _write_reference(tmp_path / "refs")
    fake = FakeMethods(exact=ref_probs)
    monkeypatch.setattr(classify, "run_methods", fake)
    out = tmp_path / "run"
    assert cli.main(ARGS + ["--output-dir", str(out), "--hmc-reference", str(tmp_path / "refs")]) == 0
    combo = json.loads((out / "results.json").read_text())["combos"]["digits-mlp"]
    em = combo["methods"]["swag-em"]
    # seed 0 has a reference (the row equals it, up to the unit's float32), seed 1 none
    assert em["extra"][0]["hmc_agreement"] == 1.0 and em["extra"][0]["hmc_total_variation"] < 1e-6
    assert "hmc_agreement" not in em["extra"][1]
    mp = combo["methods"]["map"]["extra"][0]
    from pyro_fa.metrics import agreement, total_variation

    probs = torch.load(next((out / "units").glob("digits-mlp__seed0__*.pt")))["probs"]["map"][0].double()
    assert mp["hmc_agreement"] == pytest.approx(float(agreement(probs, ref_probs)), abs=1e-12)
    assert mp["hmc_total_variation"] == pytest.approx(float(total_variation(probs, ref_probs)), abs=1e-12)
    # cost: MAP's 5 s are a grid of 5 trainings; the ensemble's 10 s are 10 of them; DEE from its size curve
    assert [e["map_trainings"] for e in combo["methods"]["ensemble"]["extra"]] == [10.0, 10.0]
    assert all("dee_nll" in e for e in em["extra"])
    assert combo["hmc_reference"]["seeds"] == [0] and combo["hmc_reference"]["diagnostics"]["0"]["chains"] == 2
    table = (out / "table.md").read_text()
    assert "| agreement w. HMC | TV to HMC | DEE (NLL) | MAP trainings |" in table
    assert "Fidelity to HMC, seed 0:" in table and "fidelity to HMC (best first)" in table
    assert "Agreement and TV to HMC are over seed(s) [0] only (the other columns over [0, 1])." in table
    assert (out / "fidelity_digits-mlp.png").is_file()
    # the units are reused: scoring again with the reference trains nothing
    fake.calls.clear()
    assert cli.main(ARGS + ["--output-dir", str(out), "--hmc-reference", str(tmp_path / "refs")]) == 0
    assert fake.calls == []
    # without a reference folder: no fidelity columns, no figure
    assert cli.main(ARGS + ["--output-dir", str(tmp_path / "plain")]) == 0
    assert "TV to HMC" not in (tmp_path / "plain" / "table.md").read_text()
    assert not (tmp_path / "plain" / "fidelity_digits-mlp.png").exists()


def test_classify_refuses_a_reference_that_is_not_of_the_run(tmp_path, monkeypatch):
    _write_reference(tmp_path / "refs", precision=0.5)
    monkeypatch.setattr(classify, "run_methods", FakeMethods())
    with pytest.raises(SystemExit, match=r"digits-split0.pt: not a reference of this run: its prior precision is "
                                         r"0.5, this run's MAP chose 1.0 for digits-mlp seed 0\."):
        cli.main(ARGS + ["--output-dir", str(tmp_path / "a"), "--hmc-reference", str(tmp_path / "refs")])
    # a reference of another split (its training part) under seed 0's name: refused before anything trains
    _write_reference(tmp_path / "other", seed=1)
    (tmp_path / "other" / "digits-split1.pt").rename(tmp_path / "other" / "digits-split0.pt")
    fake = FakeMethods()
    monkeypatch.setattr(classify, "run_methods", fake)
    with pytest.raises(SystemExit, match=r"digits-split0.pt: not a reference of this run: its training part is not "
                                         r"this run's"):
        cli.main(ARGS + ["--output-dir", str(tmp_path / "b"), "--hmc-reference", str(tmp_path / "other")])
    assert fake.calls == []
    with pytest.raises(SystemExit, match=r"--hmc-reference scores a training run's units; --merge keeps the scores"):
        cli.main(["classify", "--merge", str(tmp_path / "a"), "--output-dir", str(tmp_path / "m"),
                  "--hmc-reference", str(tmp_path / "refs")])
