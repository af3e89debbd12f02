r"""The prediction protocol every posterior over a network's weights answers, written once.

A posterior (:class:`~pyro_fa.swag.SWAG`, :class:`~pyro_fa.swag.MultiSWAG`,
:class:`~pyro_fa.laplace.FactorLaplace`) subclasses :class:`Posterior` and supplies three things:

* :meth:`Posterior.get_posterior` — the distribution over the flattened weights (a
  :class:`~pyro_fa.distributions.FactorNormal` family member);
* :meth:`Posterior.predictive` — a :class:`~pyro_fa.predictive.SampledPredictive`: how to draw weights and
  how to run the network at a draw (``pred_type="nn"``) or its linearisation at the mean (``"glm"``);
* :meth:`Posterior._linearized_marginals` — the linearised outputs' means and variances, in closed form.

Every prediction verb is then the same on every posterior, with the same signature:

.. math::

    \text{nn / mc:}\ \ \frac1S\sum_{s=1}^S g\big(f(x; \theta_s)\big), \quad \theta_s \sim q; \qquad
    \text{glm / probit:}\ \ f^{\rm lin}(x) \sim N\big(f(x; c),\ \mathrm{diag}\,J_x\Sigma J_x^\top\big),

with :math:`g` the identity (:meth:`~Posterior.predict`), the class probabilities
(:meth:`~Posterior.predict_proba`) or, averaged in probability, their logarithm
(:meth:`~Posterior.predict_log_proba`). A mixture (MultiSWAG) answers with its components' closed forms
mixed with equal weights. ``link_approx`` is dispatched once, through :data:`ROUTES`.

Posteriors of a Pyro model have no network to run: the guide (:class:`~pyro_fa.infer.AutoLowRankFactorGuide`),
``PyroFactorLaplace(...).to_guide()`` and ``SWAG.from_param_store(...).to_guide(model)`` predict through Pyro's own
``pyro.infer.Predictive(model, guide=guide, num_samples=S)`` (their ``get_posterior()`` and ``sample()`` are the
protocol's); a network trained with the guide, :class:`~pyro_fa.nn.BayesianNetwork`, hands out the same
:class:`SampledPredictive` (``bnn.predictive()``).
"""
from __future__ import annotations

import abc
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from pyro_fa.predictive.glm import probit_proba, resolve_link_approx
from pyro_fa.predictive.likelihood import LIKELIHOODS, OBSERVATION_NOISE, normalize_likelihood
from pyro_fa.predictive.sampled import SampledPredictive, log_mean_exp

__all__ = ["Posterior", "ROUTES", "class_proba", "class_log_proba", "mixture_moments"]

Inputs = Union[Tensor, Tuple[Tensor, ...]]


def class_log_proba(z: Tensor) -> Tensor:
    """Log class probabilities of logits ``z``: ``log_softmax`` over (..., C); one logit ((..., 1) or a network
    returning (N,)) is a Bernoulli's, :math:`(\\log\\sigma(-z), \\log\\sigma(z))`, shape (..., 2)."""
    if z.dim() > 1 and z.shape[-1] > 1:
        return z.log_softmax(-1)
    if z.dim() > 1:
        z = z.squeeze(-1)
    return torch.stack([torch.nn.functional.logsigmoid(-z), torch.nn.functional.logsigmoid(z)], -1)


def class_proba(z: Tensor) -> Tensor:
    r"""Class probabilities of logits ``z``: ``softmax`` over (..., C); one logit: :math:`(1 - \sigma(z), \sigma(z))`."""
    if z.dim() > 1 and z.shape[-1] > 1:
        return z.softmax(-1)
    p = torch.sigmoid(z.squeeze(-1) if z.dim() > 1 else z)
    return torch.stack([1 - p, p], -1)


def _probit_log_proba(mean: Tensor, var: Tensor) -> Tensor:
    """:func:`~pyro_fa.predictive.probit_proba` in log form; one logit (N,) or (N, 1): the Bernoulli's."""
    if mean.dim() == 1 or mean.shape[-1] == 1:
        return class_log_proba(mean / torch.sqrt(1 + torch.pi / 8 * var))
    return probit_proba(mean, var, log=True)


def mixture_moments(moments: Sequence[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
    r"""Mean and variance of an equally weighted mixture, :math:`\bar\mu = \frac1M\sum_m\mu_m` and
    :math:`\frac1M\sum_m (v_m + \mu_m^2) - \bar\mu^2` (one component: its own moments)."""
    if len(moments) == 1:
        return moments[0]
    means = torch.stack([m for m, _ in moments])
    mean = means.mean(0)
    second = torch.stack([v + m.square() for m, v in moments]).mean(0)
    return mean, (second - mean.square()).clamp_min(0)


def _positive_int(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be an integer >= 1, got {value!r}.")
    return value


class _Request(NamedTuple):
    """A verb's arguments, as a route reads them."""
    pred_type: str
    num_samples: int
    generator: Optional[torch.Generator]
    loader: object
    chunk_size: Optional[int]


class _Route:
    """How the prediction verbs compute for one ``link_approx``: (mean, variance), probabilities, log-probabilities."""

    def moments(self, posterior, x, request: _Request, with_var: bool):
        raise NotImplementedError

    def proba(self, posterior, x, request: _Request) -> Tensor:
        raise NotImplementedError

    def log_proba(self, posterior, x, request: _Request) -> Tensor:
        raise NotImplementedError


class _ByDraws(_Route):
    """``"mc"``: the average over the predictive's draws (sampled networks, or linearised ones for ``"glm"``)."""

    def moments(self, posterior, x, r, with_var):
        predictive, draws, inputs = posterior._sampled(x, r.pred_type, r.num_samples, r.generator, r.loader)
        if not with_var:
            return predictive.average(draws, *inputs), None
        moments = predictive.average(draws, *inputs, fn=lambda z: torch.stack([z, z * z]))
        return moments[0], (moments[1] - moments[0].square()).clamp_min(0)

    def proba(self, posterior, x, r):
        predictive, draws, inputs = posterior._sampled(x, r.pred_type, r.num_samples, r.generator, r.loader)
        return predictive.average(draws, *inputs, fn=class_proba)

    def log_proba(self, posterior, x, r):
        predictive, draws, inputs = posterior._sampled(x, r.pred_type, r.num_samples, r.generator, r.loader)
        return log_mean_exp(predictive.outputs(draws, *inputs, fn=class_log_proba))


class _ClosedForm(_Route):
    """``"probit"``: the linearised outputs' Gaussian moments (a mixture's components mixed with equal weights),
    and the probit approximation of their class probabilities."""

    def moments(self, posterior, x, r, with_var):
        return mixture_moments(posterior._closed_form(x, r.loader, r.chunk_size))

    def proba(self, posterior, x, r):
        return self.log_proba(posterior, x, r).exp()

    def log_proba(self, posterior, x, r):
        logs = [_probit_log_proba(mean, var) for mean, var in posterior._closed_form(x, r.loader, r.chunk_size)]
        return logs[0] if len(logs) == 1 else log_mean_exp(torch.stack(logs))


#: link_approx -> how the verbs compute (``link_approx=None``: :data:`~pyro_fa.predictive.DEFAULT_LINK_APPROX`)
ROUTES = {"mc": _ByDraws(), "probit": _ClosedForm()}


class Posterior(abc.ABC):
    r"""A Gaussian (or mixture) posterior over a network's flattened weights, and its predictions.

    Subclasses implement :meth:`get_posterior`, :meth:`predictive` and :meth:`_linearized_marginals`;
    ``sample(num_samples=None, *, generator=None)`` draws weight vectors. Everything else is here:
    :meth:`predict`, :meth:`predict_proba`, :meth:`predict_log_proba`, :meth:`predictive_samples`,
    :meth:`log_likelihood` and :meth:`tune_scale`, with one signature on every posterior.

    The default predictive is the same everywhere: ``pred_type="nn"`` (sampled networks), ``num_samples=30``.
    ``link_approx=None`` means ``"mc"`` (Monte Carlo over the draws) for ``"nn"`` and ``"probit"`` (the closed
    form of the linearised network's Gaussian outputs) for ``"glm"``.

    See also
    --------
    pyro_fa.predictive.SampledPredictive : what :meth:`predictive` returns.
    pyro_fa.predictive.tune_scale : the scale search behind :meth:`tune_scale`.
    pyro_fa.predictive.TemperatureScaling : ``TemperatureScaling(posterior.predict_log_proba)``.
    """

    # ------------------------------------------------------------------ what a posterior supplies
    @abc.abstractmethod
    def get_posterior(self):
        """The distribution over the flattened weights, shape (D,)."""

    @abc.abstractmethod
    def predictive(self, pred_type: str = "nn", *, loader=None) -> SampledPredictive:
        """This posterior's predictive: draws, and the network (``"nn"``) or its linearisation (``"glm"``) at each."""

    @abc.abstractmethod
    def _linearized_marginals(self, inputs: Tuple[Tensor, ...], chunk_size: Optional[int]
                              ) -> List[Tuple[Tensor, Tensor]]:
        """Per mixture component (one for a Gaussian): the linearised outputs' means and marginal variances at
        the current scale, each of the network output's shape ((N,) or (N, C))."""

    def _default_likelihood(self) -> str:
        """The likelihood when none is given: the posterior's own if it has one, else ``"classification"``."""
        own = getattr(self, "likelihood", None)
        return own if own in LIKELIHOODS else "classification"

    def _default_noise_std(self):
        """The observation noise a regression's variance and log-likelihood use when none is given (none)."""
        return None

    def _inputs(self, x: Inputs) -> Tuple[Tensor, ...]:
        """The network's positional inputs: ``x``, or the tuple ``x`` (several inputs)."""
        return tuple(x) if isinstance(x, (tuple, list)) else (x,)

    # ------------------------------------------------------------------ the verbs
    def _sampled(self, x, pred_type, num_samples, generator, loader):
        owner = type(self).__name__
        _positive_int(owner, "num_samples", num_samples)
        predictive = self.predictive(pred_type, loader=loader)
        if predictive.module is None:
            raise RuntimeError(f"{owner}: predictions need a posterior built from an nn.Module, got one over "
                               "parameters only; use to_guide() with pyro.infer.Predictive for Pyro models.")
        return predictive, predictive.sample(num_samples, generator), self._inputs(x)

    def _closed_form(self, x, loader, chunk_size) -> List[Tuple[Tensor, Tensor]]:
        if loader is not None:
            raise ValueError(f"{type(self).__name__}: loader must be None for the closed-form GLM predictive "
                             "(link_approx='probit': the network is linearised at the mean, with its own batch-norm "
                             "statistics), got a loader. Use link_approx='mc' to refresh them.")
        with torch.enable_grad():  # the Jacobians may come from reverse mode (e.g. an LSTM's on the CPU)
            moments = self._linearized_marginals(self._inputs(x), chunk_size)
        return [(mean.detach(), var.detach()) for mean, var in moments]

    @torch.no_grad()
    def predict(self, x: Inputs, *, pred_type: str = "nn", link_approx: Optional[str] = None,
                num_samples: int = 30, generator: Optional[torch.Generator] = None, return_var: bool = False,
                noise_std=None, loader=None, chunk_size: Optional[int] = None):
        r"""The predictive mean of the network's output; with ``return_var=True``, (mean, variance).

        Parameters
        ----------
        x : Tensor of shape (N, ...), or tuple of Tensors
            The network's input (a tuple: several positional inputs).
        pred_type : {"nn", "glm"}, default "nn"
            ``"nn"``: the network at sampled weights. ``"glm"``: the network linearised at the mean,
            :math:`f(x; c) + J_x(\theta - c)` (Immer, Korzepa & Bauer 2021, §3).
        link_approx : {None, "mc", "probit"}, default None
            ``"mc"``: the average over ``num_samples`` draws (the default for ``"nn"``); ``"probit"`` (the default
            for ``"glm"``): the linearised outputs' Gaussian moments in closed form, no draws.
        num_samples : int, default 30
        generator : torch.Generator, optional
            Seeds the draws.
        return_var : bool, default False
            Also return the predictive variance of each output: of the draws' outputs (``"mc"``), or
            :math:`\mathrm{diag}(J_x\Sigma J_x^\top)` (closed form), plus ``noise_std`` squared.
        noise_std : float or Tensor of shape (N,), optional
            The observation noise added to the variance; default the posterior's own (FactorLaplace's
            ``sigma_noise`` for a regression), else none.
        loader : iterable, optional
            Batch-norm statistics refreshed at each draw (``"mc"``; see the posterior's ``sampled_weights``).
        chunk_size : int, optional
            Closed form: examples per chunk of per-example Jacobians.

        Returns
        -------
        Tensor of the network output's shape ((N,) or (N, C)), or (mean, variance) with ``return_var=True``
            For classification this is the mean of the logits; use :meth:`predict_proba`.

        Raises
        ------
        ValueError
            An unknown ``pred_type`` or ``link_approx``, ``"probit"`` with ``"nn"``, ``num_samples`` < 1,
            ``noise_std`` not positive and finite, a ``loader`` with the closed form.
        """
        route = self._route(pred_type, link_approx)
        noise = self._noise_variance(noise_std)
        mean, var = route.moments(self, x, _Request(pred_type, num_samples, generator, loader, chunk_size), return_var)
        if not return_var:
            return mean
        if noise is not None:
            noise = noise.to(var)
            var = var + (noise.reshape(-1, *([1] * (var.dim() - 1))) if noise.dim() == 1 else noise)
        return mean, var

    def _noise_variance(self, noise_std) -> Optional[Tensor]:
        noise_std = self._default_noise_std() if noise_std is None else noise_std
        if noise_std is None:
            return None
        noise = torch.as_tensor(noise_std)
        if not bool(torch.isfinite(noise).all()) or bool((noise <= 0).any()):
            raise ValueError(f"{type(self).__name__}: noise_std must be positive and finite, got {noise_std!r}.")
        return noise.square()

    @torch.no_grad()
    def predict_proba(self, x: Inputs, *, pred_type: str = "nn", link_approx: Optional[str] = None,
                      num_samples: int = 30, generator: Optional[torch.Generator] = None, loader=None,
                      chunk_size: Optional[int] = None) -> Tensor:
        r"""Class probabilities of the predictive, for a network returning logits (N, C) (one logit: Bernoulli).

        ``"mc"``: :math:`\frac1S\sum_s \mathrm{softmax}(f(x; \theta_s))`; ``"probit"`` (``"glm"``'s default):
        :func:`~pyro_fa.predictive.probit_proba` of the linearised logits' means and variances (Daxberger et al.
        2021, §2). Arguments as for :meth:`predict`.

        Returns
        -------
        Tensor of shape (N, C)
            (N, 2) for one logit (column 1: :math:`P(y = 1)`).
        """
        route = self._route(pred_type, link_approx)
        return route.proba(self, x, _Request(pred_type, num_samples, generator, loader, chunk_size))

    @torch.no_grad()
    def predict_log_proba(self, x: Inputs, *, pred_type: str = "nn", link_approx: Optional[str] = None,
                          num_samples: int = 30, generator: Optional[torch.Generator] = None, loader=None,
                          chunk_size: Optional[int] = None) -> Tensor:
        r"""Log class probabilities of the predictive, computed in log space.

        .. math::

            \log \frac1S \sum_{s=1}^S \mathrm{softmax}(z_s) = \mathrm{logsumexp}_s\,
            \mathrm{log\_softmax}(z_s) - \log S,

        so that a class every draw gives a probability below the dtype's smallest number keeps a finite value
        (``predict_proba(...).log()`` would give ``-inf``). Arguments as for :meth:`predict_proba`.

        Returns
        -------
        Tensor of shape (N, C)
        """
        route = self._route(pred_type, link_approx)
        return route.log_proba(self, x, _Request(pred_type, num_samples, generator, loader, chunk_size))

    def _route(self, pred_type, link_approx) -> "_Route":
        """How the verbs compute, chosen once from ``link_approx`` (None: ``pred_type``'s default)."""
        return ROUTES[resolve_link_approx(type(self).__name__, pred_type, link_approx)]

    @torch.no_grad()
    def predictive_samples(self, x: Inputs, *, pred_type: str = "nn", num_samples: int = 30,
                           generator: Optional[torch.Generator] = None,
                           fn: Optional[Callable[[Tensor], Tensor]] = None, loader=None) -> Tensor:
        """The network's (``"glm"``: the linearised network's) outputs under ``num_samples`` draws, stacked:
        shape (S, ...); ``fn`` is applied to each (e.g. ``lambda z: z.softmax(-1)``: what :mod:`pyro_fa.metrics`
        takes as predictive samples)."""
        predictive, draws, inputs = self._sampled(x, pred_type, num_samples, generator, loader)
        return predictive.outputs(draws, *inputs, fn=fn)

    def log_likelihood(self, inputs, targets, likelihood=None, *, num_samples: int = 30, noise_std=None,
                       seed: int = 0, pred_type: str = "nn") -> float:
        """Log-likelihood per point of the predictive (the model average) on ``(inputs, targets)``.

        ``likelihood``: ``"classification"`` (logits) or ``"regression"`` (means, with ``noise_std``; default
        the posterior's own noise), aliases ``"categorical"`` / ``"gaussian"``, or a callable; default the
        posterior's own likelihood, else ``"classification"``. See :func:`pyro_fa.predictive.bma_log_likelihood`.
        """
        from pyro_fa.predictive.scale import bma_log_likelihood

        likelihood, noise_std = self._likelihood_and_noise(likelihood, noise_std)
        return bma_log_likelihood(self, inputs, targets, likelihood, num_samples=num_samples, noise_std=noise_std,
                                  seed=seed, pred_type=pred_type)

    def tune_scale(self, inputs, targets, likelihood=None, *, scales=None, num_samples: int = 30, noise_std=None,
                   seed: int = 0, rule: str = "gated", fraction: float = 0.7, num_se: float = 1.5, widen: int = 3,
                   pred_type: str = "nn", temperature: bool = False):
        """Choose :attr:`scale` on validation data, never worse there than the mean (scale 0).

        See :func:`pyro_fa.predictive.tune_scale` for the arguments (``likelihood`` and ``noise_std`` as in
        :meth:`log_likelihood`); a mixture splits the draws evenly over its members and sets one scale for all.

        Returns
        -------
        ScaleSearch
        """
        from pyro_fa.predictive.scale import tune_scale

        likelihood, noise_std = self._likelihood_and_noise(likelihood, noise_std)
        return tune_scale(self, inputs, targets, likelihood, scales=scales, num_samples=num_samples,
                          noise_std=noise_std, seed=seed, rule=rule, fraction=fraction, num_se=num_se, widen=widen,
                          pred_type=pred_type, temperature=temperature)

    def _likelihood_and_noise(self, likelihood, noise_std):
        owner = type(self).__name__
        likelihood = normalize_likelihood(owner, self._default_likelihood() if likelihood is None else likelihood,
                                          allow_callable=True)
        if noise_std is None and isinstance(likelihood, str) and OBSERVATION_NOISE[likelihood]:
            noise_std = self._default_noise_std()
        return likelihood, noise_std
