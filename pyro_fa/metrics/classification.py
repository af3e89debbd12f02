r"""Metrics of classifiers' predictive distributions (re-exported by :mod:`pyro_fa.metrics`).

Predictions are class probabilities: a tensor of shape (N, C), or predictive
samples of shape (S, N, C), one (N, C) block per posterior draw
:math:`\theta_s`. The Bayesian model average (BMA) is

.. math::

    \bar p(y \mid x) = \frac1S \sum_{s=1}^S p(y \mid x, \theta_s),

and every metric of a prediction is the metric of :math:`\bar p`. Targets are
integer class labels of shape (N,).
"""
from __future__ import annotations

import torch
from torch import Tensor

from pyro_fa.metrics._checks import check_finite

__all__ = [
    "bma_probs", "accuracy", "negative_log_likelihood", "brier_score", "expected_calibration_error",
    "predictive_entropy", "mutual_information", "ood_auroc",
]


def _probs(probs, fn: str, *, samples: bool = False, name: str = "probs") -> Tensor:
    """Validate probabilities of shape (N, C) or (S, N, C); return them as given (float)."""
    if not isinstance(probs, Tensor):
        raise TypeError(
            f"{fn}: {name} must be a torch.Tensor of shape (N, C) or (S, N, C), got {type(probs).__name__}."
        )
    shapes = "(S, N, C)" if samples else "(N, C) or (S, N, C)"
    if probs.dim() not in ((3,) if samples else (2, 3)) or probs.shape[-1] < 2 or probs.shape[-2] < 1:
        raise ValueError(f"{fn}: {name} must have shape {shapes} with C >= 2 classes, got {tuple(probs.shape)!r}.")
    if not probs.is_floating_point():
        raise TypeError(f"{fn}: {name} must be floating point, got dtype {probs.dtype}.")
    check_finite(probs, name, fn)
    if bool((probs < 0).any()) or bool((probs > 1).any()):
        raise ValueError(f"{fn}: {name} must lie in [0, 1], got values from {float(probs.min()):.4g} to "
                         f"{float(probs.max()):.4g}. Pass probabilities (e.g. logits.softmax(-1)), not logits.")
    tol = max(1e-4, 50 * torch.finfo(probs.dtype).eps * probs.shape[-1])
    err = float((probs.sum(-1) - 1).abs().max())
    if err > tol:
        raise ValueError(f"{fn}: {name} must sum to 1 over the last axis (classes), got sums off by up to {err:.3g}.")
    return probs


def _targets(targets, n: int, c: int, fn: str) -> Tensor:
    if not isinstance(targets, Tensor):
        raise TypeError(f"{fn}: targets must be a torch.Tensor of class labels of shape (N,), got "
                        f"{type(targets).__name__}.")
    if targets.dim() != 1 or targets.shape[0] != n:
        raise ValueError(f"{fn}: targets must have shape ({n},) like the predictions' N, got {tuple(targets.shape)!r}."
                         + (" Flatten it (targets.reshape(-1))." if targets.numel() == n else ""))
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"{fn}: targets must hold integer class labels, got dtype {targets.dtype}.")
    if n and (int(targets.min()) < 0 or int(targets.max()) >= c):
        raise ValueError(f"{fn}: targets must be class labels in [0, {c}), got values from {int(targets.min())} to "
                         f"{int(targets.max())}.")
    return targets


def bma_probs(probs: Tensor) -> Tensor:
    """The Bayesian model average: ``probs`` of shape (N, C) as given, (S, N, C) averaged over S."""
    probs = _probs(probs, "bma_probs")
    return probs.mean(0) if probs.dim() == 3 else probs


def _prepare(probs, targets, fn: str):
    p = _probs(probs, fn)
    p = p.mean(0) if p.dim() == 3 else p
    y = _targets(targets, p.shape[0], p.shape[1], fn)
    return p, y.to(p.device)


def accuracy(probs: Tensor, targets: Tensor) -> Tensor:
    """Fraction of inputs whose most probable class (under the BMA) is the target; a 0-dim tensor."""
    p, y = _prepare(probs, targets, "accuracy")
    return (p.argmax(-1) == y).to(p.dtype).mean()


def negative_log_likelihood(probs: Tensor, targets: Tensor) -> Tensor:
    r"""Mean negative log-probability of the targets under the BMA, :math:`-\frac1N\sum_i \log\bar p(y_i\mid x_i)`.

    A zero probability of a target gives the log of the dtype's smallest normal
    number instead of infinity.
    """
    p, y = _prepare(probs, targets, "negative_log_likelihood")
    py = p.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return -py.clamp_min(torch.finfo(p.dtype).tiny).log().mean()


def brier_score(probs: Tensor, targets: Tensor) -> Tensor:
    r"""Multiclass Brier score :math:`\frac1N\sum_i\sum_c(\bar p_{ic} - [y_i = c])^2` (Brier 1950), in [0, 2]."""
    p, y = _prepare(probs, targets, "brier_score")
    onehot = torch.nn.functional.one_hot(y, p.shape[-1]).to(p.dtype)
    return (p - onehot).square().sum(-1).mean()


def expected_calibration_error(probs: Tensor, targets: Tensor, n_bins: int = 15) -> Tensor:
    r"""Top-label expected calibration error with equal-width confidence bins (Guo et al. 2017, eq. 3).

    .. math::

        \mathrm{ECE} = \sum_{b=1}^{B} \frac{|I_b|}{N}\,\big|\mathrm{acc}(I_b) - \mathrm{conf}(I_b)\big|,

    where :math:`I_b` holds the inputs whose confidence :math:`\max_c \bar p_{ic}` falls in
    :math:`((b-1)/B, b/B]`, acc is the fraction of them classified correctly and conf their
    mean confidence. The same binning as the SWAG paper's and torchmetrics'
    ``MulticlassCalibrationError(norm="l1")``.

    Parameters
    ----------
    probs : Tensor of shape (N, C) or (S, N, C)
    targets : Tensor of shape (N,), integer class labels
    n_bins : int, default 15
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"expected_calibration_error: n_bins must be an integer >= 1, got {n_bins!r}.")
    p, y = _prepare(probs, targets, "expected_calibration_error")
    conf, pred = p.max(-1)
    correct = (pred == y).to(p.dtype)
    # bin b holds (b/B, (b+1)/B]; a confidence of exactly 0 (impossible for C classes) joins bin 0
    idx = (torch.ceil(conf * n_bins) - 1).clamp(0, n_bins - 1).long()
    count = torch.zeros(n_bins, dtype=p.dtype, device=p.device).index_add_(0, idx, torch.ones_like(conf))
    acc = torch.zeros_like(count).index_add_(0, idx, correct)
    cnf = torch.zeros_like(count).index_add_(0, idx, conf)
    return (acc - cnf).abs().sum() / max(p.shape[0], 1)


def _entropy(p: Tensor) -> Tensor:
    return -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(-1)


def predictive_entropy(probs: Tensor) -> Tensor:
    r"""Entropy of the BMA per input, :math:`H[\bar p(\cdot\mid x_i)]` in nats; shape (N,).

    The total uncertainty; a common score for out-of-distribution detection.
    """
    p = _probs(probs, "predictive_entropy")
    return _entropy(p.mean(0) if p.dim() == 3 else p)


def mutual_information(samples: Tensor) -> Tensor:
    r"""Mutual information between the label and the weights per input, in nats; shape (N,).

    .. math::

        I[y; \theta \mid x] = H[\bar p(\cdot\mid x)] - \frac1S\sum_s H[p(\cdot\mid x, \theta_s)],

    the epistemic part of the predictive entropy (Houlsby et al. 2011, "BALD"); needs
    predictive samples of shape (S, N, C). It is zero when all samples agree.
    """
    p = _probs(samples, "mutual_information", samples=True, name="samples")
    return (_entropy(p.mean(0)) - _entropy(p).mean(0)).clamp_min(0.0)


def ood_auroc(scores_in: Tensor, scores_out: Tensor) -> Tensor:
    r"""Area under the ROC curve for telling out-of-distribution inputs from in-distribution ones by a score.

    Higher scores should mean "more likely out of distribution" (e.g.
    :func:`predictive_entropy`). The AUROC is the probability that an OOD input scores
    higher than an in-distribution one, ties counting one half (the Mann–Whitney
    statistic); 0.5 is chance, 1 perfect. Equal to scikit-learn's
    ``roc_auc_score`` with the OOD inputs as the positive class.

    Parameters
    ----------
    scores_in : Tensor of shape (N_in,)
    scores_out : Tensor of shape (N_out,)
    """
    fn = "ood_auroc"
    for name, s in (("scores_in", scores_in), ("scores_out", scores_out)):
        if not isinstance(s, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor of shape (N,), got {type(s).__name__}.")
        if s.dim() != 1 or s.shape[0] == 0:
            raise ValueError(f"{fn}: {name} must have shape (N,) with N >= 1, got {tuple(s.shape)!r}.")
        check_finite(s, name, fn)
    dtype = torch.float64
    scores = torch.cat([scores_in.to(dtype), scores_out.to(dtype).to(scores_in.device)])
    # average ranks (ties share the mean of their ranks), then the Mann-Whitney U of the OOD scores
    sorted_scores, order = scores.sort()
    ranks = torch.empty_like(sorted_scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=dtype, device=scores.device)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(dtype)
    mean_rank = ends - (counts.to(dtype) - 1) / 2  # mean of the ranks ends-count+1 .. ends
    ranks[order] = mean_rank[inverse]
    n_in, n_out = scores_in.shape[0], scores_out.shape[0]
    u = ranks[n_in:].sum() - n_out * (n_out + 1) / 2
    return u / (n_in * n_out)

