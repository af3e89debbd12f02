r"""The Gaussian prior and the closed form of a Normal's expected log-density under a Gaussian.

.. math::

    \mathbb{E}_{N(m, v)}[\log N(\theta; \mu_0, s^2)] = -\log s - \tfrac12\log 2\pi
    - \frac{(m - \mu_0)^2 + v}{2 s^2},

which for :math:`\mu_0 = 0`, :math:`s^2 = 1/\alpha` gives the gradients of Brownlie (2021)
eqs. 4.48–4.50.

References
----------
S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
University of Edinburgh, 2021, §4.3.3.
"""
from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import Normal

from pyro_fa._validation import positive_number
from pyro_fa.infer.priors.base import FactorisedPrior
from pyro_fa.infer.priors.closed_forms import register_expected_log_prob
from pyro_fa.infer.priors.registry import register_prior

__all__ = ["GaussianPrior", "normal_expected_log_prob"]

_LOG_2PI = math.log(2 * math.pi)


def normal_expected_log_prob(loc: Tensor, variance: Tensor, prior_loc, prior_scale) -> Tensor:
    r"""Elementwise :math:`\mathbb{E}_{N(\mu, v)}[\log N(\theta; \mu_0, s^2)]`.

    .. math::

        -\log s - \tfrac12\log 2\pi - \frac{(\mu - \mu_0)^2 + v}{2 s^2}

    Parameters
    ----------
    loc, variance : Tensor
        Mean and variance of the Gaussian :math:`q`.
    prior_loc, prior_scale : Tensor or float
        Location and (positive) scale of the normal prior.

    Returns
    -------
    Tensor of the broadcast shape.
    """
    prior_scale = torch.as_tensor(prior_scale, dtype=loc.dtype, device=loc.device)
    return -prior_scale.log() - 0.5 * _LOG_2PI - ((loc - prior_loc).pow(2) + variance) / (2 * prior_scale.pow(2))


@register_expected_log_prob(Normal)
def _normal(p: Normal, loc: Tensor, variance: Tensor) -> Tensor:
    return normal_expected_log_prob(loc, variance, p.loc, p.scale)


@register_prior("gaussian")
class GaussianPrior(FactorisedPrior):
    r"""Isotropic Gaussian prior :math:`p(\theta) = N(0, \alpha^{-1} I)`.

    Parameters
    ----------
    precision : float, default 1.0
        :math:`\alpha > 0` (Brownlie 2021, eq. 2.8).

    Examples
    --------
    >>> prior = GaussianPrior(precision=4.0)
    >>> prior.expected_log_prob(torch.zeros(1), torch.ones(1))  # 0.5 log(4 / 2 pi) - 2
    tensor([-2.2258])
    """

    def __init__(self, precision: float = 1.0):
        self.precision = positive_number("GaussianPrior", "precision", precision)

    def base_distribution(self, like: Tensor) -> dist.Normal:
        """:math:`N(0, 1/\\alpha)` in ``like``'s dtype and on its device."""
        loc = torch.zeros((), dtype=like.dtype, device=like.device)
        return dist.Normal(loc, torch.full((), self.precision ** -0.5, dtype=like.dtype, device=like.device))

    @classmethod
    def batched(cls, precision: Tensor) -> Normal:
        r""":math:`N(0, 1/\alpha_r)` per replica; ``precision`` of shape (R, 1)."""
        return Normal(0.0, precision.rsqrt(), validate_args=False)

    def __repr__(self) -> str:
        return f"GaussianPrior(precision={self.precision!r})"
