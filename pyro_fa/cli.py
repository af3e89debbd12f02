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
import importlib
import sys
from typing import Optional, Sequence

from pyro_fa.experiments import output_dir_arg

#: subcommand name -> experiment module (imported only when its subcommand is parsed: `pyro-fa --help` imports none)
EXPERIMENTS = {
    "online-fa": "pyro_fa.experiments.online_fa",
    "vifa-synthetic": "pyro_fa.experiments.vifa_synthetic",
    "vifa-linreg": "pyro_fa.experiments.vifa_linreg",
    "sgd-iterates": "pyro_fa.experiments.sgd_iterates",
    "linreg-ensembles": "pyro_fa.experiments.linreg_ensembles",
    "uci": "pyro_fa.experiments.uci.command",
    "classify": "pyro_fa.experiments.classify.command",
    "revrand": "pyro_fa.experiments.revrand.command",
    "posteriordb": "pyro_fa.experiments.posteriordb.command",
}

_HELP = {
    "online-fa": "Brownlie (2021) Chapter 5: online EM / online SGA vs batch factor analysis on synthetic FA models.",
    "vifa-synthetic": "Jiang (2023) Table 1: VIFA (Gaussian and Laplace priors) vs the exact 2-D "
                      "linear-regression posterior.",
    "vifa-linreg": "Jiang (2023) Figs. 2-5: VIFA vs exact linear-regression posteriors on four UCI datasets.",
    "sgd-iterates": "Brownlie (2021) Table 6.1, Figs. 6.1-6.2: SGD iterates vs the exact 2-D "
                    "linear-regression posterior.",
    "linreg-ensembles": "Brownlie (2021) Table A.1: pre-trained, SWA, SGA-FA and EM-FA ensembles of linear "
                        "regression on UCI.",
    "uci": "The UCI Bayesian-neural-network benchmark: VIFA / VIPPCA vs Pyro's guides and SWAG on the standard splits.",
    "classify": "Classification on MNIST-1D and digits: calibration and OOD detection of SWAG, MultiSWAG, VIFA, "
                "deep ensembles, MC dropout, Laplace and IVON.",
    "revrand": "Steinberg et al., revrand technical report, Tables 2-4: random-feature SLM and GLM (FA posterior) "
               "vs scikit-learn's GPs, SVMs and random forests on Boston, digits 3 vs 5 and UCI protein.",
    "posteriordb": "Pyro's guides, Pathfinder and the factor-analysis guide scored against posteriordb's reference "
                   "draws (W1, debiased W1, moment errors, k-hat, gradient evaluations; Zhang et al. 2022).",
}


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
