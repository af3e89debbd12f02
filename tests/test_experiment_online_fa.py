import json

import pytest
import torch

from pyro_fa import cli
from pyro_fa.experiments.online_fa import generate_fa_model


def test_generate_fa_model_follows_algorithm_4():
    g = torch.Generator().manual_seed(0)
    loc, F, psi = generate_fa_model(50, 4, (1, 100), g)
    assert loc.shape == (50,) and F.shape == (50, 4) and psi.shape == (50,)
    # rows of F are rows of orthonormal eigenvectors scaled by s, s^2 in [1, 100]
    g = torch.Generator().manual_seed(0)
    torch.randn(50, generator=g, dtype=torch.float64)
    A = torch.randn(50, 50, generator=g, dtype=torch.float64)
    V = torch.linalg.eigh(A @ A.T)[1][:, -4:].flip(-1)
    s = (F / V)[:, 0]
    assert torch.allclose(F, V * s.unsqueeze(-1))
    assert ((s**2 >= 1) & (s**2 <= 100)).all()
    assert ((psi >= 0) & (psi <= (s**2).max())).all()


def test_online_fa_command_writes_results(tmp_path, capsys):
    out = tmp_path / "ofa"
    code = cli.main(["online-fa", "--trials", "2", "--dims", "20", "--sizes", "150", "400",
                     "--output-dir", str(out), "--no-progress"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] and len(res["summary"]) == 3
    for cell in res["summary"]:
        for m in ("batch", "online_em", "online_sga"):
            assert 0 < cell[m]["mean"] < 2
    assert (out / "figure_5_1.png").stat().st_size > 0 and (out / "figure_5_2.png").exists()
    assert not (out / "partial.json").exists()
    printed = capsys.readouterr().out
    assert "online EM" in printed and "T = 400" in printed


@pytest.mark.parametrize("argv, message", [
    (["--trials", "0"], "--trials must be >= 1"),
    (["--dims", "5"], "must exceed --rank=10"),
    (["--sizes", "0"], "--sizes must be positive"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_online_fa_command_rejects_bad_arguments(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        cli.main(["online-fa", "--output-dir", str(tmp_path)] + argv)
