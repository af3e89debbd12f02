"""Merging ``pyro-fa classify`` runs (``--merge``, ``--rows-from``, ``--prior-precision-from``) on hand-written
result folders: values lined up by seed, duplicates and unreadable folders refused in one line."""
import json
from dataclasses import asdict

import pytest
import torch

from pyro_fa import cli
from pyro_fa.experiments.classify import command as classify
from pyro_fa.experiments.classify.methods import Budget

OOD = ["rotated"]


def _scores(nll):
    return {"accuracy": 0.9, "nll": nll, "ece": 0.05, "brier": 0.2, "auroc_rotated": 0.7}


def fake_run(folder, seeds, rows, budget=None, predictions=True):
    """A results.json (and predictions.pt) as ``pyro-fa classify`` writes them: ``rows`` maps a row to its NLL per
    seed (the other metrics fixed); rows are written without ``seeds``, as runs before they recorded them."""
    folder.mkdir(parents=True)
    methods = {}
    for name, nlls in rows.items():
        per = [_scores(v) for v in nlls]
        methods[name] = {"per_seed": {k: [p[k] for p in per] for k in per[0]}, "seconds": [1.0] * len(nlls),
                         "extra": [{"prior_precision": 10 * v} for v in nlls]}
    combo = {"dataset": "digits", "network": "mlp", "ood": OOD, "n": {"train": 10, "val": 5, "test": 6},
             "norms": {"test": 1.0, "rotated": 1.0}, "paper_accuracy": None, "methods": methods}
    result = {"budget": json.loads(json.dumps(asdict(budget or Budget()))), "seeds": list(seeds), "devices": ["cpu"],
              "seeds_per_combo": {"digits-mlp": list(seeds)}, "combos": {"digits-mlp": combo}, "bar": []}
    (folder / "results.json").write_text(json.dumps(result))
    if predictions:
        g = torch.Generator().manual_seed(seeds[0])
        probs = {name: [torch.rand(6, 10, generator=g).softmax(-1) for _ in range(2)] for name in rows}
        torch.save({"probs": {"digits-mlp": probs}, "targets": {"digits-mlp": torch.arange(6)}, "seed": seeds[0]},
                   folder / "predictions.pt")
    return folder


def test_merge_lines_values_up_by_seed_when_the_runs_hold_different_rows(tmp_path):
    """SWAG-EM ran only with seed 1: it is compared with SWA's seed 1, not its seed 0, and the table says the row
    holds one of the two seeds."""
    fake_run(tmp_path / "a", [0], {"map": [0.5], "swa": [0.40]})
    fake_run(tmp_path / "b", [1], {"map": [0.5], "swa": [0.60], "swag-em": [0.50]})
    merged = classify.merge_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    rows = merged["combos"]["digits-mlp"]["methods"]
    assert rows["swa"]["seeds"] == [0, 1] and rows["swa"]["per_seed"]["nll"] == [0.40, 0.60]
    assert rows["swag-em"]["seeds"] == [1] and rows["swag-em"]["per_seed"]["nll"] == [0.50]
    (check,) = [c for c in merged["bar"] if c["check"].startswith("SWAG-EM NLL never")]
    assert check["verdict"] == "met", check  # 0.50 against SWA's 0.60 on seed 1 (not against 0.40 on seed 0)
    assert "worst seed -16.7 %" in check["detail"] and "over seed(s) [1] only" in check["detail"]
    auroc = [c for c in merged["bar"] if c["check"] == "SWAG-EM OOD AUROC (rotated) > MAP"][0]
    assert "over seed(s) [1] only" in auroc["detail"]
    table = (tmp_path / "m" / "table.md").read_text()
    assert "| SWAG-EM (seed(s) 1 of 2) |" in table and "| SWA |" in table
    saved = json.loads((tmp_path / "m" / "results.json").read_text())
    assert saved["combos"]["digits-mlp"]["methods"]["swag-em"]["seeds"] == [1]
    # a merge of the merged folder reads the seeds back: the same rows
    again = classify.merge_runs([tmp_path / "m"], tmp_path / "m2")["combos"]["digits-mlp"]["methods"]
    assert again["swag-em"]["seeds"] == [1] and again["swa"]["per_seed"]["nll"] == [0.40, 0.60]


def test_rows_from_refuses_two_folders_holding_one_seed_of_a_row(tmp_path):
    fake_run(tmp_path / "a", [0, 1], {"map": [0.5, 0.5], "swag-em": [0.4, 0.4]})
    fake_run(tmp_path / "r1", [1], {"swag-em": [0.3]})
    fake_run(tmp_path / "r2", [1], {"swag-em": [0.2]})
    with pytest.raises(SystemExit, match=r"--rows-from '.*r1' and '.*r2' both hold seed 1 of the row 'swag-em' of "
                                         r"digits-mlp; give one of them"):
        classify.merge_runs([tmp_path / "a"], tmp_path / "m", rows_from=[tmp_path / "r1", tmp_path / "r2"])
    # different seeds of one row from two folders are fine
    fake_run(tmp_path / "r0", [0], {"swag-em": [0.1]})
    rows = classify.merge_runs([tmp_path / "a"], tmp_path / "m", rows_from=[tmp_path / "r0", tmp_path / "r1"])
    assert rows["combos"]["digits-mlp"]["methods"]["swag-em"]["per_seed"]["nll"] == [0.1, 0.3]


DAMAGES = [
    ("truncated", r"results.json is not a results.json written by pyro-fa classify \(Expecting"),
    ("empty object", r"results.json is not a results.json written by pyro-fa classify \(no valid budget, seeds, "
                     r"combos\)"),
    ("a list", r"results.json is not a results.json written by pyro-fa classify \(a JSON list, not an object\)"),
    ("garbage predictions", r"predictions.pt is not a predictions.pt written by pyro-fa classify"),
]


@pytest.mark.parametrize("flag, damage, says", [(f, d, s) for f in ("--merge", "--rows-from", "--prior-precision-from")
                                                for d, s in DAMAGES
                                                if not (f == "--prior-precision-from" and d == "garbage predictions")])
def test_an_unreadable_folder_is_refused_in_one_line_naming_it(tmp_path, flag, damage, says):
    good = fake_run(tmp_path / "good", [0], {"map": [0.5]})
    bad = fake_run(tmp_path / "bad", [0], {"map": [0.4]})
    text = (bad / "results.json").read_text()
    if damage == "truncated":
        (bad / "results.json").write_text(text[: len(text) // 2])
    elif damage == "empty object":
        (bad / "results.json").write_text("{}")
    elif damage == "a list":
        (bad / "results.json").write_text("[1, 2]")
    else:
        (bad / "predictions.pt").write_bytes(b"garbage, not a torch file")
    if flag == "--prior-precision-from":  # reads results.json only
        call = lambda: classify.prior_precisions_from(bad, Budget(), [("digits", "mlp")], [0])  # noqa: E731
    elif flag == "--merge":
        call = lambda: classify.merge_runs([good, bad], tmp_path / "m")  # noqa: E731
    else:
        call = lambda: classify.merge_runs([good], tmp_path / "m", rows_from=[bad])  # noqa: E731
    with pytest.raises(SystemExit, match=f"^pyro-fa classify: {flag} '.*bad': .*{says}") as err:
        call()
    assert "\n" not in str(err.value)


def test_prior_precision_from_a_folder_without_results_names_its_flag(tmp_path):
    with pytest.raises(SystemExit, match=r"--prior-precision-from needs folders written by pyro-fa classify, got "
                                         r"'.*nope' without results.json"):
        cli.main(["classify", "--datasets", "digits", "--methods", "vifa", "--prior-precision-from",
                  str(tmp_path / "nope"), "--output-dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"--rows-from needs folders written by pyro-fa classify"):
        classify.merge_runs([fake_run(tmp_path / "a", [0], {"map": [0.5]})], tmp_path / "m",
                            rows_from=[tmp_path / "nope"])


def test_prior_precision_from_a_merged_folder_reads_maps_own_seeds(tmp_path):
    """MAP ran only with seed 1 in a merged folder: its value is seed 1's, and seed 0 is refused by name."""
    fake_run(tmp_path / "a", [0], {"swa": [0.4]})
    fake_run(tmp_path / "b", [1], {"map": [0.5], "swa": [0.6]})
    classify.merge_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert classify.prior_precisions_from(tmp_path / "m", Budget(), [("digits", "mlp")], [1]) == {"digits-mlp": {1: 5.0}}
    with pytest.raises(SystemExit, match=r"holds no MAP row of digits-mlp for seed\(s\) \[0\] \(it holds \[1\]\)"):
        classify.prior_precisions_from(tmp_path / "m", Budget(), [("digits", "mlp")], [0, 1])
