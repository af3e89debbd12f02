r"""The log joint of a Pyro model as :class:`~pyro_fa.laplace.PyroFactorLaplace` weighs it: each site's ``scale``
and ``mask``, and the subsampled plates.

Pyro multiplies a site's log density by its ``scale`` (the :math:`N/B` of a ``pyro.plate(name, N,
subsample_size=B)`` or ``subsample=`` of :math:`B` indices, the factor of ``poutine.scale``, the product over
nested plates) and zeroes it where its ``mask`` is False (``poutine.mask``); the ELBO, and so the Hessian of
Pyro's ``AutoLaplaceApproximation``, include both. The Laplace precision does the same:

* the prior's terms (latent sites and ``pyro.factor`` terms) enter :math:`H` as
  :math:`s\,\log p` (:func:`scaled_log_prob`);
* the observed sites enter the Monte Carlo Fisher through scores weighted by :math:`\sqrt s`
  (:func:`score_log_prob`): the curvature of :math:`s\log p(y \mid \theta)` is :math:`s` times the site's Fisher,
  and the scores of conditionally independent observations are uncorrelated, so
  :math:`\mathbb E[g g^\top] = \sum_n s_n F_n`, :math:`g = \sum_n \sqrt{s_n}\,\nabla\log p(y_n \mid \theta)`.
  Over a random subsample :math:`S` of :math:`B` of :math:`N` observations at :math:`s = N/B`,
  :math:`\mathbb E_S\big[\tfrac NB \sum_{n \in S} F_n\big] = \sum_{n=1}^N F_n`: an unbiased estimate of the
  full data set's Fisher (whereas weighting the score by :math:`s` itself would estimate :math:`N/B` times it).
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import Tensor

__all__ = ["scaled_log_prob", "score_log_prob", "subsample_sites", "map_trace"]


def _log_prob(site, weight) -> Tensor:
    return scale_and_mask(site["fn"].log_prob(site["value"]), weight, site["mask"]).sum()


def scaled_log_prob(site) -> Tensor:
    r""":math:`\sum s \log p` over the site's masked-in elements, as in Pyro's log joint (a scalar)."""
    return _log_prob(site, site["scale"])


def score_log_prob(site) -> Tensor:
    r""":math:`\sum \sqrt s \log p` over the site's masked-in elements, whose gradient is the observed site's score
    as the Monte Carlo Fisher of :math:`s \log p` weighs it (a scalar)."""
    scale = site["scale"]
    return _log_prob(site, scale.sqrt() if torch.is_tensor(scale) else math.sqrt(scale))


def subsample_sites(trace) -> List[str]:
    """The names of the plates' subsample sites of ``trace`` (one per ``pyro.plate`` with a size)."""
    return [n for n, s in trace.nodes.items() if s["type"] == "sample" and site_is_subsample(s)]


class _SubsampledSites(Messenger):
    """Records, as the model runs (so also up to a point where it fails), the sites in a plate that runs over a
    subsample of its indices."""

    def __init__(self):
        super().__init__()
        self.frames: Dict[str, object] = {}  # site -> its first subsampled plate's frame

    def _pyro_post_sample(self, msg) -> None:
        for frame in msg["cond_indep_stack"]:
            if frame.full_size is not None and frame.full_size != frame.size:
                self.frames.setdefault(msg["name"], frame)
                break

    def check_latents(self, owner: str, latents) -> None:
        """Refuse a latent site inside a plate that runs over a subsample: its values over the whole plate (what
        ``AutoDelta`` holds) are part of the posterior, and a subsample traces only some of them."""
        for n in latents:
            frame = self.frames.get(n)
            if frame is not None:
                raise ValueError(f"{owner}: the subsample of plate {frame.name!r} must be the whole plate for its "
                                 f"latent site {n!r} (the posterior is over its {frame.full_size} values), got "
                                 f"{frame.size} of {frame.full_size}. Call fit with the model arguments that give "
                                 "pyro.plate no subsample_size or subsample.")


def map_trace(owner: str, model, values: Dict[str, Tensor], args, kwargs, seed: int):
    """The model's trace conditioned on the MAP ``values`` (a subsample that the model draws drawn from ``seed``,
    the global generator untouched); a latent site in a subsampled plate is refused (``ValueError`` naming it and
    its plate), also when the model fails on the whole plate's values that the param store holds for it."""
    watch = _SubsampledSites()
    try:
        with watch, torch.random.fork_rng():
            torch.manual_seed(seed)
            trace = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
    except Exception:
        watch.check_latents(owner, values)
        raise
    watch.check_latents(owner, values)
    return trace
