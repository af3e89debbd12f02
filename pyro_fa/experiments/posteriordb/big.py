"""A posterior past posteriordb's sizes: a Bayesian logistic regression with D = 5000 coefficients.

The model (``big_logistic``) is

.. math::

    w \\sim \\mathcal N(0,\\; s^2 I_D + B B^\\top), \\qquad
    y_n \\mid w \\sim \\mathrm{Bernoulli}(\\sigma(x_n^\\top w)), \\quad n = 1, \\dots, N,

with ``B`` a fixed ``D x K`` matrix: the coefficients' prior is the marginal of a hierarchical prior
``w = B u + s e`` (``u ~ N(0, I_K)`` shared factor effects, ``e ~ N(0, I_D)``) with the factor effects
integrated out, so the sampled site is ``w`` itself and the benchmark's coordinates are the coefficients.
Features ``x_n ~ N(0, c^2 / D I_D)`` (``c = feature_scale``), the true coefficients drawn from the prior and the
labels from the likelihood, all from one seed: no data file ships.

Why this design rather than an isotropic prior ``N(0, s^2 I)`` with correlated features. Under an isotropic
prior the posterior precision is ``I / s^2`` plus a positive semi-definite data term, so the posterior
covariance is at most ``s^2 I``: features with a low-rank-plus-noise correlation make it the diagonal *minus*
a low-rank term, which the factor-analysis family ``Psi + F F^T`` cannot represent. With the factor prior the
posterior covariance is roughly the diagonal *plus* a rank-K term (the prior's K wide directions, narrowed but
not removed by the N < D rows) and a spread of mild data shrinkage over the N-dimensional row space: a target
where a rank-K factor-analysis guide or Pathfinder's diagonal-plus-low-rank inverse Hessian is the right
shape, costs O(DK) per step, and Pyro's dense ``AutoMultivariateNormal`` (D(D+1)/2 = 12.5 million scale
parameters, O(D^2) per step) is slow. The prior keeps the posterior log-concave and its condition number
moderate, so a diagonal-mass HMC mixes.

The reference draws come from :func:`make_reference`: four chains of full-batch HMC
(:func:`pyro_fa.infer.hmc.hmc`) from overdispersed points, checked by split R-hat and bulk ESS, written to ``<folder>/big_logistic_reference.pt`` (not shipped: tens of megabytes). Make it with::

    python -m pyro_fa.experiments.posteriordb.big --make-reference FOLDER

and score it with ``pyro-fa posteriordb --posteriors big_logistic --data-dir FOLDER`` (or set
``PYRO_FA_POSTERIORDB=FOLDER``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from pyro_fa.experiments.posteriordb.standin_base import StandInPosterior

__all__ = ["BigLogisticConfig", "make_data", "make_model", "log_density", "make_reference", "load_big_logistic",
           "reference_path", "score_identity", "NAME", "REFERENCE_FILE", "MAKE_COMMAND"]

NAME = "big_logistic"
REFERENCE_FILE = "big_logistic_reference.pt"
MAKE_COMMAND = "python -m pyro_fa.experiments.posteriordb.big --make-reference FOLDER"
RHAT_LIMIT = 1.01


@dataclass(frozen=True)
class BigLogisticConfig:
    """The sizes and scales of the ``big_logistic`` posterior (the defaults are the benchmark's).

    Attributes
    ----------
    dim : int
        D, the number of coefficients.
    num_rows : int
        N, the number of labelled rows.
    rank : int
        K, the number of the prior's factor directions.
    prior_scale : float
        s, the prior's per-coordinate scale.
    factor_scale : float
        the prior's extra scale along each factor direction (the columns of ``B`` have squared norm about
        ``factor_scale ** 2``).
    feature_scale : float
        c: the features are ``N(0, c^2 / D)``, so a logit ``x^T w`` has scale about ``c s``.
    seed : int
        the seed of ``B``, the features, the true coefficients and the labels.
    """

    dim: int = 5000
    num_rows: int = 2000
    rank: int = 10
    prior_scale: float = 1.0
    factor_scale: float = 5.0
    feature_scale: float = 2.0
    seed: int = 0

    def __post_init__(self):
        for name in ("dim", "num_rows", "rank"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"BigLogisticConfig: {name} must be a positive integer, got {value!r}.")
        for name in ("prior_scale", "factor_scale", "feature_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"BigLogisticConfig: {name} must be a positive number, got {value!r}.")


def make_data(config: BigLogisticConfig = BigLogisticConfig(), dtype=torch.float64) -> dict:
    """The data of the posterior, generated from ``config.seed``: ``X`` (N, D), ``y`` (N,), the prior's
    ``cov_factor`` ``B`` (D, K) and ``cov_diag`` (D,), and the true coefficients ``w_true`` (D,)."""
    g = torch.Generator().manual_seed(config.seed)
    D, N, K = config.dim, config.num_rows, config.rank
    B = torch.randn(D, K, generator=g, dtype=torch.float64) * (config.factor_scale / math.sqrt(D))
    cov_diag = torch.full((D,), config.prior_scale ** 2, dtype=torch.float64)
    w_true = B @ torch.randn(K, generator=g, dtype=torch.float64) + config.prior_scale * torch.randn(
        D, generator=g, dtype=torch.float64)
    X = torch.randn(N, D, generator=g, dtype=torch.float64) * (config.feature_scale / math.sqrt(D))
    y = torch.bernoulli(torch.sigmoid(X @ w_true), generator=g)
    return {k: v.to(dtype) for k, v in dict(X=X, y=y, cov_factor=B, cov_diag=cov_diag, w_true=w_true).items()}


def make_model(data: dict):
    """The zero-argument Pyro model of ``data`` (one latent site ``w`` of shape (D,))."""
    import pyro
    import pyro.distributions as dist

    X, y, B, cov_diag = data["X"], data["y"], data["cov_factor"], data["cov_diag"]

    def model():
        w = pyro.sample("w", dist.LowRankMultivariateNormal(X.new_zeros(X.shape[1]), B, cov_diag))
        pyro.sample("y", dist.Bernoulli(logits=X @ w).to_event(1), obs=y)

    return model


def log_density(data: dict, z: torch.Tensor) -> torch.Tensor:
    """The log joint at ``z`` of shape (D,) or (n, D), written out: the prior by the Woodbury identity and
    the matrix determinant lemma on the K x K capacitance ``C = s^2 I + B^T B``, the likelihood by
    ``y l - softplus(l)``. O(n (N + K) D)."""
    X, y, B, cov_diag = data["X"], data["y"], data["cov_factor"], data["cov_diag"]
    s2 = cov_diag[0]
    D, K = B.shape
    C = s2 * torch.eye(K, dtype=B.dtype, device=B.device) + B.T @ B
    L = torch.linalg.cholesky(C)
    v = torch.linalg.solve_triangular(L, (z @ B).unsqueeze(-1), upper=False).squeeze(-1)
    quad = ((z * z).sum(-1) - (v * v).sum(-1)) / s2
    logdet = (D - K) * torch.log(s2) + 2.0 * torch.log(torch.diagonal(L)).sum()
    prior = -0.5 * (quad + logdet + D * math.log(2 * math.pi))
    logits = z @ X.T
    return prior + (y * logits - torch.nn.functional.softplus(logits)).sum(-1)


def score_identity(log_density, draws: torch.Tensor, ess: Optional[float] = None, chunk: int = 256) -> dict:
    """The score identity ``E_p[grad log p(z)] = 0`` on ``draws`` (n, D) of ``p``: each coordinate's mean gradient
    in Monte Carlo standard errors (``sd / sqrt(ess)``, ``ess`` default n); ``max_abs_z`` of a few units when the
    draws are from ``p`` (D coordinates: the largest of D roughly standard normals)."""
    grads = []
    for part in draws.split(chunk):
        with torch.enable_grad():
            z = part.detach().clone().requires_grad_(True)
            (g,) = torch.autograd.grad(log_density(z).sum(), z)
        grads.append(g.detach())
    g = torch.cat(grads).to(torch.float64)
    n_eff = float(ess) if ess is not None else float(g.shape[0])
    z_scores = g.mean(0) / (g.std(0) / math.sqrt(n_eff))
    return {"max_abs_z": float(z_scores.abs().max()), "mean_abs_z": float(z_scores.abs().mean())}


def reference_path(folder) -> Path:
    return Path(folder) / REFERENCE_FILE


def overdispersed_inits(data: dict, chains: int, generator: torch.Generator, scale: float = 2.0) -> torch.Tensor:
    """``chains`` draws from the prior with their scale multiplied by ``scale`` (the prior is wider than the
    posterior in every direction, so these start the chains overdispersed)."""
    B, cov_diag = data["cov_factor"], data["cov_diag"]
    dt = B.dtype
    e = torch.randn(chains, B.shape[0], generator=generator, dtype=dt) * cov_diag.sqrt()
    u = torch.randn(chains, B.shape[1], generator=generator, dtype=dt)
    return scale * (u @ B.T + e)


def make_reference(folder, config: BigLogisticConfig = BigLogisticConfig(), *, chains: int = 4,
                   num_warmup: int = 300, num_samples: int = 600, thin: int = 4, num_steps: int = 12,
                   seed: int = 0, dtype=torch.float32, log=print) -> dict:
    """Make the reference draws of ``big_logistic`` by HMC and write them to ``<folder>/big_logistic_reference.pt``.

    ``chains`` chains of :func:`pyro_fa.infer.hmc.hmc` (``num_warmup`` warm-up iterations, then
    ``num_samples * thin`` sampling iterations of ``num_steps`` leapfrog steps, every ``thin``-th kept: the
    defaults run 2 400 and keep 600 draws per chain), run in ``dtype`` on the full batch, one generator seeded
    by ``seed``; ``log`` gets a progress line every 100 iterations. The file holds ``draws``
    ((chains * num_samples, D) float32, chain by chain), the ``config``, the sampler's settings and the
    diagnostics (``rhat_max``, ``ess_bulk_min``, ``ess_bulk_median``, ``ess_tail_min``, ``num_draws``,
    ``seconds``, ``step_size`` per chain, ``accept_rate`` over chains, ``grad_evals``, sampling
    ``divergences``, ``converged``, ``score_identity``). Warns when the largest R-hat is over 1.01 (the file is
    written, marked not converged, and :func:`load_big_logistic` refuses it).

    Returns
    -------
    dict
        the diagnostics.
    """
    from pyro_fa.infer.hmc import chain_diagnostics, hmc

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = make_data(config, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    init = overdispersed_inits(data, chains, gen)
    t0 = time.perf_counter()

    def progress(it, stats):
        if it % 100 == 0:
            log(f"{NAME}: iteration {it}/{num_warmup + num_samples * thin}, step size "
                f"{float(stats['step_size'].mean()):.4g}, acceptance {float(stats['accept'].mean()):.2f}, "
                f"{stats['grad_evals']} gradients, {stats['seconds']:.0f}s, "
                f"{int(stats['divergences'].sum())} divergences")

    result = hmc(lambda z: log_density(data, z), init, num_warmup=num_warmup, num_samples=num_samples,
                 num_steps=num_steps, thin=thin, generator=gen, progress=progress)
    chain = chain_diagnostics(result.draws)
    diagnostics = {"rhat_max": chain["rhat_max"], "ess_bulk_min": chain["ess_min"],
                   "ess_bulk_median": chain["ess_median"], "ess_tail_min": chain["ess_tail_min"],
                   "num_draws": int(result.draws.shape[0] * result.draws.shape[1]),
                   "seconds": time.perf_counter() - t0, "step_size": result.step_size.tolist(),
                   "accept_rate": float(result.accept_rate.mean()), "grad_evals": result.grad_evals,
                   "divergences": int(result.divergences.sum()), "converged": chain["rhat_max"] <= RHAT_LIMIT}
    flat = result.draws.reshape(-1, config.dim)
    diagnostics["score_identity"] = score_identity(lambda z: log_density(data, z), flat, diagnostics["ess_bulk_min"])
    if not diagnostics["converged"]:
        warnings.warn(f"make_reference: the largest split R-hat is {diagnostics['rhat_max']:.4f} > {RHAT_LIMIT}: "
                      "the reference is written but marked not converged; run longer chains.", RuntimeWarning)
    sampler = dict(chains=chains, num_warmup=num_warmup, num_samples=num_samples, thin=thin,
                   num_steps=num_steps, seed=seed, dtype=str(dtype))
    payload = {"draws": flat.to(torch.float32), "config": asdict(config),
               "sampler": sampler, "diagnostics": diagnostics}
    path = reference_path(folder)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    log(f"{NAME}: wrote {path}: " + json.dumps(diagnostics))
    return diagnostics


def _folder(data_dir) -> Optional[Path]:
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get("PYRO_FA_POSTERIORDB")
    return Path(env) if env else None


def load_big_logistic(data_dir=None, config: BigLogisticConfig = BigLogisticConfig()) -> StandInPosterior:
    """The ``big_logistic`` posterior with the reference draws read from ``data_dir`` (default
    ``$PYRO_FA_POSTERIORDB``).

    Raises
    ------
    FileNotFoundError
        If no reference file is found (the message names the command that makes it).
    ValueError
        If the file was made for another configuration, or its chains did not converge (R-hat > 1.01).
    """
    folder = _folder(data_dir)
    path = reference_path(folder) if folder is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"load_big_logistic: data_dir must be a folder holding {REFERENCE_FILE} (data_dir=, else the "
            f"environment variable PYRO_FA_POSTERIORDB), got {str(path) if path else None!r}; make it with "
            f"`{MAKE_COMMAND}` (its default: 4 chains of 2 700 HMC iterations of 12 leapfrog steps).")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("config") != asdict(config):
        raise ValueError(f"load_big_logistic: the reference's config must be {asdict(config)!r}, got "
                         f"{payload.get('config')!r}; remake it with `{MAKE_COMMAND}`.")
    if not payload["diagnostics"].get("converged", False):
        raise ValueError(f"load_big_logistic: the reference's largest R-hat must be <= {RHAT_LIMIT}, got "
                         f"{payload['diagnostics'].get('rhat_max')!r}; remake it with longer chains.")
    data = make_data(config)
    post = StandInPosterior(NAME, make_model(data), config.dim, payload["draws"].to(torch.float64),
                            lambda z: log_density(data, z))
    post.data, post.diagnostics = data, payload["diagnostics"]
    return post


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyro_fa.experiments.posteriordb.big",
                                     description="Make the reference draws of the big_logistic posterior (HMC).")
    parser.add_argument("--make-reference", metavar="FOLDER", required=True,
                        help=f"the folder to write {REFERENCE_FILE} to")
    parser.add_argument("--num-warmup", type=int, default=300)
    parser.add_argument("--num-samples", type=int, default=600, help="draws kept per chain (after --thin)")
    parser.add_argument("--thin", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    diag = make_reference(args.make_reference, num_warmup=args.num_warmup, num_samples=args.num_samples,
                          thin=args.thin, num_steps=args.num_steps, seed=args.seed,
                          log=lambda msg: print(msg, flush=True))
    return 0 if diag["converged"] else 1


if __name__ == "__main__":
    sys.exit(main())
