r"""Priors over model weights with closed-form expectations under a Gaussian.

Both priors are factorised over the weights, so under any Gaussian
:math:`q(\theta)` only the marginals :math:`q(\theta_i) = N(m_i, v_i)` matter,
and for an FA posterior :math:`N(c, FF^\top + \Psi)` they are
:math:`m = c`, :math:`v = \mathrm{rowsum}(F \odot F) + \psi` (Jiang 2023, §1.2).

.. math::

    \text{Gaussian (precision } \alpha\text{):}\quad
    \mathbb{E}_q[\log p(\theta_i)] = \tfrac12\log\frac{\alpha}{2\pi}
    - \frac{\alpha}{2}(m_i^2 + v_i)

    \text{Laplace (scale } b\text{):}\quad
    \mathbb{E}_q[\log p(\theta_i)] = -\log 2b - \frac{1}{b}\,\mathbb{E}|\theta_i|,
    \quad \mathbb{E}|\theta_i| = m_i\,\mathrm{erf}\Big(\frac{m_i}{\sqrt{2v_i}}\Big)
    + \sqrt{\frac{2v_i}{\pi}}\, e^{-m_i^2/2v_i}.

The Gaussian case gives the gradients of Brownlie (2021) eqs. 4.48–4.50, the
Laplace case those of Jiang (2023) eqs. (1)–(4).

References
----------
S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
University of Edinburgh, 2021, §4.3.3.
X. Jiang, *Laplace prior and variational inference probabilistic PCA (VIPPCA)*,
report, University of Edinburgh, 2023, §1.2–1.3.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict

import pyro.distributions as dist
import torch
from torch import Tensor

__all__ = [
    "GaussianPrior",
    "LaplacePrior",
    "normal_expected_log_prob",
    "laplace_expected_log_prob",
    "expected_abs",
]

_LOG_2PI = math.log(2 * math.pi)


def _tiny(x: Tensor) -> float:
    return torch.finfo(x.dtype).tiny


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
    variance = variance.clamp_min(_tiny(variance))
    std = variance.sqrt()
    ratio = loc / std
    return loc * torch.erf(ratio / math.sqrt(2)) + std * math.sqrt(2 / math.pi) * torch.exp(-0.5 * ratio * ratio)


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


def _positive_number(cls_name: str, arg: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{cls_name}: {arg} must be a real number, got {value!r}.")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{cls_name}: {arg} must be a positive finite number, got {value!r}.")
    return value


class _FactorisedPrior:
    """Base class: an i.i.d. zero-centred prior on every weight."""

    def distribution(self, like: Tensor) -> dist.TorchDistribution:
        """The prior of one sample site shaped like ``like``.

        Parameters
        ----------
        like : Tensor
            Gives the event shape, dtype and device of the site.

        Returns
        -------
        pyro.distributions.TorchDistribution
            Event shape ``like.shape``, empty batch shape.
        """
        loc = torch.zeros((), dtype=like.dtype, device=like.device)
        scale = torch.full((), self._dist_scale, dtype=like.dtype, device=like.device)
        return self._base(loc, scale).expand(like.shape).to_event(like.dim())

    def log_prob(self, value: Tensor) -> Tensor:
        """Elementwise log-density of ``value`` (same shape)."""
        return self.distribution(value.reshape(-1)).base_dist.log_prob(value.reshape(-1)).reshape(value.shape)

    def bayesianize(self, module: torch.nn.Module, *, copy: bool = True):
        """Turn ``module`` into a Bayesian :class:`~pyro.nn.PyroModule` with this prior on every weight.

        Every parameter of ``module`` and of its submodules becomes a
        :class:`~pyro.nn.PyroSample` site (named by its dotted parameter
        name, e.g. ``"0.weight"``) whose prior is :meth:`distribution` of
        that parameter, as TyXe does in one call.

        Parameters
        ----------
        module : torch.nn.Module
        copy : bool, default True
            Convert a deep copy and leave ``module`` untouched.

        Returns
        -------
        pyro.nn.PyroModule
            It carries ``initial_values``, a dict mapping each site name to
            the parameter's value at conversion (e.g. as ``nn.Linear``
            initialised it); :class:`~pyro_fa.AutoLowRankFactorGuide` starts
            its mean there when this module is its model, and
            :func:`pyro.infer.autoguide.init_to_value` can use it otherwise.

        Raises
        ------
        TypeError
            If ``module`` is not an ``nn.Module``.
        ValueError
            If ``module`` has no parameters.
        """
        return _bayesianize(self, module, copy=copy)


class GaussianPrior(_FactorisedPrior):
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

    _base = dist.Normal

    def __init__(self, precision: float = 1.0):
        self.precision = _positive_number("GaussianPrior", "precision", precision)

    @property
    def _dist_scale(self) -> float:
        return self.precision ** -0.5

    def expected_log_prob(self, loc: Tensor, variance: Tensor) -> Tensor:
        r"""Elementwise :math:`\mathbb{E}_{N(m, v)}[\log p(\theta)]` (Brownlie 2021, eqs. 4.48–4.50).

        Parameters
        ----------
        loc, variance : Tensors of the same (broadcastable) shape
            Marginal means and variances of :math:`q`.

        Returns
        -------
        Tensor of the broadcast shape.
        """
        return normal_expected_log_prob(loc, variance, 0.0, self._dist_scale)

    def __repr__(self) -> str:
        return f"GaussianPrior(precision={self.precision!r})"


class LaplacePrior(_FactorisedPrior):
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

    _base = dist.Laplace

    def __init__(self, scale: float = 1.0):
        self.scale = _positive_number("LaplacePrior", "scale", scale)

    @property
    def _dist_scale(self) -> float:
        return self.scale

    def expected_log_prob(self, loc: Tensor, variance: Tensor) -> Tensor:
        r"""Elementwise :math:`\mathbb{E}_{N(m, v)}[\log p(\theta)]` (Jiang 2023, §1.2).

        Parameters
        ----------
        loc, variance : Tensors of the same (broadcastable) shape
            Marginal means and variances of :math:`q`.

        Returns
        -------
        Tensor of the broadcast shape.
        """
        return laplace_expected_log_prob(loc, variance, 0.0, self.scale)

    def __repr__(self) -> str:
        return f"LaplacePrior(scale={self.scale!r})"


def _bayesianize(prior: _FactorisedPrior, module: torch.nn.Module, copy: bool = True):
    import copy as _copy

    from pyro.nn import PyroSample
    from pyro.nn.module import to_pyro_module_

    cls = type(prior).__name__
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{cls}.bayesianize: module must be a torch.nn.Module, got {module!r}.")
    if next(module.parameters(), None) is None:
        raise ValueError(f"{cls}.bayesianize: module must have at least one parameter, got {module!r}.")
    if copy:
        module = _copy.deepcopy(module)
    initial_values: Dict[str, Tensor] = {
        name: value.detach().clone() for name, value in module.named_parameters()
    }
    to_pyro_module_(module)
    for _prefix, sub in module.named_modules():
        for name, value in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, PyroSample(prior.distribution(value.detach())))
    object.__setattr__(module, "initial_values", initial_values)
    object.__setattr__(module, "prior", prior)
    return module
