r"""A factor-analysis Laplace approximation of a Pyro model at its ``AutoDelta`` MAP, as a guide for ``Predictive``.

Pyro's own :class:`pyro.infer.autoguide.AutoLaplaceApproximation` forms the dense :math:`D\times D` Hessian of
the negative log joint (``torch.autograd.functional.hessian``) and inverts it. :class:`PyroFactorLaplace` keeps
:math:`O(DK)` memory: in the unconstrained coordinates :math:`u` of the latent sites, at the MAP :math:`u_*`,

.. math::

    P = \mathrm{diag}(h) + FF^\top + \Psi, \qquad
    h = \mathrm{diag}\,\nabla^2_u\big[-\log p(z(u)) - \log|\det \partial z/\partial u|\big], \qquad
    FF^\top + \Psi \approx \mathbb E_{\tilde y \sim p(y \mid z(u_*))}\big[g g^\top\big],\;
    g = \nabla_u \log p(\tilde y \mid z(u)),

the prior's curvature exactly (one Hessian-vector product with the ones vector: exact when the latent sites'
priors and transforms act coordinate by coordinate, as ``dist.Normal(...).to_event()`` priors do) and the
likelihood's by the Monte Carlo Fisher of the observed sites (Kunstner, Hennig & Balles 2019, §3: observations
simulated from the model, not the data, so it is not the biased empirical Fisher), whose ``num_samples``
gradients the factor-analysis core fits (:func:`~pyro_fa.laplace.moment.fit_second_moment`). For a model whose
observations are Gaussian or categorical in a linear predictor, the Fisher is the Hessian, and the approximation
converges to Pyro's ``AutoLaplaceApproximation`` as ``num_samples`` grows (with ``rank >= D``).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
from torch import Tensor

from pyro_fa.laplace.moment import fit_second_moment
from pyro_fa.distributions import LowRankPrecisionNormal
from pyro_fa.swag.guide import FactorPosteriorGuide

__all__ = ["PyroFactorLaplace"]


#: the largest D whose precision is formed densely to re-split it (as fit_second_moment's dense_max_dim)
_DENSE_MAX_DIM = 1024


def _grad(output: Tensor, u: Tensor, **kwargs) -> Tensor:
    """``torch.autograd.grad(output, u)``, zero where ``output`` has no graph to ``u`` (a flat prior's log density,
    a constant gradient): such a term contributes no gradient or curvature."""
    if not output.requires_grad:
        return torch.zeros_like(u)
    grad = torch.autograd.grad(output, u, allow_unused=True, **kwargs)[0]
    return torch.zeros_like(u) if grad is None else grad


def _coordinate_names(names: List[str], shapes: List[torch.Size]) -> List[str]:
    """The unconstrained coordinates' names, ``"beta[0]"`` (``"sigma"`` for a scalar site)."""
    out = []
    for n, shape in zip(names, shapes):
        out.extend([n] if len(shape) == 0 else
                   [f"{n}[{','.join(str(int(i)) for i in idx)}]"
                    for idx in zip(*torch.unravel_index(torch.arange(shape.numel()), shape))])
    return out


def _positive_split(F: Tensor, diag: Tensor, coords: List[str], owner: str):
    r"""``(U, a)`` with :math:`\mathrm{diag}(a) + UU^\top = P = \mathrm{diag}(d) + FF^\top` and :math:`a > 0`, where
    :math:`d` has entries :math:`\le 0` (a flat prior's zero curvature plus ``psi = 0`` at ``rank >= D``).

    :math:`P` is formed densely (:math:`D \le` ``_DENSE_MAX_DIM``) and Jacobi-scaled,
    :math:`R = S^{-1/2} P S^{-1/2}` with :math:`S = \mathrm{diag}(P)`; with :math:`\mu = \lambda_{\min}(R) > 0`,
    :math:`a = \tfrac\mu2 \mathrm{diag}(P)` and :math:`U = S^{1/2} V (\Lambda - \tfrac\mu2)^{1/2}`, exactly
    :math:`P`. A :math:`P` that is not positive definite (a coordinate with no curvature from the prior or the
    likelihood) is an improper posterior: refused, naming the coordinates.
    """
    D = diag.shape[0]
    bad = [coords[i] for i in (diag <= 0).nonzero().flatten().tolist()]
    if D > _DENSE_MAX_DIM:
        raise ValueError(f"{owner}: the prior's curvature plus the Fisher's diagonal must be positive at D > "
                         f"{_DENSE_MAX_DIM}, got {float(diag.min())!r} at {bad[:10]!r}; the posterior is improper "
                         "there or the prior is not log-concave at the MAP.")
    wide = torch.float64
    P = F.to(wide) @ F.to(wide).T + torch.diag(diag.to(wide))
    s = P.diagonal().clone()
    if not bool((s > 0).all()):
        zero = [coords[i] for i in (s <= 0).nonzero().flatten().tolist()]
        raise ValueError(f"{owner}: the Laplace precision (the Hessian of the negative log joint at the MAP) must be "
                         f"positive definite, got a diagonal of {float(s.min())!r} at {zero[:10]!r}: no curvature "
                         "from the prior (flat) nor the likelihood there, so the posterior is improper.")
    r = s.rsqrt()
    lam, V = torch.linalg.eigh(r.unsqueeze(-1) * P * r)
    if not float(lam[0]) > D * torch.finfo(wide).eps * float(lam[-1]):
        v = V[:, 0].abs()
        worst = [coords[i] for i in (v > 0.1 * v.max()).nonzero().flatten().tolist()]
        raise ValueError(f"{owner}: the Laplace precision (the Hessian of the negative log joint at the MAP) must be "
                         f"positive definite, got a smallest scaled eigenvalue of {float(lam[0])!r} along "
                         f"{worst[:10]!r}: the posterior is improper (or the prior not log-concave) in that direction.")
    mu = 0.5 * float(lam[0])
    U = s.sqrt().unsqueeze(-1) * V * (lam - mu).clamp_min(0).sqrt()
    return U.to(F.dtype), (mu * s).to(diag.dtype)


class _FromParamStore:
    from_param_store = True  # FactorPosteriorGuide maps the draws through biject_to(support)


class PyroFactorLaplace:
    r"""Laplace approximation :math:`N(u_*, P^{-1})` of a Pyro model in unconstrained coordinates, at ``AutoDelta``'s MAP.

    Parameters
    ----------
    model : callable
        The Pyro model ``AutoDelta`` was fitted to.
    prefix : str, default "AutoDelta"
        The guide's name: the MAP is read from Pyro's param store entries ``prefix + "." + site``.
    rank : int, default 20
        :math:`K`; ``rank >= D`` keeps the Monte Carlo Fisher exactly.
    num_samples : int, default 256
        Simulated data sets (gradients) for the Monte Carlo Fisher.
    seed : int, default 0

    Attributes
    ----------
    loc : Tensor of shape (D,)
        :math:`u_*`, the unconstrained MAP.
    cov_factor : Tensor of shape (D, K)
    cov_diag : Tensor of shape (D,)
        The fitted Fisher :math:`FF^\top + \Psi`.
    prior_curvature : Tensor of shape (D,)
        :math:`h`.

    Notes
    -----
    :meth:`fit` costs one trace of the model for the MAP, one Hessian-vector product for :math:`h`, and
    ``num_samples`` simulations and gradients; memory :math:`O(DK)` besides the fit of the second moment.

    References
    ----------
    Pyro's ``AutoLaplaceApproximation`` (dense); Daxberger et al., *Laplace Redux*, NeurIPS 2021, §2;
    Kunstner, Hennig & Balles, *Limitations of the empirical Fisher approximation*, NeurIPS 2019, §3.
    """

    def __init__(self, model: Callable, prefix: str = "AutoDelta", rank: int = 20, num_samples: int = 256,
                 seed: int = 0):
        name = type(self).__name__
        if not callable(model):
            raise TypeError(f"{name}: model must be a callable Pyro model, got {type(model).__name__}.")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"{name}: prefix must be a non-empty str (the AutoDelta guide's name), got {prefix!r}.")
        for arg, value in (("rank", rank), ("num_samples", num_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be an integer >= 1, got {value!r}.")
        self.model, self.prefix, self.rank, self.num_samples, self.seed = model, prefix, rank, num_samples, seed
        self._source = _FromParamStore()
        self._names: Optional[List[str]] = None
        self._shapes: Optional[List[torch.Size]] = None
        self._posterior: Optional[LowRankPrecisionNormal] = None

    # ------------------------------------------------------------------ the protocol of FactorPosteriorGuide
    def site_names(self) -> List[str]:
        """The latent sites, in flattening order."""
        self._check_fitted("site_names()")
        return list(self._names)

    def _split(self, theta: Tensor) -> List[Tensor]:
        return list(theta.split([s.numel() for s in self._shapes]))

    def get_posterior(self) -> LowRankPrecisionNormal:
        r"""The Laplace approximation :math:`N(u_*, P^{-1})` over the unconstrained latent vector (D,).

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        """
        self._check_fitted("get_posterior()")
        return self._posterior

    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Unconstrained draws, shape (D,) (``num_samples=None``) or (num_samples, D).

        ``get_posterior().rsample``: with a ``generator`` (on any device) the draws are its (the global generator
        untouched); without one, the global's.
        """
        self._check_fitted("sample()")
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                        or num_samples < 1):
            raise ValueError(f"{type(self).__name__}: num_samples must be an integer >= 1 or None, got "
                             f"{num_samples!r}.")
        shape = () if num_samples is None else (num_samples,)
        return self._posterior.rsample(shape, generator=generator)

    def to_guide(self, model: Optional[Callable] = None) -> FactorPosteriorGuide:
        """A guide for ``pyro.infer.Predictive(model, guide=..., num_samples=S)`` drawing the latent sites."""
        self._check_fitted("to_guide()")
        return FactorPosteriorGuide(self.model if model is None else model, [self])

    def _check_fitted(self, what: str) -> None:
        if self._posterior is None:
            raise RuntimeError(f"{type(self).__name__}: {what} needs fit(*args, **kwargs) first.")

    # ------------------------------------------------------------------ fit
    def fit(self, *args, **kwargs) -> "PyroFactorLaplace":
        r"""Fit at the MAP in Pyro's param store; ``args`` / ``kwargs`` are the model's (its data).

        Raises
        ------
        RuntimeError
            No ``prefix.*`` entries in the param store, or a model without observed sites.
        ValueError
            A latent site without a MAP value, or an improper posterior: a coordinate with no curvature from the
            prior (flat, or log prior linear in it) nor the likelihood, or a precision
            :math:`\mathrm{diag}(h) + FF^\top + \Psi` that is not positive definite, the coordinates named (the
            previous fit, if any, is kept).

        Notes
        -----
        A term without a graph to the latents (a flat prior) contributes zero curvature. ``pyro.deterministic``
        sites are not observations. Where :math:`h + \psi` has zeros but the precision is positive definite (a flat
        prior at ``rank >= D``, where :math:`\psi = 0`), the posterior's precision is re-split densely
        (:math:`D \le 1024`) into a positive diagonal plus a low-rank part, the same matrix.
        """
        import pyro
        import pyro.poutine as poutine
        from pyro.poutine.util import site_is_subsample
        from torch.distributions import biject_to

        name = type(self).__name__
        store = dict(pyro.get_param_store().named_parameters())
        head = self.prefix + "."
        found = {k[len(head):]: v.detach() for k, v in store.items() if k.startswith(head)}
        if not found:
            raise RuntimeError(f"{name}: Pyro's param store must hold the MAP as {head + '*'!r} entries, got "
                               f"{sorted(store)!r}. Fit an AutoDelta guide with SVI first, or pass prefix=.")
        constrained = {k: pyro.param(head + k).detach() for k in found}
        trace = poutine.trace(poutine.condition(self.model, data=constrained)).get_trace(*args, **kwargs)
        latent = [(n, s) for n, s in trace.nodes.items() if s["type"] == "sample" and not s["is_observed"]
                  and not site_is_subsample(s)]
        # pyro.deterministic sites are observed Delta sites: not data (conditioning one on a simulated value
        # would cut the likelihood's graph to the latents)
        observed = [n for n, s in trace.nodes.items() if s["type"] == "sample" and s["is_observed"]
                    and n not in constrained and not s["infer"].get("_deterministic", False)]
        missing = [n for n, _ in latent if n not in found]
        if missing:
            raise ValueError(f"{name}: every latent site must have a MAP in the param store, got {missing!r} "
                             f"without {head}<site> entries.")
        if not observed:
            raise RuntimeError(f"{name}: the model must have observed sites (its likelihood), got none.")
        names = [n for n, _ in trace.nodes.items() if n in found]
        supports = {n: trace.nodes[n]["fn"].support for n in names}
        shapes = [found[n].shape for n in names]  # set on self once the fit is accepted
        u_star = torch.cat([found[n].reshape(-1) for n in names])
        sizes = [s.numel() for s in shapes]

        def constrain(u: Tensor):
            out, logdet = {}, u.new_zeros(())
            for n, piece, shape in zip(names, u.split(sizes), shapes):
                t = biject_to(supports[n])
                x = t(piece.reshape(shape))
                out[n] = x
                logdet = logdet + t.log_abs_det_jacobian(piece.reshape(shape), x).sum()
            return out, logdet

        def log_terms(u: Tensor, data: dict):
            values, logdet = constrain(u)
            tr = poutine.trace(poutine.condition(self.model, data={**values, **data})).get_trace(*args, **kwargs)
            prior = sum(tr.nodes[n]["fn"].log_prob(tr.nodes[n]["value"]).sum() for n in names) + logdet
            lik = sum(tr.nodes[n]["fn"].log_prob(tr.nodes[n]["value"]).sum() for n in observed)
            return prior, lik

        # prior curvature: diag of the Hessian of -log prior(u), one Hessian-vector product with ones
        # (a flat prior, or one linear in u, has no graph to u or a constant gradient: zero curvature)
        u = u_star.clone().requires_grad_(True)
        g = _grad(-log_terms(u, {})[0], u, create_graph=True)
        h = _grad(g, u, grad_outputs=torch.ones_like(g)).detach()
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            sims = []
            for _ in range(self.num_samples):
                with torch.no_grad():
                    values, _ = constrain(u_star)
                    sim = poutine.trace(poutine.condition(poutine.uncondition(self.model), data=values)).get_trace(
                        *args, **kwargs)
                sims.append({n: sim.nodes[n]["value"].detach() for n in observed})

        seen = torch.zeros_like(u_star, dtype=torch.bool)  # coordinates the likelihood's gradients ever move

        def passes():
            for data in sims:
                u = u_star.clone().requires_grad_(True)
                v = _grad(log_terms(u, data)[1], u).detach()
                seen.logical_or_(v != 0)
                yield v.unsqueeze(0)

        F, psi, fit_info = fit_second_moment(passes, u_star.numel(), self.rank, seed=self.seed,
                                                  dtype=u_star.dtype, device=u_star.device, owner=name)
        coords = _coordinate_names(names, shapes)
        flat = [coords[i] for i in ((h <= 0) & ~seen).nonzero().flatten().tolist()]
        if flat:
            raise ValueError(f"{name}: the Laplace precision (the Hessian of the negative log joint at the MAP) must be "
                             f"positive definite, got no curvature from the prior (flat) nor the likelihood at "
                             f"{flat[:10]!r}: the posterior is improper there.")
        prec_factor, prec_diag = F, h + psi
        if not bool((prec_diag > 0).all()):  # e.g. a flat prior with psi = 0 (rank >= D): re-split P, or refuse
            prec_factor, prec_diag = _positive_split(F, prec_diag, coords, name)
        self._names, self._shapes, self.fit_info = names, shapes, fit_info
        self.loc, self.cov_factor, self.cov_diag, self.prior_curvature = u_star, F, psi, h
        self._posterior = LowRankPrecisionNormal(u_star, prec_factor, prec_diag)
        return self
