r"""Choosing the scale of a posterior over a module's weights on validation data.

The spread of an optimizer's iterates is set by its learning rate and batch size
(Mandt, Hoffman & Blei 2017), not by the posterior it stands in for: SGD late in
training moves by about 1 % of the weights, and samples at that spread predict
like their mean (SWA). Maddox et al. (2019) sample
:math:`\theta = c + \sqrt{s}\,\delta` with :math:`\delta \sim N(0, FF^\top + \Psi)`
and choose :math:`s` on validation data. :func:`tune_scale` does so by the
log-likelihood of the Bayesian model average,

.. math::

    \mathcal L(s) = \frac1N \sum_{i=1}^N \log \frac1S \sum_{j=1}^S p\big(y_i \mid x_i, c + \sqrt{s}\,\delta_j\big),

with the same draws :math:`\delta_j` for every candidate (common random numbers:
the comparison between scales is not blurred by Monte Carlo noise).
"""
from __future__ import annotations

import math
from typing import Callable, List, NamedTuple, Optional, Sequence, Union

import torch

from pyro_fa.predictive.likelihood import check_targets, point_log_likelihood
from pyro_fa.predictive.sampled import SampledPredictive, log_mean_exp

__all__ = ["ScaleSearch", "tune_scale", "bma_log_likelihood", "DEFAULT_SCALES"]

DEFAULT_SCALES = tuple(float(10 ** (k / 2)) for k in range(-4, 9))  # 0.01, 0.032, ..., 1e4


class ScaleSearch(NamedTuple):
    """What :func:`tune_scale` tried and chose.

    Attributes
    ----------
    scale : float
        The chosen scale (now set on the posterior).
    scales : list of float
        The candidates, in the order tried.
    log_likelihoods : list of float
        The validation log-likelihood per point of the model average at each candidate.
    """

    scale: float
    scales: List[float]
    log_likelihoods: List[float]


def _members(posterior, fn: str) -> list:
    """The posteriors whose scale is searched: ``posterior.members`` (a mixture) or ``[posterior]``."""
    members = getattr(posterior, "members", None)
    members = [posterior] if members is None else list(members)
    for member in members:
        if not (callable(getattr(member, "predictive", None)) and hasattr(member, "scale")):
            raise TypeError(
                f"{fn}: posterior must have a scale and a predictive() returning a SampledPredictive (a SWAG), or "
                f"hold such posteriors as members (a MultiSWAG), got {type(posterior).__name__}"
                + ("." if member is posterior else f" with a member of type {type(member).__name__}.")
            )
    return members


def _draws(predictives: List[SampledPredictive], num_samples: int, generator: torch.Generator):
    """Unscaled draws split evenly over the members: a list of (predictive, deviations of shape (S_m, D))."""
    out = []
    M = len(predictives)
    for m, predictive in enumerate(predictives):
        S_m = num_samples // M + (1 if m < num_samples % M else 0)
        if S_m:
            out.append((predictive, predictive.deviations(S_m, generator)))
    return out


@torch.no_grad()
def bma_log_likelihood(posterior, inputs, targets, likelihood="categorical", *, scale: Optional[float] = None,
                       num_samples: int = 30, noise_std=None, seed: int = 0) -> float:
    r"""Log-likelihood per point of the Bayesian model average on ``(inputs, targets)``.

    The model's output for ``inputs`` under sampled weights is scored by
    ``likelihood``; see :func:`tune_scale` for the arguments. ``scale`` defaults to the
    posterior's own.
    """
    scale = _members(posterior, "bma_log_likelihood")[0].scale if scale is None else scale
    return _scores(posterior, inputs, targets, likelihood, [scale], num_samples, noise_std, seed,
                   "bma_log_likelihood")[0]


@torch.no_grad()
def tune_scale(posterior, inputs, targets, likelihood: Union[str, Callable] = "categorical", *,
               scales: Optional[Sequence[float]] = None, num_samples: int = 30, noise_std=None,
               seed: int = 0) -> ScaleSearch:
    r"""Choose the posterior scale by the validation log-likelihood of the Bayesian model average.

    Parameters
    ----------
    posterior : SWAG, MultiSWAG or any posterior with a scale and a predictive
        An object with a settable ``scale`` and a ``predictive()`` returning a
        :class:`~pyro_fa.predictive.SampledPredictive` with a module, ``loc`` and
        ``deviations`` (e.g. a SWAG built from an ``nn.Module``), or one with
        ``members`` that are such objects (e.g. a MultiSWAG: the draws are split
        evenly over the members and one scale is chosen for all).
    inputs : Tensor or tuple of Tensors
        The validation inputs, passed to the module as ``module(*inputs)``.
    targets : Tensor of shape (N,)
        Class labels (``"categorical"``) or real values (``"gaussian"``).
    likelihood : {"categorical", "gaussian"} or callable, default "categorical"
        ``"categorical"``: the module returns logits of shape (N, C). ``"gaussian"``: it
        returns means of shape (N,) or (N, 1), and ``noise_std`` is the observation
        noise. A callable ``(output, targets) -> Tensor of shape (N,)`` gives the
        log-likelihood of each point under one draw.
    scales : sequence of float, optional
        Candidates; default :data:`DEFAULT_SCALES`, :math:`10^{-2}` to :math:`10^4` in
        half decades.
    num_samples : int, default 30
        Draws per candidate (the same draws for every candidate).
    noise_std : float or Tensor, optional
        For ``likelihood="gaussian"``.
    seed : int, default 0
        Seed of the draws.

    Returns
    -------
    ScaleSearch
        The chosen scale (set on the posterior), the candidates and their scores.

    Raises
    ------
    ValueError, TypeError
        A posterior without a scale and a predictive; empty or non-positive ``scales``, empty or mis-shaped ``targets`` (or class labels
        outside the model's logits), an unknown
        ``likelihood``, a missing ``noise_std``; the posterior is then unchanged.

    Notes
    -----
    Cost: ``len(scales) * num_samples`` forward passes over ``inputs``.
    """
    scales = list(DEFAULT_SCALES if scales is None else scales)
    scores = _scores(posterior, inputs, targets, likelihood, scales, num_samples, noise_std, seed, "tune_scale")
    finite = [(v, i) for i, v in enumerate(scores) if math.isfinite(v)]
    if not finite:
        raise RuntimeError("tune_scale: every candidate scale gave a non-finite log-likelihood; check the model's "
                           "output.")
    best = scales[max(finite)[1]]
    for member in _members(posterior, "tune_scale"):
        member.scale = best
    return ScaleSearch(best, scales, scores)


def _scores(posterior, inputs, targets, likelihood, scales: List[float], num_samples: int, noise_std, seed: int,
            fn: str) -> List[float]:
    """The model average's validation log-likelihood per point at each scale, with common draws."""
    predictives = [member.predictive() for member in _members(posterior, fn)]
    for predictive in predictives:
        if predictive.module is None:
            raise RuntimeError(f"{fn}: the posterior must be built from an nn.Module to run it under sampled "
                               "weights; use pyro.infer.Predictive with to_guide() for Pyro models.")
        if predictive.deviations is None:
            raise TypeError(f"{fn}: the posterior's predictive must give loc and deviations (a Gaussian over the "
                            "flattened weights) to be scaled, got a SampledPredictive without them.")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"{fn}: num_samples must be an integer >= 1, got {num_samples!r}.")
    if not scales:
        raise ValueError(f"{fn}: scales must hold at least one candidate, got none.")
    for s in scales:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s > 0):
            raise ValueError(f"{fn}: scales must be positive finite numbers, got {s!r}.")
    targets = check_targets(targets, None if callable(likelihood) else likelihood, fn)
    point_ll = point_log_likelihood(likelihood, noise_std, fn)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    ref = predictives[0].loc
    generator = torch.Generator(device=ref.device).manual_seed(seed)
    draws = _draws(predictives, num_samples, generator)
    y = targets.to(ref.device)
    scores = []
    for s in scales:
        lls = []
        for predictive, dev in draws:
            for delta in dev:
                theta = torch.add(predictive.loc, delta, alpha=math.sqrt(s))
                with predictive.network(theta) as net:
                    ll = point_ll(net(*inputs), y)
                if ll.shape != y.shape:
                    raise ValueError(f"{fn}: the likelihood must return one value per point, shape "
                                     f"{tuple(y.shape)!r}, got {tuple(ll.shape)!r}.")
                lls.append(ll.to(torch.float64))
        stacked = torch.stack(lls)  # (S, N)
        scores.append(float(log_mean_exp(stacked).mean()))
    return scores
