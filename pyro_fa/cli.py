"""The ``pyro-fa`` command: reproduce the experiments of the papers behind pyro_fa.

Each subcommand is an experiment module with ``add_arguments(parser)`` and
``run(args)``; ``pyro-fa <name> --quick`` runs a small subset in minutes.

References
----------
S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
University of Edinburgh, 2021.
X. Jiang, *Laplace prior and variational inference probabilistic PCA (VIPPCA)*, report,
University of Edinburgh, 2023.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from pyro_fa.experiments import output_dir_arg

def _declared_help(path: Path) -> Optional[str]:
    """The string a module assigns to ``HELP`` at its top level, read from its source (None when it has none)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "HELP"):
            return ast.literal_eval(node.value)
    return None


def _discover(root: Optional[Path] = None, package: str = "pyro_fa.experiments") -> Tuple[Dict[str, str], Dict[str, str]]:
    """Every experiment of ``pyro_fa/experiments/``: a public module, or a public package's ``command.py``, that
    declares ``HELP``; the subcommand is its name with ``-`` for ``_``. Read from the source files, so that
    building the parser imports no experiment: adding one is its module alone."""
    modules, helps = {}, {}
    root = Path(__file__).parent / "experiments" if root is None else Path(root)
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(("_", ".")):
            continue
        if entry.is_dir():
            path, module = entry / "command.py", f"{package}.{entry.name}.command"
        elif entry.suffix == ".py":
            path, module = entry, f"{package}.{entry.stem}"
        else:
            continue
        text = _declared_help(path) if path.is_file() else None
        if text is not None:
            name = (entry.name if entry.is_dir() else entry.stem).replace("_", "-")
            modules[name], helps[name] = module, text
    return modules, helps


#: subcommand name -> experiment module, and its help (imported only when its subcommand is parsed: `pyro-fa
#: --help` imports none)
EXPERIMENTS, _HELP = _discover()


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser whose experiment options are added only when that subcommand is parsed: its module
    (``EXPERIMENTS[name]``) is imported then, so that ``pyro-fa --help`` and the parser import no experiment."""

    experiment: Optional[str] = None

    def load(self) -> None:
        """Import the experiment's module and add its options (once)."""
        if self.experiment is None or getattr(self, "_loaded", False):
            return
        self._loaded = True
        mod = importlib.import_module(EXPERIMENTS[self.experiment])
        mod.add_arguments(self)
        self.set_defaults(_module=mod)

    def parse_known_args(self, args=None, namespace=None):
        self.load()
        return super().parse_known_args(args, namespace)

    def format_help(self):
        self.load()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    """The ``pyro-fa`` parser; an experiment's module is imported only when its subcommand is parsed."""
    parser = argparse.ArgumentParser(
        prog="pyro-fa",
        description="Reproduce the experiments of pyro_fa (factor-analysis posteriors for Bayesian deep learning).",
        epilog="References: Brownlie (2021), Extending the Bayesian Deep Learning Method MultiSWAG, MSc thesis, "
               "University of Edinburgh; Jiang (2023), Laplace prior and variational inference probabilistic PCA "
               "(VIPPCA), report, University of Edinburgh.",
    )
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", parser_class=_SubcommandParser)
    sub.required = True
    for name in EXPERIMENTS:
        p = sub.add_parser(name, help=_HELP.get(name, f"the {name} experiment"))
        p.experiment = name
        p.add_argument("--quick", action="store_true", help="a small subset that finishes in minutes")
        p.add_argument("--output-dir", type=output_dir_arg, default=None,
                       help=f"where results go (default: results/{name}); checked and locked before any work")
        p.add_argument("--seed", type=int, default=0, help="base random seed (default 0)")
        p.add_argument("--no-progress", action="store_true",
                       help="hide progress bars (shown only on a terminal: logs and pipes get one line per unit)")
        p.set_defaults(_name=name)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output_dir is None:
        args.output_dir = f"results/{args._name}"
    result = args._module.run(args)
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
