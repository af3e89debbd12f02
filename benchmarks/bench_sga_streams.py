"""Online SGA against batch FA on the SGD-iterate streams of ``bench_swag_streams.py`` (issue 29, item 2).

The streams are recorded once by :func:`bench_swag_streams.make_streams`; each variant is fed the same
vectors and its covariance :math:`FF^\\top + \\Psi` is compared with the iterates' empirical covariance
:math:`S` by :math:`\\|FF^\\top+\\Psi - S\\|_F / \\|S\\|_F`, printed as a ratio to batch FA's distance
(scikit-learn's ``FactorAnalysis``). The bar of the issue is 1.5.

Variants (``lib`` rows run the library; the others are reference implementations written here, in the
stream's dtype, one vector at a time, so that a variant can be judged before it is built into
:mod:`pyro_fa.fa.fitters.sga`):

- ``sga lr=...``: ``SWAG(..., method="sga", lr=...)`` (the library's fused Adam on the gradient of one
  vector's log-likelihood, eqs. 4.24-4.26 of Brownlie 2021, in standardised coordinates, Polyak average);
- ``sga natural step=...``: ``SWAG(..., method="sga", optimizer="natural", optimizer_kwargs={"step": ...})``,
  the library's EM-preconditioned gradient step on the log-likelihood of the running moments
  (:mod:`pyro_fa.fa.fitters.sga_natural`; the exact scatter where :math:`D \\le 3K`, the linear model);
- ``natural SA``: one natural-gradient (EM-preconditioned) step per vector in parameter space,
  :math:`F \\leftarrow F + \\gamma_t (d m^\\top - F\\,E[hh^\\top])\\bar H^{-1}`, :math:`\\gamma_t = a/(t+a-1)`,
  :math:`\\psi` moment-matched to the exact running variances;
- ``moments + Adam``: Adam on the gradient of the Gaussian log-likelihood of the running moments,
  :math:`C^{-1}(SC^{-1}F - F)`, with :math:`SC^{-1}F` kept as a running :math:`D\\times K` statistic
  :math:`\\bar A` (each vector seen through the factor of its time);
- ``EM start + moments Adam``: the same after ``em_phase`` vectors of online EM (a warm start);
- ``moments, EM step eta``: the EM-preconditioned step :math:`F \\leftarrow F + \\eta(F_{EM} - F)` on the
  same statistic, with :math:`F_{EM}` the expanded factor :math:`\\bar A L^{-\\top}` (in the *new* latent
  coordinates) and the statistics left in the old ones for :math:`\\eta < 1`: a mismatch of coordinates
  that the library's step corrects; :math:`\\eta = 1` is online EM itself (step 1/t, the SWAG default).

    python benchmarks/bench_sga_streams.py --quick      # linear T=480, MLP T=300/1000, yacht T=1000
    python benchmarks/bench_sga_streams.py              # all streams of bench_swag_streams.py
    python benchmarks/bench_sga_streams.py --variants "lib sga natural step=1" "lib sga natural step=0.5"
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Dict, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_swag_streams import Stream, empirical_covariance, feed, make_streams, relative_distance  # noqa: E402


def _orthogonal(D: int, K: int, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(D, K, generator=g, dtype=torch.float64))[0].to(dtype)


def natural_sa(X: torch.Tensor, K: int, warmup: int = 10, a: float = 2.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-vector natural-gradient stochastic approximation in parameter space (reference implementation).

    In coordinates standardised by the running standard deviations; returns (F, psi) in the data's units.
    """
    T, D = X.shape
    dtype = X.dtype
    eye = torch.eye(K, dtype=dtype)
    mean, sq = torch.zeros(D, dtype=torch.float64), torch.zeros(D, dtype=torch.float64)
    F = _orthogonal(D, K, dtype)
    F = F / F.norm(dim=1, keepdim=True) * math.sqrt(0.5)
    psi, H = torch.full((D,), 0.5, dtype=dtype), eye.clone()
    s = torch.ones(D, dtype=dtype)
    for t in range(1, T + 1):
        x = X[t - 1].double()
        delta = x - mean
        mean += delta / t
        sq += delta * (x - mean)
        if t <= warmup:
            continue
        var = (sq / t).to(dtype)
        s = var.sqrt().clamp_min(torch.finfo(dtype).tiny)
        d = (x - mean).to(dtype) / s
        Fp = F / psi[:, None]
        L = torch.linalg.cholesky(eye + F.T @ Fp)
        m = torch.cholesky_solve((Fp.T @ d)[:, None], L)[:, 0]
        E = torch.cholesky_inverse(L) + torch.outer(m, m)
        k = t - warmup
        gam = min(1.0, a / (k + a - 1))
        H = (1 - gam) * H + gam * E
        F = F + gam * torch.cholesky_solve((torch.outer(d, m) - F @ E).T, torch.linalg.cholesky(H)).T
        psi = torch.clamp(1.0 - ((F @ H) * F).sum(1), min=1e-4)
    return (F @ torch.linalg.cholesky(H)) * s[:, None], psi * s**2


def moments_ascent(X: torch.Tensor, K: int, warmup: int = 10, step: str = "adam", lr: float = 1e-2,
                   eta: float = 1.0, em_phase: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ascent on the log-likelihood of the running moments through the statistic :math:`\\bar A \\approx SC^{-1}F`.

    ``step="adam"``: Adam (lr in units of the running standard deviations) on
    :math:`C^{-1}(\\bar A - F)` and on :math:`\\log\\psi`; ``step="em"``: the EM-preconditioned
    step of size ``eta`` (PX-EM's factor :math:`\\bar A L^{-\\top}`, :math:`\\bar H = LL^\\top`); the first
    ``em_phase`` vectors always take the full EM step (a warm start). Statistics with step 1/t (SWAG's).
    """
    T, D = X.shape
    dtype = X.dtype
    eye = torch.eye(K, dtype=dtype)
    mean, sq = torch.zeros(D, dtype=torch.float64), torch.zeros(D, dtype=torch.float64)
    F, psi = _orthogonal(D, K, dtype), torch.ones(D, dtype=dtype)
    A, H = torch.zeros(D, K, dtype=dtype), torch.zeros(K, K, dtype=dtype)
    adam = [torch.zeros(D, K, dtype=dtype), torch.zeros(D, K, dtype=dtype), torch.zeros(D, dtype=dtype),
            torch.zeros(D, dtype=dtype)]
    n_adam = 0
    for t in range(1, T + 1):
        x = X[t - 1].double()
        delta = x - mean
        mean += delta / t
        sq += delta * (x - mean)
        var = (sq / t).to(dtype)
        d = (x - mean).to(dtype)
        if 2 <= t <= warmup and t & (t - 1) == 0:  # the warm-up's rescaling to the data's units, as EM's
            F = F / F.norm(dim=1, keepdim=True).clamp_min(torch.finfo(dtype).tiny) * (0.5 * var).sqrt()[:, None]
            psi = (0.5 * var).clamp_min(torch.finfo(dtype).tiny)
        Fp = F / psi[:, None]
        L = torch.linalg.cholesky(eye + F.T @ Fp)
        Minv = torch.cholesky_inverse(L)
        m = Minv @ (Fp.T @ d)
        gam = 1.0 / t
        A = (1 - gam) * A + gam * torch.outer(d, m)
        H = (1 - gam) * H + gam * (Minv + torch.outer(m, m))
        if t <= warmup:
            continue
        floor = (1e-4 * var).clamp_min(torch.finfo(dtype).tiny)
        if step == "em" or t <= em_phase:
            e = 1.0 if t <= em_phase else eta
            F_em = torch.linalg.solve_triangular(torch.linalg.cholesky(H), A.T, upper=False).T
            F = F + e * (F_em - F)
            psi = torch.maximum(psi + e * (var - (F_em**2).sum(1) - psi), floor)
            if e == 1.0:  # PX-EM moves the statistics to the new latent coordinates
                A, H = F.clone(), eye.clone()
            continue
        R = A - F
        gF = (R - F @ (Minv @ (Fp.T @ R))) / psi[:, None]
        e2 = var - 2 * (F * A).sum(1) + ((F @ H) * F).sum(1)
        glp = 0.5 * (e2 / psi - 1)
        n_adam += 1
        b1, b2 = 0.9, 0.999
        s = var.sqrt()
        for i, g in ((0, gF * s[:, None]), (2, glp)):  # F in units of the running standard deviation
            adam[i].mul_(b1).add_(g, alpha=1 - b1)
            adam[i + 1].mul_(b2).addcmul_(g, g, value=1 - b2)
        upd = lambda i: lr * (adam[i] / (1 - b1**n_adam)) / ((adam[i + 1] / (1 - b2**n_adam)).sqrt() + 1e-8)
        F = F + upd(0) * s[:, None]
        psi = torch.maximum(psi * upd(2).exp(), floor)
    return F, psi


def _lib(lr: float) -> Callable[[Stream], Tuple[np.ndarray, np.ndarray]]:
    def fit(stream):
        swag = feed(stream, "sga", lr=lr)
        return swag.cov_factor.double().numpy(), swag.cov_diag.double().numpy()
    return fit


def _lib_natural(step: float) -> Callable[[Stream], Tuple[np.ndarray, np.ndarray]]:
    def fit(stream):
        swag = feed(stream, "sga", optimizer="natural", optimizer_kwargs={"step": step})
        return swag.cov_factor.double().numpy(), swag.cov_diag.double().numpy()
    return fit


def _ref(fn, **kw) -> Callable[[Stream], Tuple[np.ndarray, np.ndarray]]:
    def fit(stream):
        F, psi = fn(torch.from_numpy(stream.iterates).to(stream.dtype), stream.rank, **kw)
        return F.double().numpy(), psi.double().numpy()
    return fit


VARIANTS: Dict[str, Callable] = {
    "lib sga lr=1e-3 (SWAG default)": _lib(1e-3),
    "lib sga lr=1e-2": _lib(1e-2),
    "lib sga lr=3e-2": _lib(3e-2),
    "lib sga natural step=1": _lib_natural(1.0),
    "lib sga natural step=0.8": _lib_natural(0.8),
    "lib sga natural step=0.5": _lib_natural(0.5),
    "natural SA (a=2)": _ref(natural_sa),
    "moments + Adam 1e-2": _ref(moments_ascent, step="adam", lr=1e-2),
    "EM start 300 + moments Adam 1e-3": _ref(moments_ascent, step="adam", lr=1e-3, em_phase=300),
    "moments, EM step eta=0.5": _ref(moments_ascent, step="em", eta=0.5),
    "moments, EM step eta=1 (= online EM)": _ref(moments_ascent, step="em", eta=1.0),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="linear T=480, MLP T=300/1000, yacht T=1000")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    streams = make_streams(dtypes=(dtype,), quick=args.quick)
    from sklearn.decomposition import FactorAnalysis

    head = ["network", "stream", "batch FA"] + args.variants
    print("Covariance distance to S as a multiple of batch FA's (bar: 1.5), " + args.dtype)
    print()
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---" for _ in head) + " |")
    for s in streams:
        S = empirical_covariance(s.iterates)
        fa = FactorAnalysis(n_components=s.rank).fit(s.iterates)
        batch = relative_distance(fa.components_.T, fa.noise_variance_, S)
        cells = [s.network, s.label, f"{batch:.4f}"]
        for v in args.variants:
            try:
                cells.append(f"{relative_distance(*VARIANTS[v](s), S) / batch:.2f}")
            except torch.linalg.LinAlgError:
                cells.append("fails (not PD)")
        print("| " + " | ".join(cells) + " |", flush=True)
    print()
    print(f"({time.perf_counter() - t0:.0f} s, {torch.get_num_threads()} thread(s))")


if __name__ == "__main__":
    main()
