"""The first road: variational inference with factor-analysis posteriors inside Pyro SVI.

* :class:`AutoLowRankFactorGuide` — what :math:`q` is: N(c, FFᵀ + Ψ) (VIFA) or
  N(c, FFᵀ + σ²I) (VIPPCA) over all latent sites of a model;
* :class:`FactorELBO` — how it is trained: a ``pyro.infer.ELBO`` with the
  entropy and Gaussian / Laplace prior terms in closed form (:class:`JitFactorELBO`:
  the same, compiled by the PyTorch JIT);
* :class:`GaussianPrior`, :class:`LaplacePrior` — the factorised priors whose expected
  log-density under :math:`q` :class:`FactorELBO` knows in closed form.
"""
from pyro_fa.infer._jit_elbo import JitFactorELBO
from pyro_fa.infer.elbo import FactorELBO
from pyro_fa.infer.guide import AutoLowRankFactorGuide
from pyro_fa.infer.priors import GaussianPrior, LaplacePrior

__all__ = ["AutoLowRankFactorGuide", "FactorELBO", "JitFactorELBO", "GaussianPrior", "LaplacePrior"]

_MOVED = {"SWAG": "pyro_fa.swag", "MultiSWAG": "pyro_fa.swag"}


def __getattr__(name):
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(f"`pyro_fa.infer.{name}` is deprecated and will be removed in the next release; "
                      f"use `{_MOVED[name]}.{name}` (or `pyro_fa.{name}`)", FutureWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
