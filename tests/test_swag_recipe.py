"""The SWAG recipe of docs/swag.md runs end to end (examples/swag_recipe.py), and the docs show its code."""
import importlib.util
import math
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from pyro_fa import SWAG

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "swag_recipe.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("swag_recipe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recipe_block() -> str:
    text = EXAMPLE.read_text()
    block = text[text.index("    # recipe:start"):text.index("    # recipe:end")]
    return textwrap.dedent("\n".join(block.splitlines()[1:])).strip()


def test_docs_show_the_example_code():
    docs = (ROOT / "docs" / "swag.md").read_text()
    blocks = [b.strip() for b in re.findall(r"```python\n(.*?)```", docs, flags=re.S)]
    assert _recipe_block() in blocks


@pytest.mark.slow
def test_recipe_example_runs_and_is_sane(capsys):
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # as a user runs it (the suite's default is float64)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _load_example().main(["--quick"])
    finally:
        torch.set_default_dtype(default)
    printed = capsys.readouterr().out
    # the default warmup fits the recipe: the fit starts without "the warm-up ends here"
    assert not [w for w in caught if "warm-up" in str(w.message) or "warmup" in str(w.message)]
    assert out["n_collected"] == 20
    for name in ("last", "swa", "swag"):
        nll, acc = out[name]
        assert math.isfinite(nll) and 0 < nll < math.log(10)  # far better than chance
        assert acc > 0.9
    # the scale is chosen on validation data among the candidates (0: the mean, where sampling does not help on
    # validation); the model average is never far from its mean
    assert out["scale"] >= 0
    assert out["swag"][0] <= out["swa"][0] + 0.05
    for line in ("SWA ", "SWAG ", "scale chosen on validation"):
        assert line in printed


def test_default_warmup_fits_a_per_epoch_run():
    # 20 collected epochs at rank 10: the default warm-up (= rank) is over, no "warm-up ends here" warning
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 3)
    swag = SWAG(net, rank=10, seed=0)
    assert swag.warmup == 10
    with torch.no_grad():
        for _ in range(20):
            for p in net.parameters():
                p.add_(0.01 * torch.randn_like(p))
            swag.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = swag.get_posterior()
    assert q.cov_factor.shape == (18, 10) and bool((q.cov_diag > 0).all())
