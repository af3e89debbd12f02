"""Deprecated import paths kept for one release after the package was arranged by road.

``pyro_fa.linalg``, ``pyro_fa.priors``, ``pyro_fa.infer.swag``, ``pyro_fa.infer.multiswag`` and
``pyro_fa.infer.scale`` moved to :mod:`pyro_fa.fa.linalg`, :mod:`pyro_fa.infer.priors` and
:mod:`pyro_fa.swag`. Importing an old path still works and warns once with a ``FutureWarning``
naming the new one.
"""
from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make module ``old`` the module ``new``, warning that ``old`` is deprecated.

    Called from the old module's own file: the new module replaces it in ``sys.modules``, so
    ``old.name is new.name`` for every name and there is one copy of each class.
    """
    warnings.warn(f"`{old}` is deprecated and will be removed in the next release; import from `{new}` instead",
                  FutureWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    parent, _, child = old.rpartition(".")
    setattr(sys.modules[parent], child, module)
