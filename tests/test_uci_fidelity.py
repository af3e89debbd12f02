"""pyro-fa uci --hmc-reference: a method's test predictive scored against a hand-made HMC reference (exact cases:
an equal predictive scores 0, a shifted one the shift, Gaussians by their closed form), the refusals, the unit keys
and the report's columns."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import wasserstein_distance

from pyro_fa import cli
from pyro_fa.datasets import load_uci
from pyro_fa.experiments.uci import fidelity as fid
from pyro_fa.experiments.uci.protocol import SplitData, evaluate
from pyro_fa.experiments.uci.results import _unit_key
from pyro_fa.metrics import predictive_wasserstein2


def _split(m=7, p=3, y_mean=1.5, y_std=2.0, split=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(name="toy", split=split, x_train=torch.randn(20, p, generator=g, dtype=torch.float64),
                           y_test=torch.randn(m, generator=g, dtype=torch.float64), y_mean=y_mean, y_std=y_std,
                           n_hidden=None)


def _write(path, f_draws, noise=0.3, y_mean=1.5, y_std=2.0, likelihood="regression", dim=None, **extra):
    obj = {"reference": {}, "per_chain": [], "meta": {"y_mean": y_mean, "y_std": y_std, "map": {"precision": 10.0}},
           "likelihood": likelihood, "f_draws": f_draws.float(), "noise": torch.tensor(noise), **extra}
    torch.save(obj, path)
    if dim is not None:
        path.with_suffix(".json").write_text(json.dumps({"dim": dim}))
    return path


def _reference(tmp_path, S=40, m=7, noise=0.3, **kw):
    f = torch.randn(S, m, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return fid.Reference.load(_write(tmp_path / "toy-split0.pt", f, noise, **kw), 0)


def test_an_equal_predictive_scores_zero_and_a_shifted_one_the_shift(tmp_path):
    ref = _reference(tmp_path)
    f, nv = ref.f_draws, torch.full((ref.f_draws.shape[0],), ref.noise ** 2, dtype=torch.float64)
    same = ref.score(f, nv, seed=5)
    assert same["w1"] == 0.0 and same["w2"] == pytest.approx(0.0, abs=1e-12)
    shifted = ref.score(f + 0.25, nv, seed=5)
    assert shifted["w1"] == pytest.approx(0.25, abs=1e-12) and shifted["w2"] == pytest.approx(0.25, abs=1e-12)
    # in float32 (a method's dtype): 0 to rounding
    assert ref.score(f.float(), nv.float(), seed=5)["w1"] == pytest.approx(0.0, abs=1e-6)


def test_gaussian_predictives_score_their_closed_form_and_scipys_distance(tmp_path):
    """Reference N(0, 0.3^2) at every point, method N(c, s^2): W2 = sqrt(c^2 + (s - 0.3)^2) exactly; W1 of the
    samples is scipy's wasserstein_distance of them, and near E|c + (s - 0.3) Z| (the Gaussians' W1)."""
    m, c, s = 6, 0.2, 0.5
    ref = fid.Reference.load(_write(tmp_path / "g.pt", torch.zeros(1, m)), 0)
    means, nv = torch.full((1, m), c, dtype=torch.float64), torch.tensor([s ** 2], dtype=torch.float64)
    got = ref.score(means, nv, seed=11)
    assert got["w2"] == pytest.approx(math.sqrt(c ** 2 + (s - 0.3) ** 2), rel=1e-12)
    ours, theirs = fid.predictive_samples(means, nv, 11), ref.samples(11)
    by_scipy = sum(wasserstein_distance(ours[i].numpy(), theirs[i].numpy()) for i in range(m)) / m
    assert got["w1"] == pytest.approx(by_scipy, rel=1e-10)
    a, b = c, s - 0.3
    exact = b * math.sqrt(2 / math.pi) * math.exp(-a * a / (2 * b * b)) + a * math.erf(a / (b * math.sqrt(2)))
    assert got["w1"] == pytest.approx(exact, abs=0.02)
    # a mixture is matched by its moments for W2: two draws at +-d are N(0, d^2 + noise) by moments
    d = 0.4
    mix = fid.Reference.load(_write(tmp_path / "mix.pt", torch.tensor([[d] * m, [-d] * m])), 0)
    w2 = mix.score(torch.zeros(1, m, dtype=torch.float64), torch.tensor([0.3 ** 2 + d ** 2]), seed=0)["w2"]
    assert w2 == pytest.approx(0.0, abs=1e-7)


def test_score_fit_records_scores_cost_and_the_choice_beside_the_reference(tmp_path):
    m, S = 7, 5
    d = _split(m)
    ref = _reference(tmp_path, m=m, dim=51)
    g = torch.Generator().manual_seed(1)
    means = torch.randn(S, 2, m, generator=g, dtype=torch.float64)  # replicas 0, 1 = splits 0, 1 (1 unscored)
    nv = torch.tensor([[0.1], [0.2]], dtype=torch.float64)
    data = SplitData(torch.zeros(2, 20, 3), torch.zeros(2, 20), torch.zeros(2, m, 3),
                     torch.stack([d.y_test, d.y_test]), torch.tensor([2.0, 2.0], dtype=torch.float64))
    fit = fid.Fit(means, nv, 51, 1.0, torch.tensor([0.5, 0.6]), seconds=3.0, map_seconds=1.5)
    other = SimpleNamespace(**{**vars(d), "split": 1})
    out = fid.score_fit(fit, data, [d, other], {0: ref}, seed=2)
    assert set(out) == {"0"}
    rec = out["0"]
    expected = evaluate(means[:, :1], nv[:1], data.take(torch.tensor([0])))
    assert rec["ll"] == pytest.approx(float(expected["ll"][0])) and rec["rmse"] == pytest.approx(
        float(expected["rmse"][0]))
    assert rec["w2"] == pytest.approx(float(predictive_wasserstein2(
        means[:, 0], torch.full((S, m), 0.1, dtype=torch.float64), *ref.moments())), rel=1e-10)
    assert rec["w1"] == pytest.approx(ref.score(means[:, 0], torch.full((S,), 0.1, dtype=torch.float64), 2)["w1"])
    assert rec["map_trainings"] == 2.0 and rec["seconds"] == 3.0
    assert (rec["precision"], rec["noise"], rec["reference_precision"]) == (1.0, 0.5, 10.0)
    assert rec["reference_noise"] == pytest.approx(0.3) and rec["reference"] == ref.digest
    # another network (a 2x50 method) is not scored, and says why
    wide = fid.score_fit(fid.Fit(means, nv, 3301, 1.0, torch.ones(2), 1.0), data, [d], {0: ref}, seed=2)
    assert wide == {"0": {"skipped": "its network has 3301 weights, the reference's 51"}}
    # without the diagnostics' dim, the reference's network is the benchmark's 1x50 on the split's inputs
    (tmp_path / "bare").mkdir()
    assert _reference(tmp_path / "bare", m=m).network_dim(d) == (3 + 2) * 50 + 1


def test_the_reference_row_is_the_floor_of_the_methods_draws(tmp_path):
    m = 7
    d = _split(m)
    ref = _reference(tmp_path, S=40, m=m)
    data = SplitData(torch.zeros(1, 20, 3), torch.zeros(1, 20), torch.zeros(1, m, 3), d.y_test.unsqueeze(0),
                     torch.tensor([2.0], dtype=torch.float64))
    rec = fid.score_reference(data, [d], {0: ref}, seed=0, draws=10)["0"]
    thin = ref.thinned(10)
    assert rec["draws"] == 10 and torch.equal(thin[0], ref.f_draws[0]) and torch.equal(thin[-1], ref.f_draws[-1])
    assert rec["w1"] == pytest.approx(ref.score(thin, torch.full((10,), ref.noise ** 2), 0)["w1"])
    full = fid.score_reference(data, [d], {0: ref}, seed=0, draws=40)["0"]
    assert full["w1"] == 0.0 and full["w2"] == pytest.approx(0.0, abs=1e-7) and full["ll"] == rec["ll"]
    nv = torch.full((40, 1, 1), ref.noise ** 2, dtype=torch.float64)
    assert rec["ll"] == pytest.approx(float(evaluate(ref.f_draws.unsqueeze(1), nv, data)["ll"][0]))


def test_references_of_another_test_set_or_kind_are_refused(tmp_path):
    f = torch.zeros(4, 7)
    d = _split(7)
    with pytest.raises(ValueError, match=r"must hold the 6 test points of split 0 of 'toy', got 7: it was made on "
                                         r"another test set"):
        fid.Reference.load(_write(tmp_path / "a.pt", f), 0).check(_split(6))
    with pytest.raises(ValueError, match=r"must be standardised as split 0 of 'toy' is \(y_std 2\.0\), got y_std "
                                         r"2\.5: it was made on another split"):
        fid.Reference.load(_write(tmp_path / "b.pt", f, y_std=2.5), 0).check(d)
    with pytest.raises(ValueError, match=r"\(y_mean 1\.5\), got y_mean 0\.0"):
        fid.Reference.load(_write(tmp_path / "c.pt", f, y_mean=0.0), 0).check(d)
    with pytest.raises(ValueError, match="must be a regression reference, got likelihood 'classification'"):
        fid.Reference.load(_write(tmp_path / "d.pt", f, likelihood="classification"), 0)
    torch.save({"reference": {}}, tmp_path / "e.pt")
    with pytest.raises(ValueError, match=r"must hold the keys \['f_draws', 'likelihood', 'meta', 'noise'\], got "
                                         r"\['reference'\]"):
        fid.Reference.load(tmp_path / "e.pt", 0)
    (tmp_path / "f.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="must be a torch file written by pyro-fa hmc-reference, got an unreadable"):
        fid.Reference.load(tmp_path / "f.pt", 0)
    with pytest.raises(ValueError, match="must hold f_draws, a finite"):
        fid.Reference.load(_write(tmp_path / "g.pt", torch.full((2, 7), math.nan)), 0)
    with pytest.raises(ValueError, match="must hold meta with y_mean and y_std"):
        torch.save({"meta": {}, "likelihood": "regression", "f_draws": f, "noise": 0.1}, tmp_path / "h.pt")
        fid.Reference.load(tmp_path / "h.pt", 0)
    with pytest.raises(ValueError, match="--hmc-reference must be a folder, got"):
        fid.find_references(tmp_path / "a.pt", "toy", [d])


def test_a_reference_whose_chains_disagree_is_used_with_a_warning(tmp_path):
    d = _split(7)
    _write(tmp_path / "toy-split0.pt", torch.zeros(4, 7))
    (tmp_path / "toy-split0.json").write_text(json.dumps({"dim": 51, "rhat_max": 1.18}))
    with pytest.warns(UserWarning, match=r"has R-hat 1\.180 \(not below 1\.05\): its chains disagree"):
        refs = fid.find_references(tmp_path, "toy", [d])
    assert refs[0].rhat_max == 1.18 and refs[0].dim == 51
    (tmp_path / "toy-split0.json").write_text(json.dumps({"dim": 51, "rhat_max": 1.019}))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fid.find_references(tmp_path, "toy", [d])[0].rhat_max == 1.019


def test_a_unit_is_keyed_by_its_references_only_when_it_has_some(tmp_path):
    run_key = {"protocol": 1, "budget": {}, "seed": 0, "splits": None}
    plain = _unit_key(run_key, "yacht", "vifa-gaussian-1x50", ["vifa-gaussian-1x50"])
    assert _unit_key(run_key, "yacht", "vifa-gaussian-1x50", ["vifa-gaussian-1x50"], {}) == plain
    assert "hmc_reference" not in plain  # units of runs without references keep their keys (and files)
    ref = _reference(tmp_path)
    keyed = _unit_key(run_key, "yacht", "vifa-gaussian-1x50", ["vifa-gaussian-1x50"], fid.reference_key({0: ref}))
    assert keyed == {**plain, "hmc_reference": {"0": ref.digest}}


def _yacht_reference(folder, split=0, m=None, seed=0):
    d = load_uci("yacht", split, dtype=torch.float64)
    f = d.y_test.unsqueeze(0) + 0.1 * torch.randn(50, d.y_test.shape[0], generator=torch.Generator().manual_seed(seed),
                                                  dtype=torch.float64)
    folder.mkdir(exist_ok=True)
    return _write(folder / f"yacht-split{split}.pt", f if m is None else f[:, :m], 0.1, d.y_mean, d.y_std)


def test_uci_command_scores_the_split_that_has_a_reference(tmp_path, capsys):
    refs, out = tmp_path / "refs", tmp_path / "uci"
    _yacht_reference(refs)
    args = ["uci", "--quick", "--datasets", "yacht", "--methods", "vifa-gaussian-1x50", "vifa-gaussian-2x50",
            "swag-em-1x50", "factor-ivon-1x50", "--steps", "40", "--output-dir", str(out), "--no-progress"]
    assert cli.main(args) == 0
    plain = json.loads((out / "results.json").read_text())
    assert plain["fidelity"] == {"yacht": {}}
    assert cli.main(args + ["--hmc-reference", str(refs)]) == 0
    res = json.loads((out / "results.json").read_text())
    # the other results are those of the run without references, to the bit
    assert res["results"]["yacht"]["vifa-gaussian-1x50"]["ll"] == plain["results"]["yacht"]["vifa-gaussian-1x50"]["ll"]
    assert res["results"]["yacht"]["swag-em-1x50"]["ll"] == plain["results"]["yacht"]["swag-em-1x50"]["ll"]
    scored = res["fidelity"]["yacht"]
    assert set(scored) == {"vifa-gaussian-1x50", "vifa-gaussian-2x50", "swag-em-1x50", "factor-ivon-1x50", fid.MAP_NAME,
                           fid.HMC_NAME}
    assert res["results"]["yacht"]["factor-ivon-1x50"]["ll"] == plain["results"]["yacht"]["factor-ivon-1x50"]["ll"]
    assert all(set(per_split) == {"0"} for per_split in scored.values())  # split 1 has no reference
    assert "skipped" in scored["vifa-gaussian-2x50"]["0"]
    for name in ("vifa-gaussian-1x50", "swag-em-1x50", "factor-ivon-1x50", fid.MAP_NAME):
        rec = scored[name]["0"]
        assert rec["w1"] > 0 and rec["seconds"] > 0
        assert rec["ll"] == pytest.approx(res["results"]["yacht"].get(name, {"ll": [rec["ll"]]})["ll"][0])
    assert scored[fid.MAP_NAME]["0"]["map_trainings"] == 1.0
    table = (out / "table.md").read_text()
    assert "## Fidelity to HMC" in table and "**yacht, split 0**" in table and "MAP 1×50" in table
    assert "W1 to HMC (splits)" in table and f"{scored['swag-em-1x50']['0']['w1']:.3f} (1)" in table
    assert "not scored: its network has" in capsys.readouterr().out
    # a reference made on another test set is refused before any training
    bad = tmp_path / "bad"
    _yacht_reference(bad, m=10)
    with pytest.raises(SystemExit, match=r"bad/yacht-split0\.pt must hold the 31 test points of split 0 of 'yacht', "
                                         r"got 10"):
        cli.main(args + ["--hmc-reference", str(bad), "--output-dir", str(tmp_path / "never")])
