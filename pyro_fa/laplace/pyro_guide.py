r"""A factor-analysis Laplace approximation of a Pyro model at its ``AutoDelta`` MAP, as a guide for ``Predictive``.

Pyro's own :class:`pyro.infer.autoguide.AutoLaplaceApproximation` forms the dense :math:`D\times D` Hessian of
the negative log joint (``torch.autograd.functional.hessian``) and inverts it. :class:`PyroFactorLaplace` keeps
:math:`O(DK)` memory: in the unconstrained coordinates :math:`u` of the latent sites, at the MAP :math:`u_*`,

.. math::

    P = H + FF^\top + \Psi, \qquad
    H = \nabla^2_u\big[-\log p(z(u)) - \log|\det \partial z/\partial u|\big], \qquad
    FF^\top + \Psi \approx \mathbb E_{\tilde y \sim p(y \mid z(u_*))}\big[g g^\top\big],\;
    g = \nabla_u \log p(\tilde y \mid z(u)),

where the prior term also holds the model's ``pyro.factor`` terms (part of the log joint, not data). Its curvature
is kept exactly: for :math:`D \le 1024` the full Hessian :math:`H` of the negative log prior (:math:`D`
Hessian-vector products), coupling included (a centred hierarchical prior couples :math:`\theta_j`, :math:`\mu`
and :math:`\log\tau`; a correlated ``MultivariateNormal`` prior its coordinates), so that
:math:`P = H + FF^\top + \Psi`, re-split into a positive diagonal plus a low-rank part where :math:`H` is not
diagonal; above it, only :math:`h = \mathrm{diag}\,H`: exact when :math:`H` is diagonal (the priors and transforms
act coordinate by coordinate, as ``dist.Normal(...).to_event()`` priors do), else Hutchinson's estimate, the
off-diagonal coupling dropped (with a warning). The likelihood's curvature is the Monte Carlo Fisher of the
observed sites (Kunstner, Hennig & Balles 2019, §3: observations simulated from the model, not the data, so it is
not the biased empirical Fisher), whose ``num_samples`` gradients the factor-analysis core fits
(:func:`~pyro_fa.laplace.moment.fit_second_moment`). For a model whose observations are Gaussian or categorical in
a linear predictor, the Fisher is the Hessian, and the approximation converges to Pyro's
``AutoLaplaceApproximation`` as ``num_samples`` grows (with ``rank >= D``).
"""
from __future__ import annotations

import math
import warnings
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


def _prior_hessian(g: Tensor, u: Tensor) -> Tensor:
    """The dense Hessian of the negative log prior, row by row: :math:`D` Hessian-vector products
    :math:`He_i` of its gradient ``g`` (``create_graph=True``), symmetrized."""
    D = u.numel()
    if not g.requires_grad:  # a flat prior, or one linear in u
        return u.new_zeros(D, D)
    eye = torch.eye(D, dtype=u.dtype, device=u.device)
    H = torch.stack([_grad(g, u, grad_outputs=eye[i], retain_graph=True).detach() for i in range(D)])
    return 0.5 * (H + H.T)


def _prior_diagonal(g: Tensor, u: Tensor, probes: int, seed: int):
    r"""``(h, coupled, hvps)``: the diagonal of the Hessian :math:`H` of the negative log prior at large :math:`D`.

    The row sums :math:`r = H\mathbf 1` are the diagonal exactly when :math:`H` is diagonal, which holds iff
    :math:`Hz = r \odot z` for a Gaussian :math:`z` (:math:`(H - \mathrm{diag}(r))z` is zero almost surely only
    when :math:`H` has no off-diagonal entries): then ``h = r``. Otherwise (``coupled``) Hutchinson's estimate
    :math:`h = \frac1S \sum_s v_s \odot Hv_s` over ``probes`` :math:`S` Rademacher probes (Bekas, Kokiopoulou &
    Saad 2007, eq. 2.1): unbiased, with standard deviation :math:`\lVert H_{i,-i}\rVert / \sqrt S` in
    coordinate :math:`i`.
    """
    if not g.requires_grad:
        return torch.zeros_like(u), False, 0
    gen = torch.Generator(device=u.device).manual_seed(seed)
    r = _grad(g, u, grad_outputs=torch.ones_like(g), retain_graph=True).detach()
    z = torch.randn(u.shape, generator=gen, dtype=u.dtype, device=u.device)
    Hz = _grad(g, u, grad_outputs=z, retain_graph=True).detach()
    scale = float(torch.maximum((r * z).abs().max(), Hz.abs().max()))
    if float((Hz - r * z).abs().max()) <= math.sqrt(torch.finfo(u.dtype).eps) * scale:
        return r, False, 2
    h = torch.zeros_like(u)
    for _ in range(probes):
        v = torch.randint(0, 2, u.shape, generator=gen, device=u.device).to(u.dtype).mul_(2).sub_(1)
        h += v * _grad(g, u, grad_outputs=v, retain_graph=True).detach()
    return h / probes, True, 2 + probes


def _coordinate_names(names: List[str], shapes: List[torch.Size]) -> List[str]:
    """The unconstrained coordinates' names, ``"beta[0]"`` (``"sigma"`` for a scalar site)."""
    out = []
    for n, shape in zip(names, shapes):
        out.extend([n] if len(shape) == 0 else
                   [f"{n}[{','.join(str(int(i)) for i in idx)}]"
                    for idx in zip(*torch.unravel_index(torch.arange(shape.numel()), shape))])
    return out


def _positive_split(P: Tensor, coords: List[str], owner: str):
    r"""``(U, a)`` with :math:`\mathrm{diag}(a) + UU^\top = P` and :math:`a > 0`, for a dense precision :math:`P`
    whose diagonal-plus-low-rank form :math:`\mathrm{diag}(h + \psi) + FF^\top` has entries
    :math:`h + \psi \le 0` (a flat prior's zero curvature plus ``psi = 0`` at ``rank >= D``) or that holds the
    prior's off-diagonal curvature (a coupled prior).

    :math:`P` (:math:`D \le` ``_DENSE_MAX_DIM``, float64) is Jacobi-scaled,
    :math:`R = S^{-1/2} P S^{-1/2}` with :math:`S = \mathrm{diag}(P)`; with :math:`\mu = \lambda_{\min}(R) > 0`,
    :math:`a = \tfrac\mu2 \mathrm{diag}(P)` and :math:`U = S^{1/2} V (\Lambda - \tfrac\mu2)^{1/2}`, exactly
    :math:`P`. A :math:`P` that is not positive definite (a coordinate with no curvature from the prior or the
    likelihood) is an improper posterior: refused, naming the coordinates.
    """
    D = P.shape[0]
    wide = torch.float64
    s = P.diagonal().clone()
    if not bool((s > 0).all()):
        zero = [coords[i] for i in (s <= 0).nonzero().flatten().tolist()]
        raise ValueError(f"{owner}: the Laplace precision (the Hessian of the negative log joint at the MAP) must be "
                         f"positive definite, got a diagonal of {float(s.min())!r} at {zero[:10]!r}: the prior and the "
                         "likelihood give no positive curvature there (a flat prior, or one not log-concave at the "
                         "MAP), so the Gaussian is improper.")
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
    return U, mu * s


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
        Seeds the simulated data sets and the probes.
    prior_probes : int, default 100
        Above :math:`D = 1024`, when the prior's Hessian is not diagonal: the Rademacher probes :math:`S` of
        Hutchinson's estimate of its diagonal, whose error in coordinate :math:`i` has standard deviation
        :math:`\lVert H_{i,-i}\rVert / \sqrt S` (a tenth of the off-diagonal row's norm at the default).

    Attributes
    ----------
    loc : Tensor of shape (D,)
        :math:`u_*`, the unconstrained MAP.
    cov_factor : Tensor of shape (D, K)
    cov_diag : Tensor of shape (D,)
        The fitted Fisher :math:`FF^\top + \Psi`.
    prior_curvature : Tensor of shape (D,)
        :math:`h = \mathrm{diag}\,H`, the diagonal of the negative log prior's Hessian (``pyro.factor`` terms
        included).
    fit_info : dict
        The second-moment fit's, plus ``"prior_hessian"``: ``"dense"`` (the full :math:`H`), ``"diagonal"``
        (:math:`H` diagonal, exactly) or ``"hutchinson"`` (estimated, the coupling dropped), and
        ``"prior_hvps"``, the Hessian-vector products spent on :math:`H`.

    Notes
    -----
    :meth:`fit` costs one trace of the model for the MAP, :math:`D` Hessian-vector products for :math:`H`
    (:math:`D \le 1024`; above it 2, plus ``prior_probes`` where :math:`H` is not diagonal), and ``num_samples``
    simulations and gradients. Where :math:`H` has off-diagonal entries (:math:`D \le 1024`) the precision
    :math:`H + FF^\top + \Psi` is formed densely and re-split into a positive diagonal plus a rank-:math:`D`
    factor, the same matrix. **Above** :math:`D = 1024` **the prior's off-diagonal coupling is dropped**: the
    precision is :math:`\mathrm{diag}(h) + FF^\top + \Psi`, exact for priors that act coordinate by coordinate,
    an approximation (warned of) for coupled ones. ``pyro.factor`` terms count as prior terms (their exact
    curvature); a model whose likelihood is all ``pyro.factor`` terms has no Fisher (:math:`F = 0`,
    :math:`\Psi = 0`).

    Every term is weighted as in Pyro's log joint (:mod:`pyro_fa.laplace._pyro_sites`): by its site's ``scale``
    (the :math:`N/B` of a subsampled ``pyro.plate``, ``poutine.scale``) and ``mask`` (``poutine.mask``), as the
    Hessian of the ELBO that ``AutoLaplaceApproximation`` forms. The Monte Carlo Fisher weights each observed
    score by :math:`\sqrt{s}`, so that over a subsampled plate it estimates the **full** data set's Fisher without
    bias (each simulated data set on the subsample that the model draws, its gradient on the same subsample).
    The exact full-data Fisher needs the whole data: call :meth:`fit` with the model arguments that run its plates
    whole (no ``subsample_size`` or ``subsample``), as a model with a latent site in a subsampled plate must be.

    References
    ----------
    Pyro's ``AutoLaplaceApproximation`` (dense); Daxberger et al., *Laplace Redux*, NeurIPS 2021, §2;
    Kunstner, Hennig & Balles, *Limitations of the empirical Fisher approximation*, NeurIPS 2019, §3.
    """

    def __init__(self, model: Callable, prefix: str = "AutoDelta", rank: int = 20, num_samples: int = 256,
                 seed: int = 0, prior_probes: int = 100):
        name = type(self).__name__
        if not callable(model):
            raise TypeError(f"{name}: model must be a callable Pyro model, got {type(model).__name__}.")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"{name}: prefix must be a non-empty str (the AutoDelta guide's name), got {prefix!r}.")
        for arg, value in (("rank", rank), ("num_samples", num_samples), ("prior_probes", prior_probes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be an integer >= 1, got {value!r}.")
        self.model, self.prefix, self.rank, self.num_samples, self.seed = model, prefix, rank, num_samples, seed
        self.prior_probes = prior_probes
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
            No ``prefix.*`` entries in the param store, or a model without observed sites or ``pyro.factor``
            terms.
        ValueError
            A latent site without a MAP value, a latent site in a subsampled plate (fit over the whole plate),
            or an improper posterior: a coordinate with no curvature from the
            prior (flat, or log prior linear in it) nor the likelihood, or a precision
            :math:`H + FF^\top + \Psi` that is not positive definite, the coordinates named (the previous fit, if
            any, is kept).

        Warns
        -----
        UserWarning
            Above :math:`D = 1024`, when the prior's Hessian is not diagonal: its coupling is dropped.

        Notes
        -----
        A term without a graph to the latents (a flat prior) contributes zero curvature. ``pyro.deterministic``
        sites are not observations. Where :math:`h + \psi` has zeros but the precision is positive definite (a flat
        prior at ``rank >= D``, where :math:`\psi = 0`), or where the prior's Hessian :math:`H` is not diagonal, the
        posterior's precision is re-split densely (:math:`D \le 1024`) into a positive diagonal plus a low-rank
        part, the same matrix.
        """
        import pyro
        import pyro.poutine as poutine
        from pyro.distributions import Unit
        from torch.distributions import biject_to

        from pyro_fa.laplace._pyro_sites import map_trace, scaled_log_prob, score_log_prob, subsample_sites

        name = type(self).__name__
        store = dict(pyro.get_param_store().named_parameters())
        head = self.prefix + "."
        found = {k[len(head):]: v.detach() for k, v in store.items() if k.startswith(head)}
        if not found:
            raise RuntimeError(f"{name}: Pyro's param store must hold the MAP as {head + '*'!r} entries, got "
                               f"{sorted(store)!r}. Fit an AutoDelta guide with SVI first, or pass prefix=.")
        constrained = {k: pyro.param(head + k).detach() for k in found}
        trace = map_trace(name, self.model, constrained, args, kwargs, self.seed)
        subsamples = subsample_sites(trace)
        latent = [(n, s) for n, s in trace.nodes.items() if s["type"] == "sample" and not s["is_observed"]
                  and n not in subsamples]
        # pyro.deterministic sites are observed Delta sites: not data (conditioning one on a simulated value
        # would cut the likelihood's graph to the latents)
        # pyro.factor sites are observed Unit sites: terms of the log joint, not data, kept with the prior
        factors = [n for n, s in trace.nodes.items() if s["type"] == "sample" and s["is_observed"]
                   and isinstance(s["fn"], Unit)]
        observed = [n for n, s in trace.nodes.items() if s["type"] == "sample" and s["is_observed"]
                    and n not in constrained and not s["infer"].get("_deterministic", False) and n not in factors
                    and n not in subsamples]
        missing = [n for n, _ in latent if n not in found]
        if missing:
            raise ValueError(f"{name}: every latent site must have a MAP in the param store, got {missing!r} "
                             f"without {head}<site> entries.")
        if not observed and not factors:
            raise RuntimeError(f"{name}: the model must have observed sites or pyro.factor terms (its likelihood), "
                               "got none.")
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
            # weighted by the sites' scale and mask (subsampled plates, poutine.scale / mask); the observed scores
            # by the square root of the scale, for the Fisher of the scaled likelihood
            prior = sum(scaled_log_prob(tr.nodes[n]) for n in names + factors) + logdet
            lik = sum(score_log_prob(tr.nodes[n]) for n in observed)
            return prior, lik

        # prior curvature: the Hessian H of -log prior(u), dense up to _DENSE_MAX_DIM, else its diagonal
        # (a flat prior, or one linear in u, has no graph to u or a constant gradient: zero curvature)
        D = u_star.numel()
        u = u_star.clone().requires_grad_(True)
        with torch.random.fork_rng():  # a subsample drawn by the model: seeded, the global generator untouched
            torch.manual_seed(self.seed)
            g = _grad(-log_terms(u, {})[0], u, create_graph=True)
        coupling = None
        if D <= _DENSE_MAX_DIM:
            H = _prior_hessian(g, u)
            h = H.diagonal().clone()
            if bool((H - torch.diag(h)).ne(0).any()):
                coupling = (H - torch.diag(h)).to(torch.float64)
            prior_info = {"prior_hessian": "dense", "prior_hvps": D if g.requires_grad else 0}
        else:
            h, coupled, hvps = _prior_diagonal(g, u, self.prior_probes, self.seed)
            prior_info = {"prior_hessian": "hutchinson" if coupled else "diagonal", "prior_hvps": hvps}
            if coupled:
                warnings.warn(f"{name}: the prior's Hessian (pyro.factor terms included) is not diagonal, and at D = "
                              f"{D} > {_DENSE_MAX_DIM} only its diagonal is kept (Hutchinson's estimate, "
                              f"{self.prior_probes} probes): the prior's off-diagonal coupling is dropped.",
                              UserWarning, stacklevel=2)
        del g, u
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            sims = []
            for _ in range(self.num_samples if observed else 0):
                with torch.no_grad():
                    values, _ = constrain(u_star)
                    sim = poutine.trace(poutine.condition(poutine.uncondition(self.model), data=values)).get_trace(
                        *args, **kwargs)
                # the subsample the data were simulated on is the one their gradient is taken on
                sims.append({n: sim.nodes[n]["value"].detach() for n in observed + subsamples})

        seen = torch.zeros_like(u_star, dtype=torch.bool)  # coordinates the likelihood's gradients ever move

        def passes():
            for data in sims:
                u = u_star.clone().requires_grad_(True)
                v = _grad(log_terms(u, data)[1], u).detach()
                seen.logical_or_(v != 0)
                yield v.unsqueeze(0)

        if observed:
            F, psi, fit_info = fit_second_moment(passes, D, self.rank, seed=self.seed, dtype=u_star.dtype,
                                                 device=u_star.device, owner=name)
        else:  # the likelihood is all pyro.factor terms, whose curvature H holds
            F, psi, fit_info = u_star.new_zeros(D, self.rank), u_star.new_zeros(D), {"method": None, "passes": 0}
        fit_info = {**fit_info, **prior_info}
        coords = _coordinate_names(names, shapes)
        flat = [coords[i] for i in ((h <= 0) & ~seen).nonzero().flatten().tolist()]
        if flat:
            raise ValueError(f"{name}: the Laplace precision (the Hessian of the negative log joint at the MAP) must be "
                             f"positive definite, got no curvature from the prior (flat) nor the likelihood at "
                             f"{flat[:10]!r}: the posterior is improper there.")
        prec_factor, prec_diag = F, h + psi
        # a coupled prior, or e.g. a flat prior with psi = 0 (rank >= D): re-split P densely, or refuse
        if coupling is not None or not bool((prec_diag > 0).all()):
            if D > _DENSE_MAX_DIM:
                bad = [coords[i] for i in (prec_diag <= 0).nonzero().flatten().tolist()]
                raise ValueError(f"{name}: the prior's curvature plus the Fisher's diagonal must be positive at D > "
                                 f"{_DENSE_MAX_DIM}, got {float(prec_diag.min())!r} at {bad[:10]!r}; the posterior is "
                                 "improper there or the prior is not log-concave at the MAP.")
            wide = torch.float64
            P = F.to(wide) @ F.to(wide).T + torch.diag(prec_diag.to(wide))
            U, a = _positive_split(P if coupling is None else P + coupling, coords, name)
            prec_factor, prec_diag = U.to(F.dtype), a.to(prec_diag.dtype)
        self._names, self._shapes, self.fit_info = names, shapes, fit_info
        self.loc, self.cov_factor, self.cov_diag, self.prior_curvature = u_star, F, psi, h
        self._posterior = LowRankPrecisionNormal(u_star, prec_factor, prec_diag)
        return self
