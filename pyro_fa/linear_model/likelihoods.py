r"""The observation models of :class:`~pyro_fa.linear_model.GeneralizedLinearModel`: one class per likelihood.

A likelihood turns the linear predictor :math:`f = \phi(x)^\top w` into a Pyro distribution of :math:`y`
(:meth:`Likelihood.distribution`), checks targets, and integrates :math:`w` out of predictions under the
posterior :math:`q(w)` (Steinberg et al. 2016, eqs. 28–29): in closed form where the moments exist, by Monte
Carlo over weight draws otherwise (the defaults of :class:`Likelihood`). :data:`LIKELIHOODS` maps the names
``GeneralizedLinearModel`` accepts to the classes; a new likelihood is one subclass registered with
:func:`register_likelihood`:

>>> import pyro.distributions as dist
>>> @register_likelihood("exponential")
... class Exponential(Likelihood):
...     '''y ~ Exponential with mean exp(f) (log link).'''
...     def distribution(self, f, noise=None):
...         return dist.Exponential(torch.exp(-f))
>>> LIKELIHOODS.pop("exponential").__name__
'Exponential'

References
----------
Steinberg, Tiao, McCalman, Reid & O'Callaghan (2016), *revrand: technical report*, CSIRO Data61, §1.3.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple, Type

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistributionMixin
from torch import Tensor

__all__ = ["Likelihood", "Gaussian", "Bernoulli", "Poisson", "CallableLikelihood", "LIKELIHOODS",
           "register_likelihood", "make_likelihood"]

#: Registered likelihoods, name -> class (a subclass of :class:`Likelihood` built without arguments).
LIKELIHOODS: Dict[str, Type["Likelihood"]] = {}


def register_likelihood(name: str) -> Callable[[Type["Likelihood"]], Type["Likelihood"]]:
    """Class decorator: register a :class:`Likelihood` subclass under ``name`` (its ``name`` attribute is set).

    Raises
    ------
    ValueError
        If ``name`` is already registered.
    """
    if name in LIKELIHOODS:
        raise ValueError(f"register_likelihood: name must be new, got {name!r} (already registered).")

    def register(cls: Type["Likelihood"]) -> Type["Likelihood"]:
        cls.name = name
        LIKELIHOODS[name] = cls
        return cls

    return register


class Likelihood:
    r"""An observation model :math:`p(y \mid f)` of a GLM and its predictions with :math:`w \sim q` integrated out.

    Subclasses implement :meth:`distribution`; the predictions default to Monte Carlo over joint draws of
    :math:`f_*` and are overridden where a closed form exists. They receive ``latent``, the linear predictor
    under :math:`q` at the inputs: ``latent.moments(X)`` (mean and variance of :math:`f_*`),
    ``latent.samples(X, n)`` (blocks of joint draws, shape (n, rows)), ``latent.n_samples(value)`` (a checked
    count) and ``latent.noise_scale`` (:math:`\sigma`).

    Attributes
    ----------
    name : str
        The registered name (set by :func:`register_likelihood`).
    has_noise : bool
        Whether :meth:`distribution` takes the model's noise scale :math:`\sigma`, in the units of ``y`` (a
        location-scale family: standardised targets give :math:`\sigma` in standardised units).
    binary : bool
        Whether the targets are labels in {0, 1} with class probabilities (``predict_proba``).
    """

    name = "likelihood"
    has_noise = False
    binary = False

    def distribution(self, f: Tensor, noise: Optional[Tensor] = None) -> dist.Distribution:
        """The Pyro distribution of ``y`` given the linear predictor ``f`` (batch shape ``f.shape``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement distribution(f, noise).")

    def check_targets(self, cls: str, y: Tensor) -> None:
        """Raise ``ValueError`` (naming ``cls``) if ``y`` of shape (N,) is outside the support; default: any real."""

    # ------------------------------------------------------------ the noise scale
    def noise(self, initial: Tensor, learn: bool) -> Optional[Tensor]:
        """The noise scale inside the model: ``None`` without one."""
        return None

    def fitted_noise(self, learn: bool) -> Optional[Tensor]:
        """The learned noise scale read from the Pyro parameter store after a fit (``None``: keep the current)."""
        return None

    # ------------------------------------------------------------ predictions
    def predictive_moments(self, latent, X: Tensor, n_samples) -> Tuple[Tensor, Tensor]:
        """Mean and variance of :math:`y_*` by Monte Carlo (law of total variance over the draws of :math:`f_*`)."""
        means, variances = [], []
        for f in latent.samples(X, latent.n_samples(n_samples)):
            d = self.distribution(f, None)
            m = d.mean
            means.append(m.mean(0))
            variances.append(d.variance.mean(0) + m.var(0, unbiased=False))
        return torch.cat(means), torch.cat(variances)

    def log_predictive(self, latent, X: Tensor, y: Tensor, n_samples) -> Tensor:
        r""":math:`\log \frac1S \sum_s p(y_* \mid f_*^{(s)})` over ``n_samples`` weight draws (biased low, O(1/S))."""
        n_samples = latent.n_samples(n_samples)
        out, start = [], 0
        for f in latent.samples(X, n_samples):
            yb = y[start:start + f.shape[-1]]
            start += f.shape[-1]
            out.append(torch.logsumexp(self.distribution(f, None).log_prob(yb), 0) - math.log(n_samples))
        return torch.cat(out)

    def __repr__(self) -> str:
        return self.name


@register_likelihood("gaussian")
class Gaussian(Likelihood):
    r""":math:`y \sim N(f, \sigma^2)`, identity link, with a noise scale :math:`\sigma` (learned or fixed).

    Predictions are exact: :math:`\mathbb{E}[y_*] = \mu_*`, :math:`\mathbb{V}[y_*] = v_* + \sigma^2`, with
    :math:`\mu_*, v_*` the mean and variance of :math:`f_*` under :math:`q`.
    """

    has_noise = True

    def distribution(self, f, noise=None):
        return dist.Normal(f, noise)

    def noise(self, initial, learn):
        if not learn:
            return initial
        return pyro.param("noise_scale", lambda: initial.detach().clone(), constraint=constraints.positive)

    def fitted_noise(self, learn):
        return pyro.param("noise_scale").detach().clone() if learn else None

    def predictive_moments(self, latent, X, n_samples):
        mu, v = latent.moments(X)
        return mu, v + latent.noise_scale.pow(2)

    def log_predictive(self, latent, X, y, n_samples):
        mu, v = latent.moments(X)
        return dist.Normal(mu, (v + latent.noise_scale.pow(2)).sqrt()).log_prob(y)


@register_likelihood("bernoulli")
class Bernoulli(Likelihood):
    r""":math:`y \sim \mathrm{Bernoulli}(\mathrm{sigmoid}(f))`, logit link; labels in {0, 1}.

    :math:`p_* = \mathbb{E}_q[\mathrm{sigmoid}(f_*)]` by Monte Carlo (Steinberg et al. 2016, eq. 29),
    standard deviation :math:`\sqrt{p_*(1 - p_*)}`.
    """

    binary = True

    def distribution(self, f, noise=None):
        return dist.Bernoulli(logits=f)

    def check_targets(self, cls, y):
        if not ((y == 0) | (y == 1)).all():
            bad = y[(y != 0) & (y != 1)][:3].tolist()
            raise ValueError(f"{cls}: y must hold labels in {{0, 1}} for likelihood='bernoulli', got {bad}.")

    def probability(self, latent, X: Tensor, n_samples: int) -> Tensor:
        """:math:`p_*`, shape (M,), a Monte Carlo average of the sigmoid over ``n_samples`` weight draws."""
        return torch.cat([torch.sigmoid(f).mean(0) for f in latent.samples(X, n_samples)])

    def log_probabilities(self, latent, X: Tensor, n_samples: int) -> Tensor:
        r""":math:`[\log(1 - p_*), \log p_*]`, shape (M, 2), as logsumexp of log-sigmoids minus :math:`\log S`.

        Finite where every draw lies far in a tail (the log of the averaged probability is -inf there).
        """
        logsig = torch.nn.functional.logsigmoid
        out = torch.cat([torch.stack([torch.logsumexp(logsig(-f), 0), torch.logsumexp(logsig(f), 0)], -1)
                         for f in latent.samples(X, n_samples)])
        return out - math.log(n_samples)

    def predictive_moments(self, latent, X, n_samples):
        mean = self.probability(latent, X, latent.n_samples(n_samples))
        return mean, mean * (1 - mean)


@register_likelihood("poisson")
class Poisson(Likelihood):
    r""":math:`y \sim \mathrm{Poisson}(e^f)`, log link; non-negative integer counts.

    Predictions are exact: :math:`\mathbb{E}[y_*] = e^{\mu_* + v_*/2}` (the mean rate) and
    :math:`\mathbb{V}[y_*] = \mathbb{E}[y_*] + \mathbb{E}[y_*]^2 (e^{v_*} - 1)`.
    """

    def distribution(self, f, noise=None):
        return dist.Poisson(f.exp())

    def check_targets(self, cls, y):
        if not ((y >= 0) & (y == y.round())).all():
            bad = y[(y < 0) | (y != y.round())][:3].tolist()
            raise ValueError(f"{cls}: y must hold non-negative integer counts for likelihood='poisson', got {bad}.")

    def predictive_moments(self, latent, X, n_samples):
        mu, v = latent.moments(X)
        mean = (mu + 0.5 * v).exp()
        return mean, mean + mean.pow(2) * torch.expm1(v)


class CallableLikelihood(Likelihood):
    """A user's callable ``f -> pyro distribution`` (batch shape ``f.shape``, event shape ()) as a likelihood."""

    def __init__(self, fn: Callable[[Tensor], dist.Distribution]):
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def distribution(self, f, noise=None):
        return self.fn(f)

    def check_targets(self, cls, y):
        n = y.shape[0]
        d = self.fn(y.new_zeros(n))
        if not isinstance(d, TorchDistributionMixin):
            raise TypeError(f"{cls}: likelihood(f) must return a pyro.distributions distribution, got {type(d).__name__}.")
        if tuple(d.batch_shape) != (n,) or tuple(d.event_shape) != ():
            raise ValueError(
                f"{cls}: likelihood(f) must return a distribution with batch shape f.shape = ({n},) and "
                f"event shape (), got batch shape {tuple(d.batch_shape)}, event shape {tuple(d.event_shape)}."
            )
        if not bool(d.support.check(y).all()):
            raise ValueError(f"{cls}: y must lie in the likelihood's support {d.support}, got values outside it.")


def make_likelihood(cls: str, likelihood) -> Likelihood:
    """The :class:`Likelihood` of a registered name, or a callable wrapped in :class:`CallableLikelihood`."""
    if isinstance(likelihood, str):
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"{cls}: likelihood must be one of {tuple(LIKELIHOODS)} or a callable, got {likelihood!r}.")
        return LIKELIHOODS[likelihood]()
    if not callable(likelihood):
        raise TypeError(
            f"{cls}: likelihood must be one of {tuple(LIKELIHOODS)} or a callable f -> distribution, got {likelihood!r}."
        )
    return CallableLikelihood(likelihood)
