"""The package's shape bars (docs/architecture.md): no module over 600 lines, no class over 400, and no dispatch on
a string option outside registries and argument checks.

"Dispatch on a string option" is a comparison of an expression with a string literal (``likelihood ==
"classification"``, ``method in ("em", "sga")``) that chooses what the code does. Allowed:

- an argument check: the comparison is the test of an ``if`` whose body only raises (or warns then raises);
- comparisons with Pyro's and torch's own vocabulary (``site["type"]``, ``device.type``, ``type(x).__name__``);
- the ``pyro-fa`` command and its experiments (argument parsing), and modules named ``registry.py``.

Everything else goes through a registry (a name -> object table) or an object's method.
"""
import ast
from pathlib import Path

import pytest

import pyro_fa

ROOT = Path(pyro_fa.__file__).parent
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def _modules():
    return sorted(p for p in ROOT.rglob("*.py"))


def _exempt_module(path: Path) -> bool:
    rel = path.relative_to(ROOT).parts
    return rel[0] in ("experiments", "cli.py") or path.name == "registry.py"


def _is_string_literal(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        return all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
    return False


def _foreign_vocabulary(left: ast.AST) -> bool:
    """``site["type"]``, ``x.device.type``, ``type(x).__name__``, ``s.get("...")`` of a Pyro site, ``k`` of a dict."""
    text = ast.unparse(left)
    return (text.endswith('["type"]') or text.endswith("['type']") or text.endswith(".type")
            or text.endswith(".__name__") or "['infer']" in text or '["infer"]' in text)


def _raises_only(body) -> bool:
    stmts = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                                     and ast.unparse(s.value.func).endswith("warn"))]
    return bool(stmts) and all(isinstance(s, ast.Raise) for s in stmts)


def string_dispatch_sites(source: str, filename: str = "<string>"):
    """``(line, text)`` of every string-literal comparison that is neither an argument check nor foreign vocabulary."""
    tree = ast.parse(source)
    checks = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _raises_only(node.body) and not node.orelse:
            for sub in ast.walk(node.test):
                checks.add(id(sub))
    sites = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1
                and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.In, ast.NotIn))):
            continue
        if not _is_string_literal(node.comparators[0]) or id(node) in checks:
            continue
        if _foreign_vocabulary(node.left):
            continue
        sites.append((node.lineno, ast.unparse(node)))
    return sites


def test_no_module_over_600_lines():
    big = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, big


def test_no_class_over_400_lines():
    big = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                big[f"{p.relative_to(ROOT)}:{node.name}"] = n
    assert not big, big


def test_no_string_literal_dispatch_outside_registries_and_argument_checks():
    found = {}
    for p in _modules():
        if _exempt_module(p):
            continue
        sites = string_dispatch_sites(p.read_text(), str(p))
        if sites:
            found[str(p.relative_to(ROOT))] = sites
    assert not found, found


@pytest.mark.parametrize("src, n", [
    ('def f(x):\n    if x == "a":\n        return 1\n    return 2\n', 1),  # dispatch
    ('def f(x):\n    if x not in ("a", "b"):\n        raise ValueError(x)\n', 0),  # an argument check
    ('def f(s):\n    return s["type"] == "sample"\n', 0),  # Pyro's vocabulary
    ('def f(x):\n    y = 1 if x == "a" else 2\n    return y\n', 1),  # dispatch in an expression
    ('def f(x):\n    if x == "a":\n        raise ValueError\n    else:\n        return 1\n', 1),  # if/else dispatches
])
def test_the_dispatch_finder_sees_dispatch_and_spares_checks(src, n):
    assert len(string_dispatch_sites(src)) == n
