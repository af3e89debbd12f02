"""The package is arranged by layer (docs/architecture.md): every public name imports from the top, imports flow
one way and never in a circle."""
import importlib
import warnings

import pytest

import pyro_fa


def test_every_public_name_importable_from_the_top_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in pyro_fa.__all__:
            assert getattr(pyro_fa, name) is not None
        from pyro_fa.nn import BayesianNetwork  # noqa: F401
        from pyro_fa.sklearn import FactorAnalysis  # noqa: F401
        from pyro_fa.swag import FactorPosteriorGuide, tune_scale  # noqa: F401


@pytest.mark.parametrize("old", ["pyro_fa.linalg", "pyro_fa.priors", "pyro_fa.infer.swag", "pyro_fa.infer.multiswag",
                                 "pyro_fa.infer.scale"])
def test_the_never_released_module_aliases_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


@pytest.mark.parametrize("name", ["SWAG", "MultiSWAG"])
def test_swag_names_live_in_swag_not_infer(name):
    assert not hasattr(importlib.import_module("pyro_fa.infer"), name)
    assert getattr(pyro_fa, name) is getattr(importlib.import_module("pyro_fa.swag"), name)


def test_import_graph_flows_one_way():
    # distributions <- core <- VI / SWAG <- adapters <- experiments: no module imports one from a later layer.
    import ast
    from pathlib import Path

    root = Path(pyro_fa.__file__).parent
    layer = {"distributions": -1, "fa": 0, "_state": 0, "_files": 0, "_validation": 0, "_registry": 0, "metrics": 0, "datasets": 0, "predictive": 0.5,
             "infer": 1, "swag": 1, "laplace": 1, "optim": 1, "basis": 1, "nn": 2, "sklearn": 2, "linear_model": 2, "distributed": 0.75,
             "experiments": 3, "cli": 4}
    shims = set()  # modules exempt from the layering (none: the never-released aliases are gone)
    bad = []
    for path in root.rglob("*.py"):
        if path in shims or path.name == "__init__.py" and path.parent == root:
            continue
        top = path.relative_to(root).parts[0].removesuffix(".py")
        if top not in layer:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pyro_fa."):
                target = node.module.split(".")[1]
                if target in layer and layer[target] > layer[top]:
                    bad.append(f"{path.relative_to(root)} imports {node.module}")
    assert not bad, bad


def _import_graph():
    """Edges module -> imported pyro_fa module, from every import statement (function-level and TYPE_CHECKING too)."""
    import ast
    from pathlib import Path

    root = Path(pyro_fa.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = ("pyro_fa",) + path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` imports the module pkg.sub when there is one, else pkg itself
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = sorted(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_circle_hidden_in_a_function():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": []}) == []


def test_no_import_cycles_among_modules():
    # a package's __init__ importing its own modules is no circle: it is not imported back by them
    cycles = _cycles(_import_graph())
    assert not cycles, f"import circles (function-level imports included): {cycles}"
