r"""``FactorELBO``: an ELBO with the entropy and Gaussian / Laplace prior terms in closed form."""
from __future__ import annotations

import warnings
from typing import Dict, Iterable, List, Optional, Tuple

import pyro.poutine as poutine
import torch
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide import AutoContinuous, AutoGuideList
from pyro.infer.elbo import ELBO
from pyro.infer.trace_elbo import Trace_ELBO
from pyro.infer.util import is_validation_enabled, torch_item
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_model_guide_match, check_site_shape, warn_if_nan
from torch import Tensor
from torch.distributions import Independent, Laplace, Normal

from pyro_fa.priors import laplace_expected_log_prob, normal_expected_log_prob

__all__ = ["FactorELBO"]


def _auto_continuous_guides(guide) -> List[AutoContinuous]:
    guide = poutine.unwrap(guide) if hasattr(poutine, "unwrap") else guide
    if isinstance(guide, AutoContinuous):
        return [guide]
    if isinstance(guide, AutoGuideList):
        return [g for g in guide if isinstance(g, AutoContinuous)]
    return []


def _analytic_base(fn):
    """The Normal or Laplace under ``Independent`` wrappers, or None."""
    base = fn
    while isinstance(base, Independent):
        base = base.base_dist
    if isinstance(base, (Normal, Laplace)) and type(base).__name__ in ("Normal", "Laplace"):
        return base
    return None


def _expected_log_prob(base, loc: Tensor, variance: Tensor) -> Tensor:
    if isinstance(base, Normal):
        return normal_expected_log_prob(loc, variance, base.loc, base.scale)
    return laplace_expected_log_prob(loc, variance, base.loc, base.scale)


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
      entropy, including its dependence on :math:`F` that Algorithm 3 of seed
      000 drops (seed 003 eqs. 7–8, the :math:`-A + CB^\top` terms);
    * for each latent site the guide covers whose prior is a ``Normal`` or
      ``Laplace`` (possibly expanded or ``.to_event``-ed, e.g. from
      :class:`~pyro_fa.GaussianPrior` or :class:`~pyro_fa.LaplacePrior`)
      with parameters that do not depend on other latent variables,
      :math:`\mathbb{E}_q[\log p]` is computed from the marginals
      :math:`N(c_i, \mathrm{rowsum}(F\odot F)_i + \psi_i)` (seed 000 eqs.
      4.48–4.50; seed 003 §1.2).

    Everything else — the likelihood, other latent sites, and the
    log-Jacobian of constrained sites (a ``LogNormal`` or ``HalfCauchy``
    scale) — is estimated by Monte Carlo exactly as in
    :class:`~pyro.infer.Trace_ELBO`, so the estimator has the same
    expectation as ``Trace_ELBO`` and smaller variance. Priors whose
    parameters depend on other latent variables fall back to Monte Carlo
    (detected once per site by autograd on the first call). Subsampled plates
    scale the likelihood by :math:`N/M` as in Pyro. Guides with
    non-reparameterisable sites fall back to ``Trace_ELBO`` for the whole
    particle.

    Parameters
    ----------
    num_particles : int, default 1
    max_plate_nesting : int, default inf
    vectorize_particles : bool, default False
    strict_enumeration_warning, ignore_jit_warnings, retain_graph
        As :class:`~pyro.infer.ELBO`.

    Notes
    -----
    The closed-form parts cost :math:`O(DK^2)` per step, independent of the
    number of particles; the Monte-Carlo part costs what ``Trace_ELBO``'s
    does.

    References
    ----------
    Kingma & Welling (2014), *Auto-encoding variational Bayes*, §2.3 (the
    closed-form KL variant); seed 000 §4.3; seed 003 §1.

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
    ):
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
        """Record, per latent site with a Normal/Laplace prior, whether its parameters depend on latents.

        Replays the model against a guide trace whose values are fresh leaf
        tensors and asks autograd whether each prior's loc/scale reaches them.
        """
        with torch.enable_grad(), poutine.block():
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
                params = [p for p in (base.loc, base.scale) if torch.is_tensor(p) and p.requires_grad]
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
                self._prior_depends_on_latents.setdefault(name, True)  # not Normal/Laplace: Monte Carlo

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
                elementwise = _expected_log_prob(base, m, v)
                event_dim = site["fn"].event_dim
                term = elementwise.sum(list(range(-event_dim, 0))) if event_dim else elementwise
                total = total + scale_and_mask(term, site["scale"], site["mask"]).sum()
                skip_model.add(name)
                skip_guide.add(name)  # identity transform: the Delta's log-density is 0
        return total, skip_guide, skip_model

    def _elbo_particle(self, model_trace, guide_trace, guide) -> Tuple[Tensor, Tensor]:
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
        elbo = analytic
        for name, site in model_trace.nodes.items():
            if site["type"] == "sample" and name not in skip_model:
                elbo = elbo + site["log_prob_sum"]
        for name, site in guide_trace.nodes.items():
            if site["type"] == "sample" and name not in skip_guide:
                elbo = elbo - site["log_prob_sum"]
        if not torch.is_tensor(elbo):
            elbo = torch.tensor(float(elbo))
        return -elbo, -elbo

    def _particles(self, model, guide, args, kwargs) -> Iterable[Tuple[Tensor, Tensor]]:
        self._maybe_detect(model, guide, args, kwargs)
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            yield self._elbo_particle(model_trace, guide_trace, guide)

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
