"""What a ``pyro-fa classify`` run keeps and prints: every finished seed (a unit file per dataset × network × seed,
written when it is done and reused by a rerun), another run's results (refused, not overwritten), and a quick run's
screenful (methods stood in by a fake that trains nothing)."""
import json

import pytest
import torch

from pyro_fa import cli
from pyro_fa.experiments.classify import command as classify

pytest.importorskip("mnist1d")

ARGS = ["classify", "--datasets", "digits", "--networks", "mlp", "--methods", "map", "swag-em", "--seeds", "3",
        "--epochs", "4", "--no-progress"]


class FakeMethods:
    """``run_methods`` without training: fixed probabilities per seed; counts its calls, and raises
    ``interrupt_at``'s exception on that seed (Ctrl-C in the middle of a run)."""

    def __init__(self, interrupt_at=None):
        self.calls, self.interrupt_at = [], interrupt_at

    def __call__(self, methods, network, data, budget, seed, tick=lambda k: None, prior_precision=None):
        if seed == self.interrupt_at:
            raise KeyboardInterrupt
        self.calls.append(seed)
        g = torch.Generator().manual_seed(seed)
        inputs = [data.x_test, *data.ood.values()]
        rows = {}
        for name in methods:
            probs = [torch.randn(len(x), 10, generator=g, dtype=torch.float64).softmax(-1) for x in inputs]
            rows[name] = {"probs": probs, "seconds": 0.5 + seed, "extra": {"prior_precision": 1.0, "val_nll": {1.0: 0.3}}}
        if budget.temperature:  # as run_methods adds them: a "+T" row per row
            rows.update({f"{name}+T": dict(row) for name, row in rows.items()})
        return rows


def test_an_interrupted_run_keeps_its_finished_seeds_and_a_rerun_reuses_them(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setattr(classify, "run_methods", FakeMethods(interrupt_at=1))
    with pytest.raises(KeyboardInterrupt):
        cli.main(ARGS + ["--output-dir", str(out)])
    units = sorted(p.name for p in (out / "units").iterdir())
    assert len(units) == 2 and units[0].startswith("digits-mlp__seed0__")  # seed 0's unit and its probabilities
    assert {p.rsplit(".", 1)[1] for p in units} == {"json", "pt"}
    assert not (out / "results.json").exists()
    with pytest.raises(SystemExit, match=r"without results.json; it holds the seeds of an unfinished run: run its "
                                         r"command again to finish it\.$"):
        cli.main(["classify", "--merge", str(out), "--output-dir", str(tmp_path / "m")])
    rerun = FakeMethods()
    monkeypatch.setattr(classify, "run_methods", rerun)
    assert cli.main(ARGS + ["--output-dir", str(out)]) == 0
    assert rerun.calls == [1, 2]  # seed 0 is not computed again
    assert "digits-mlp seed 0: done before" in capsys.readouterr().out
    fresh = FakeMethods()
    monkeypatch.setattr(classify, "run_methods", fresh)
    assert cli.main(ARGS + ["--output-dir", str(tmp_path / "fresh")]) == 0
    assert fresh.calls == [0, 1, 2]
    resumed, whole = (json.loads((d / "results.json").read_text()) for d in (out, tmp_path / "fresh"))
    assert resumed["combos"] == whole["combos"] and resumed["bar"] == whole["bar"]
    assert resumed["combos"]["digits-mlp"]["methods"]["swag-em"]["seeds"] == [0, 1, 2]
    a, b = (torch.load(d / "predictions.pt") for d in (out, tmp_path / "fresh"))
    for x, y in zip(a["probs"]["digits-mlp"]["map"], b["probs"]["digits-mlp"]["map"]):
        assert torch.equal(x, y)
    # the same run again rewrites its files from its units alone
    again = FakeMethods()
    monkeypatch.setattr(classify, "run_methods", again)
    assert cli.main(ARGS + ["--output-dir", str(out)]) == 0
    assert again.calls == []
    assert json.loads((out / "results.json").read_text())["combos"] == whole["combos"]


def test_a_folder_holding_another_runs_results_is_refused(tmp_path, monkeypatch):
    """--merge A B --output-dir A, or a run of other methods or fewer seeds into A, would replace A's results: refused,
    A untouched. The same merge again, or the same run over more seeds, goes on."""
    monkeypatch.setattr(classify, "run_methods", FakeMethods())
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli.main(ARGS + ["--output-dir", str(a)]) == 0
    assert cli.main(ARGS + ["--seed", "3", "--output-dir", str(b)]) == 0
    before = {p.name: p.read_bytes() for p in a.iterdir() if p.is_file()}
    with pytest.raises(SystemExit, match=r"--output-dir '.*a' already holds the results of another run \(.*"
                                         r"results.json\), which this run would replace; choose another --output-dir"):
        cli.main(["classify", "--merge", str(a), str(b), "--output-dir", str(a)])
    with pytest.raises(SystemExit, match="already holds the results of another run"):
        cli.main(ARGS + ["--seeds", "2", "--output-dir", str(a)])  # other seeds: refused too
    with pytest.raises(SystemExit, match="already holds the results of another run"):
        cli.main(ARGS + ["--methods", "map", "--output-dir", str(a)])  # other methods
    assert {p.name: p.read_bytes() for p in a.iterdir() if p.is_file()} == before
    # a merge goes into a folder of its own, and the same merge again may rewrite it
    assert cli.main(["classify", "--merge", str(a), str(b), "--output-dir", str(tmp_path / "m")]) == 0
    assert cli.main(["classify", "--merge", str(a), str(b), "--output-dir", str(tmp_path / "m")]) == 0
    with pytest.raises(SystemExit, match="already holds the results of another run"):
        cli.main(["classify", "--merge", str(a), "--output-dir", str(tmp_path / "m")])
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert merged["seeds_per_combo"] == {"digits-mlp": [0, 1, 2, 3, 4, 5]}
    # more seeds of the same run go on from its units, and its report holds them all
    more = FakeMethods()
    monkeypatch.setattr(classify, "run_methods", more)
    assert cli.main(ARGS + ["--seeds", "4", "--output-dir", str(a)]) == 0
    assert more.calls == [3]
    assert json.loads((a / "results.json").read_text())["seeds"] == [0, 1, 2, 3]
    with pytest.raises(SystemExit, match=r"--merge got seed\(s\) \[3\] of digits-mlp twice"):  # b's seed 3 too
        cli.main(["classify", "--merge", str(a), str(b), "--output-dir", str(tmp_path / "m2")])


def test_a_quick_run_prints_every_way_to_a_posterior_on_one_screen(tmp_path, monkeypatch, capsys):
    """--quick: one table (MNIST-1D's reference MLP) with SWAG-EM, MultiSWAG, VIFA and FactorLaplace beside MAP and
    the peers, and one line about the bars instead of their rows; a full run's output keeps its bar rows."""
    from pyro_fa.experiments.classify import report as rep

    fake = FakeMethods()
    seen = []
    monkeypatch.setattr(classify, "run_methods", lambda methods, *a, **k: seen.append(list(methods)) or fake(methods, *a, **k))
    monkeypatch.setattr(classify, "peers_available", lambda: {"laplace": True, "ivon": True})
    assert cli.main(["classify", "--quick", "--no-progress", "--output-dir", str(tmp_path / "q")]) == 0
    printed = capsys.readouterr().out
    assert seen == [list(classify.QUICK_METHODS)] and fake.calls == [0]
    assert {"swag-em", "multiswag", "vifa", "factor-laplace"} <= set(seen[0])
    lines = printed.splitlines()
    assert len(lines) <= 60, printed
    assert "NOT met" not in printed and "Bars: not judged on a quick run" in printed
    assert "| FactorLaplace (ours, marglik) |" in printed and "| VIFA (ours) |" in printed
    assert "mnist1d-mlp (1 seed(s))" in printed and "digits" not in printed.split("wrote")[0]
    # the bars are still checked, and written to table.md
    table = (tmp_path / "q" / "table.md").read_text()
    assert "## The bars" in table and rep.SMALL_RUN_NOTE in table
    # a run that is not --quick prints its bar rows as before
    assert cli.main(["classify", "--datasets", "digits", "--methods", "map", "swag-em", "--seeds", "1", "--epochs", "4",
                     "--no-progress", "--output-dir", str(tmp_path / "small")]) == 0
    printed = capsys.readouterr().out
    assert "| dataset × network | check (over seeds; paired where two rows)" in printed
    assert rep.SMALL_RUN_NOTE in printed and "Bars: not judged" not in printed
