"""The user guide's examples run as written: every ```python block of a user-guide page that starts with an import.

Fragments (blocks that do not start with ``import`` / ``from``) are excerpts and are not run. Each example is
meant to take a second or two of CPU; the suite runs them in float32, as a user's session would be.
"""
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: one page per way to a posterior, and the laplace-torch user's page
GUIDE = ["docs/variational.md", "docs/swag.md", "docs/laplace.md", "docs/from_laplace_torch.md"]


def _examples(page):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)
    return [b for b in blocks if b.startswith(("import ", "from "))]


EXAMPLES = [(page, i) for page in GUIDE for i in range(len(_examples(page)))]


def test_every_guide_page_has_a_runnable_example():
    for page in GUIDE[:3]:
        assert _examples(page), f"{page} has no runnable example (a ```python block starting with an import)"


@pytest.mark.parametrize("page,index", EXAMPLES, ids=[f"{p.split('/')[-1]}[{i}]" for p, i in EXAMPLES])
def test_guide_example_runs_and_prints_clean_numbers(page, index, capsys):
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        namespace = {"__name__": "__docs__"}
        exec(compile(_examples(page)[index], f"{page}[python example {index}]", "exec"), namespace)
    finally:
        torch.set_default_dtype(default)
    printed = capsys.readouterr().out
    assert printed.strip(), f"{page} example {index} prints nothing"
    for noise in ("grad_fn", "requires_grad", "Parameter containing"):
        assert noise not in printed, f"{page} example {index} prints {noise!r}: {printed}"
