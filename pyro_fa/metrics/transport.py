"""Scores between an approximation's draws and reference draws, the way the Pathfinder paper scores posteriordb.

All inputs are draws in the posterior's unconstrained space, rows are draws, columns coordinates (N, D).

* :func:`wasserstein1` — exact 1-Wasserstein distance between two equal-size empirical measures (optimal
  assignment on the Euclidean cost, :func:`scipy.optimize.linear_sum_assignment`);
* :func:`wasserstein1_floor` — the reference against itself on disjoint halves (what W1 reads for a perfect fit);
* :func:`debiased_wasserstein1` — the cross distance minus the mean of the two self distances (disjoint halves);
* :func:`marginal_errors` — each marginal's mean error in reference standard deviations and s.d. ratio;
* :func:`pareto_khat` — the Pareto shape k̂ of the importance ratios p/q (PSIS; ArviZ's ``psislw``).

References
----------
L. Zhang, B. Carpenter, A. Gelman & A. Vehtari (2022), *Pathfinder: parallel quasi-Newton variational
inference*, JMLR 23(306), Section 4 (the 1-Wasserstein distance over 100 reference and 100 approximate draws).
Y. Yao, A. Vehtari, D. Simpson & A. Gelman (2018), *Yes, but did it work?: evaluating variational inference*,
ICML (k̂ < 0.7 usable).
A. Vehtari, D. Simpson, A. Gelman, Y. Yao & J. Gabry (2024), *Pareto smoothed importance sampling*, JMLR 25(72).
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

__all__ = [
    "wasserstein1",
    "wasserstein1_floor",
    "debiased_wasserstein1",
    "marginal_errors",
    "pareto_khat",
    "psis_log_weights",
]


def _as_draws(name: str, x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"{name}: draws must be an array of shape (N, D) with N >= 1, got shape {x.shape!r}.")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: draws must be finite, got {int((~np.isfinite(x)).sum())} non-finite entries.")
    return x


def wasserstein1(x, y) -> float:
    r"""Exact 1-Wasserstein distance between the empirical measures of ``x`` and ``y`` (equal sizes).

    .. math:: W_1 = \min_{\pi} \frac1N \sum_i \lVert x_i - y_{\pi(i)} \rVert_2

    over permutations :math:`\pi` (for uniform weights on equal-size sets an optimal plan is a permutation,
    Birkhoff–von Neumann). Solved by :func:`scipy.optimize.linear_sum_assignment`, :math:`O(N^3)`.

    Parameters
    ----------
    x, y : array_like or Tensor, shape (N, D) (or (N,) for D = 1)

    Returns
    -------
    float

    Raises
    ------
    ValueError
        If the draws are not finite 2-D arrays of the same shape.
    """
    from scipy.optimize import linear_sum_assignment
    from scipy.spatial.distance import cdist

    x = _as_draws("wasserstein1", x)
    y = _as_draws("wasserstein1", y)
    if x.shape != y.shape:
        raise ValueError(f"wasserstein1: x and y must have the same shape, got {x.shape!r} and {y.shape!r}.")
    cost = cdist(x, y)
    rows, cols = linear_sum_assignment(cost)
    return float(cost[rows, cols].mean())


def _halves(name: str, draws, n: Optional[int], rng: np.random.Generator):
    draws = _as_draws(name, draws)
    N = draws.shape[0]
    if n is None:
        n = N // 2
    if n < 1 or 2 * n > N:
        raise ValueError(f"{name}: n must be an integer from 1 to N // 2 = {N // 2}, got {n!r}.")
    idx = rng.permutation(N)
    return draws[idx[:n]], draws[idx[n:2 * n]]


def wasserstein1_floor(reference, n: Optional[int] = None, *, seed: int = 0) -> float:
    """W1 between two disjoint random halves of ``n`` draws each of ``reference``: what :func:`wasserstein1`
    reads, at this sample size, for an approximation that is exact.

    Parameters
    ----------
    reference : array_like, shape (N, D)
    n : int, optional
        Draws per half; default ``N // 2``.
    seed : int, default 0
        Seeds the random split.

    Raises
    ------
    ValueError
        If ``n`` is not from 1 to ``N // 2``.
    """
    a, b = _halves("wasserstein1_floor", reference, n, np.random.default_rng(seed))
    return wasserstein1(a, b)


def debiased_wasserstein1(approx, reference, n: Optional[int] = None, *, seed: int = 0) -> Dict[str, float]:
    r"""A debiased empirical 1-Wasserstein distance, on disjoint halves.

    Split ``approx`` into disjoint random halves :math:`Q_1, Q_2` and ``reference`` into :math:`P_1, P_2`,
    ``n`` draws each. Then

    .. math::
        W_{\mathrm{cross}} = \tfrac12\,[W_1(Q_1, P_1) + W_1(Q_2, P_2)], \quad
        W_{\mathrm{self}} = \tfrac12\,[W_1(Q_1, Q_2) + W_1(P_1, P_2)], \quad
        W_{\mathrm{debiased}} = W_{\mathrm{cross}} - W_{\mathrm{self}},

    every distance between two sets of ``n`` independent draws (the same sample size, so the same
    :math:`O(n^{-1/D})` bias to first order). For :math:`q = p` its expectation is 0; it can be negative.
    Unlike the plain :math:`W_1(Q, P)`, it does not reward a :math:`q` that is too narrow: a narrow :math:`q`
    has a small :math:`W_1(Q_1, Q_2)`, and that is subtracted. (This is the 1-Wasserstein analogue of the
    Sinkhorn-divergence debiasing :math:`S(\alpha,\beta) = W(\alpha,\beta) - \frac12 W(\alpha,\alpha) -
    \frac12 W(\beta,\beta)`, Feydy et al. 2019, with the self terms on disjoint halves so that they are not 0.)

    Parameters
    ----------
    approx, reference : array_like, shape (N_q, D) and (N_p, D)
    n : int, optional
        Draws per half; default ``min(N_q, N_p) // 2``.
    seed : int, default 0

    Returns
    -------
    dict
        ``w1_cross``, ``w1_self_q``, ``w1_self_p``, ``w1_debiased``.

    Raises
    ------
    ValueError
        If ``n`` is larger than half of either set or the dimensions differ.
    """
    q = _as_draws("debiased_wasserstein1", approx)
    p = _as_draws("debiased_wasserstein1", reference)
    if q.shape[1] != p.shape[1]:
        raise ValueError(f"debiased_wasserstein1: approx and reference must have the same dimension, got "
                         f"{q.shape[1]} and {p.shape[1]}.")
    if n is None:
        n = min(q.shape[0], p.shape[0]) // 2
    rng = np.random.default_rng(seed)
    q1, q2 = _halves("debiased_wasserstein1", q, n, rng)
    p1, p2 = _halves("debiased_wasserstein1", p, n, rng)
    cross = 0.5 * (wasserstein1(q1, p1) + wasserstein1(q2, p2))
    self_q = wasserstein1(q1, q2)
    self_p = wasserstein1(p1, p2)
    return {"w1_cross": cross, "w1_self_q": self_q, "w1_self_p": self_p,
            "w1_debiased": cross - 0.5 * (self_q + self_p)}


def marginal_errors(approx, reference) -> Dict[str, np.ndarray]:
    """Each marginal's mean error in reference standard deviations and its standard-deviation ratio.

    Returns
    -------
    dict
        ``mean_error`` (D,): ``|mean_q - mean_p| / sd_p``; ``sd_ratio`` (D,): ``sd_q / sd_p`` (1 is exact);
        and the summaries ``max_mean_error``, ``max_log_sd_ratio`` (the largest ``|log sd_q / sd_p|``).
    """
    q = _as_draws("marginal_errors", approx)
    p = _as_draws("marginal_errors", reference)
    if q.shape[1] != p.shape[1]:
        raise ValueError(f"marginal_errors: approx and reference must have the same dimension, got "
                         f"{q.shape[1]} and {p.shape[1]}.")
    sd_p = p.std(axis=0, ddof=1)
    mean_error = np.abs(q.mean(axis=0) - p.mean(axis=0)) / sd_p
    sd_ratio = (q.std(axis=0, ddof=1) if q.shape[0] > 1 else np.zeros(q.shape[1])) / sd_p
    with np.errstate(divide="ignore"):
        log_ratio = np.abs(np.log(sd_ratio))
    return {"mean_error": mean_error, "sd_ratio": sd_ratio, "max_mean_error": float(mean_error.max()),
            "max_log_sd_ratio": float(log_ratio.max())}


def psis_log_weights(log_ratios):
    """Pareto-smoothed log importance weights (normalised) and k̂, by ArviZ's ``psislw``.

    Parameters
    ----------
    log_ratios : array_like, shape (S,)
        ``log p(z_s) - log q(z_s)`` (p may be unnormalised).

    Returns
    -------
    (ndarray of shape (S,), float)
        Normalised smoothed log weights (logsumexp 0) and k̂.

    Raises
    ------
    ValueError
        If the ratios are not a 1-D array of at least 2 values (non-finite ratios count as -inf weight).
    """
    import warnings

    from arviz import psislw

    lr = np.asarray(log_ratios.detach().cpu().double().numpy() if hasattr(log_ratios, "detach") else log_ratios,
                    dtype=np.float64)
    if lr.ndim != 1 or lr.shape[0] < 2:
        raise ValueError(f"psis_log_weights: log_ratios must be a 1-D array of at least 2 values, got shape "
                         f"{lr.shape!r}.")
    lr = np.where(np.isnan(lr), -np.inf, lr)
    finite = np.isfinite(lr)
    if not finite.any():
        return np.full_like(lr, -np.log(lr.shape[0])), float("inf")
    lr = np.where(finite, lr, lr[finite].min() - 1e3)  # ArviZ refuses -inf: a negligible weight instead
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ArviZ warns on k-hat > 0.7; the caller reports k-hat
        lw, k = psislw(lr - lr.max())
    return np.asarray(lw, dtype=np.float64), float(k)


def pareto_khat(log_ratios) -> float:
    """The Pareto shape k̂ of the importance ratios ``exp(log_ratios)`` (PSIS, Vehtari et al. 2024).

    k̂ < 0.5: the importance sampler has finite variance; k̂ < 0.7: usable (Yao et al. 2018); larger: the
    approximation ``q`` misses part of ``p``'s mass.

    Parameters
    ----------
    log_ratios : array_like, shape (S,)
        ``log p(z_s) - log q(z_s)``, ``z_s ~ q``.
    """
    return psis_log_weights(log_ratios)[1]
