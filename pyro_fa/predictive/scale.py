r"""Choosing the scale of a posterior over a module's weights on validation data.

The spread of an optimizer's iterates is set by its learning rate and batch size
(Mandt, Hoffman & Blei 2017), not by the posterior it stands in for: SGD late in
training moves by about 1 % of the weights, and samples at that spread predict
like their mean (SWA). Maddox et al. (2019) sample
:math:`\theta = c + \sqrt{s}\,\delta` with :math:`\delta \sim N(0, FF^\top + \Psi)`
and choose :math:`s` on validation data. :func:`tune_scale` scores each candidate by the
per-point log-likelihood of the Bayesian model average,

.. math::

    \ell_i(s) = \log \frac1S \sum_{j=1}^S p\big(y_i \mid x_i, c + \sqrt{s}\,\delta_j\big),
    \qquad \mathcal L(s) = \frac1N \sum_{i=1}^N \ell_i(s),

with the same draws :math:`\delta_j` for every candidate (common random numbers:
the comparison between scales is not blurred by Monte Carlo noise). Scale 0, the
mean itself (SWA / MAP), is always a candidate, and the scale is chosen by a rule
that generalises from a small validation set (:func:`select_scale`): the default,
``"gated"``, keeps the mean unless the best scale's gain over it exceeds twice its *paired*
standard error, and then takes the smallest scale whose validation log-likelihood is within
one paired standard error of the best's (``"one_se"``, the default before).
"""
from __future__ import annotations

import inspect
import math
import warnings
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from pyro_fa.predictive.glm import check_pred_type
from pyro_fa.predictive.likelihood import check_targets, normalize_likelihood, point_log_likelihood
from pyro_fa.predictive.registry import DEFAULT_PRED_TYPE
from pyro_fa.predictive.sampled import SampledPredictive, log_mean_exp
from pyro_fa.predictive.scale_rules import RULES, SCALE_RULES, Curve
from pyro_fa._validation import check_scale

__all__ = ["ScaleSearch", "ScaleSelectionWarning", "tune_scale", "select_scale", "bma_log_likelihood",
           "DEFAULT_SCALES", "RULES"]

DEFAULT_SCALES = tuple(float(10 ** (k / 2)) for k in range(-4, 9))  # 0.01, 0.032, ..., 1e4 (scale 0 is added)
MIN_POINTS = 50  # fewer validation points than this: the choice is flagged as undecidable


class ScaleSelectionWarning(UserWarning):
    """The validation curve cannot support the choice of a scale: flat, too few points, or best at the edge."""


class ScaleSearch(NamedTuple):
    """What :func:`tune_scale` tried and chose.

    Attributes
    ----------
    scale : float
        The chosen scale (now set on the posterior); 0 is the mean (SWA / MAP).
    scales : list of float
        The candidates in increasing order, starting with 0 (the mean), including
        those added where the best sat at an edge of the grid.
    log_likelihoods : list of float
        :math:`\\mathcal L(s)`, the validation log-likelihood per point of the model average at each candidate.
    standard_errors : list of float
        The standard error of each :math:`\\mathcal L(s)` over the validation points.
    gain_standard_errors : list of float
        The paired standard error of each :math:`\\mathcal L(s) - \\mathcal L(0)` (the same points, common draws).
    rule : str
        The selection rule used (see :func:`select_scale`).
    gain : float
        :math:`\\mathcal L(\\hat s) - \\mathcal L(0)`: the chosen scale's validation gain over the mean, per point.
    reason : str
        Why this scale, in words.
    point_log_likelihoods : Tensor of shape (len(scales), N), optional
        The :math:`\\ell_i(s)` themselves, float64.
    temperatures : list of float, optional
        With ``tune_scale(..., temperature=True)``: the temperature fitted on the validation
        points at each candidate (Guo et al. 2017); the log-likelihoods above are then those of
        the tempered model average. ``None`` otherwise.
    """

    scale: float
    scales: List[float]
    log_likelihoods: List[float]
    standard_errors: List[float] = []
    gain_standard_errors: List[float] = []
    rule: str = "argmax"
    gain: float = 0.0
    reason: str = ""
    point_log_likelihoods: Optional[Tensor] = None
    temperatures: Optional[List[float]] = None

    @property
    def temperature(self) -> float:
        """The temperature fitted at the chosen scale (1.0 when the search was not tempered)."""
        if self.temperatures is None:
            return 1.0
        return float(self.temperatures[list(self.scales).index(self.scale)])

    def plot(self, ax=None):
        """Plot the validation curve with one-standard-error bars and mark the chosen scale.

        Scale 0 (the mean) is drawn as a dashed horizontal line; the candidates on a log axis.

        Parameters
        ----------
        ax : matplotlib Axes, optional
            Default: a new figure's axes.

        Returns
        -------
        matplotlib Axes
        """
        if ax is None:
            import matplotlib.pyplot as plt  # lazily: plotting is optional

            ax = plt.figure(figsize=(5, 3.2)).gca()
        pos = [i for i, s in enumerate(self.scales) if s > 0]
        ses = self.standard_errors or [0.0] * len(self.scales)
        ax.errorbar([self.scales[i] for i in pos], [self.log_likelihoods[i] for i in pos],
                    yerr=[ses[i] for i in pos], marker="o", ms=3, capsize=2, label="model average")
        if 0.0 in self.scales:
            ax.axhline(self.log_likelihoods[self.scales.index(0.0)], ls="--", c="gray", label="mean (scale 0)")
        if self.scale > 0:
            ax.axvline(self.scale, c="C3", lw=1, label=f"chosen {self.scale:.3g} ({self.rule})")
        else:
            ax.plot([], [], c="C3", label=f"chosen: the mean ({self.rule})")
        ax.set_xscale("log")
        ax.set_xlabel("scale s")
        ax.set_ylabel("validation log-likelihood / point" + (" (tempered)" if self.temperatures else ""))
        ax.legend(fontsize="small")
        return ax


def select_scale(scales: Sequence[float], point_log_likelihoods: Tensor, rule: str = "gated", *,
                 fraction: float = 0.7, num_se: float = 1.5) -> Tuple[int, str]:
    r"""Choose a scale from per-point validation log-likelihoods.

    With :math:`d_i(s) = \ell_i(s) - \ell_i(0)` the per-point gain over the mean,
    :math:`g(s)` its mean and :math:`\mathrm{se}(s)` its paired standard error over the
    N points:

    * ``"gated"`` (default): the mean (scale 0) unless the best scale's gain over it exceeds twice its
      paired standard error, :math:`g(\hat s) > 2\,\mathrm{se}(\hat s)`; then ``"one_se"``'s choice.
      The one-SE step back, entered only on a significant gain. Chosen by measurement
      (``benchmarks/bench_scale_rule.py``, ``benchmarks/bench_scale_rule_classify.py``; figures in
      ``benchmarks/results/measurements_from_docstrings.md``).
    * ``"one_se"`` (the default before): with :math:`\hat s = \arg\max_s \mathcal L(s)` (0 included), the
      smallest candidate :math:`s` with :math:`\mathcal L(\hat s) - \mathcal L(s) \le
      \mathrm{se}_i\big(\ell_i(\hat s) - \ell_i(s)\big)`, the *paired* standard error of the
      difference (the same points and draws; Hastie, Tibshirani & Friedman, *The elements of
      statistical learning*, 2009, §7.10, with the paired error in place of the best's own).
      The mean (scale 0) is chosen whenever the best gain over it is within its paired
      standard error. The test curve's optimum tends to sit at or below the validation
      optimum, with a steep cliff above it: the smallest scale that the validation points
      cannot tell from the best keeps clear of it (``benchmarks/bench_scale_rule.py``).
      (A standard error of :math:`\mathcal L` itself rather than of the paired difference
      is an order of magnitude larger and picks the mean nearly always.)
    * ``"fraction"``: :math:`s^\dagger = \arg\max_{s > 0}\, g(s) - z\,\mathrm{se}(s)`
      (:math:`z` = ``num_se``), the scale whose gain has the best lower confidence bound;
      the mean (scale 0) when :math:`g(s^\dagger) \le \mathrm{se}(s^\dagger)` (no gain beyond its
      paired standard error); else the smallest scale with
      :math:`g(s) \ge` ``fraction`` :math:`\cdot g(s^\dagger)`. The test curve's optimum tends
      to sit at or below the validation optimum, with a steep cliff above it where the
      per-point gains turn heavy-tailed (a few points lose much): the lower bound steers
      away from such noisy gains, and stepping back to 70 % of the gain keeps most of it
      clear of the cliff (``fraction`` = 0.7 and ``num_se`` = 1.5 measured best of this
      family in ``docs/swag.md``).
    * ``"argmax"``: the candidate (0 included) with the highest :math:`\mathcal L(s)`.
    * ``"significant"``: :math:`s^\ast = \arg\max_{s > 0} g(s)` when
      :math:`g(s^\ast) > 2\,\mathrm{se}(s^\ast)`, else the mean.

    Parameters
    ----------
    scales : sequence of float
        Candidates in increasing order, the first 0 (the mean).
    point_log_likelihoods : Tensor of shape (len(scales), N)
        :math:`\ell_i(s)` per candidate and point.
    rule : {"gated", "one_se", "fraction", "argmax", "significant"}, default "gated"
    fraction : float in (0, 1], default 0.7
        For ``"fraction"``.
    num_se : float >= 0, default 1.5
        For ``"fraction"``: the lower bound's multiple of the standard error.

    Returns
    -------
    (int, str)
        The index of the chosen candidate, and why, in words.

    Raises
    ------
    ValueError
        An unknown ``rule``, ``fraction`` outside (0, 1], a negative ``num_se``, scales not increasing from 0, or a
        ``point_log_likelihoods`` of the wrong shape or with no finite row.

    Examples
    --------
    >>> L = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-0.5, -0.6, -0.5, -0.6], [-0.45, -0.55, -0.4, -0.5]])
    >>> select_scale([0.0, 1.0, 10.0], L)[0], select_scale([0.0, 1.0, 10.0], L, "fraction")[0]
    (2, 1)
    """
    _check_rule("select_scale", rule, fraction, num_se)
    scales = [float(s) for s in scales]
    if not scales or scales[0] != 0.0 or any(b <= a for a, b in zip(scales, scales[1:])):
        raise ValueError(f"select_scale: scales must increase from 0 (the mean), got {scales!r}.")
    L = torch.as_tensor(point_log_likelihoods, dtype=torch.float64)
    if L.dim() != 2 or L.shape[0] != len(scales) or L.shape[1] == 0:
        raise ValueError(f"select_scale: point_log_likelihoods must have shape ({len(scales)}, N) with N >= 1, got "
                         f"{tuple(L.shape)!r}.")
    N = L.shape[1]
    finite = torch.isfinite(L).all(1)
    if not bool(finite[0]):
        raise ValueError("select_scale: the mean (scale 0) must have a finite log-likelihood at every point; check "
                         "the model's output.")
    mean = L.mean(1).where(finite, L.new_tensor(-math.inf))
    d = L - L[0]
    gain = d.mean(1).where(finite, L.new_tensor(-math.inf))
    se = (d.std(1, unbiased=True) / math.sqrt(N)).nan_to_num(0.0) if N > 1 else d.new_zeros(len(scales))
    return SCALE_RULES[rule].choose(Curve(scales, L, N, finite, mean, gain, se, fraction, num_se))


def _stacklevel() -> int:
    """The ``warnings.warn`` stacklevel of the first caller outside pyro_fa (``SWAG.tune_scale`` calls
    :func:`tune_scale`: the warning names the user's line either way)."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    no_grad = os.path.join("torch", "utils", "_contextlib.py")  # torch.no_grad's decorator frame
    frame, level = sys._getframe(1), 1
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(root)
                                 or frame.f_code.co_filename.endswith(no_grad)):
        frame, level = frame.f_back, level + 1
    return level


def _check_rule(fn: str, rule, fraction, num_se) -> None:
    if rule not in RULES:
        raise ValueError(f"{fn}: rule must be one of {RULES}, got {rule!r}.")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"{fn}: fraction must be a number in (0, 1], got {fraction!r}.")
    if isinstance(num_se, bool) or not isinstance(num_se, (int, float)) or not (math.isfinite(num_se) and num_se >= 0):
        raise ValueError(f"{fn}: num_se must be a finite number >= 0, got {num_se!r}.")


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


def _predictives(members, pred_type: str, fn: str) -> List[SampledPredictive]:
    """Each member's predictive: ``predictive()`` for ``"nn"``, ``predictive(pred_type=...)`` otherwise."""
    check_pred_type(fn, pred_type)
    out = []
    for member in members:
        try:
            params = inspect.signature(member.predictive).parameters
        except (TypeError, ValueError):  # a builtin without a signature: let the call decide
            params = {"pred_type": None}
        if "pred_type" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
            out.append(member.predictive(pred_type=pred_type))
            continue
        if pred_type != DEFAULT_PRED_TYPE:  # predictive() without arguments gives the default one only
            raise TypeError(f"{fn}: pred_type={pred_type!r} needs a posterior whose predictive() takes pred_type, "
                            f"got {type(member).__name__}.predictive() without it; use pred_type='nn'.")
        out.append(member.predictive())
    return out


def _draws(predictives: List[SampledPredictive], num_samples: int, generator: torch.Generator):
    """Unscaled draws split evenly over the members: a list of (predictive, deviations of shape (S_m, D))."""
    out = []
    M = len(predictives)
    for m, predictive in enumerate(predictives):
        S_m = num_samples // M + (1 if m < num_samples % M else 0)
        if S_m:
            out.append((predictive, predictive.deviations(S_m, generator)))
    return out


def _check_scales(scales, fn: str) -> List[float]:
    scales = list(scales)
    for s in scales:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s >= 0):
            raise ValueError(f"{fn}: scales must be finite numbers >= 0, got {s!r}.")
    if not any(s > 0 for s in scales):
        raise ValueError(f"{fn}: scales must hold at least one positive candidate (0, the mean, is always added), "
                         f"got {scales!r}.")
    return sorted({0.0, *map(float, scales)})


@torch.no_grad()
def bma_log_likelihood(posterior, inputs, targets, likelihood="classification", *, scale: Optional[float] = None,
                       num_samples: int = 30, noise_std=None, seed: int = 0, pred_type: str = "nn") -> float:
    r"""Log-likelihood per point of the Bayesian model average on ``(inputs, targets)``.

    The model's output for ``inputs`` under sampled weights is scored by
    ``likelihood``; see :func:`tune_scale` for the arguments. ``scale`` defaults to the
    posterior's own (for a mixture, its members' common scale: members at different scales
    are refused); at scale 0 the model average is the mean's prediction (one forward
    pass per member).
    """
    fn = "bma_log_likelihood"
    if scale is None:  # the posterior's own: one for all members (each member's draws are scored at it)
        own = sorted({float(m.scale) for m in _members(posterior, fn)})
        if len(own) > 1:
            raise ValueError(f"{fn}: the members' scales differ, got {own!r}; set one (posterior.scale = value) or "
                             "pass scale=.")
        scale = own[0]
    check_scale(fn, scale)
    likelihood = normalize_likelihood(fn, likelihood, allow_callable=True)
    scorer = _Scorer(posterior, inputs, targets, likelihood, num_samples, noise_std, seed, pred_type, fn)
    return float(scorer(float(scale)).mean())


@torch.no_grad()
def tune_scale(posterior, inputs, targets, likelihood: Union[str, Callable] = "classification", *,
               scales: Optional[Sequence[float]] = None, num_samples: int = 30, noise_std=None,
               seed: int = 0, rule: str = "gated", fraction: float = 0.7, num_se: float = 1.5, widen: int = 3,
               pred_type: str = "nn", temperature: bool = False) -> ScaleSearch:
    r"""Choose the posterior scale on validation data, never worse there than the mean (scale 0).

    Every candidate, and scale 0 (the posterior mean's own prediction: SWA, MAP), is
    scored by the per-point validation log-likelihood of the Bayesian model average on
    common draws; :func:`select_scale` applies ``rule``. When the best positive scale sits
    at an end of the grid, up to ``widen`` more candidates are tried beyond it, one grid
    step (the ratio of the two nearest candidates) at a time.

    Parameters
    ----------
    posterior : SWAG, MultiSWAG, FactorLaplace or any posterior with a scale and a predictive
        An object with a settable ``scale`` (0 allowed) and a ``predictive()`` returning a
        :class:`~pyro_fa.predictive.SampledPredictive` with a module, ``loc`` and
        ``deviations`` (e.g. a SWAG built from an ``nn.Module``, a fitted FactorLaplace), or one with
        ``members`` that are such objects (e.g. a MultiSWAG: the draws are split
        evenly over the members and one scale is chosen for all; scale 0 is then the
        ensemble of the members' means).
    inputs : Tensor or tuple of Tensors
        The validation inputs, passed to the module as ``module(*inputs)``.
    targets : Tensor of shape (N,)
        Class labels (``"classification"``) or real values (``"regression"``).
    likelihood : {"classification", "regression"} or callable, default "classification"
        ``"classification"``: the module returns logits of shape (N, C). ``"regression"``: it
        returns means of shape (N,) or (N, 1), and ``noise_std`` is the observation
        noise. The aliases ``"categorical"`` and ``"gaussian"`` are accepted
        (:func:`~pyro_fa.predictive.normalize_likelihood`). A callable ``(output, targets) -> Tensor
        of shape (N,)`` gives the log-likelihood of each point under one draw.
    scales : sequence of float, optional
        Candidates (>= 0; 0 is always added); default :data:`DEFAULT_SCALES`,
        :math:`10^{-2}` to :math:`10^4` in half decades.
    num_samples : int, default 30
        Draws per candidate (the same draws for every candidate).
    noise_std : float or Tensor, optional
        For ``likelihood="regression"``.
    seed : int, default 0
        Seed of the draws. They come from a CPU generator and move to the posterior's device, so one seed
        gives the same draws, the same curve up to round-off and the same choice on every device (a CUDA
        generator's stream differs from the CPU's).
    rule : {"gated", "one_se", "fraction", "argmax", "significant"}, default "gated"
        See :func:`select_scale`; ``"argmax"`` is the previous behaviour (with the mean a candidate).
    fraction : float, default 0.7
        For ``rule="fraction"``.
    num_se : float, default 1.5
        For ``rule="fraction"``: the lower confidence bound's multiple of the standard error.
    widen : int, default 3
        At most this many candidates added beyond an edge of the grid where the best sits.
    pred_type : {"nn", "glm"}, default "nn"
        ``"nn"``: sampled networks (``predictive()``); otherwise the posterior's
        ``predictive(pred_type=pred_type)`` (e.g. the linearised network).
    temperature : bool, default False
        Score each candidate (the mean included) *after* temperature scaling: the model
        average's log class probabilities divided by the temperature of least validation NLL
        at that candidate (:func:`~pyro_fa.predictive.fit_temperature`; Guo et al., "On
        calibration of modern neural networks", 2017), for a user who will temper the
        predictive anyway. Without it the posterior's spread is also asked to cure the
        network's overconfidence, which one temperature cures at no cost in accuracy: on an
        overconfident network the raw rule then picks a large scale that loses accuracy, and
        the tempered model average at that scale is worse than the tempered mean's (MNIST-1D
        MLP, ``docs/swag.md``). The fitted temperatures are kept in
        :attr:`ScaleSearch.temperatures`; :attr:`ScaleSearch.temperature` is the chosen one,
        to divide the model average's log probabilities by (e.g. with
        :class:`~pyro_fa.predictive.TemperatureScaling`). ``likelihood="classification"`` only.

    Returns
    -------
    ScaleSearch
        The chosen scale (set on the posterior), the candidates, their scores and standard
        errors, the rule, the gain over the mean and the reason.

    Raises
    ------
    ValueError, TypeError
        A posterior without a scale and a predictive (or one whose ``predictive()`` does
        not take ``pred_type`` when that is not ``"nn"``); negative ``scales``, an unknown
        ``rule`` or ``pred_type``, empty or mis-shaped ``targets`` (or class labels outside
        the model's logits), an unknown ``likelihood``, a missing ``noise_std``; the
        posterior is then unchanged.
    RuntimeError
        The mean's own prediction (scale 0) has a non-finite log-likelihood at some point.

    Warns
    -----
    ScaleSelectionWarning
        Fewer than 50 validation points; no scale beating the mean by more than its paired
        standard error (the mean is chosen); the best scale still at the grid's upper edge
        after widening.

    Notes
    -----
    Cost: ``(len(scales) + widened) * num_samples`` forward passes over ``inputs``, plus one
    per member for scale 0.
    """
    fn = "tune_scale"
    members = _members(posterior, fn)
    grid = _check_scales(DEFAULT_SCALES if scales is None else scales, fn)
    _check_rule(fn, rule, fraction, num_se)
    if isinstance(widen, bool) or not isinstance(widen, int) or widen < 0:
        raise ValueError(f"{fn}: widen must be an integer >= 0, got {widen!r}.")
    if not isinstance(temperature, bool):
        raise ValueError(f"{fn}: temperature must be True or False, got {temperature!r}.")
    likelihood = normalize_likelihood(fn, likelihood, allow_callable=True)
    if temperature and likelihood != "classification":
        raise ValueError(f"{fn}: temperature=True needs likelihood='classification' (a temperature on class "
                         f"probabilities), got likelihood={likelihood!r}.")
    scorer = _Scorer(posterior, inputs, targets, likelihood, num_samples, noise_std, seed, pred_type, fn,
                     temperature)
    rows = {s: scorer(s) for s in grid}
    for _ in range(widen):  # one grid step beyond an edge where the best positive scale sits
        pos = [s for s in sorted(rows) if s > 0]
        if len(pos) < 2:
            break
        means = {s: float(rows[s].mean()) for s in pos}
        top = max(pos, key=lambda s: means[s])
        if top == pos[-1]:
            new = pos[-1] * pos[-1] / pos[-2]
        elif top == pos[0] and means[top] > float(rows[0.0].mean()):
            new = pos[0] * pos[0] / pos[1]
        else:
            break
        rows[new] = scorer(new)
    cands = sorted(rows)
    L = torch.stack([rows[s] for s in cands])  # (n, N)
    if not bool(torch.isfinite(L[0]).all()):
        raise RuntimeError(f"{fn}: the mean (scale 0) gives a non-finite log-likelihood; check the model's output.")
    i, reason = select_scale(cands, L, rule, fraction=fraction, num_se=num_se)
    N = L.shape[1]
    d = L - L[0]
    se = (L.std(1) / math.sqrt(N)).nan_to_num(0.0) if N > 1 else L.new_zeros(len(cands))
    gse = (d.std(1) / math.sqrt(N)).nan_to_num(0.0) if N > 1 else L.new_zeros(len(cands))
    means = L.mean(1)
    search = ScaleSearch(cands[i], cands, means.tolist(), se.tolist(), gse.tolist(), rule,
                         float(means[i] - means[0]), reason, L,
                         [scorer.temperatures[c] for c in cands] if temperature else None)
    best_pos = max(range(1, len(cands)), key=lambda j: float(means[j]))
    if N < MIN_POINTS:
        warnings.warn(f"{fn}: {N} validation points are too few to tell scales apart reliably (fewer than "
                      f"{MIN_POINTS}); chose {search.scale:.3g} by {reason}.", ScaleSelectionWarning, stacklevel=_stacklevel())
    elif search.scale == 0.0 and SCALE_RULES[rule].flat_when_mean:
        warnings.warn(f"{fn}: the validation curve is flat: {reason}.", ScaleSelectionWarning, stacklevel=_stacklevel())
    if best_pos == len(cands) - 1 and float(means[best_pos]) > float(means[0]):
        warnings.warn(f"{fn}: the best scale is still the largest tried ({cands[-1]:.3g}) after widening the grid by "
                      f"{widen}; pass larger scales= to see the curve fall.", ScaleSelectionWarning, stacklevel=_stacklevel())
    for member in members:
        member.scale = search.scale
    return search


class _Scorer:
    """Per-point model-average log-likelihoods :math:`\\ell_i(s)` at any scale, on one set of common draws."""

    def __init__(self, posterior, inputs, targets, likelihood, num_samples, noise_std, seed, pred_type, fn,
                 temperature: bool = False):
        predictives = _predictives(_members(posterior, fn), pred_type, fn)
        for predictive in predictives:
            if predictive.module is None:
                raise RuntimeError(f"{fn}: the posterior must be built from an nn.Module to run it under sampled "
                                   "weights; use pyro.infer.Predictive with to_guide() for Pyro models.")
            if predictive.deviations is None:
                raise TypeError(f"{fn}: the posterior's predictive must give loc and deviations (a Gaussian over the "
                                "flattened weights) to be scaled, got a SampledPredictive without them.")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"{fn}: num_samples must be an integer >= 1, got {num_samples!r}.")
        targets = check_targets(targets, None if callable(likelihood) else likelihood, fn)
        self.point_ll = point_log_likelihood(likelihood, noise_std, fn)
        self.inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        ref = predictives[0].loc
        # a CPU generator: the same draws, hence the same choice, on every device (pyro_fa._random moves them)
        generator = torch.Generator().manual_seed(seed)
        self.draws = _draws(predictives, num_samples, generator)
        self.y = targets.to(ref.device)
        self.fn = fn
        self.temperature = temperature
        self.temperatures = {}  # scale -> the temperature fitted there (temperature=True)

    def _run(self, predictive, theta) -> Tensor:
        with predictive.network(theta) as net:
            ll = self.point_ll(net(*self.inputs), self.y)
        if ll.shape != self.y.shape:
            raise ValueError(f"{self.fn}: the likelihood must return one value per point, shape "
                             f"{tuple(self.y.shape)!r}, got {tuple(ll.shape)!r}.")
        return ll.to(torch.float64)

    def _run_log_probs(self, predictive, theta) -> Tensor:
        with predictive.network(theta) as net:
            logits = net(*self.inputs)
        if logits.dim() != 2 or logits.shape[0] != self.y.shape[0]:
            raise ValueError(f"{self.fn}: the module must return logits of shape (N, C) with N = "
                             f"{self.y.shape[0]}, got {tuple(logits.shape)!r}.")
        return logits.to(torch.float64).log_softmax(-1)

    def _tempered(self, s: float) -> Tensor:
        """The tempered model average's :math:`\\ell_i(s)`: log class probabilities averaged over the draws,
        divided by the temperature of least NLL on these points (kept in ``self.temperatures``)."""
        from pyro_fa.predictive.temperature import fit_temperature

        logs = self._per_draw(s, self._run_log_probs)
        average = log_mean_exp(logs)  # (N, C)
        t = fit_temperature(average, self.y)
        self.temperatures[s] = t
        return (average / t).log_softmax(-1).gather(-1, self.y[:, None]).squeeze(-1)

    def __call__(self, s: float) -> Tensor:
        """:math:`\\ell_i(s)`, float64 of shape (N,); scale 0: one forward pass per member at its mean."""
        if self.temperature:
            return self._tempered(s)
        return log_mean_exp(self._per_draw(s, self._run))

    def _per_draw(self, s: float, run) -> Tensor:
        """``run(predictive, theta)`` at every draw scaled by ``s``, stacked (S, ...); scale 0: one run per
        member at its mean, repeated for its share of the draws."""
        out = []
        for predictive, dev in self.draws:
            if s == 0.0:
                r = run(predictive, predictive.loc)
                out.append(r.unsqueeze(0).expand(dev.shape[0], *r.shape))
                continue
            for delta in dev:
                out.append(run(predictive, torch.add(predictive.loc, delta, alpha=math.sqrt(s))).unsqueeze(0))
        return torch.cat(out)
