r"""Batch and match (BaM) with a factor-analysis patch: score-based variational inference in the family
:math:`N(\mu, FF^\top + \Psi)`.

Batch and match (Cai, Modi, Pillaud-Vivien, Margossian, Gower, Blei & Saul 2024, Algorithm 1) fits a Gaussian
:math:`q_t = N(\mu_t, \Sigma_t)` to an unnormalised target :math:`p` from its scores only. Each iteration
draws a *batch* :math:`z_1, \dots, z_B \sim q_t`, evaluates the scores :math:`g_b = \nabla \log p(z_b)` and
*matches* them: :math:`(\mu_{t+1}, \Sigma_{t+1})` minimise the batch estimate of the score-based divergence
:math:`\mathbb{E}_q \|\nabla\log q - \nabla\log p\|^2_{\operatorname{Cov}(q)}` plus
:math:`\frac{2}{\lambda_t}\operatorname{KL}(q_t \| q)`. The minimiser is in closed form (their §3, the BaM
update): with the batch statistics

.. math::
    \bar z = \tfrac1B \textstyle\sum_b z_b, \quad \bar g = \tfrac1B \sum_b g_b, \quad
    C = \tfrac1B \sum_b (z_b - \bar z)(z_b - \bar z)^\top, \quad
    \Gamma = \tfrac1B \sum_b (g_b - \bar g)(g_b - \bar g)^\top,

.. math::
    U = \lambda\Gamma + \tfrac{\lambda}{1+\lambda}\bar g \bar g^\top, \qquad
    V = \Sigma_t + \lambda C + \tfrac{\lambda}{1+\lambda}(\mu_t - \bar z)(\mu_t - \bar z)^\top,

.. math::
    \Sigma_{t+1} = 2V\bigl(I + (I + 4UV)^{1/2}\bigr)^{-1}, \qquad
    \mu_{t+1} = \tfrac{1}{1+\lambda}\mu_t + \tfrac{\lambda}{1+\lambda}(\Sigma_{t+1}\bar g + \bar z).

:math:`\Sigma_{t+1}` is the positive definite solution of :math:`\Sigma U \Sigma + \Sigma = V`. When
:math:`U = QQ^\top` has low rank (:math:`B < D`; their low-rank form, as in the authors' ``bam_lowrank_update``
of github.com/modichirag/GSM-VI),

.. math::
    \Sigma_{t+1} = V - VQ\,N^{-2}\,Q^\top V, \qquad N = \tfrac12 I + (Q^\top V Q + \tfrac14 I)^{1/2},

which we use with :math:`Q = [\sqrt{\lambda/B}\,(g_b - \bar g)]_b \,\|\, \sqrt{\lambda/(1+\lambda)}\,\bar g`
(:math:`B + 1` columns) and :math:`V = \Psi_t + RR^\top`,
:math:`R = [F_t,\ \sqrt{\lambda/B}\,(z_b - \bar z)_b,\ \sqrt{\lambda/(1+\lambda)}(\mu_t - \bar z)]`. So
:math:`\Sigma_{t+1} = \Psi_t + RR^\top - PP^\top` with :math:`P = VQ\,N^{-1}` (:math:`D \times (B+1)`), held by
its factors and never formed (check: :math:`\Sigma Q = VQN^{-1}` since :math:`N^2 - Q^\top VQ = N`, so
:math:`\Sigma QQ^\top\Sigma + \Sigma = V`).

The patch (Modi, Cai & Saul 2025, pBaM): :math:`\Sigma_{t+1}` leaves the family; it is projected back onto
:math:`\Psi + FF^\top` by minimising :math:`\operatorname{KL}(N(0, \Sigma_{t+1}) \| N(0, \Psi + FF^\top))`, i.e.
maximum-likelihood factor analysis with :math:`\Sigma_{t+1}` in the place of the sample covariance, by EM from
the current :math:`(F_t, \Psi_t)` (Ghahramani & Hinton 1996; the library's
:func:`~pyro_fa.fa.batch.em_from_covariance` step :data:`~pyro_fa.fa.batch.BATCH_STEPS` ``["em"]``). An EM
step needs only :math:`\operatorname{diag}(\Sigma_{t+1})` and :math:`\Sigma_{t+1}W`, :math:`W = \Psi^{-1}F`,
both from the factors: :math:`O(D(K+B)^2)` per iteration, :math:`O(D(K+B))` memory.

The learning rate: the papers' decreasing schedule :math:`\lambda_t = BD/(t+1)` by default (Cai et al. 2024,
§5, for non-Gaussian targets), or a constant, or any callable of :math:`t`.

References
----------
D. Cai, C. Modi, L. Pillaud-Vivien, C. C. Margossian, R. M. Gower, D. M. Blei and L. K. Saul, *Batch and
match: black-box variational inference with a score-based divergence*, ICML 2024 (Algorithm 1, §3).
C. Modi, D. Cai and L. K. Saul, *Batch, match, and patch: low-rank approximations for score-based variational
inference*, AISTATS 2025.
Z. Ghahramani and G. E. Hinton, *The EM algorithm for mixtures of factor analyzers*, CRG-TR-96-1, 1996.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from pyro_fa.infer._fit_to_guide import guide_of_model, model_log_density, set_guide_to
from pyro_fa.distributions import StableLowRankMultivariateNormal, draw
from pyro_fa.fa import linalg
from pyro_fa.fa.batch import BATCH_STEPS

__all__ = ["BatchAndMatch"]


class _ImplicitCovariance:
    r""":math:`\operatorname{diag}(\psi) + RR^\top - PP^\top`, held by its factors: the BaM update's covariance.

    It answers what an EM step for factor analysis asks of a covariance (``diagonal()``, ``@`` a (D, K) matrix,
    ``dtype``, ``device``) in :math:`O(D(K + m))`, :math:`m` the columns of :math:`R` and :math:`P`;
    :meth:`dense` forms it (tests, small D).
    """

    def __init__(self, psi: Tensor, R: Tensor, P: Tensor):
        self.psi, self.R, self.P = psi, R, P
        self.dtype, self.device = psi.dtype, psi.device

    def diagonal(self) -> Tensor:
        return self.psi + self.R.pow(2).sum(-1) - self.P.pow(2).sum(-1)

    def __matmul__(self, W: Tensor) -> Tensor:
        if W.dim() == 1:
            return self.psi * W + self.R @ (self.R.T @ W) - self.P @ (self.P.T @ W)
        return self.psi.unsqueeze(-1) * W + self.R @ (self.R.T @ W) - self.P @ (self.P.T @ W)

    def dense(self) -> Tensor:
        return torch.diag(self.psi) + self.R @ self.R.T - self.P @ self.P.T


def _bam_step(mu: Tensor, F: Tensor, psi: Tensor, z: Tensor, g: Tensor, lam: float
              ) -> Tuple[Tensor, _ImplicitCovariance]:
    r"""One BaM update (Cai et al. 2024, Algorithm 1, §3) from :math:`q_t = N(\mu, FF^\top + \Psi)`.

    ``z``, ``g``: the batch (B, D) and its scores. Returns :math:`\mu_{t+1}` (D,) and :math:`\Sigma_{t+1} =
    \Psi + RR^\top - PP^\top` by factors (module docstring: the low-rank form with :math:`U = QQ^\top`).
    Cost :math:`O(D(K+B)^2)`.
    """
    B = z.shape[0]
    zbar, gbar = z.mean(0), g.mean(0)
    a = lam / (1.0 + lam)
    c = math.sqrt(lam / B)
    R = torch.cat([F, c * (z - zbar).T, math.sqrt(a) * (mu - zbar).unsqueeze(-1)], dim=1)  # V = Psi + R R^T
    Q = torch.cat([c * (g - gbar).T, math.sqrt(a) * gbar.unsqueeze(-1)], dim=1)  # U = Q Q^T, (D, B + 1)
    VQ = psi.unsqueeze(-1) * Q + R @ (R.T @ Q)
    A = Q.T @ VQ
    evals, evecs = torch.linalg.eigh(0.5 * (A + A.T))
    n = 0.5 + (evals.clamp_min(0) + 0.25).sqrt()  # N = E diag(n) E^T
    P = (VQ @ evecs) / n  # P P^T = VQ N^{-2} Q^T V
    cov = _ImplicitCovariance(psi, R, P)
    mu_new = mu / (1.0 + lam) + a * (cov @ gbar + zbar)
    return mu_new, cov


def _patch(cov: _ImplicitCovariance, F: Tensor, psi: Tensor, num_em_iters: int, floor: Tensor
           ) -> Tuple[Tensor, Tensor]:
    r"""The pBaM patch (Modi, Cai & Saul 2025): EM for factor analysis on :math:`\Sigma_{t+1}` from (F, psi).

    Each step is the library's EM step (Ghahramani & Hinton 1996; :func:`~pyro_fa.fa.batch.em_from_covariance`)
    with the capacitance Cholesky factor of :func:`~pyro_fa.fa.linalg.capacitance_cholesky` and
    :math:`\Sigma_{t+1}\Psi^{-1}F` from the factors. Cost :math:`O(D(K+B)K)` per step.
    """
    step = BATCH_STEPS["em"](cov, F, psi, floor)
    for _ in range(num_em_iters):
        W = F / psi.unsqueeze(-1)
        L = linalg.capacitance_cholesky(F, psi)
        F, psi = step(F, psi, L, W, cov @ W)
    return F, psi


def _check_int(name: str, arg: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}: {arg} must be an integer >= {low}, got {value!r}.")
    return int(value)


def _check_positive(name: str, arg: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{name}: {arg} must be a finite positive number, got {value!r}.")
    return float(value)


class BatchAndMatch:
    r"""Batch and match with a factor-analysis patch (pBaM): score-based VI of a Pyro model or a log density.

    Fits :math:`q = N(\mu, FF^\top + \Psi)` of rank K to the unconstrained posterior from gradient
    evaluations alone: each iteration draws B points from :math:`q_t`, takes their scores and moves
    :math:`(\mu, \Sigma)` to the BaM update (Cai et al. 2024), then projects :math:`\Sigma` back onto the family
    by EM for factor analysis (the *patch* of Modi, Cai & Saul 2025). Nothing :math:`D \times D` is formed: an
    iteration costs B gradients and :math:`O(D(K+B)^2)`. The module docstring gives the equations.

    Parameters
    ----------
    model : callable, optional
        A Pyro model; its arguments go to :meth:`fit`. The latent vector is packed as Pyro's ``AutoContinuous``
        packs it (unconstrained, the log-Jacobian included).
    log_density : callable, optional
        Instead of ``model``: ``log_density(z) -> scalar`` for one vector ``z`` of shape (D,) (differentiable);
        then ``dim`` is required.
    dim : int, optional
        D, with ``log_density``.
    rank : int, default 5
        K, the columns of :math:`F` (at most D).
    batch_size : int, default 16
        B, draws (and gradient evaluations) per iteration.
    num_iters : int, default 200
        Iterations; ``max_grad_evals`` instead sets ``num_iters = max_grad_evals // batch_size``.
    max_grad_evals : int, optional
        A budget of gradient evaluations (at least ``batch_size``).
    learning_rate : float or callable, optional
        :math:`\lambda_t`: a positive constant, or a callable ``t -> lambda_t`` (t = 0, 1, ...); default the
        papers' schedule :math:`\lambda_t = BD/(t+1)`.
    num_em_iters : int, default 100
        EM steps of the patch per iteration (warm-started from the previous :math:`F, \Psi`). EM for factor
        analysis converges slowly where the covariance is badly conditioned, and a patch that stops short of the
        projection leaves :math:`q` too narrow there; each step costs :math:`O(D(K+B)K)`.
    init_loc : Tensor of shape (D,), optional
        :math:`\mu_0`; default 0.
    init_scale : float, default 1.0
        s: :math:`\Psi_0 = s^2 I`, and :math:`F_0` has random orthogonal columns of norm :math:`s/2` (EM cannot
        grow :math:`F` from 0).
    init_loc_fn : callable, optional
        A Pyro init strategy used only to trace the model once (its shapes).
    dtype : torch.dtype, default torch.float64

    Attributes
    ----------
    loc_, cov_factor_, cov_diag_ : Tensors of shapes (D,), (D, K), (D,)
        The fit, after :meth:`fit`.
    num_grad_evals_ : int
        Value-and-gradient evaluations of :math:`\log p` in the last :meth:`fit` (B per iteration).
    num_density_evals_ : int
        Value-only evaluations (0: BaM uses scores only).
    num_skipped_ : int
        Iterations whose batch had a non-finite score or whose update was not a valid covariance (the state was
        kept; their gradients are counted).

    Notes
    -----
    Per iteration: B gradient evaluations, :math:`O(D(K+B)^2)` for the match and :math:`O(D(K+B)K)` per EM
    step of the patch. Far from the posterior the large scores shrink :math:`\Sigma` along them (the
    :math:`\bar g\bar g^\top` term of :math:`U`) and each mean step is about one current standard deviation, so
    a poor start can stall short of the mode: start near the posterior (e.g. Pathfinder's mean, with a small
    ``init_scale``).

    See Also
    --------
    pyro_fa.infer.Pathfinder : another fast factor-analysis posterior, from the L-BFGS path.
    pyro_fa.infer.AutoLowRankFactorGuide : the guide :meth:`init_guide` sets.

    References
    ----------
    Cai et al., *Batch and match*, ICML 2024 (Algorithm 1); Modi, Cai & Saul, *Batch, match, and patch*,
    AISTATS 2025; Ghahramani & Hinton 1996 (EM for factor analysis).

    Examples
    --------
    >>> target = torch.distributions.MultivariateNormal(torch.ones(3, dtype=torch.float64),
    ...                                                 torch.eye(3, dtype=torch.float64))
    >>> bam = BatchAndMatch(log_density=target.log_prob, dim=3, rank=1, num_iters=50)
    >>> q = bam.fit(generator=torch.Generator().manual_seed(0)).get_posterior()
    >>> bool((q.mean - 1).abs().max() < 0.1), bam.num_grad_evals_
    (True, 800)
    """

    def __init__(self, model: Optional[Callable] = None, *, log_density: Optional[Callable] = None,
                 dim: Optional[int] = None, rank: int = 5, batch_size: int = 16, num_iters: int = 200,
                 max_grad_evals: Optional[int] = None,
                 learning_rate: Union[None, float, Callable[[int], float]] = None, num_em_iters: int = 100,
                 init_loc: Optional[Tensor] = None, init_scale: float = 1.0, init_loc_fn: Optional[Callable] = None,
                 dtype: torch.dtype = torch.float64):
        name = type(self).__name__
        if (model is None) == (log_density is None):
            raise ValueError(f"{name}: exactly one of model and log_density must be given, got "
                             f"model={model!r}, log_density={log_density!r}.")
        if log_density is not None:
            if dim is None:
                raise ValueError(f"{name}: dim must be an integer >= 1 with log_density, got None.")
            dim = _check_int(name, "dim", dim, 1)
        self.model, self._log_density, self.dim = model, log_density, dim
        self.rank = _check_int(name, "rank", rank, 1)
        if dim is not None and self.rank > dim:
            raise ValueError(f"{name}: rank must be at most dim={dim}, got {rank!r}.")
        self.batch_size = _check_int(name, "batch_size", batch_size, 1)
        self.num_iters = _check_int(name, "num_iters", num_iters, 1)
        if max_grad_evals is not None:
            self.num_iters = _check_int(name, "max_grad_evals", max_grad_evals, self.batch_size) // self.batch_size
        if learning_rate is not None and not callable(learning_rate):
            learning_rate = _check_positive(name, "learning_rate", learning_rate)
        self.learning_rate = learning_rate
        self.num_em_iters = _check_int(name, "num_em_iters", num_em_iters, 1)
        self.init_scale = _check_positive(name, "init_scale", init_scale)
        if init_loc is not None:
            init_loc = torch.as_tensor(init_loc, dtype=dtype)
            if init_loc.dim() != 1 or (dim is not None and init_loc.shape[0] != dim) or not torch.isfinite(
                    init_loc).all():
                raise ValueError(f"{name}: init_loc must be a finite tensor of shape (D,), got {init_loc!r}.")
        self.init_loc = init_loc
        self.init_loc_fn = init_loc_fn
        self.dtype = dtype
        self.loc_: Optional[Tensor] = None

    def _lambda(self, t: int) -> float:
        """:math:`\\lambda_t`: the option's constant or callable, else the papers' :math:`BD/(t+1)`."""
        if self.learning_rate is None:
            return self.batch_size * self.dim / (t + 1.0)
        if callable(self.learning_rate):
            return _check_positive(type(self).__name__, f"learning_rate({t})", self.learning_rate(t))
        return self.learning_rate

    def _scores(self, z: Tensor) -> Tensor:
        """:math:`\\nabla \\log p` of each row of ``z`` (B, D); a row outside the support gives NaN."""
        out = []
        for row in z:
            self._ngrad += 1
            x = row.detach().requires_grad_(True)
            try:
                (g,) = torch.autograd.grad(self._lp(x), x)
            except (ValueError, RuntimeError) as err:  # outside the support of a model's checks
                self._last_error = err
                g = torch.full_like(row, float("nan"))
            out.append(g.detach())
        return torch.stack(out)

    def _initial_state(self, generator) -> Tuple[Tensor, Tensor, Tensor]:
        D, K, s = self.dim, self.rank, self.init_scale
        mu = torch.zeros(D, dtype=self.dtype) if self.init_loc is None else self.init_loc.clone()
        if mu.shape[0] != D:
            raise ValueError(f"{type(self).__name__}: init_loc must be a finite tensor of shape ({D},), "
                             f"got shape {tuple(mu.shape)!r}.")
        F = linalg.orthogonal_init(D, K, scale=0.5 * s, generator=generator, dtype=self.dtype)
        return mu, F, torch.full((D,), s * s, dtype=self.dtype)

    def fit(self, *args, generator: Optional[torch.Generator] = None, **kwargs) -> "BatchAndMatch":
        """Run ``num_iters`` iterations of batch, match and patch; the model's ``args``/``kwargs`` follow.

        Returns
        -------
        BatchAndMatch
            ``self``, with :attr:`loc_`, :attr:`cov_factor_`, :attr:`cov_diag_`, :attr:`num_grad_evals_`.

        Raises
        ------
        ValueError
            If ``rank`` exceeds the model's latent dimension, ``init_loc`` does not have its shape, or a
            callable ``learning_rate`` returns a value that is not positive.
        RuntimeError
            If no iteration could be used (every batch had a non-finite score or update).
        """
        name = type(self).__name__
        if self.model is not None:
            self._lp, self.dim = model_log_density(self.model, args, kwargs, self.init_loc_fn)
            if self.rank > self.dim:
                raise ValueError(f"{name}: rank must be at most the model's latent dimension {self.dim}, "
                                 f"got {self.rank!r}.")
        else:
            self._lp = self._log_density
        self._ngrad, skipped = 0, 0
        mu, F, psi = self._initial_state(generator)
        B, D, K = self.batch_size, self.dim, self.rank
        self._last_error = None
        for t in range(self.num_iters):
            lam = self._lambda(t)
            eps = torch.randn(B, D + K, dtype=self.dtype, generator=generator)
            z = mu + eps[:, :K] @ F.T + psi.sqrt() * eps[:, K:]
            g = self._scores(z)
            if not bool(torch.isfinite(g).all()):
                skipped += 1
                continue
            try:
                mu_new, cov = _bam_step(mu, F, psi, z, g, lam)
                floor = cov.diagonal().abs().max() * math.sqrt(torch.finfo(self.dtype).eps)
                F_new, psi_new = _patch(cov, F, psi, self.num_em_iters, floor)
            except torch.linalg.LinAlgError as err:  # a numerically singular step: keep the state
                self._last_error = err
                skipped += 1
                continue
            if not (bool(torch.isfinite(mu_new).all() and torch.isfinite(F_new).all()
                         and torch.isfinite(psi_new).all()) and bool((psi_new > 0).all())):
                skipped += 1
                continue
            mu, F, psi = mu_new, F_new, psi_new
        if skipped == self.num_iters:
            raise RuntimeError(f"{name}: every batch had a non-finite score or update (last error: "
                               f"{self._last_error!r}); check that log p is finite and differentiable near "
                               "init_loc, or lower init_scale.")
        self.loc_, self.cov_factor_, self.cov_diag_ = mu, F, psi
        self.num_grad_evals_, self.num_density_evals_, self.num_skipped_ = self._ngrad, 0, skipped
        return self

    def _check_fit(self, what: str) -> None:
        if self.loc_ is None:
            raise RuntimeError(f"{type(self).__name__}: {what} needs a fitted BatchAndMatch; call fit() first.")

    def get_posterior(self) -> StableLowRankMultivariateNormal:
        """The fit :math:`N(\\mu, FF^\\top + \\Psi)`.

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        """
        self._check_fit("get_posterior()")
        return StableLowRankMultivariateNormal(self.loc_, self.cov_factor_, self.cov_diag_)

    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Draws of the fit in the unconstrained space, (num_samples, D) or (D,) when ``num_samples`` is None.

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        ValueError
            If ``num_samples`` is not None or an integer >= 1.
        """
        self._check_fit("sample()")
        return draw(type(self).__name__, self.get_posterior(), num_samples, generator)

    def to_guide(self, rank: Optional[int] = None, *args, **kwargs):
        """A new :class:`~pyro_fa.infer.AutoLowRankFactorGuide` of ``self.model`` set to this posterior
        (:meth:`init_guide`); ``args``/``kwargs`` are the model's (the guide is run once on them).

        Raises
        ------
        RuntimeError
            Before :meth:`fit`, or when built on a ``log_density`` (no model).
        """
        self._check_fit("to_guide()")
        return guide_of_model(self, self.rank if rank is None else rank, args, kwargs)

    def init_guide(self, guide) -> None:
        """Set an :class:`~pyro_fa.infer.AutoLowRankFactorGuide` (already set up, rank K) to :meth:`get_posterior`.

        As :meth:`Pathfinder.init_guide <pyro_fa.infer.Pathfinder.init_guide>`: loc = :math:`\\mu`; the K
        leading columns of :math:`F` (the rest's variance added to :math:`\\Psi`), or small random extra columns
        when the guide's rank is larger; ``scale`` = :math:`\\sqrt{\\Psi}`, ``factor`` =
        :math:`\\operatorname{diag}(s)^{-1}F`. With the guide's rank equal to :attr:`rank` and
        ``noise="diagonal"`` the guide's posterior is this one.

        Raises
        ------
        RuntimeError
            Before :meth:`fit`, or if the guide has not run yet.
        ValueError
            If the guide's latent dimension is not :attr:`dim`.
        """
        self._check_fit("init_guide()")
        guide._check_setup(f"{type(self).__name__}.init_guide()")
        set_guide_to(self.get_posterior(), guide, type(self).__name__)
