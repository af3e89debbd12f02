"""The README's quick starts run as written."""
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_three_quick_starts():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index):
    torch.set_default_dtype(torch.float32)  # as a user's session would be
    torch.manual_seed(0)
    namespace = {"__name__": "__readme__"}
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), namespace)
