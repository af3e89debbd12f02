r"""Pathfinder: Gaussian approximations along the L-BFGS path of a Pyro model, chosen by the ELBO.

Zhang, Carpenter, Gelman & Vehtari (2022), *Pathfinder: parallel quasi-Newton variational inference*,
JMLR 23(306), Algorithms 1-5, on the unconstrained log density of a Pyro model (the latent vector packed in the
order of Pyro's :class:`~pyro.infer.autoguide.AutoContinuous`).

The inverse Hessian and its factor form
---------------------------------------
At iterate :math:`l` with the last :math:`m \le J` accepted pairs :math:`S = [s_i]`, :math:`Y = [y_i]`
(:math:`s_i` steps, :math:`y_i` differences of the gradients of :math:`-\log p`, :math:`s_i^\top y_i > 0`) and the
diagonal :math:`\alpha` (Gilbert & Lemaréchal's diagonal BFGS update, the paper's Algorithm 3 lines 3-5), the L-BFGS
inverse Hessian is, in Byrd, Nocedal & Schnabel's (1994) compact form (their eq. 2.6, paper eq. 3-4),

.. math::
    \Sigma = \operatorname{diag}(\alpha) + \beta\gamma\beta^\top,\quad
    \beta = [\operatorname{diag}(\alpha) Y,\ S],\quad
    \gamma = \begin{bmatrix} 0 & -R^{-1} \\ -R^{-\top} & R^{-\top}(E + Y^\top \operatorname{diag}(\alpha) Y)R^{-1}
    \end{bmatrix},

:math:`R` the upper triangle of :math:`S^\top Y`, :math:`E` its diagonal. :math:`\gamma` is indefinite, so
:math:`\beta\gamma\beta^\top` is a *signed* low-rank correction. With the thin QR
:math:`\operatorname{diag}(\alpha)^{-1/2}\beta = QR_\beta` and :math:`M = I + R_\beta \gamma R_\beta^\top = LL^\top`
(positive definite when every pair has :math:`s^\top y > 0`),

.. math::
    \Sigma = \alpha^{1/2} \bigl(I + Q (M - I) Q^\top\bigr) \alpha^{1/2}
           = \operatorname{diag}(\alpha) + \alpha^{1/2} Q V \Lambda V^\top Q^\top \alpha^{1/2},

:math:`M - I = V\Lambda V^\top`. The Pathfinder draws and log densities use this exactly (the paper's
Algorithm 4: :math:`\phi = \mu + \alpha^{1/2}(Q(L - I)Q^\top u + u)`).

**The covariance form** (:meth:`Pathfinder.get_posterior`): the family's
:class:`~pyro_fa.distributions.StableLowRankMultivariateNormal` :math:`N(\mu, FF^\top + \Psi)` needs a PSD
correction. We take :math:`\Psi = \operatorname{diag}(\alpha)` and :math:`F = \alpha^{1/2} Q V_+ \Lambda_+^{1/2}`,
the eigenvalues :math:`\lambda_j > 0` of :math:`M - I`. When :math:`M \succeq I` this is exact. Otherwise the
negative eigenvalues (:math:`-1 < \lambda_j < 0`: directions where the posterior is narrower than
:math:`\operatorname{diag}(\alpha)` says) are set to 0: in the whitened space (:math:`\alpha^{-1/2}` on both
sides) this is the Frobenius-nearest PSD correction within the span of :math:`Q`, and the covariance is
:math:`\succeq` the exact one (never too narrow). :attr:`Pathfinder.clipped_` holds the clipped eigenvalues
(empty when exact). We chose this over the precision form because the precision form's correction
:math:`(M^{-1} - I)` has the opposite signs and so fails exactly when this one succeeds; the exact Pathfinder
Gaussian stays available through :meth:`Pathfinder.sample` (single path) and the ELBO.

Multi-path Pathfinder (Algorithm 5) runs ``num_paths`` single paths from independent initial points, pools
their draws with their log importance ratios :math:`\log p - \log q_i` and resamples by Pareto-smoothed
importance weights (PSIS, Vehtari et al. 2024).

Costs are counted: :attr:`Pathfinder.num_grad_evals_` (value-and-gradient evaluations of :math:`\log p`, in
L-BFGS) and :attr:`Pathfinder.num_density_evals_` (values only, for the ELBO draws and the importance weights).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import Tensor

from pyro_fa.infer._fit_to_guide import guide_of_model, model_log_density, set_guide_to
from pyro_fa.distributions import StableLowRankMultivariateNormal, draw

__all__ = ["Pathfinder", "HISTORY_SIZE", "TOL_REL_OBJ"]

#: the default L-BFGS history J: chosen on fifteen posteriordb posteriors by the debiased W1 to their reference
#: draws, confirmed on ten others (Zhang et al. 2022 use 6); see benchmarks/results/pathfinder_history.md
HISTORY_SIZE = 20

#: L-BFGS's default relative tolerance on log p: 1e2 x float64's machine epsilon, as in the paper's experiments
#: (the authors' code ran R's ``optim`` L-BFGS-B with ``factr = 1e2``, whose test is the same relative change)
TOL_REL_OBJ = 1e2 * torch.finfo(torch.float64).eps


@dataclass
class _Gaussian:
    """One Pathfinder Gaussian: mean, diagonal alpha, Q (D, k), L (k, k) lower, and its ELBO."""

    mu: Tensor
    alpha: Tensor
    Q: Tensor
    L: Tensor
    iteration: int
    elbo: float = float("-inf")

    @property
    def logdet(self) -> Tensor:
        return self.alpha.log().sum() + 2 * self.L.diagonal().abs().log().sum()

    def draw(self, n: int, generator=None, u: Optional[Tensor] = None):
        """``n`` draws (n, D) and their log q (n,), the paper's Algorithm 4 (from the standard normals ``u``)."""
        D = self.mu.shape[0]
        if u is None:
            u = torch.randn(n, D, dtype=self.mu.dtype, device=self.mu.device, generator=generator)
        Qu = u @ self.Q
        x = u + (Qu @ (self.L - torch.eye(self.L.shape[0], dtype=u.dtype, device=u.device)).T) @ self.Q.T
        phi = self.mu + self.alpha.sqrt() * x
        logq = -0.5 * (self.logdet + u.pow(2).sum(-1) + D * math.log(2 * math.pi))
        return phi, logq

    def log_prob(self, z: Tensor) -> Tensor:
        D = self.mu.shape[0]
        w = (z - self.mu) / self.alpha.sqrt()  # = A u, A = I + Q (L - I) Q^T
        Qw = w @ self.Q
        # A^{-1} = I + Q (L^{-1} - I) Q^T
        Linv = torch.linalg.inv(self.L)
        u = w + (Qw @ (Linv - torch.eye(self.L.shape[0], dtype=w.dtype, device=w.device)).T) @ self.Q.T
        return -0.5 * (self.logdet + u.pow(2).sum(-1) + D * math.log(2 * math.pi))

    def factor_form(self):
        """``(F, Psi, clipped)``: Sigma ~= F F^T + diag(Psi), exact when ``clipped`` is empty (module docstring)."""
        k = self.L.shape[0]
        M = self.L @ self.L.T - torch.eye(k, dtype=self.L.dtype, device=self.L.device)
        lam, V = torch.linalg.eigh(0.5 * (M + M.T))
        pos = lam > 0
        F = self.alpha.sqrt().unsqueeze(-1) * (self.Q @ (V[:, pos] * lam[pos].sqrt()))
        return F, self.alpha.clone(), lam[~pos]

    def covariance_matrix(self) -> Tensor:
        k = self.L.shape[0]
        M = self.L @ self.L.T - torch.eye(k, dtype=self.L.dtype, device=self.L.device)
        a = self.alpha.sqrt()
        return torch.diag(self.alpha) + (a.unsqueeze(-1) * self.Q) @ M @ (a.unsqueeze(-1) * self.Q).T


def _check_int(name: str, arg: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}: {arg} must be an integer >= {low}, got {value!r}.")
    return int(value)


def _two_loop(g: Tensor, S, Y, alpha: Tensor) -> Tensor:
    """H g by the L-BFGS two-loop recursion with H0 = diag(alpha) (Nocedal & Wright, Alg. 7.4)."""
    q = g.clone()
    rhos, alphas = [], []
    for s, y in zip(reversed(S), reversed(Y)):
        rho = 1.0 / float(s @ y)
        a = rho * float(s @ q)
        q = q - a * y
        rhos.append(rho)
        alphas.append(a)
    r = alpha * q if S else q
    for (s, y), rho, a in zip(zip(S, Y), reversed(rhos), reversed(alphas)):
        b = rho * float(y @ r)
        r = r + s * (a - b)
    return r

def _bfgs_gaussian(x: Tensor, g: Tensor, alpha: Tensor, S, Y, it: int) -> Optional[_Gaussian]:
    """The paper's Algorithm 3 (BFGS-Mat) and the factors of Algorithm 4; None if not positive definite."""
    Sm, Ym = torch.stack(S, -1), torch.stack(Y, -1)  # (D, m)
    m = Sm.shape[1]
    SY = Sm.T @ Ym
    R = torch.triu(SY)
    E = torch.diag(SY.diagonal())
    eye = torch.eye(m, dtype=x.dtype)
    Rinv = torch.linalg.solve_triangular(R, eye, upper=True)
    beta = torch.cat([alpha.unsqueeze(-1) * Ym, Sm], dim=1)  # (D, 2m)
    gamma = torch.zeros(2 * m, 2 * m, dtype=x.dtype)
    gamma[:m, m:] = -Rinv
    gamma[m:, :m] = -Rinv.T
    gamma[m:, m:] = Rinv.T @ (E + Ym.T @ (alpha.unsqueeze(-1) * Ym)) @ Rinv
    Q, Rb = torch.linalg.qr(beta / alpha.sqrt().unsqueeze(-1))  # thin: (D, k), (k, 2m)
    k = Q.shape[1]
    Mmat = torch.eye(k, dtype=x.dtype) + Rb @ gamma @ Rb.T
    L, info = torch.linalg.cholesky_ex(0.5 * (Mmat + Mmat.T))
    if int(info) != 0 or not torch.isfinite(L).all():
        return None
    # mean: one quasi-Newton step, mu = x + Sigma grad log p = x - Sigma g
    mu = x - (alpha * g + beta @ (gamma @ (beta.T @ g)))
    return _Gaussian(mu=mu, alpha=alpha.clone(), Q=Q, L=L, iteration=it)


class Pathfinder:
    r"""Single- and multi-path Pathfinder on a Pyro model (Zhang et al. 2022), a factor-analysis posterior.

    Parameters
    ----------
    model : callable, optional
        A Pyro model; its arguments go to :meth:`fit`. The latent vector is packed as Pyro's ``AutoContinuous``
        packs it (unconstrained, the log-Jacobian included).
    log_density : callable, optional
        Instead of ``model``: ``log_density(z) -> scalar`` for one unconstrained vector ``z`` of shape (D,)
        (differentiable); then ``dim`` is required.
    dim : int, optional
        D, with ``log_density``.
    num_paths : int, default 1
        1: single-path Pathfinder (Algorithm 1); more: multi-path with PSIS resampling (Algorithm 5).
    history_size : int, default 20
        J, the L-BFGS history (:data:`HISTORY_SIZE`); the low-rank part of each Gaussian has rank at most 2J.
        Zhang et al. (2022) use 6. A longer history costs :math:`O(DJ)` memory and :math:`O(DJ^2)` per iterate,
        negligible beside the gradients, and holds the curvature of more directions: with 6 pairs the directions
        the last pairs do not span get only the diagonal estimate, too narrow where coordinates correlate (see
        benchmarks/results/pathfinder_history.md).
    max_iters : int, default 1000
        L-BFGS iterations per path at most.
    num_elbo_draws : int, default 25
        K, draws per ELBO estimate along the path (Stan's default).
    num_draws_per_path : int, default 1000
        M, draws per path pooled for importance resampling (multi-path).
    init_radius : float, default 2.0
        Initial points are uniform in ``[-init_radius, init_radius]^D`` (Stan's default), unless ``init`` is given.
    init : Tensor, optional
        A fixed initial point (D,) for every path.
    init_loc_fn : callable, optional
        A Pyro init strategy used only to trace the model once (its shapes); needed where the default
        (``init_to_median``) cannot run, e.g. a model with ``ImproperUniform`` priors.
    tol_rel_obj, tol_grad : float
        L-BFGS stops when the relative change of :math:`\log p`, :math:`|\Delta \log p| / \max(|\log p|, 1)`, is
        below ``tol_rel_obj`` or the largest gradient entry below ``tol_grad``. The default ``tol_rel_obj`` is that
        of the paper's experiments (the authors' code ran R's ``optim`` L-BFGS-B with ``factr = 1e2``, the same
        relative test at :math:`10^2\epsilon \approx 2.2 \times 10^{-14}`; :data:`TOL_REL_OBJ`). A looser one (CmdStan's
        :math:`10^4\epsilon`, BlackJAX's :math:`10^{-5}`) can stop on a nearly flat ridge of a badly scaled
        posterior, where one step gains little relative to a large :math:`|\log p|` although the mode is many
        nats away (e.g. an intercept at :math:`10^4` scale, nearly collinear with its slope).

    Attributes
    ----------
    paths_ : list of the chosen Gaussian per path; ``elbo_`` (the best path's ELBO);
    num_failed_paths_ : int
        Paths that made no step with positive curvature (left out of the pool).
    num_grad_evals_, num_density_evals_ : int
        Costs of the last :meth:`fit` (value-and-gradient, value-only evaluations of :math:`\log p`).
    clipped_ : Tensor
        Eigenvalues of the signed correction dropped by :meth:`get_posterior` (empty: exact).

    Examples
    --------
    >>> import pyro, pyro.distributions as dist
    >>> def model():
    ...     pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
    >>> pf = Pathfinder(model).fit(generator=torch.Generator().manual_seed(0))
    >>> pf.get_posterior().mean.abs().max() < 1e-4
    tensor(True)
    """

    def __init__(self, model: Optional[Callable] = None, *, log_density: Optional[Callable] = None,
                 dim: Optional[int] = None, num_paths: int = 1, history_size: int = HISTORY_SIZE, max_iters: int = 1000,
                 num_elbo_draws: int = 25, num_draws_per_path: int = 1000, init_radius: float = 2.0,
                 init: Optional[Tensor] = None, tol_rel_obj: float = TOL_REL_OBJ, tol_grad: float = 1e-8,
                 init_loc_fn: Optional[Callable] = None, dtype: torch.dtype = torch.float64):
        name = type(self).__name__
        if (model is None) == (log_density is None):
            raise ValueError(f"{name}: exactly one of model and log_density must be given, got "
                             f"model={model!r}, log_density={log_density!r}.")
        if log_density is not None:
            dim = _check_int(name, "dim", dim, 1) if dim is not None else None
            if dim is None:
                raise ValueError(f"{name}: dim must be an integer >= 1 with log_density, got None.")
        self.model = model
        self._log_density = log_density
        self.dim = dim
        self.num_paths = _check_int(name, "num_paths", num_paths, 1)
        self.history_size = _check_int(name, "history_size", history_size, 1)
        self.max_iters = _check_int(name, "max_iters", max_iters, 1)
        self.num_elbo_draws = _check_int(name, "num_elbo_draws", num_elbo_draws, 1)
        self.num_draws_per_path = _check_int(name, "num_draws_per_path", num_draws_per_path, 2)
        self.init_radius = float(init_radius)
        self.init = init
        self.tol_rel_obj = float(tol_rel_obj)
        self.tol_grad = float(tol_grad)
        self.init_loc_fn = init_loc_fn
        self.dtype = dtype
        self.paths_: Optional[List[_Gaussian]] = None

    # ------------------------------------------------------------------ the log density
    def _setup(self, args, kwargs) -> Callable[[Tensor], Tensor]:
        if self._log_density is not None:
            return self._log_density
        log_density, self.dim = model_log_density(self.model, args, kwargs, self.init_loc_fn)
        return log_density

    def _value_and_grad(self, x: Tensor):
        self._ngrad += 1
        x = x.detach().requires_grad_(True)
        lp = self._lp(x)
        (g,) = torch.autograd.grad(lp, x)
        return float(lp.detach()), g.detach()

    def _values(self, z: Tensor) -> Tensor:
        out = []
        with torch.no_grad():
            for row in z:
                self._ndens += 1
                try:
                    v = self._lp(row)
                    out.append(float(v))
                except (ValueError, RuntimeError):  # outside the support of a model's checks
                    out.append(float("-inf"))
        t = torch.tensor(out, dtype=z.dtype)
        return torch.where(torch.isnan(t), torch.full_like(t, float("-inf")), t)

    # ------------------------------------------------------------------ one path (Algorithms 1-4)
    def _path(self, x0: Tensor, generator) -> tuple:
        D = x0.shape[0]
        lp, glp = self._value_and_grad(x0)
        f, g = -lp, -glp
        alpha = torch.ones(D, dtype=x0.dtype)
        S: List[Tensor] = []
        Y: List[Tensor] = []
        best: Optional[_Gaussian] = None
        # common random numbers: every iterate's ELBO from the same standard normals, so that the choice
        # among nearly equal Gaussians late on the path is not decided by Monte Carlo noise
        u = torch.randn(self.num_elbo_draws, D, dtype=x0.dtype, generator=generator)
        x = x0
        for it in range(1, self.max_iters + 1):
            d = -_two_loop(g, S, Y, alpha)
            gd = float(g @ d)
            if not gd < 0:  # not a descent direction: restart from steepest descent
                d, gd, S, Y = -g, -float(g @ g), [], []
            step = 1.0 if S else min(1.0, 1.0 / max(float(g.norm()), 1e-12))
            accepted = False
            for _ in range(40):  # backtracking with the Armijo condition
                x_new = x + step * d
                try:
                    lp_new, glp_new = self._value_and_grad(x_new)
                except (ValueError, RuntimeError):
                    lp_new, glp_new = float("-inf"), None
                if math.isfinite(lp_new) and -lp_new <= f + 1e-4 * step * gd and torch.isfinite(glp_new).all():
                    accepted = True
                    break
                step *= 0.5
            if not accepted:
                break
            f_new, g_new = -lp_new, -glp_new
            s, y = x_new - x, g_new - g
            sy = float(s @ y)
            if sy > 2.2e-16 * float(y @ y):  # the curvature condition (paper Alg. 1, line 7)
                # Gilbert-Lemarechal diagonal update of alpha (paper Alg. 3, lines 3-5)
                a = float(y @ (alpha * y))
                c = float(s @ (s / alpha))
                alpha_new = 1.0 / (a / (alpha * sy) + y * y / sy - a * (s / alpha) ** 2 / (c * sy))
                if torch.isfinite(alpha_new).all() and (alpha_new > 0).all():
                    alpha = alpha_new
                S.append(s)
                Y.append(y)
                if len(S) > self.history_size:
                    S.pop(0)
                    Y.pop(0)
            rel = abs(f_new - f) / max(abs(f_new), abs(f), 1.0)
            x, f, g = x_new, f_new, g_new
            if S:
                approx = _bfgs_gaussian(x, g, alpha, S, Y, it)
                if approx is not None:
                    phi, logq = approx.draw(self.num_elbo_draws, u=u)
                    logp = self._values(phi)
                    approx.elbo = float((logp - logq).mean()) if torch.isfinite(logp).all() else float("-inf")
                    if best is None or approx.elbo > best.elbo:
                        best = approx
            if rel < self.tol_rel_obj or float(g.abs().max()) < self.tol_grad:
                break
        if best is None:
            raise RuntimeError(f"{type(self).__name__}: L-BFGS made no accepted step with positive curvature from "
                               "its initial point; try another init or seed.")
        return best

    # ------------------------------------------------------------------ public verbs
    def fit(self, *args, generator: Optional[torch.Generator] = None, **kwargs) -> "Pathfinder":
        """Run the path(s); the model's ``args``/``kwargs`` follow.

        Returns
        -------
        Pathfinder
            ``self``, with :attr:`paths_`, :attr:`elbo_`, :attr:`num_grad_evals_`, :attr:`num_density_evals_`.

        Raises
        ------
        RuntimeError
            If no path makes a step with positive curvature.
        """
        self._lp = self._setup(args, kwargs)
        self._ngrad = 0
        self._ndens = 0
        D = self.dim
        paths, failures = [], []
        for _ in range(self.num_paths):
            if self.init is not None:
                x0 = torch.as_tensor(self.init, dtype=self.dtype).detach().clone().reshape(D)
            else:
                x0 = (torch.rand(D, dtype=self.dtype, generator=generator) * 2 - 1) * self.init_radius
            try:
                paths.append(self._path(x0, generator))
            except RuntimeError as err:  # multi-path goes on without a path that made no step
                failures.append(err)
        if not paths:
            raise failures[0]
        self.num_failed_paths_ = len(failures)
        self.paths_ = paths
        self.best_ = max(paths, key=lambda p: p.elbo)
        self.elbo_ = self.best_.elbo
        F, psi, clipped = self.best_.factor_form()
        self._factor_form = (F, psi)
        self.clipped_ = clipped
        self.num_grad_evals_ = self._ngrad
        self.num_density_evals_ = self._ndens
        return self

    def _check_fit(self, what: str) -> None:
        if self.paths_ is None:
            raise RuntimeError(f"{type(self).__name__}: {what} needs a fitted Pathfinder; call fit() first.")

    def get_posterior(self) -> StableLowRankMultivariateNormal:
        """The best path's Gaussian in the family's covariance form :math:`N(\\mu, FF^\\top + \\Psi)`.

        Exact when :attr:`clipped_` is empty; else the negative part of the signed correction is dropped (the
        module docstring). Multi-path: the path of the highest ELBO (the importance-resampled mixture is what
        :meth:`sample` draws).

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        """
        self._check_fit("get_posterior()")
        F, psi = self._factor_form
        if F.shape[1] == 0:
            F = psi.new_zeros(psi.shape[0], 1)
        return StableLowRankMultivariateNormal(self.best_.mu, F, psi)

    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Draws in the unconstrained space, (num_samples, D) or (D,) when ``num_samples`` is None.

        Single path: draws of :meth:`get_posterior` (the chosen Pathfinder Gaussian, Algorithm 4, with any
        negative eigenvalues of its correction clipped: :attr:`clipped_`; the exact Gaussian's draws are
        ``best_.draw(n, generator)[0]``). Multi-path: each path draws
        ``num_draws_per_path``; the pool is resampled (with replacement) by PSIS-smoothed weights
        (Algorithm 5). The importance diagnostics of the last call are in :attr:`khat_` (multi-path).

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        ValueError
            If ``num_samples`` is not None or an integer >= 1.
        """
        self._check_fit("sample()")
        if num_samples is not None:
            _check_int(type(self).__name__, "num_samples", num_samples, 1)
        if self.num_paths == 1:
            return draw(type(self).__name__, self.get_posterior(), num_samples, generator)
        out = self._resample(1 if num_samples is None else num_samples, generator)
        return out[0] if num_samples is None else out

    def log_importance_ratios(self, z: Tensor) -> Tensor:
        """``log p(z) - log q(z)`` of draws ``z`` (n, D) under the single-path Gaussian (counted evaluations)."""
        self._check_fit("log_importance_ratios()")
        return self._values(z) - self.best_.log_prob(z)

    def _resample(self, n: int, generator) -> Tensor:
        import numpy as np

        from pyro_fa.metrics.transport import psis_log_weights

        draws, ratios = [], []
        for path in self.paths_:
            phi, logq = path.draw(self.num_draws_per_path, generator)
            draws.append(phi)
            ratios.append(self._values(phi) - logq)
        pool = torch.cat(draws)
        lw, self.khat_ = psis_log_weights(torch.cat(ratios).numpy())
        w = torch.as_tensor(np.exp(lw), dtype=pool.dtype)
        idx = torch.multinomial(w / w.sum(), n, replacement=True, generator=generator)
        return pool[idx]

    def to_guide(self, rank: Optional[int] = None, *args, **kwargs):
        """A new :class:`~pyro_fa.infer.AutoLowRankFactorGuide` of ``self.model`` set to this posterior
        (:meth:`init_guide`): SVI with :class:`~pyro_fa.infer.FactorELBO` can go on from it, and it is a guide for
        Pyro's ``Predictive``. ``args``/``kwargs`` are the model's (the guide is run once on them).

        Raises
        ------
        RuntimeError
            Before :meth:`fit`, or when the Pathfinder was built on a ``log_density`` (no model).
        """
        self._check_fit("to_guide()")
        return guide_of_model(self, rank, args, kwargs)

    def init_guide(self, guide) -> None:
        """Set an :class:`~pyro_fa.infer.AutoLowRankFactorGuide` (already set up, rank K) to :meth:`get_posterior`.

        loc = :math:`\\mu`; with :math:`\\Sigma \\approx FF^\\top + \\Psi` (rank r): if r > K, the K leading
        columns are kept and the dropped columns' diagonal is added to :math:`\\Psi` (the marginal variances stay);
        if r < K, small random columns (1e-2 of the scale) fill the rest. Then ``scale`` = :math:`\\sqrt{\\Psi}`
        (its mean for ``noise="isotropic"``) and ``factor`` = :math:`\\operatorname{diag}(s)^{-1} F`.
        A guide built with ``loc_scale=`` (a whitened mean) gets ``loc_scale`` = the marginal s.d. of
        :meth:`get_posterior`: SVI from there then steps the mean in posterior s.d. (recommended: Adam's step is
        about its rate whatever the scale, which on a tight posterior undoes the initialisation).

        Raises
        ------
        RuntimeError
            Before :meth:`fit`, or if the guide has not run yet.
        ValueError
            If the guide's latent dimension is not :attr:`dim`.
        """
        self._check_fit("init_guide()")
        guide._check_setup("Pathfinder.init_guide()")
        set_guide_to(self.get_posterior(), guide, type(self).__name__)
