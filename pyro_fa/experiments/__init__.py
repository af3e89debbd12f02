"""The experiments behind the ``pyro-fa`` command (see :mod:`pyro_fa.cli`), one room each.

A larger experiment is a package (:mod:`.uci`, :mod:`.classify`, :mod:`.revrand`) whose
``command`` module is the subcommand (``add_arguments(parser)`` and ``run(args)``) beside its
protocol, methods, ``baselines`` (the peers), results and ``report`` modules; a smaller one is a
single module with the same two functions (:mod:`.online_fa`, :mod:`.vifa_synthetic`,
:mod:`.vifa_linreg`, :mod:`.sgd_iterates`, :mod:`.linreg_ensembles`). The output folder, the
argument types and the progress bars every subcommand shares are in :mod:`._io`.
"""
from pyro_fa.experiments._io import output_dir_arg  # the --output-dir type, shared with pyro_fa.cli

__all__ = ["output_dir_arg"]
