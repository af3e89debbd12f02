"""Every ```python block of the documentation pages (docs/*.md) runs as written.

A page's blocks run in order in one fresh Python process (a reader's session: float32 by default, nothing
registered by other tests), in a scratch folder, so a later block may use what an earlier block of the same
page defined. A block that cannot run on its own (it needs several processes, a data set or hours) is
marked by an HTML comment on the line before its fence, with the reason:

    <!-- no-test: needs torch.distributed processes; examples/distributed_swag.py runs it -->

Such blocks are few and each names where the same code does run.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
#: an optional marker line, then a python block
BLOCK = re.compile(r"(?:<!--\s*no-test:(?P<reason>[^>]*?)-->\s*\n)?```python\n(?P<code>.*?)```", flags=re.S)
#: at most this many marked blocks over all pages: the convention is for exceptions
MAX_SKIPPED = 7
#: the user guide: one page per way to a posterior, and the laplace-torch user's page; each holds a runnable
#: example whose printed numbers carry none of autograd's bookkeeping
GUIDE = ["variational.md", "swag.md", "laplace.md", "optim.md", "from_laplace_torch.md"]
NOISE = ("grad_fn", "requires_grad", "Parameter containing")
#: printed after each block, so that each block's output can be told apart
_END = "--- end of python block "


def _blocks(text):
    """(code, reason) of each python block; reason is None for a block that must run."""
    return [(m["code"], None if m["reason"] is None else m["reason"].strip()) for m in BLOCK.finditer(text)]


def _program(page):
    """One script that runs the page's blocks in order, each compiled under its own name for tracebacks."""
    parts = ["import matplotlib", "matplotlib.use('Agg')", "_ns = {'__name__': '__main__'}"]
    for i, (code, reason) in enumerate(_blocks(page.read_text())):
        if reason is None:
            parts.append(f"exec(compile({code!r}, {f'{page.name}[python block {i}]'!r}, 'exec'), _ns)")
            parts.append(f"print({_END!r} + '{i}', flush=True)")
    return "\n".join(parts) + "\n"


def test_the_block_pattern_reads_markers_and_blocks():
    text = ("a\n```python\nx = 1\n```\n<!-- no-test: needs two processes -->\n```python\ny = 2\n```\n"
            "```bash\nls\n```\n")
    assert _blocks(text) == [("x = 1\n", None), ("y = 2\n", "needs two processes")]


def test_a_failing_block_fails_the_page(tmp_path):
    page = tmp_path / "bad.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'the second block sees the first'\n```\n")
    run = subprocess.run([sys.executable, "-c", _program(page)], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0 and "bad.md[python block 1]" in run.stderr


def test_every_guide_page_has_a_runnable_example():
    for name in GUIDE:
        code = [c for c, reason in _blocks((ROOT / "docs" / name).read_text()) if reason is None]
        assert any(c.startswith(("import ", "from ")) for c in code), f"docs/{name} has no runnable example"


def test_markers_are_few_and_give_reasons():
    reasons = [(p.name, r) for p in PAGES for _, r in _blocks(p.read_text()) if r is not None]
    assert all(len(r) >= 10 for _, r in reasons), reasons
    assert len(reasons) <= MAX_SKIPPED, reasons


@pytest.mark.slow  # about 3 minutes in all: laplace.md's blocks fit and tune three approximations
@pytest.mark.parametrize("page", [p for p in PAGES if any(r is None for _, r in _blocks(p.read_text()))],
                         ids=lambda p: p.name)
def test_docs_page_python_blocks_run_as_written(page, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), MPLBACKEND="Agg",
               OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _program(page)], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=900)
    assert run.returncode == 0, f"{page.name}: a python block fails as written:\n{run.stderr[-4000:]}"
    if page.name in GUIDE:
        printed = dict(zip((i for i, (_, r) in enumerate(_blocks(page.read_text())) if r is None),
                           re.split(re.escape(_END) + r"\d+\n", run.stdout)))
        for i, (code, reason) in enumerate(_blocks(page.read_text())):
            if reason is None and code.startswith(("import ", "from ")):  # an example, not an excerpt
                assert printed[i].strip(), f"{page.name}: python block {i}, an example, prints nothing"
        for noise in NOISE:
            assert noise not in run.stdout, f"{page.name}: an example prints {noise!r}: {run.stdout[-2000:]}"
