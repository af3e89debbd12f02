r"""What a :class:`~pyro_fa.SWAG` holds to fit its collected vectors: one fit per ``method``, chosen once.

SWAG collects :math:`\theta_t` from an optimizer, guards against a diverged run and samples;
how the collected stream becomes :math:`N(c, FF^\top + \Psi)` is its fit's. The protocol
(:class:`IterateFit`) is the :class:`~pyro_fa.fa.fitters.Fitter` one seen from SWAG: a fit is
stateless and keeps its tensors as buffers of the SWAG that holds it (so that ``.to()``,
``state_dict()`` and the checkpoint keys are SWAG's), and every method takes that SWAG.

* :class:`OnlineFit` (``"em"``, ``"sga"``): an :class:`~pyro_fa.OnlineFactorAnalysis` held as
  ``swag.fa``, which dispatches to the registered :class:`~pyro_fa.fa.fitters.Fitter` of that
  name (:mod:`pyro_fa.fa.fitters.em`, :mod:`~pyro_fa.fa.fitters.sga`);
* :class:`~pyro_fa.swag._classic.ClassicFit` (``"swag"``): classic SWAG's last :math:`K`
  deviations (Maddox et al. 2019). It is not a registered ``Fitter``: it keeps its own running
  moments beside the deviations (its buffers are SWAG's ``_moments``, ``_mean`` and ``_dev``),
  its update is :math:`O(D)` with no factor to step, and ``OnlineFactorAnalysis`` has no
  use for it.
"""
from __future__ import annotations

import warnings
from typing import List

import torch
from torch import Tensor

from pyro_fa.fa.fitters import Fitter, resolve_fitter
from pyro_fa.fa.moments import RunningMoments
from pyro_fa.fa.online import OnlineFactorAnalysis

__all__ = ["IterateFit", "OnlineFit"]

# SWAG's own defaults of the fitters' options it still takes beside a method name (with a fitter object, the
# object carries them)
_SWAG_FIT_OPTIONS = dict(lr=1e-3, step_scale=1.0, optimizer=None)


class IterateFit:
    """The protocol of a SWAG's fit (base class); ``swag`` is the :class:`~pyro_fa.SWAG` holding the state."""

    def __init__(self, method: str):
        self.method = method

    def check(self, owner: str, *, rank: int, warmup: int, optimizer=None) -> None:
        """Refuse options this fit cannot work with (raise ``ValueError``), warn about its caveats."""

    def setup(self, swag, dim: int, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        """Register the fit's state on ``swag`` for ``rows`` of the ``dim`` coordinates (all without sharding)."""
        raise NotImplementedError

    def loc(self, swag) -> Tensor:
        """The running mean :math:`c` in the state's dtype, shape (D,)."""
        raise NotImplementedError

    def moments(self, swag) -> RunningMoments:
        """The exact running moments of the collected vectors (the divergence guard's spread)."""
        raise NotImplementedError

    def update(self, swag, theta: Tensor) -> None:
        """Take one collected vector (this rank's rows); raise ``ValueError`` (state unchanged) if it would overflow."""
        raise NotImplementedError

    def cov_factor(self, swag) -> Tensor:
        """The posterior's :math:`F`, shape (D, K)."""
        raise NotImplementedError

    def cov_diag(self, swag) -> Tensor:
        r"""The posterior's :math:`\psi`, shape (D,)."""
        raise NotImplementedError

    def low_rank(self, swag, h: Tensor) -> Tensor:
        """The low-rank part :math:`Fh` of draws, shape (S, D), from latent draws ``h`` of shape (S, K)."""
        raise NotImplementedError

    def check_ready(self, swag, what: str) -> None:
        """Refuse (``RuntimeError``) a posterior that cannot be used yet; ``swag`` has collected vectors."""

    def sq_dev_total(self, swag) -> float:
        """Sharded: the sum over all D of the running squared deviations."""
        raise NotImplementedError

    def set_sq_dev_total(self, swag, total: float) -> None:
        raise NotImplementedError

    def check_state_values(self, swag, state_dict, prefix: str) -> None:
        """Refuse (``ValueError``) saved values this fit cannot hold; ``state_dict`` is relative to ``swag``."""

    def load_marks(self, swag, total) -> List[tuple]:
        """The submodules whose load the whole check covered, ``[(module, mark)]``."""
        return []

    def skip_load(self, swag) -> None:
        """A parent's non-strict load without this posterior's entries."""


class OnlineFit(IterateFit):
    """Online factor analysis of the collected vectors: ``swag.fa``, an :class:`~pyro_fa.OnlineFactorAnalysis`."""

    def check(self, owner: str, *, rank: int, warmup: int, optimizer=None) -> None:
        # the fitter as OnlineFactorAnalysis will build it (a name with SWAG's options, or the object)
        fitter = resolve_fitter(self.method, owner, **dict(_SWAG_FIT_OPTIONS, optimizer=optimizer))
        fitter.check(owner, rank=rank, warmup=warmup)
        caveat = fitter.iterate_caveat
        if caveat is not None:
            warnings.warn(f"{owner}: {caveat}", UserWarning, stacklevel=3)

    def setup(self, swag, dim: int, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        kwargs = swag._fa_kwargs
        if isinstance(self.method, Fitter):
            changed = sorted(k for k, v in _SWAG_FIT_OPTIONS.items() if kwargs.get(k, v) is not v and kwargs[k] != v)
            if changed:
                raise ValueError(f"{type(swag).__name__}: {', '.join(changed)} must be given to the fitter object "
                                 f"with method={type(self.method).__name__}(...), got them beside it.")
            kwargs = {k: v for k, v in kwargs.items() if k not in _SWAG_FIT_OPTIONS}
        swag.fa = OnlineFactorAnalysis(dim, swag.rank, self.method, swag._warmup, dtype=dtype, device=device,
                                       process_group=swag._sharding, **kwargs)

    def loc(self, swag) -> Tensor:
        return swag.fa.loc

    def moments(self, swag) -> RunningMoments:
        return swag.fa._moments

    def update(self, swag, theta: Tensor) -> None:
        swag.fa.update(theta)
        swag._n = swag.fa.n_updates

    def cov_factor(self, swag) -> Tensor:
        return swag.fa.cov_factor

    def cov_diag(self, swag) -> Tensor:
        return swag.fa.cov_diag

    def low_rank(self, swag, h: Tensor) -> Tensor:
        return h @ swag.fa.cov_factor.T

    def check_ready(self, swag, what: str) -> None:
        cls, n, early = type(swag).__name__, swag._n, swag.fa.fitter.finishes_warmup
        if early and swag.rank < n <= swag.warmup:
            # a shorter run than the warm-up planned for (e.g. one collection per epoch): end it here
            warnings.warn(
                f"{cls}: {n} vectors collected, not more than warmup={swag.warmup}: the warm-up ends here and "
                f"the factor is fitted to them (pass warmup < {n} to choose this).",
                UserWarning,
                stacklevel=4,
            )
            swag.fa.finish_warmup()
        if n <= swag.warmup:
            raise RuntimeError(
                f"{cls}: {what} needs more than warmup={swag.warmup} collected vectors for method="
                f"{self.method!r}, got {n}"
                + (f" (more than rank={swag.rank} to end the warm-up early)" if early else "")
                + ". Collect more, or pass a smaller warmup."
            )

    def sq_dev_total(self, swag) -> float:
        return swag.fa._sq_dev_total

    def set_sq_dev_total(self, swag, total: float) -> None:
        swag.fa._sq_dev_total = total

    def check_state_values(self, swag, state_dict, prefix: str) -> None:
        cls = type(swag).__name__
        swag.fa._check_values({k[3:]: v for k, v in state_dict.items() if k.startswith("fa.")}, prefix + "fa.", cls)
        mine, fit = state_dict.get("_extra_state"), state_dict.get("fa._extra_state")
        if isinstance(mine, dict) and isinstance(fit, dict) and mine.get("n") != fit.get("n_updates"):
            raise ValueError(f"{cls}: the saved state's count of collected vectors must agree with its fit's, got "
                             f"n={mine.get('n')!r} against the fit's n_updates={fit.get('n_updates')!r}; nothing "
                             "was loaded.")

    def load_marks(self, swag, total) -> List[tuple]:
        return [(swag.fa, (total,))]

    def skip_load(self, swag) -> None:
        swag.fa.__dict__.pop("_load_checked", None)

