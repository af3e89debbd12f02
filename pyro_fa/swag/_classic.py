r"""Classic SWAG's fit: the running moments and the last :math:`K` deviations (Maddox et al. 2019).

.. math::

    c = \bar\theta, \qquad \Sigma = \tfrac12\big(\Sigma_{\rm diag} + \tfrac{1}{K-1}\hat D\hat D^\top\big),

with :math:`\Sigma_{\rm diag}` the running variances and :math:`\hat D` the last :math:`K`
deviations :math:`\theta_i - \bar\theta_i` (mean after :math:`\theta_i`), i.e.
:math:`F = \hat D/\sqrt{2(K'-1)}` (:math:`K'` the deviations held so far, zero-padded columns),
:math:`\psi = \Sigma_{\rm diag}/2`, floored at ``min_variance`` times the mean variance.

The state is three buffers of the :class:`~pyro_fa.SWAG` that holds it: ``_moments`` (exact
moments in float64, :class:`~pyro_fa.fa.moments.RunningMoments`), ``_mean`` (the mean rounded
to the state's dtype) and ``_dev`` (shape (K, D), a ring of the last K deviations). Memory
:math:`O(DK)`, time :math:`O(D)` per collection. Sharded, each rank keeps its rows, and the
overflow check and the sum of squared deviations (the noise floor's scale) are all-reduced.

References
----------
W. Maddox, T. Garipov, P. Izmailov, D. Vetrov, A. G. Wilson, "A simple baseline for
Bayesian uncertainty in deep learning", NeurIPS 2019, eq. 3 and Algorithm 1.
"""
from __future__ import annotations

import math
import torch
from torch import Tensor

from pyro_fa.fa.moments import RunningMoments
from pyro_fa.swag._fits import IterateFit

__all__ = ["ClassicFit"]


class ClassicFit(IterateFit):
    """Classic SWAG's deviations (``method="swag"``); see the module docstring."""

    def setup(self, swag, dim: int, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        # exact moments in float64 (see pyro_fa.fa.moments); _mean is the mean rounded to the state's dtype
        swag._moments = RunningMoments(rows, device)
        swag.register_buffer("_mean", torch.zeros(rows, dtype=dtype, device=device))
        swag.register_buffer("_dev", torch.zeros(swag.rank, rows, dtype=dtype, device=device))

    def loc(self, swag) -> Tensor:
        return swag._mean

    def moments(self, swag) -> RunningMoments:
        return swag._moments

    def update(self, swag, theta: Tensor) -> None:
        # running mean / squared deviations, then the deviation from the new mean (Maddox et al. Alg. 1),
        # formed in float64 and rounded once
        moments = swag._moments
        t, tmax = moments.deviation(theta)  # in place, no temporaries: O(D) per collection
        tmax = tmax if swag._n else 0.0
        n_old, n = swag._n, swag._n + 1
        # sharded: the overflow check and the spread over all ranks (total None in one process)
        tmax, total = swag._rows.max_and_total(
            tmax, lambda: float(moments.sq_dev.sum()) + n_old / n * float(torch.dot(t, t)))
        if not tmax * tmax <= torch.finfo(swag._dev.dtype).max / 8:
            raise ValueError(f"{type(swag).__name__}: the parameter vector must keep the running variances within "
                             f"{swag._dev.dtype}, got one at {tmax:.3g} from the mean whose update would overflow them.")
        moments.add_deviation(t, n_old)
        torch.mul(t, n_old / n, out=swag._dev[n_old % swag.rank])  # theta - mean_new, rounded once
        swag._mean.copy_(moments.mean)
        swag._n = n
        if total is not None:
            swag._sq_dev_total = total

    def _k_scale(self, swag) -> float:
        k = min(swag._n, swag.rank)
        return 2 * max(k - 1, 1)

    def cov_factor(self, swag) -> Tensor:
        return swag._dev.T / math.sqrt(self._k_scale(swag))

    def cov_diag(self, swag) -> Tensor:
        var = swag._moments.variance(swag._n).to(swag._mean.dtype)
        floor = swag.min_variance * self._mean_variance(swag, var).clamp_min(torch.finfo(var.dtype).tiny)
        return 0.5 * var.clamp_min(floor)

    def _mean_variance(self, swag, var: Tensor) -> Tensor:
        """Mean over all D of the running variances (the relative floor's scale)."""
        return swag._rows.mean_variance(var, lambda: swag._sq_dev_total / (max(swag._n, 1) * swag.dim))

    def low_rank(self, swag, h: Tensor) -> Tensor:
        return (h @ swag._dev).mul_(1.0 / math.sqrt(self._k_scale(swag)))

    def sq_dev_total(self, swag) -> float:
        return swag._sq_dev_total

    def set_sq_dev_total(self, swag, total: float) -> None:
        swag._sq_dev_total = total

    def check_state_values(self, swag, state_dict, prefix: str) -> None:
        v = state_dict.get("_moments.sq_dev")
        if torch.is_tensor(v) and not bool((v >= 0).all()):
            raise ValueError(f"{type(swag).__name__}: state_dict[{prefix + '_moments.sq_dev'!r}] must be >= 0 (running "
                             f"squared deviations), got {int((v < 0).sum())} negative entries; nothing was loaded.")
