"""No private name crosses packages: a name starting with ``_`` is its own package's business.

Every module under ``pyro_fa`` is read with :mod:`ast`; an import of a name that starts with
``_`` (a function, a class, or a module imported by name) from another top-level package of
``pyro_fa`` (``pyro_fa.X`` importing from ``pyro_fa.Y``) fails the test, and so does an import of
any name from a private module of another package (``from pyro_fa.Y._z import public`` in
``pyro_fa.X``): what two packages share lives in a public module. Layer-0 helpers
that every package shares are top-level private modules (``pyro_fa._validation``,
``pyro_fa._files``): the names they export are public to the package.
"""
import ast
from pathlib import Path

import pyro_fa

ROOT = Path(pyro_fa.__file__).parent

#: (importing file, module, name) crossings being removed by work in progress elsewhere; empty it as they land.
ALLOWED = set()


def _top(module: str) -> str:
    """The top-level package of a dotted pyro_fa module name ('' for pyro_fa itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private_module(module: str) -> bool:
    """Whether a dotted pyro_fa module lies in a private module or package below its top-level package."""
    return any(part.startswith("_") and not part.startswith("__") for part in module.split(".")[2:])


def private_crossings(root: Path = ROOT):
    """Every ``(file, module, name)`` where a module imports a private name, or from a private module, of another
    top-level package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = ("pyro_fa",) + rel.with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        here = _top(name)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                imported = [(base, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):  # `import pyro_fa.y._z`: the module _z is the name imported
                imported = [tuple(alias.name.rsplit(".", 1)) for alias in node.names if "." in alias.name]
            else:
                continue
            for module, item in imported:
                if module == "pyro_fa":  # `from pyro_fa import _files`: a top-level shared module
                    continue
                if module.split(".")[0] != "pyro_fa" or _top(module) == here:
                    continue
                if (item.startswith("_") and not item.startswith("__")) or _private_module(module):
                    found.append((rel.as_posix(), module, item))
    return found


def test_no_module_imports_a_private_name_from_another_package():
    crossings = set(private_crossings())
    unexpected = sorted(crossings - ALLOWED)
    assert not unexpected, f"private names imported across packages (make them public, or move them): {unexpected}"


def test_the_allow_list_holds_only_crossings_that_still_exist():
    stale = sorted(ALLOWED - set(private_crossings()))
    assert not stale, f"these crossings are gone: remove them from ALLOWED in {Path(__file__).name}: {stale}"


def test_the_walk_sees_private_names_and_relative_imports(tmp_path):
    pkg = tmp_path / "pyro_fa"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from pyro_fa.a.m import _mine  # same package: allowed\n")
    (pkg / "a" / "m.py").write_text("_mine = 1\nfrom ..b.n import _theirs, public\n")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "b" / "n.py").write_text("_theirs = public = 2\nimport pyro_fa.a._hidden\nfrom pyro_fa import _validation\n")
    assert private_crossings(pkg) == [("a/m.py", "pyro_fa.b.n", "_theirs"), ("b/n.py", "pyro_fa.a", "_hidden")]


def test_the_walk_sees_public_names_of_private_modules(tmp_path):
    pkg = tmp_path / "pyro_fa"
    for sub in ("a", "b", "b/_inner"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_shared.py").write_text("helper = 0\n")
    (pkg / "b" / "_m.py").write_text("public = 1\n")
    (pkg / "b" / "_inner" / "x.py").write_text("other = 2\n")
    (pkg / "b" / "own.py").write_text("from pyro_fa.b._m import public  # same package: allowed\n")
    (pkg / "a" / "m.py").write_text(
        "from pyro_fa.b._m import public\n"          # a private module of another package
        "from ..b._inner.x import other\n"           # a module inside a private subpackage, relative
        "from pyro_fa._shared import helper\n"       # a top-level shared module: allowed
        "from pyro_fa.b import own\n"                # a public module: allowed
    )
    assert private_crossings(pkg) == [("a/m.py", "pyro_fa.b._m", "public"), ("a/m.py", "pyro_fa.b._inner.x", "other")]
