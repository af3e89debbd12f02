"""``pyro-fa uci`` with FactorIVON's column searched over another grid than its default.

The column searches the budget's prior precisions x rate x initial Hessian (``IVON_LRS`` x ``IVON_HESS_INITS`` of
:mod:`pyro_fa.experiments.uci.factor_ivon`); with beta2 = 0.99999 the Hessian hardly moves from its initial value
in 10 000 steps, so the initial Hessian sets the posterior's width. This runs the command with the rate x initial
Hessian grid ``--lrs`` x ``--hess-inits`` instead (the other methods' units are the command's own), and with
``--precisions`` other prior precisions than the budget's (give such a run an output folder of its own: the unit
key does not name the grid); pass the command's arguments after ``--``::

    PYTHONPATH=. python benchmarks/bench_factor_ivon_uci_grid.py --lrs 0.05 0.1 0.2 0.4 --hess-inits 2 10 50 250 \\
        -- --datasets yacht --splits 3 --steps 2000 --tune-splits 1 --methods factor-ivon-1x50 --output-dir runs/x
"""
import argparse
import sys

from pyro_fa import cli
from pyro_fa.experiments.uci import factor_ivon


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lrs", type=float, nargs="+", required=True)
    parser.add_argument("--hess-inits", type=float, nargs="+", required=True)
    parser.add_argument("--precisions", type=float, nargs="+", default=None,
                        help="the prior precisions searched (default the budget's; e.g. an HMC reference's alone)")
    args = parser.parse_args(argv[:split])
    if args.precisions is not None:
        if not all(a > 0 for a in args.precisions):
            raise SystemExit(f"bench_factor_ivon_uci_grid: --precisions must be > 0, got {args.precisions}.")
        factor_ivon.PRECISIONS = tuple(args.precisions)
    factor_ivon.IVON_LRS, factor_ivon.IVON_HESS_INITS = tuple(args.lrs), tuple(args.hess_inits)
    return cli.main(["uci", *argv[split + 1:]])


if __name__ == "__main__":
    sys.exit(main())
