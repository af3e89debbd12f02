r"""Fidelity of an approximate predictive to a reference one (full-batch HMC), and the deep-ensemble equivalent.

The metrics of the NeurIPS 2021 approximate-inference competition (Wilson, Izmailov, Hoffman et al. 2022), which
score an approximation by how close its test-set predictive is to HMC's (Izmailov, Vikram, Hoffman & Wilson
2021), as the competition's starter kit defines them (``izmailovpavel/neurips_bdl_starter_kit``,
``metrics.py``):

* :func:`agreement` — the fraction of test points whose most probable class is the reference's
  (the kit's ``agreement``; higher is better, 1 for a perfect match);
* :func:`total_variation` — the mean over test points of :math:`\tfrac12\sum_c |p_c - p^{\rm ref}_c|`
  (the kit's ``total_variation_distance``; 0 for a perfect match);
* :func:`competition_wasserstein` — the regression score: per test point, the 1-D Wasserstein distance
  between the empirical distributions of the approximation's and the reference's predictive samples
  (``scipy.stats.wasserstein_distance``), averaged over test points. The kit names it ``w2_distance`` but
  ``scipy.stats.wasserstein_distance`` is the first Wasserstein distance, and the kit returns its negation as
  a score (higher better) and requires 1000 samples per point; this function returns the distance itself for
  any sample counts.

:func:`predictive_wasserstein2` is the closed form for Gaussian predictives given by their moments (a mixture
is matched by its mean and variance first): per test point
:math:`W_2 = \sqrt{(\mu - \mu')^2 + (\sigma - \sigma')^2}`, averaged over test points.

:func:`deep_ensemble_equivalent` is Ashukha, Lyzhov, Molchanov & Vetrov (2020)'s DEE: the (real) number of
deep-ensemble members whose metric equals the method's, on the ensemble's metric curve over sizes 1..M
interpolated linearly.

References
----------
P. Izmailov, S. Vikram, M. D. Hoffman & A. G. Wilson (2021), *What are Bayesian neural network posteriors
really like?*, ICML.
A. G. Wilson, P. Izmailov, M. D. Hoffman, Y. Gal, Y. Li, M. F. Pradier, S. Vikram, A. Foong, S. Lotfi &
S. Farquhar (2022), *Evaluating approximate inference in Bayesian deep learning*, NeurIPS 2021 Competitions and
Demonstrations Track, PMLR 176.
A. Ashukha, A. Lyzhov, D. Molchanov & D. Vetrov (2020), *Pitfalls of in-domain uncertainty estimation and
ensembling in deep learning*, ICLR (section 4, the deep ensemble equivalent).
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import torch
from torch import Tensor

from pyro_fa.metrics._checks import check_finite, check_finite_number
from pyro_fa.metrics.classification import _probs

__all__ = ["agreement", "total_variation", "competition_wasserstein", "predictive_wasserstein2",
           "deep_ensemble_equivalent"]


def _pair(probs, ref_probs, fn: str):
    """Both predictives validated as probabilities, each averaged over its draws when (S, N, C); same (N, C)."""
    p, q = _probs(probs, fn, name="probs"), _probs(ref_probs, fn, name="ref_probs")
    p, q = (x.mean(0) if x.dim() == 3 else x for x in (p, q))
    if p.shape != q.shape:
        raise ValueError(f"{fn}: probs and ref_probs must have the same shape (N, C), got {tuple(p.shape)!r} and "
                         f"{tuple(q.shape)!r}.")
    return p, q.to(device=p.device, dtype=p.dtype)


def agreement(probs: Tensor, ref_probs: Tensor) -> Tensor:
    """The fraction of test points whose most probable class under ``probs`` is the reference's; a 0-dim tensor.

    Parameters
    ----------
    probs, ref_probs : Tensor of shape (N, C) or (S, N, C)
        Predictive probabilities (draws are averaged first: the model average is compared).

    Raises
    ------
    TypeError, ValueError
        When either is not a floating tensor of probabilities (finite, in [0, 1], summing to 1 over C), or their
        shapes differ.

    Examples
    --------
    >>> agreement(torch.tensor([[0.9, 0.1], [0.4, 0.6]]), torch.tensor([[0.6, 0.4], [0.7, 0.3]]))
    tensor(0.5000)
    """
    p, q = _pair(probs, ref_probs, "agreement")
    return (p.argmax(-1) == q.argmax(-1)).to(p.dtype).mean()


def total_variation(probs: Tensor, ref_probs: Tensor) -> Tensor:
    r"""Mean over test points of the total variation distance :math:`\tfrac12\sum_c |p_c - p^{\rm ref}_c|`.

    Parameters
    ----------
    probs, ref_probs : Tensor of shape (N, C) or (S, N, C)
        As for :func:`agreement`.

    Returns
    -------
    Tensor
        0-dim, in [0, 1].

    Raises
    ------
    TypeError, ValueError
        As :func:`agreement`.

    Examples
    --------
    >>> total_variation(torch.tensor([[0.9, 0.1], [0.4, 0.6]]), torch.tensor([[0.6, 0.4], [0.4, 0.6]]))
    tensor(0.1500)
    """
    p, q = _pair(probs, ref_probs, "total_variation")
    return 0.5 * (p - q).abs().sum(-1).mean()


def _samples(value, name: str, fn: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor of shape (N, S), got {type(value).__name__}.")
    if value.dim() != 2 or value.shape[0] < 1 or value.shape[1] < 1:
        raise ValueError(f"{fn}: {name} must have shape (N, S) (test points x samples), got {tuple(value.shape)!r}.")
    if not value.is_floating_point():
        raise TypeError(f"{fn}: {name} must be floating point, got dtype {value.dtype}.")
    return check_finite(value, name, fn)


def competition_wasserstein(samples: Tensor, ref_samples: Tensor) -> Tensor:
    r"""The competition's regression score: the mean over test points of the 1-D Wasserstein distance between
    the empirical distributions of ``samples`` and ``ref_samples`` (a 0-dim tensor; 0 for equal samples).

    .. math:: W_1(u, v) = \int_{-\infty}^{\infty} |F_u(t) - F_v(t)|\,dt,

    with :math:`F_u, F_v` the empirical CDFs, as ``scipy.stats.wasserstein_distance`` computes it (what the
    starter kit's ``w2_distance`` calls, then negates).

    Parameters
    ----------
    samples : Tensor of shape (N, S)
        S predictive samples at each of N test points (the kit asks for S = 1000).
    ref_samples : Tensor of shape (N, S')
        The reference's samples at the same points (S' may differ from S).

    Raises
    ------
    TypeError, ValueError
        When either is not a finite floating tensor of shape (N, S), or their N differ.

    Examples
    --------
    >>> competition_wasserstein(torch.tensor([[0.0, 1.0]]), torch.tensor([[2.0, 3.0]]))
    tensor(2.)
    """
    fn = "competition_wasserstein"
    u, v = _samples(samples, "samples", fn), _samples(ref_samples, "ref_samples", fn)
    if u.shape[0] != v.shape[0]:
        raise ValueError(f"{fn}: samples and ref_samples must have the same number of test points N, got "
                         f"{u.shape[0]} and {v.shape[0]}.")
    v = v.to(device=u.device, dtype=u.dtype)
    u, v = u.sort(-1).values, v.sort(-1).values
    both = torch.cat([u, v], -1).sort(-1).values
    deltas = both.diff(dim=-1)
    at = both[:, :-1].contiguous()
    cdf_u = torch.searchsorted(u, at, right=True).to(u.dtype) / u.shape[1]
    cdf_v = torch.searchsorted(v, at, right=True).to(u.dtype) / v.shape[1]
    return ((cdf_u - cdf_v).abs() * deltas).sum(-1).mean()


def _moments(mean, var, names, fn: str):
    """Mean and variance per point, shape (N,); components (S, N) matched by the mixture's two moments."""
    m_name, v_name = names
    for name, value in ((m_name, mean), (v_name, var)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor of shape (N,) or (S, N), got "
                            f"{type(value).__name__}.")
        if not value.is_floating_point():
            raise TypeError(f"{fn}: {name} must be floating point, got dtype {value.dtype}.")
        check_finite(value, name, fn)
    if mean.dim() not in (1, 2) or mean.shape[-1] < 1:
        raise ValueError(f"{fn}: {m_name} must have shape (N,) or (S, N), got {tuple(mean.shape)!r}.")
    if var.shape != mean.shape:
        raise ValueError(f"{fn}: {v_name} must have the shape of {m_name}, {tuple(mean.shape)!r}, got "
                         f"{tuple(var.shape)!r}.")
    if bool((var < 0).any()):
        raise ValueError(f"{fn}: {v_name} must be non-negative variances, got a minimum of {float(var.min())!r}.")
    if mean.dim() == 1:
        return mean, var
    m = mean.mean(0)
    return m, var.mean(0) + (mean - m).pow(2).mean(0)


def predictive_wasserstein2(mean: Tensor, var: Tensor, ref_mean: Tensor, ref_var: Tensor) -> Tensor:
    r"""Mean over test points of the 2-Wasserstein distance between Gaussian predictives given by moments.

    .. math:: W_2\big(N(\mu, \sigma^2), N(\mu', \sigma'^2)\big) = \sqrt{(\mu - \mu')^2 + (\sigma - \sigma')^2}.

    A Gaussian-mixture predictive (S components per point, as a model average over S draws) is first replaced
    by the Gaussian of its mean and variance, :math:`\bar\mu = \frac1S\sum_s\mu_s`,
    :math:`\bar\sigma^2 = \frac1S\sum_s(\sigma_s^2 + (\mu_s - \bar\mu)^2)`.

    Parameters
    ----------
    mean, var : Tensor of shape (N,) or (S, N)
        The approximation's predictive means and variances (per component when (S, N)).
    ref_mean, ref_var : Tensor of shape (N,) or (S', N)
        The reference's.

    Returns
    -------
    Tensor
        0-dim.

    Raises
    ------
    TypeError, ValueError
        On non-tensors, non-finite values, negative variances, a variance whose shape is not its mean's, or
        different N.

    Examples
    --------
    >>> predictive_wasserstein2(torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([3.0]), torch.tensor([25.0]))
    tensor(5.)
    """
    fn = "predictive_wasserstein2"
    m, v = _moments(mean, var, ("mean", "var"), fn)
    m_ref, v_ref = _moments(ref_mean, ref_var, ("ref_mean", "ref_var"), fn)
    if m.shape != m_ref.shape:
        raise ValueError(f"{fn}: mean and ref_mean must have the same number of test points N, got {m.shape[0]} "
                         f"and {m_ref.shape[0]}.")
    m_ref, v_ref = m_ref.to(device=m.device, dtype=m.dtype), v_ref.to(device=m.device, dtype=m.dtype)
    return ((m - m_ref).pow(2) + (v.sqrt() - v_ref.sqrt()).pow(2)).sqrt().mean()


def deep_ensemble_equivalent(value: float, ensemble_curve: Union[Sequence[float], Tensor],
                             higher_is_better: bool = True) -> float:
    r"""The deep ensemble equivalent (DEE) of a method's metric ``value``.

    .. math:: \mathrm{DEE} = \min\{\, l \in [1, M] : \mathrm{DE}(l) \ge \text{value} \,\},

    where :math:`\mathrm{DE}(k)` is the ensemble's metric at ``k`` members (``ensemble_curve[k - 1]``, sizes
    1..M) and :math:`\mathrm{DE}(l)` between two sizes is the straight line between them (Ashukha et al. 2020,
    section 4, on the test log-likelihood). A method no better than one member has DEE 1; one better than the
    whole curve has DEE ``inf`` (more members than were measured).

    Parameters
    ----------
    value : float
        The method's metric (e.g. its test log-likelihood).
    ensemble_curve : sequence of float or Tensor of shape (M,)
        The ensemble's metric at 1, 2, ..., M members.
    higher_is_better : bool, default True
        False for a metric to minimise (NLL, error, Brier): both are negated first.

    Returns
    -------
    float

    Raises
    ------
    TypeError, ValueError
        When ``value`` is not a finite number, or ``ensemble_curve`` is not a non-empty 1-D sequence of finite
        numbers.

    Examples
    --------
    >>> deep_ensemble_equivalent(-0.9, [-1.0, -0.8, -0.7])
    1.5
    """
    fn = "deep_ensemble_equivalent"
    value = check_finite_number(value, "value", fn)
    try:
        curve = torch.as_tensor(ensemble_curve, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{fn}: ensemble_curve must be a 1-D sequence of numbers (sizes 1..M), got "
                        f"{type(ensemble_curve).__name__}.") from None
    if curve.dim() != 1 or curve.numel() < 1:
        raise ValueError(f"{fn}: ensemble_curve must be 1-D with M >= 1 entries (sizes 1..M), got shape "
                         f"{tuple(curve.shape)!r}.")
    check_finite(curve, "ensemble_curve", fn)
    if not higher_is_better:
        curve, value = -curve, -value
    if value <= float(curve[0]):
        return 1.0
    for k in range(1, curve.numel()):
        lo, hi = float(curve[k - 1]), float(curve[k])
        if hi >= value:  # the first crossing: lo < value <= hi
            return k + (value - lo) / (hi - lo)
    return math.inf
