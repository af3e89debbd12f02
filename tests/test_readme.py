"""The README's quick starts run as written; the README stays a front door and its links hold."""
import math
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
#: the README, the hand-written documentation pages and the benchmarks' results pages (the generated reports
#: under docs/*/ are not scanned)
PAGES = [README] + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "benchmarks" / "results").glob("*.md"))
#: [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MAX_README_LINES = 225


def _relative_links(page):
    """(path, anchor) of every link from ``page`` to another file; anchor is '' when there is none."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith("#"):
            continue  # http:, https:, mailto:, ... and anchors within the page
        path, _, anchor = target.partition("#")
        yield path, anchor


def _anchors(page):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_readme_has_a_quick_start_for_each_way():
    assert len(BLOCKS) >= 4
    assert "AutoLowRankFactorGuide" in BLOCKS[PYRO] and "SWAG(" in BLOCKS[SWAG_BLOCK]
    assert "FactorLaplace(" in BLOCKS[LAPLACE]
    assert not any("manual_seed" in block for block in BLOCKS)  # a user's run is unseeded: so are the tests'


#: the quick starts by what they show (the order of the README's python blocks)
PYRO, SWAG_BLOCK, LAPLACE = 0, 1, 2
#: unseeded runs of every block in the slow tier: each must run and print, as a user's repeated runs would
UNSEEDED_RUNS = 5


def _run_snippet(index, capsys, seed=None):
    """Run a README block as a user does: float32, and torch's generator left as it is unless ``seed`` is given."""
    torch.set_default_dtype(torch.float32)  # as a user's session would be
    if seed is not None:
        torch.manual_seed(seed)
    namespace = {"__name__": "__readme__"}
    capsys.readouterr()
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), namespace)
    return namespace, capsys.readouterr().out


def _check_printed(index, printed):
    assert printed.strip(), f"README python block {index} prints nothing"
    for noise in ("grad_fn", "requires_grad", "Parameter containing"):
        assert noise not in printed, f"README python block {index} prints {noise!r}: {printed}"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs_and_prints_clean_numbers(index, capsys):
    """Every quick start, unseeded, prints something, and no tensor of its output carries autograd's bookkeeping."""
    _check_printed(index, _run_snippet(index, capsys)[1])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs_unseeded_again_and_again(index, capsys):
    """A user's repeated runs: every block, without a seed, runs and prints every time (the SWAG quick start
    used to stop at scale 0 in 4 of 7 such runs)."""
    for _ in range(UNSEEDED_RUNS):
        _check_printed(index, _run_snippet(index, capsys)[1])


@pytest.mark.parametrize("seed", [0, None], ids=["seeded", "unseeded"])
def test_readme_pyro_snippet_prints_the_posterior_it_claims(capsys, seed):
    """The first quick start's posterior: mean near the true weights, s.d. near the exact posterior's."""
    namespace, printed = _run_snippet(PYRO, capsys, seed)
    X, y = namespace["X"], namespace["y"]
    q = namespace["q"]
    # the exact posterior of this model: prior N(0, I), noise s.d. 0.3
    precision = torch.eye(3) + X.T @ X / 0.09
    cov = torch.linalg.inv(precision)
    mean = cov @ X.T @ y / 0.09
    torch.testing.assert_close(q.loc.detach(), mean, atol=0.02, rtol=0)
    torch.testing.assert_close(q.stddev.detach(), cov.diagonal().sqrt(), atol=0.02, rtol=0)
    assert printed.startswith("mean tensor([") and " sd tensor([" in printed


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("seed", [0, None], ids=["seeded", "unseeded"])
def test_readme_swag_snippet_prints_its_scale_and_error(capsys, seed):
    namespace, printed = _run_snippet(SWAG_BLOCK, capsys, seed)
    assert re.fullmatch(r"scale [0-9.e+-]+, validation RMSE [0-9.]+\n", printed), printed
    assert namespace["search"].scale == namespace["swag"].scale
    rmse = float(printed.split()[-1])
    assert rmse < float(namespace["y_val"].std())  # the model average explains part of the signal


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("seed", [0, None], ids=["seeded", "unseeded"])
def test_readme_laplace_snippet_prints_what_it_chose(capsys, seed):
    """The Laplace quick start: the printed numbers are the object's, the chosen scale is never worse than the MAP
    network on validation (the gated rule), and the test NLL beats chance (log 2) by far."""
    namespace, printed = _run_snippet(LAPLACE, capsys, seed)
    m = re.fullmatch(r"prior precision ([0-9.e+-]+), scale ([0-9.e+-]+), test NLL ([0-9.]+)\n", printed)
    assert m, printed
    la, search = namespace["la"], namespace["search"]
    assert float(m.group(2)) == search.scale == la.scale
    assert float(m.group(1)) == pytest.approx(la.prior_precision.item(), rel=1e-2)
    chosen = search.log_likelihoods[search.scales.index(search.scale)]
    assert chosen >= search.log_likelihoods[0]
    assert float(m.group(3)) < 0.5 * math.log(2)

def test_readme_swag_snippet_runs_when_tune_scale_keeps_the_mean(capsys, monkeypatch):
    """tune_scale may choose scale 0 (the mean): the quick start's get_posterior() and predict still run, and the
    prediction is the mean network's."""
    from pyro_fa import SWAG

    tune = SWAG.tune_scale

    def tune_to_zero(self, *args, **kwargs):
        search = tune(self, *args, **kwargs)
        self.scale = 0.0
        return search._replace(scale=0.0)

    monkeypatch.setattr(SWAG, "tune_scale", tune_to_zero)
    namespace, printed = _run_snippet(1, capsys)  # the posterior of the mean, get_posterior(), predict
    from pyro_fa.distributions import PointMassNormal

    assert printed.startswith("scale 0, validation RMSE "), printed
    swag, net = namespace["swag"], namespace["net"]
    assert isinstance(namespace["posterior"], PointMassNormal)
    assert torch.equal(namespace["posterior"].mean, swag.loc)
    with swag.sampled_weights(swag.loc):
        at_mean = net(namespace["X_val"])
    torch.testing.assert_close(namespace["prediction"], at_mean, rtol=1e-6, atol=1e-6)  # the mean of 30 equal outputs


# ----------------------------------------------------------------------------- commands a reader copies
#: ```bash blocks of the README and the documentation pages
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", flags=re.S)
#: inline code that is a whole command line: a launcher and a script path
INLINE_COMMAND = re.compile(r"`([^`\n]*\s[^`\n]*\.py(?:\s[^`\n]*)?)`")


def _commands(page):
    text = page.read_text()
    for block in SHELL_BLOCK.findall(text):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():  # a continued line is one command
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                yield line
    for span in INLINE_COMMAND.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
        yield span.strip()


def _installed_scripts():
    """Console scripts the project's environment provides (ours and its dependencies', e.g. torch's torchrun)."""
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group="console_scripts")}


def _unreachable(line):
    """Why the command ``line`` would not run as written from the repository root after ``make setup``."""
    import shlex
    import shutil

    words = [w for w in shlex.split(line) if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]  # drop VAR=value
    if not words:
        return None
    exe, args = words[0], words[1:]
    if "/" in exe:
        if exe.startswith(".venv/bin/"):
            name = exe[len(".venv/bin/"):]
            if name not in _installed_scripts() | {"python", "pip"}:
                return f"{exe}: no package installs {name!r}"
            if (ROOT / ".venv").is_dir() and not (ROOT / exe).exists():
                return f"{exe}: not in this checkout's .venv"
        elif not (ROOT / exe).exists():
            return f"{exe}: no such file"
    elif exe == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        missing = [a for a in args if not a.startswith("-") and "=" not in a and a not in targets]
        if missing:
            return f"make: no target {missing}"
    elif exe in _installed_scripts():
        return f"{exe}: installed into .venv only; write .venv/bin/{exe} (or say to activate .venv)"
    elif shutil.which(exe) is None:
        return f"{exe}: not on PATH"
    paths = [a for a in args if a.endswith(".py") or a.startswith(("examples/", "benchmarks/", "tutorials/"))]
    gone = [a for a in paths if not (ROOT / a).exists()]
    return f"{line}: no file {gone}" if gone else None


def test_command_check_catches_what_a_new_user_met():
    assert "installed into .venv only" in _unreachable("torchrun --nproc_per_node 2 examples/distributed_swag.py")
    assert "installed into .venv only" in _unreachable("pyro-fa revrand --quick")
    assert "no file" in _unreachable(".venv/bin/torchrun --nproc_per_node 2 examples/nope.py")
    assert "no target" in _unreachable("make nothing-here")
    assert _unreachable(".venv/bin/torchrun --nproc_per_node 2 examples/distributed_swag.py") is None
    assert _unreachable("make test TORCH=torch") is None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_are_reachable_as_written(page):
    bad = [why for line in _commands(page) if (why := _unreachable(line))]
    assert not bad, f"{page.relative_to(ROOT)}: commands that do not run as written: {bad}"


def test_readme_is_a_front_door():
    n_lines = len(README.read_text().splitlines())
    assert n_lines < MAX_README_LINES, (
        f"README.md has {n_lines} lines, expected fewer than {MAX_README_LINES}: "
        "move protocols, histories and full tables to a page under docs/"
    )


def test_link_pattern_finds_links_and_images():
    text = "see [a](docs/a.md#x), ![fig](uci/ll.png) and [web](https://x.org)"
    assert LINK.findall(text) == ["docs/a.md#x", "uci/ll.png", "https://x.org"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page):
    broken = []
    for path, anchor in _relative_links(page):
        target = page.parent / path
        if not target.exists():
            broken.append(path)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{path}#{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files or headings {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_works_are_cited_by_name_not_seed_number(page):
    hits = [line for line in page.read_text().splitlines() if "seed 00" in line.lower()]
    assert not hits, f"{page.relative_to(ROOT)} cites a seed number; cite the work (see docs/index.md): {hits[:3]}"
