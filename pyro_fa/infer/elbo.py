r"""``FactorELBO``: an ELBO with the entropy and Gaussian / Laplace prior terms in closed form."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import pyro.poutine as poutine
import torch
from pyro.poutine.messenger import Messenger
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide import AutoContinuous, AutoGuideList
from pyro.infer.elbo import ELBO
from pyro.infer.trace_elbo import Trace_ELBO
from pyro.infer.util import is_validation_enabled, torch_item
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_model_guide_match, check_site_shape, warn_if_nan
from torch import Tensor
from torch.distributions import Independent, LowRankMultivariateNormal, MultivariateNormal

from pyro_fa.infer.priors.closed_forms import base_of, closed_form, expected_log_prob

__all__ = ["FactorELBO", "spherical_radial_rule"]



@dataclass(frozen=True)
class _Sampling:
    """How FactorELBO draws the vectorised particles of an AutoContinuous guide's latent: by the spherical-radial
    rule where it fits (``cubature``, else i.i.d.), refusing where it does not (``required``)."""
    cubature: bool
    required: bool


#: ``sampling`` option -> how the particles are drawn
_SAMPLING = {"auto": _Sampling(cubature=True, required=False), "iid": _Sampling(cubature=False, required=False),
             "spherical-radial": _Sampling(cubature=True, required=True)}
_PARTICLE_PLATE = "num_particles_vectorized"  # the plate Pyro's ELBO vectorises particles with


def spherical_radial_rule(dim: int, num_points: int, *, dtype=None, device=None) -> Tuple[Tensor, Tensor]:
    r"""Randomised spherical-radial cubature for :math:`\mathbb{E}_{\varepsilon \sim N(0, I_d)}[f(\varepsilon)]`.

    The stochastic degree-3 rule of Genz & Monahan (1998): with a Haar-random
    orthogonal :math:`Q` and :math:`\rho^2 \sim \chi^2_{d+2}`,

    .. math::

        \hat I = \Big(1 - \frac{d}{\rho^2}\Big) f(0)
        + \frac{1}{2\rho^2} \sum_{i=1}^{d} \big[f(\rho q_i) + f(-\rho q_i)\big].

    :math:`\mathbb{E}[\hat I] = \mathbb{E}[f(\varepsilon)]` for every integrable
    :math:`f` (unbiased), and :math:`\hat I` is *exact*, draw by draw, for
    every polynomial of degree at most 3. ``num_points // (2d + 1)``
    independent replicates are averaged; leftover points get weight 0.

    Parameters
    ----------
    dim : int
        :math:`d \ge 1`.
    num_points : int
        At least :math:`2d + 1`.
    dtype, device : optional
        Of the returned tensors.

    Returns
    -------
    points : Tensor of shape (num_points, dim)
    weights : Tensor of shape (num_points,)
        Summing to ``num_points`` (equal weights would all be 1), so
        :math:`\hat I = \frac{1}{L}\sum_l w_l f(\varepsilon_l)`. The centre
        weight is negative when :math:`\rho^2 < d`.

    Raises
    ------
    ValueError
        If ``num_points < 2 * dim + 1``.

    References
    ----------
    Genz & Monahan (1998), *Stochastic integration rules for infinite
    regions*, SIAM J. Sci. Comput. 19(2), rule SR_{3,3}.

    Examples
    --------
    >>> eps, w = spherical_radial_rule(3, 8)
    >>> float((w[:, None] * eps.pow(2)).mean(0).sum())  # E|eps|^2 = d, exactly
    3.0...
    """
    n = 2 * dim + 1
    if num_points < n:
        raise ValueError(
            f"spherical_radial_rule: num_points must be >= 2 * dim + 1 = {n}, got {num_points!r}."
        )
    reps, left = divmod(num_points, n)
    kw = {"dtype": dtype or torch.get_default_dtype(), "device": device}
    z = torch.randn(reps, dim + 1, dim + 2, **kw)  # one call: a d x d Gaussian block and d + 2 more normals
    Q, R = torch.linalg.qr(z[:, :dim, :dim])
    rho2 = z[:, dim].pow(2).sum(-1, keepdim=True)  # chi^2 with d + 2 degrees of freedom, shape (reps, 1)
    # rows rho q_i of a Haar-distributed Q (QR with the signs of diag(R) fixed)
    rows = (Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)).transpose(-1, -2)
    rows = rows * rho2.sqrt().unsqueeze(-1)
    points = torch.cat([rows.new_zeros(reps, 1, dim), rows, -rows], 1).reshape(reps * n, dim)
    inv = 1 / rho2
    weights = torch.cat([1 - dim * inv, (0.5 * inv).expand(reps, 2 * dim)], 1).reshape(-1)
    if left:  # leftover points: anywhere, weight 0
        points = torch.cat([points, points.new_zeros(left, dim)])
        weights = torch.cat([weights, weights.new_zeros(left)])
    return points, weights * (num_points / reps)


def _rng_untouched():
    """Run a throw-away trace without consuming the global RNG (CPU and initialised CUDA generators).

    The first call of a new :class:`FactorELBO` traces model and guide once to
    inspect them; forking the RNG keeps a resumed run (param store + RNG state
    restored, new ELBO) bit-identical to an uninterrupted one, as with
    :class:`~pyro.infer.Trace_ELBO`.
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


def _noise_dim(fn) -> Optional[int]:
    """Dimension of the standard-normal noise behind a reparameterised Gaussian, or None."""
    if fn.batch_shape != ():
        return None
    # int(): under the JIT tracer sizes are traced tensors; the structure is static anyway
    if isinstance(fn, LowRankMultivariateNormal):
        return int(fn.cov_factor.shape[-1]) + int(fn.loc.shape[-1])
    if isinstance(fn, MultivariateNormal):
        return int(fn.loc.shape[-1])
    if isinstance(fn, Independent) and type(fn.base_dist).__name__ == "Normal":
        return int(fn.base_dist.loc.numel())
    return None


def _affine(fn, eps: Tensor) -> Tensor:
    """The draw loc + A eps of ``fn`` for noise ``eps`` of shape (L, d), differentiable (as rsample)."""
    if isinstance(fn, LowRankMultivariateNormal):
        K = fn.cov_factor.shape[-1]
        return fn.loc + eps[:, :K] @ fn.cov_factor.T + eps[:, K:] * fn.cov_diag.sqrt()
    if isinstance(fn, MultivariateNormal):
        return fn.loc + eps @ fn.scale_tril.T
    base = fn.base_dist
    return base.loc + eps.reshape((-1,) + base.loc.shape) * base.scale


class _SphericalRadialMessenger(Messenger):
    """Draws the vectorised particles of one AutoContinuous latent by :func:`spherical_radial_rule`."""

    def __init__(self, site_name: str, required: bool, size: int, dim: int):
        super().__init__()
        self.site_name = site_name
        self.required = required
        self.size = size  # the particle plate's size and dim; it is entered outside this messenger
        self.dim = dim
        self.weights: Optional[Tensor] = None

    def _pyro_sample(self, msg) -> None:
        if msg["name"] != self.site_name or msg["value"] is not None or msg["is_observed"]:
            return
        fn = msg["fn"]
        d = _noise_dim(fn)
        if d is None or 2 * d + 1 > self.size:
            if self.required:
                need = "a Gaussian guide" if d is None else f"num_particles >= 2 * d + 1 = {2 * d + 1}"
                raise ValueError(
                    f"FactorELBO: sampling='spherical-radial' needs {need} (d = rank + latent dim), "
                    f"got num_particles={self.size}. Raise num_particles or use sampling='auto'."
                )
            return
        like = fn.loc if hasattr(fn, "loc") else fn.mean
        eps, self.weights = spherical_radial_rule(d, self.size, dtype=like.dtype, device=like.device)
        value = _affine(fn, eps)
        msg["value"] = value.reshape((self.size,) + (1,) * (-self.dim - 1) + tuple(fn.event_shape))


def _auto_continuous_guides(guide) -> List[AutoContinuous]:
    guide = poutine.unwrap(guide) if hasattr(poutine, "unwrap") else guide
    if isinstance(guide, AutoContinuous):
        return [guide]
    if isinstance(guide, AutoGuideList):
        return [g for g in guide if isinstance(g, AutoContinuous)]
    return []


def _analytic_base(fn):
    """The distribution under ``fn``'s ``Independent`` wrappers when its type has a registered closed form, else None.

    The closed forms are those registered with
    :func:`~pyro_fa.infer.priors.register_expected_log_prob` (``Normal``, ``Laplace`` and any
    a user adds); the lookup is :func:`~pyro_fa.infer.priors.closed_form`'s.
    """
    base = base_of(fn)
    return base if closed_form(base) is not None else None


def _prior_parameters(base) -> List[Tensor]:
    """The tensor parameters of a distribution (those its ``arg_constraints`` name)."""
    params = []
    for name in getattr(base, "arg_constraints", {}):
        try:
            value = getattr(base, name)
        except Exception:  # a lazily derived parameterisation (probs/logits) may fail; it is not a leaf
            continue
        if torch.is_tensor(value):
            params.append(value)
    return params


class FactorELBO(ELBO):
    r"""ELBO with closed-form entropy and prior terms for Gaussian autoguides.

    .. math::

        \mathcal{L}(q) = \underbrace{\mathbb{H}[q]}_{\text{closed form}}
        + \sum_{\text{Gaussian/Laplace sites}}\underbrace{\mathbb{E}_q[\log p(\theta_s)]}_{\text{closed form}}
        + \mathbb{E}_q\Big[\log p(y, \theta_{\text{rest}} \mid \theta)
        + \log\Big|\frac{\partial u}{\partial\theta_{\text{rest}}}\Big|\Big]

    For every :class:`~pyro.infer.autoguide.AutoContinuous` guide whose
    posterior has an analytic entropy (:class:`~pyro_fa.AutoLowRankFactorGuide`,
    Pyro's low-rank, multivariate and diagonal normal guides; also inside an
    :class:`~pyro.infer.autoguide.AutoGuideList`):

    * :math:`-\mathbb{E}_q[\log q]` is the entropy
      :math:`\tfrac12\log|2\pi e(FF^\top+\Psi)|` in :math:`O(DK^2)` — the full
      entropy, including its dependence on :math:`F` that Algorithm 3 of
      Brownlie (2021) drops (Jiang 2023, eqs. 7–8, the :math:`-A + CB^\top` terms);
    * for each latent site the guide covers whose prior has a registered
      closed form (:func:`~pyro_fa.infer.priors.register_expected_log_prob`:
      ``Normal``, ``Laplace`` and any a user registers; possibly expanded or
      ``.to_event``-ed, e.g. from :class:`~pyro_fa.GaussianPrior`,
      :class:`~pyro_fa.LaplacePrior` or a :class:`~pyro_fa.infer.priors.FactorisedPrior`)
      with parameters that do not depend on other latent variables,
      :math:`\mathbb{E}_q[\log p]` is computed from the marginals
      :math:`N(c_i, \mathrm{rowsum}(F\odot F)_i + \psi_i)` (Brownlie 2021,
      eqs. 4.48–4.50; Jiang 2023, §1.2).

    Everything else — the likelihood, other latent sites, and the
    log-Jacobian of constrained sites (a ``LogNormal`` or ``HalfCauchy``
    scale) — is estimated by Monte Carlo exactly as in
    :class:`~pyro.infer.Trace_ELBO`, so the estimator has the same
    expectation as ``Trace_ELBO``. Its variance is not always smaller: the
    closed forms remove the prior's and entropy's sampling noise, but
    ``Trace_ELBO``'s draws of :math:`\log p(\theta) - \log q(\theta)` are
    correlated with its likelihood draws and partly cancel them, so near the
    optimum of a likelihood-dominated model the Monte Carlo ``Trace_ELBO``
    loss can be the quieter one (its gradient variance was about equal in
    the tutorial's regression). Priors whose
    parameters depend on other latent variables fall back to Monte Carlo
    (detected once per site by autograd on the first call). Latent sites
    inside (nested) plates get their closed forms elementwise; subsampled
    plates scale the likelihood and the closed-form prior terms of the
    sites inside them by :math:`N/M` as in Pyro (the entropy of the packed
    latent, sampled outside every plate, is not scaled, as in
    ``Trace_ELBO``). Sites with constrained supports (a ``LogNormal``,
    ``HalfCauchy``, ``Beta`` prior) keep their Monte-Carlo prior term and
    log-Jacobian. Guides with non-reparameterisable sites fall back to
    ``Trace_ELBO`` for the whole particle. Discrete sites the model
    enumerates are refused (see Raises); :class:`~pyro.infer.TraceEnum_ELBO`
    handles them with this guide. :class:`~pyro_fa.JitFactorELBO` is the
    compiled variant.

    Parameters
    ----------
    num_particles : int, default 1
    max_plate_nesting : int, default inf
    vectorize_particles : bool, default False
    strict_enumeration_warning, ignore_jit_warnings, retain_graph
        As :class:`~pyro.infer.ELBO`.
    sampling : {"auto", "iid", "spherical-radial"}, default "auto"
        How the vectorised particles of an
        :class:`~pyro.infer.autoguide.AutoContinuous` guide's Gaussian are
        drawn. ``"iid"``: independently, as in Pyro. ``"spherical-radial"``:
        as the points of :func:`spherical_radial_rule` (Genz & Monahan 1998)
        in the :math:`d` dimensions of the standard-normal noise
        (:math:`d = K + D` for a low-rank guide), weighting each particle's
        Monte-Carlo terms; still unbiased, and exact — loss and gradients,
        draw by draw — whenever the Monte-Carlo part is a polynomial of
        degree at most 3 in the latent, e.g. the log-likelihood of a
        linear-Gaussian model. It needs ``vectorize_particles=True`` and
        ``num_particles >= 2d + 1``. ``"auto"``: spherical-radial when that
        holds, i.i.d. otherwise (e.g. for a neural network, whose :math:`d`
        is large).

    Raises
    ------
    ValueError
        If ``sampling`` is unknown, or is ``"spherical-radial"`` without
        vectorised particles, with fewer than :math:`2d + 1` of them (at the
        first call), or with a guide that is not one ``AutoContinuous``;
        and (at the call, before any gradient) if the model has sites
        configured for enumeration that the guide does not sample — use
        :class:`~pyro.infer.TraceEnum_ELBO` for those.

    Notes
    -----
    With i.i.d. particles the reparameterised gradient is noisy even for a
    linear-Gaussian model: the likelihood's gradient at
    :math:`\theta = c + F h + \psi^{1/2} \odot z` carries the terms
    :math:`H(Fh + \psi^{1/2}\odot z)` (and, for :math:`F`, their products with
    :math:`h`), with :math:`H` the likelihood's Hessian; the cubature cancels
    them exactly. The closed-form parts cost :math:`O(DK^2)` per step, independent of the
    number of particles; the Monte-Carlo part costs what ``Trace_ELBO``'s
    does.

    References
    ----------
    Kingma & Welling (2014), *Auto-encoding variational Bayes*, §2.3 (the
    closed-form KL variant); Genz & Monahan (1998), *Stochastic integration
    rules for infinite regions*.
    S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
    University of Edinburgh, 2021, §4.3.
    X. Jiang, *Laplace prior and variational inference probabilistic PCA (VIPPCA)*,
    report, University of Edinburgh, 2023, §1.

    Examples
    --------
    >>> import pyro, pyro.distributions as dist
    >>> from pyro_fa import AutoLowRankFactorGuide
    >>> def model():
    ...     pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    >>> guide = AutoLowRankFactorGuide(model, rank=1)
    >>> loss = FactorELBO().loss(model, guide)  # no likelihood: the exact KL(q || p)
    """

    def __init__(
        self,
        num_particles: int = 1,
        max_plate_nesting: float = float("inf"),
        vectorize_particles: bool = False,
        strict_enumeration_warning: bool = True,
        ignore_jit_warnings: bool = False,
        retain_graph: Optional[bool] = None,
        sampling: str = "auto",
    ):
        if sampling not in _SAMPLING:
            raise ValueError(f"FactorELBO: sampling must be one of {tuple(_SAMPLING)}, got {sampling!r}.")
        if isinstance(num_particles, bool) or not isinstance(num_particles, int) or num_particles < 1:
            raise ValueError(f"FactorELBO: num_particles must be an integer >= 1, got {num_particles!r}.")
        if _SAMPLING[sampling].required and not (vectorize_particles and num_particles > 1):
            raise ValueError(
                "FactorELBO: sampling='spherical-radial' couples the particles of one vectorised draw, "
                f"got num_particles={num_particles!r}, vectorize_particles={vectorize_particles!r}. "
                "Pass vectorize_particles=True and num_particles >= 2 * (rank + D) + 1."
            )
        self.sampling = sampling
        super().__init__(
            num_particles=num_particles,
            max_plate_nesting=max_plate_nesting,
            vectorize_particles=vectorize_particles,
            strict_enumeration_warning=strict_enumeration_warning,
            ignore_jit_warnings=ignore_jit_warnings,
            retain_graph=retain_graph,
        )
        # site name -> True when its prior's parameters depend on other latent variables
        self._prior_depends_on_latents: Dict[str, bool] = {}
        self._warned_fallback = False
        self._rule: Optional[_SphericalRadialMessenger] = None

    # ------------------------------------------------------------------ traces
    def _get_trace(self, model, guide, args, kwargs):
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
        if is_validation_enabled():
            check_model_guide_match(model_trace, guide_trace, self.max_plate_nesting)
        guide_trace = prune_subsample_sites(guide_trace)
        model_trace = prune_subsample_sites(model_trace)
        return model_trace, guide_trace

    def _detect_dependencies(self, model, guide, args, kwargs) -> None:
        """Record, per latent site with a closed-form prior, whether its parameters depend on latents.

        Replays the model against a guide trace whose values are fresh leaf
        tensors and asks autograd whether each prior's parameters reach them.
        """
        with torch.enable_grad(), poutine.block(), _rng_untouched():
            guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
            leaves = []
            for site in guide_trace.nodes.values():
                if site["type"] == "sample" and torch.is_tensor(site["value"]) and site["value"].is_floating_point():
                    site["value"] = site["value"].detach().requires_grad_()
                    leaves.append(site["value"])
            model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
            for name, site in model_trace.nodes.items():
                if site["type"] != "sample" or site["is_observed"]:
                    continue
                base = _analytic_base(site["fn"])
                if base is None:
                    continue
                params = [p for p in _prior_parameters(base) if p.requires_grad]
                depends = False
                if params and leaves:
                    grads = torch.autograd.grad(
                        sum(p.sum() for p in params), leaves, allow_unused=True, retain_graph=True
                    )
                    depends = any(g is not None for g in grads)
                self._prior_depends_on_latents[name] = depends

    def _maybe_detect(self, model, guide, args, kwargs) -> None:
        guides = _auto_continuous_guides(guide)
        if not guides:
            return
        if guides[0].prototype_trace is None:
            with poutine.block():
                guide(*args, **kwargs)  # sets up the prototype
        names = [
            name for g in guides for name, _ in g.prototype_trace.iter_stochastic_nodes()
        ]
        if any(name not in self._prior_depends_on_latents for name in names):
            self._detect_dependencies(model, guide, args, kwargs)
            for name in names:
                self._prior_depends_on_latents.setdefault(name, True)  # no closed form: Monte Carlo

    # --------------------------------------------------------------- estimator
    def _analytic_terms(self, model_trace, guide_trace, guide) -> Tuple[Tensor, set, set]:
        """Closed-form entropy + prior terms; returns (value, skipped guide sites, skipped model sites)."""
        total = 0.0
        skip_guide, skip_model = set(), set()
        for g in _auto_continuous_guides(guide):
            aux_name = "_{}_latent".format(g._pyro_name)
            aux = guide_trace.nodes.get(aux_name)
            if aux is None or aux["mask"] is not None:
                continue
            fn = aux["fn"]
            try:
                entropy = fn.entropy()
            except NotImplementedError:
                continue
            total = total + scale_and_mask(entropy, aux["scale"]).sum()
            skip_guide.add(aux_name)
            try:
                mean, variance = fn.mean, fn.variance
            except NotImplementedError:
                continue
            # mean and variance unpacked separately: a stacked (2, ..., D) tensor would put its extra
            # leading dim where the sites' plate dims go (shape (..., D) -> each site's plate + event shape)
            for (proto, m), (_, v) in zip(g._unpack_latent(mean), g._unpack_latent(variance)):
                name = proto["name"]
                site = model_trace.nodes.get(name)
                if site is None or site["type"] != "sample" or site["is_observed"]:
                    continue
                if self._prior_depends_on_latents.get(name, True):
                    continue
                base = _analytic_base(site["fn"])
                if base is None:
                    continue
                elementwise = expected_log_prob(base, m, v)
                event_dim = site["fn"].event_dim
                term = elementwise.sum(list(range(-event_dim, 0))) if event_dim else elementwise
                total = total + scale_and_mask(term, site["scale"], site["mask"]).sum()
                skip_model.add(name)
                skip_guide.add(name)  # identity transform: the Delta's log-density is 0
        return total, skip_guide, skip_model

    def _elbo_particle(self, model_trace, guide_trace, guide, rule=None) -> Tuple[Tensor, Tensor]:
        reparam = all(
            site["fn"].has_rsample
            for site in guide_trace.nodes.values()
            if site["type"] == "sample" and not site["is_observed"]
        )
        if not reparam:
            if not self._warned_fallback:
                warnings.warn(
                    "FactorELBO: the guide has non-reparameterisable sites; using Trace_ELBO's estimator.",
                    RuntimeWarning,
                )
                self._warned_fallback = True
            model_trace.compute_log_prob()
            guide_trace.compute_score_parts()
            loss, surrogate = Trace_ELBO._differentiable_loss_particle(self, model_trace, guide_trace)
            return torch.as_tensor(loss), surrogate

        analytic, skip_guide, skip_model = self._analytic_terms(model_trace, guide_trace, guide)
        model_trace.compute_log_prob(site_filter=lambda name, site: name not in skip_model)
        guide_trace.compute_log_prob(site_filter=lambda name, site: name not in skip_guide)
        if is_validation_enabled():
            for trace, skip in ((model_trace, skip_model), (guide_trace, skip_guide)):
                for name, site in trace.nodes.items():
                    if site["type"] == "sample" and name not in skip:
                        check_site_shape(site, self.max_plate_nesting)
        weights = None
        if rule is not None and rule.weights is not None:
            weights = rule.weights.reshape((-1,) + (1,) * (-rule.dim - 1))

        def mc_term(site):
            if weights is None:
                return site["log_prob_sum"]
            return (site["log_prob"] * weights).sum()  # the particle dim carries the cubature weights

        elbo = analytic
        for name, site in model_trace.nodes.items():
            if site["type"] == "sample" and name not in skip_model:
                elbo = elbo + mc_term(site)
        for name, site in guide_trace.nodes.items():
            if site["type"] == "sample" and name not in skip_guide:
                elbo = elbo - mc_term(site)
        if not torch.is_tensor(elbo):
            elbo = torch.tensor(float(elbo))
        return -elbo, -elbo

    def _cubature(self, guide) -> Optional[str]:
        """The guide's latent site to draw by the spherical-radial rule, or None for i.i.d. particles."""
        sampling = _SAMPLING[self.sampling]
        if not sampling.cubature or not (self.vectorize_particles and self.num_particles > 1):
            return None
        inner = poutine.unwrap(guide) if hasattr(poutine, "unwrap") else guide
        if not isinstance(inner, AutoContinuous):  # one Gaussian over every latent: nothing left i.i.d.
            if sampling.required:
                raise ValueError(
                    f"FactorELBO: sampling='spherical-radial' needs an AutoContinuous guide, got {guide!r}. "
                    "Use sampling='auto'."
                )
            return None
        return "_{}_latent".format(inner._pyro_name)

    def _guess_max_plate_nesting(self, model, guide, args, kwargs):
        with _rng_untouched():  # a throw-away trace: leave the global RNG as it was (bit-exact resume)
            super()._guess_max_plate_nesting(model, guide, args, kwargs)

    def _get_vectorized_trace(self, model, guide, args, kwargs):
        site = self._cubature(guide)
        self._rule = None
        if site is not None:
            # wrapped here, inside the particle plate, so it sees the site before the plate broadcasts it
            self._rule = _SphericalRadialMessenger(
                site, _SAMPLING[self.sampling].required, self.num_particles, -self.max_plate_nesting
            )
            guide = self._rule(guide)
        return super()._get_vectorized_trace(model, guide, args, kwargs)

    def _check_not_enumerated(self, model_trace, guide_trace) -> None:
        """Refuse model sites configured for enumeration that the guide does not sample.

        Such a site must be summed out of the likelihood (``TraceEnum_ELBO``'s
        variable elimination); drawn once from its prior, as a Trace-style
        estimator would, it biases the ELBO. Raised before any gradient is
        taken, so the parameters stay as they were.
        """
        names = [
            name
            for name, site in model_trace.nodes.items()
            if site["type"] == "sample"
            and not site["is_observed"]
            and site["infer"].get("enumerate") in ("parallel", "sequential")
            and name not in guide_trace.nodes
        ]
        if names:
            raise ValueError(
                f"FactorELBO: the model's sites must not be configured for enumeration, got {names!r} "
                "(infer={'enumerate': ...}, e.g. from config_enumerate). FactorELBO does not sum discrete "
                "sites out: use pyro.infer.TraceEnum_ELBO (or JitTraceEnum_ELBO), which works with "
                "AutoLowRankFactorGuide, or remove the enumeration."
            )

    def _particles(self, model, guide, args, kwargs) -> Iterable[Tuple[Tensor, Tensor]]:
        self._maybe_detect(model, guide, args, kwargs)
        self._rule = None
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            self._check_not_enumerated(model_trace, guide_trace)
            yield self._elbo_particle(model_trace, guide_trace, guide, self._rule)
            self._rule = None

    def _loss_and_surrogate_loss(self, model, guide, args, kwargs) -> Tuple[Tensor, Tensor]:
        """The negative ELBO estimate and its surrogate, averaged over the particles (both tensors)."""
        loss, surrogate_loss = 0.0, 0.0
        for particle_loss, surrogate in self._particles(model, guide, args, kwargs):
            loss = loss + particle_loss / self.num_particles
            surrogate_loss = surrogate_loss + surrogate / self.num_particles
        return loss, surrogate_loss

    def loss(self, model, guide, *args, **kwargs) -> float:
        """An estimate of the negative ELBO, as a float."""
        with torch.no_grad():
            loss = 0.0
            for particle_loss, _ in self._particles(model, guide, args, kwargs):
                loss += torch_item(particle_loss) / self.num_particles
        warn_if_nan(loss, "loss")
        return loss

    def differentiable_loss(self, model, guide, *args, **kwargs) -> Tensor:
        """A differentiable estimate of the negative ELBO."""
        loss, surrogate_loss = 0.0, 0.0
        for particle_loss, surrogate in self._particles(model, guide, args, kwargs):
            loss = loss + particle_loss.detach() / self.num_particles
            surrogate_loss = surrogate_loss + surrogate / self.num_particles
        warn_if_nan(surrogate_loss, "loss")
        return loss + (surrogate_loss - surrogate_loss.detach())

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """Estimate the negative ELBO and backpropagate its gradient."""
        loss = 0.0
        for particle_loss, surrogate in self._particles(model, guide, args, kwargs):
            loss += torch_item(particle_loss) / self.num_particles
            if getattr(surrogate, "requires_grad", False):
                (surrogate / self.num_particles).backward(retain_graph=self.retain_graph)
        warn_if_nan(loss, "loss")
        return loss
