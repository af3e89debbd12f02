r"""Post-hoc temperature scaling of a classifier's (or a model average's) log class probabilities.

Guo, Pleiss, Sun & Weinberger ("On calibration of modern neural networks", ICML 2017, §4.2)
divide the logits by one temperature :math:`T > 0` fitted on validation data:

.. math::

    \hat T = \arg\min_{T > 0}\; -\frac1N \sum_{i=1}^N \log \mathrm{softmax}(z_i / T)_{y_i}.

For a posterior the "logits" are the model average's log class probabilities,
:math:`z_i = \log \frac1S \sum_s \mathrm{softmax}(f_{\theta_s}(x_i))` (any additive constant per
point cancels in the softmax), so one recipe serves SWAG, MultiSWAG, a
:class:`~pyro_fa.nn.BayesianNetwork` and a MAP network alike. With :math:`\beta = 1/T` the
objective :math:`\frac1N\sum_i \mathrm{logsumexp}(\beta z_i) - \beta z_{i y_i}` is convex in
:math:`\beta` (its second derivative is the mean variance of :math:`z_i` under
:math:`\mathrm{softmax}(\beta z_i)`), so a safeguarded Newton iteration on :math:`\beta`
finds the global minimum.
"""
from __future__ import annotations

import math
from typing import Callable, Tuple

import torch
from torch import Tensor

from pyro_fa.predictive.likelihood import check_targets

__all__ = ["fit_temperature", "TemperatureScaling"]


def _check_logits(fn: str, logits, targets) -> Tuple[Tensor, Tensor]:
    if not isinstance(logits, Tensor):
        raise TypeError(f"{fn}: log_probs_or_logits must be a torch.Tensor of shape (N, C), got "
                        f"{type(logits).__name__}.")
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"{fn}: log_probs_or_logits must have shape (N, C) with C >= 2, got {tuple(logits.shape)!r}.")
    if bool(torch.isnan(logits).any()) or bool((logits == math.inf).any()):
        raise ValueError(f"{fn}: log_probs_or_logits must not hold NaN or +inf (-inf is a class ruled out), got "
                         f"{int((torch.isnan(logits) | (logits == math.inf)).sum())} such entries.")
    targets = check_targets(targets, "classification", fn)
    if targets.shape[0] != logits.shape[0]:
        raise ValueError(f"{fn}: targets must have one label per row of log_probs_or_logits ({logits.shape[0]}), got "
                         f"{targets.shape[0]}.")
    C = logits.shape[1]
    bad = (targets < 0) | (targets >= C)
    if bool(bad.any()):
        raise ValueError(f"{fn}: targets must be class labels in [0, {C}), got {int(bad.sum())} outside, e.g. "
                         f"{targets[bad][:5].tolist()!r}.")
    z = logits.detach().to(torch.float64)
    zy = z.gather(1, targets.to(z.device).unsqueeze(1)).squeeze(1)
    if not bool(torch.isfinite(zy).all()):
        raise ValueError(f"{fn}: every target's class must have a finite log-probability (no temperature makes a "
                         "ruled-out class likely), got -inf at some targets.")
    return z, zy


def _nll_and_derivatives(beta: float, z: Tensor, zy: Tensor):
    """Mean NLL of softmax(beta z) and its first two derivatives in beta (Guo et al. 2017 with beta = 1/T)."""
    s = beta * z
    p = s.softmax(-1)
    zf = z.masked_fill(~torch.isfinite(z), 0.0)  # p = 0 there: 0 * z counts as 0
    ez = (p * zf).sum(-1)
    var = (p * zf.square()).sum(-1) - ez.square()
    nll = (torch.logsumexp(s, -1) - beta * zy).mean()
    return float(nll), float((ez - zy).mean()), float(var.clamp_min(0).mean())


def fit_temperature(log_probs_or_logits: Tensor, targets: Tensor, *, min_temperature: float = 1e-2,
                    max_temperature: float = 1e2, tol: float = 1e-10, max_iter: int = 200) -> float:
    r"""The temperature :math:`T` minimising the NLL of :math:`\mathrm{softmax}(z / T)` on validation data.

    Parameters
    ----------
    log_probs_or_logits : Tensor of shape (N, C)
        A network's logits, or a model average's log class probabilities (``-inf`` allowed
        for a class ruled out, but not at a target).
    targets : Tensor of shape (N,)
        Integer class labels in ``[0, C)``.
    min_temperature, max_temperature : float, default 0.01 and 100
        The search interval; the optimum is clipped to it.
    tol : float, default 1e-10
        Stop when the step in :math:`1/T` is below ``tol`` times :math:`1/T`.
    max_iter : int, default 200

    Returns
    -------
    float
        :math:`\hat T`. Divide the logits by it (:class:`TemperatureScaling` does).

    Raises
    ------
    TypeError
        Not a Tensor; float targets.
    ValueError
        Wrong shapes, NaN / +inf, labels outside ``[0, C)``, a target at ``-inf``, or a bad interval.

    Notes
    -----
    Safeguarded Newton on :math:`\beta = 1/T` over the bracket
    :math:`[1/T_{\max}, 1/T_{\min}]` (convex objective: the global minimum); each
    iteration costs O(NC).

    Examples
    --------
    >>> z = torch.tensor([[4.0, 0.0], [0.0, 4.0], [4.0, 0.0], [4.0, 0.0]])
    >>> round(fit_temperature(z, torch.tensor([0, 1, 1, 0])), 3)  # one error in four: p = 3/4 wants e^(4/T) = 3
    3.641
    """
    fn = "fit_temperature"
    for name, v in (("min_temperature", min_temperature), ("max_temperature", max_temperature)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"{fn}: {name} must be a positive finite number, got {v!r}.")
    if not min_temperature < max_temperature:
        raise ValueError(f"{fn}: min_temperature must be below max_temperature, got {min_temperature!r} and "
                         f"{max_temperature!r}.")
    z, zy = _check_logits(fn, log_probs_or_logits, targets)
    lo, hi = 1.0 / max_temperature, 1.0 / min_temperature
    if _nll_and_derivatives(lo, z, zy)[1] >= 0:
        return float(max_temperature)
    if _nll_and_derivatives(hi, z, zy)[1] <= 0:
        return float(min_temperature)
    beta = min(max(1.0, lo), hi)
    for _ in range(max_iter):
        _, d1, d2 = _nll_and_derivatives(beta, z, zy)
        if d1 > 0:
            hi = beta
        else:
            lo = beta
        step = d1 / d2 if d2 > 0 else math.inf
        new = beta - step
        if not lo < new < hi:  # Newton left the bracket: bisect
            new = 0.5 * (lo + hi)
        if abs(new - beta) <= tol * beta:
            beta = new
            break
        beta = new
    return 1.0 / beta


class TemperatureScaling:
    r"""A predictor of logits (or of a model average's log class probabilities), temperature-scaled.

    ``predict`` is any callable returning a Tensor of shape (N, C): a MAP network itself,
    ``swag.predict_log_proba``, ``multiswag.predict_log_proba``, ``laplace.predict_log_proba`` (any
    :class:`~pyro_fa.predictive.Posterior`'s), a
    :class:`~pyro_fa.nn.BayesianNetwork`'s ``predict_log_proba``. For a sampled model average, fix
    its draws (pass a seeded ``generator``, e.g. with :func:`functools.partial`) so that
    validation and test see the same model.

    Parameters
    ----------
    predict : callable
        ``predict(*inputs) -> Tensor of shape (N, C)``.

    Attributes
    ----------
    temperature : float
        1 until :meth:`fit`.

    Examples
    --------
    >>> net = torch.nn.Linear(3, 4)
    >>> x, y = torch.randn(200, 3), torch.randint(4, (200,))
    >>> scaled = TemperatureScaling(net).fit(x, y)
    >>> scaled.log_proba(x).shape
    torch.Size([200, 4])
    """

    def __init__(self, predict: Callable[..., Tensor]):
        if not callable(predict):
            raise TypeError(f"TemperatureScaling: predict must be callable (inputs -> logits of shape (N, C)), got "
                            f"{type(predict).__name__}.")
        self.predict = predict
        self.temperature = 1.0

    @torch.no_grad()
    def fit(self, inputs, targets: Tensor, **kwargs) -> "TemperatureScaling":
        """Fit :attr:`temperature` on validation data; ``kwargs`` go to :func:`fit_temperature`.

        Parameters
        ----------
        inputs : Tensor or tuple of Tensors
            Passed as ``predict(*inputs)``.
        targets : Tensor of shape (N,)

        Returns
        -------
        TemperatureScaling
            ``self``; on a refusal :attr:`temperature` is unchanged.
        """
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self.temperature = fit_temperature(self.predict(*inputs), targets, **kwargs)
        return self

    @torch.no_grad()
    def log_proba(self, *inputs) -> Tensor:
        r""":math:`\log \mathrm{softmax}(z / T)` of shape (N, C), in the predictor's dtype."""
        z = self.predict(*inputs)
        return (z / self.temperature).log_softmax(-1)

    def proba(self, *inputs) -> Tensor:
        r""":math:`\mathrm{softmax}(z / T)` of shape (N, C)."""
        return self.log_proba(*inputs).exp()

    __call__ = log_proba

    def __repr__(self) -> str:
        return f"TemperatureScaling(temperature={self.temperature:.4g})"
