r"""The Laplace prior and the closed form of a Laplace's expected log-density under a Gaussian.

.. math::

    \mathbb{E}_{N(m, v)}[\log \mathrm{Laplace}(\theta; \mu_0, b)] = -\log 2b
    - \frac{1}{b}\,\mathbb{E}|\theta - \mu_0|,
    \quad \mathbb{E}|\theta| = m\,\mathrm{erf}\Big(\frac{m}{\sqrt{2v}}\Big)
    + \sqrt{\frac{2v}{\pi}}\, e^{-m^2/2v},

whose gradients are those of Jiang (2023) eqs. (1)–(4).

References
----------
X. Jiang, *Laplace prior and variational inference probabilistic PCA (VIPPCA)*,
report, University of Edinburgh, 2023, §1.2–1.3.
"""
from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import Laplace

from pyro_fa._validation import positive_number
from pyro_fa.infer.priors.base import FactorisedPrior
from pyro_fa.infer.priors.closed_forms import register_expected_log_prob
from pyro_fa.infer.priors.registry import register_prior

__all__ = ["LaplacePrior", "laplace_expected_log_prob", "expected_abs"]


def expected_abs(loc: Tensor, variance: Tensor) -> Tensor:
    r"""Mean of the folded normal, :math:`\mathbb{E}|X|` for :math:`X \sim N(\mu, v)`.

    .. math::

        \mathbb{E}|X| = \mu\,\mathrm{erf}\Big(\frac{\mu}{\sqrt{2v}}\Big)
        + \sqrt{\frac{2v}{\pi}}\exp\Big(-\frac{\mu^2}{2v}\Big)

    (Jiang 2023, §1.2, Theorem; :math:`2\Phi(x) - 1 = \mathrm{erf}(x/\sqrt2)`).

    Parameters
    ----------
    loc : Tensor
        :math:`\mu`, any shape.
    variance : Tensor
        :math:`v \ge 0`, broadcastable with ``loc``.

    Returns
    -------
    Tensor of the broadcast shape.

    Notes
    -----
    Written with ``erf`` so it is exact for :math:`|\mu|/\sqrt v` large (the
    exponential underflows to 0 and the result is :math:`|\mu|`) and for
    :math:`v \to 0`; the variance is clamped at the dtype's smallest normal
    number, which keeps the gradients finite: :math:`\partial/\partial\mu =
    \mathrm{erf}(\mu/\sqrt{2v})` and :math:`\partial/\partial v =
    \exp(-\mu^2/2v)/\sqrt{2\pi v}` (Jiang 2023, eqs. 1–2).

    Examples
    --------
    >>> expected_abs(torch.tensor(0.0), torch.tensor(1.0))  # sqrt(2/pi)
    tensor(0.7979)
    """
    variance = variance.clamp_min(torch.finfo(variance.dtype).tiny)
    std = variance.sqrt()
    ratio = loc / std
    return loc * torch.erf(ratio / math.sqrt(2)) + std * math.sqrt(2 / math.pi) * torch.exp(-0.5 * ratio * ratio)


def laplace_expected_log_prob(loc: Tensor, variance: Tensor, prior_loc, prior_scale) -> Tensor:
    r"""Elementwise :math:`\mathbb{E}_{N(\mu, v)}[\log \mathrm{Laplace}(\theta; \mu_0, b)]`.

    .. math::

        -\log 2b - \frac{1}{b}\,\mathbb{E}|\theta - \mu_0|

    with the folded-normal mean of :func:`expected_abs` (Jiang 2023, §1.2).

    Parameters
    ----------
    loc, variance : Tensor
        Mean and variance of the Gaussian :math:`q`.
    prior_loc, prior_scale : Tensor or float
        Location and (positive) scale :math:`b` of the Laplace prior.

    Returns
    -------
    Tensor of the broadcast shape.
    """
    prior_scale = torch.as_tensor(prior_scale, dtype=loc.dtype, device=loc.device)
    return -(2 * prior_scale).log() - expected_abs(loc - prior_loc, variance) / prior_scale


@register_expected_log_prob(Laplace)
def _laplace(p: Laplace, loc: Tensor, variance: Tensor) -> Tensor:
    return laplace_expected_log_prob(loc, variance, p.loc, p.scale)


@register_prior("laplace")
class LaplacePrior(FactorisedPrior):
    r"""Laplace prior :math:`p(\theta_i) = \frac{1}{2b} e^{-|\theta_i|/b}` on every weight.

    Parameters
    ----------
    scale : float, default 1.0
        :math:`b > 0`; the rate :math:`1/b` is Jiang's (2023) :math:`\alpha`, and
        the variance is :math:`2b^2`. A Laplace prior with the variance of a
        Gaussian prior of precision :math:`\alpha` has
        :math:`b = 1/\sqrt{2\alpha}` (Jiang 2023, §3.1).

    Examples
    --------
    >>> LaplacePrior(scale=1.0).expected_log_prob(torch.zeros(1), torch.full((1,), 1e-30))  # -log 2
    tensor([-0.6931])
    """

    def __init__(self, scale: float = 1.0):
        self.scale = positive_number("LaplacePrior", "scale", scale)

    @property
    def precision(self) -> float:
        r""":math:`1/(2b^2)`, one over the variance."""
        return 1.0 / (2.0 * self.scale ** 2)

    def base_distribution(self, like: Tensor) -> dist.Laplace:
        """:math:`\\mathrm{Laplace}(0, b)` in ``like``'s dtype and on its device."""
        loc = torch.zeros((), dtype=like.dtype, device=like.device)
        return dist.Laplace(loc, torch.full((), self.scale, dtype=like.dtype, device=like.device))

    @classmethod
    def batched(cls, precision: Tensor) -> Laplace:
        r""":math:`\mathrm{Laplace}(0, b_r)` with :math:`b_r = 1/\sqrt{2\alpha_r}`; ``precision`` of shape (R, 1)."""
        return Laplace(0.0, (2 * precision).rsqrt(), validate_args=False)

    def __repr__(self) -> str:
        return f"LaplacePrior(scale={self.scale!r})"
