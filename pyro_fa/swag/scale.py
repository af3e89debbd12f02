r"""Choosing the scale of a SWAG / MultiSWAG posterior on validation data.

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
from torch import Tensor

__all__ = ["ScaleSearch", "tune_scale", "bma_log_likelihood", "DEFAULT_SCALES"]

DEFAULT_SCALES = tuple(float(10 ** (k / 2)) for k in range(-4, 9))  # 0.01, 0.032, ..., 1e4
_LIKELIHOODS = ("categorical", "gaussian")


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


def _members(posterior):
    from pyro_fa.swag.multiswag import MultiSWAG
    from pyro_fa.swag.swag import SWAG

    if isinstance(posterior, SWAG):
        return [posterior]
    if isinstance(posterior, MultiSWAG):
        return list(posterior.members)
    raise TypeError(f"tune_scale: posterior must be a SWAG or a MultiSWAG, got {type(posterior).__name__}.")


def _point_log_likelihood(likelihood, noise_std, fn: str) -> Callable[[Tensor, Tensor], Tensor]:
    if callable(likelihood):
        return likelihood
    if likelihood not in _LIKELIHOODS:
        raise ValueError(f"{fn}: likelihood must be one of {_LIKELIHOODS} or a callable (output, targets) -> "
                         f"per-point log-likelihood, got {likelihood!r}.")
    if likelihood == "categorical":
        def categorical(logits: Tensor, y: Tensor) -> Tensor:
            if logits.dim() != 2 or logits.shape[0] != y.shape[0]:
                raise ValueError(f"{fn}: the model's output must be logits of shape (N, C) with N={y.shape[0]}, got "
                                 f"{tuple(logits.shape)!r}.")
            C = logits.shape[-1]
            bad = (y < 0) | (y >= C)
            if bool(bad.any()):
                raise ValueError(f"{fn}: targets must be class labels in [0, {C}) for the model's {C} logits, got "
                                 f"{int(bad.sum())} outside, e.g. {y[bad][:5].tolist()!r}.")
            return logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return categorical
    if noise_std is None:
        raise ValueError(f"{fn}: noise_std must be given for likelihood='gaussian' (the observation noise's "
                         "standard deviation, a positive number or a tensor broadcasting to (N,)), got None.")
    noise = torch.as_tensor(noise_std)
    if not bool(torch.isfinite(noise).all()) or bool((noise <= 0).any()):
        raise ValueError(f"{fn}: noise_std must be positive and finite, got {noise_std!r}.")

    def gaussian(mean: Tensor, y: Tensor) -> Tensor:
        if mean.dim() == 2 and mean.shape[-1] == 1:
            mean = mean.squeeze(-1)
        if mean.shape != y.shape:
            raise ValueError(f"{fn}: the model's output must be means of shape ({y.shape[0]},) or "
                             f"({y.shape[0]}, 1), got {tuple(mean.shape)!r}.")
        sd = noise.to(mean)
        return -0.5 * ((y - mean) / sd).square() - sd.log() - 0.5 * math.log(2 * math.pi)
    return gaussian


def _check_targets(targets, likelihood, fn: str) -> Tensor:
    if not isinstance(targets, Tensor):
        raise TypeError(f"{fn}: targets must be a torch.Tensor of shape (N,), got {type(targets).__name__}.")
    if targets.dim() != 1 or targets.shape[0] == 0:
        raise ValueError(f"{fn}: targets must have shape (N,) with N >= 1, got {tuple(targets.shape)!r}."
                         + (" Flatten it (targets.reshape(-1))." if targets.dim() == 2 and targets.shape[1] == 1
                            else ""))
    if likelihood == "categorical" and (targets.is_floating_point() or targets.dtype == torch.bool):
        raise TypeError(f"{fn}: targets must hold integer class labels for likelihood='categorical', got dtype "
                        f"{targets.dtype}.")
    if likelihood == "gaussian" and not targets.is_floating_point():
        raise TypeError(f"{fn}: targets must be floating point for likelihood='gaussian', got dtype {targets.dtype}.")
    return targets


def _draws(members, num_samples: int, generator: torch.Generator):
    """Unscaled draws split evenly over the members: a list of (member, deviations of shape (S_m, D))."""
    out = []
    M = len(members)
    for m, member in enumerate(members):
        S_m = num_samples // M + (1 if m < num_samples % M else 0)
        if S_m:
            member._check_ready("tune_scale()")
            out.append((member, member._deviations(S_m, generator)))
    return out


@torch.no_grad()
def bma_log_likelihood(posterior, inputs, targets, likelihood="categorical", *, scale: Optional[float] = None,
                       num_samples: int = 30, noise_std=None, seed: int = 0) -> float:
    r"""Log-likelihood per point of the Bayesian model average on ``(inputs, targets)``.

    The model's output for ``inputs`` under sampled weights is scored by
    ``likelihood``; see :func:`tune_scale` for the arguments. ``scale`` defaults to the
    posterior's own.
    """
    scale = _members(posterior)[0].scale if scale is None else scale
    return _scores(posterior, inputs, targets, likelihood, [scale], num_samples, noise_std, seed,
                   "bma_log_likelihood")[0]


@torch.no_grad()
def tune_scale(posterior, inputs, targets, likelihood: Union[str, Callable] = "categorical", *,
               scales: Optional[Sequence[float]] = None, num_samples: int = 30, noise_std=None,
               seed: int = 0) -> ScaleSearch:
    r"""Choose the posterior scale by the validation log-likelihood of the Bayesian model average.

    Parameters
    ----------
    posterior : SWAG or MultiSWAG
        Built from an ``nn.Module`` (the model is run under sampled weights). For a
        MultiSWAG the draws are split evenly over the members and one scale is chosen
        for all.
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
        Empty or non-positive ``scales``, empty or mis-shaped ``targets`` (or class labels
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
    for member in _members(posterior):
        member.scale = best
    return ScaleSearch(best, scales, scores)


def _scores(posterior, inputs, targets, likelihood, scales: List[float], num_samples: int, noise_std, seed: int,
            fn: str) -> List[float]:
    """The model average's validation log-likelihood per point at each scale, with common draws."""
    members = _members(posterior)
    for member in members:
        if member._source.module is None:
            raise RuntimeError(f"{fn}: the posterior must be built from an nn.Module to run it under sampled "
                               "weights; use pyro.infer.Predictive with to_guide() for Pyro models.")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"{fn}: num_samples must be an integer >= 1, got {num_samples!r}.")
    if not scales:
        raise ValueError(f"{fn}: scales must hold at least one candidate, got none.")
    for s in scales:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s > 0):
            raise ValueError(f"{fn}: scales must be positive finite numbers, got {s!r}.")
    targets = _check_targets(targets, None if callable(likelihood) else likelihood, fn)
    point_ll = _point_log_likelihood(likelihood, noise_std, fn)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    ref = members[0].loc
    generator = torch.Generator(device=ref.device).manual_seed(seed)
    draws = _draws(members, num_samples, generator)
    y = targets.to(ref.device)
    scores = []
    for s in scales:
        lls = []
        for member, dev in draws:
            module = member._source.module
            for delta in dev:
                theta = torch.add(member.loc, delta, alpha=math.sqrt(s))
                with member.sampled_weights(theta):
                    ll = point_ll(module(*inputs), y)
                if ll.shape != y.shape:
                    raise ValueError(f"{fn}: the likelihood must return one value per point, shape "
                                     f"{tuple(y.shape)!r}, got {tuple(ll.shape)!r}.")
                lls.append(ll.to(torch.float64))
        stacked = torch.stack(lls)  # (S, N)
        bma = torch.logsumexp(stacked, 0) - math.log(stacked.shape[0])
        scores.append(float(bma.mean()))
    return scores
