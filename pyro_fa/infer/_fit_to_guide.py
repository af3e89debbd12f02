"""What the fits of a Pyro model's posterior share (Pathfinder, BatchAndMatch): the model's log density of one
packed unconstrained vector, and setting an :class:`~pyro_fa.infer.AutoLowRankFactorGuide` to a fitted Gaussian."""
from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import Tensor


def model_log_density(model: Callable, args, kwargs, init_loc_fn) -> Tuple[Callable[[Tensor], Tensor], int]:
    """``(log_density, D)``: the model's unconstrained log joint (log-Jacobian included) of one vector packed as
    Pyro's ``AutoContinuous`` packs its latents.

    The fit may run in another dtype or on another device than the model (L-BFGS in float64 for a float32
    model): ``z`` goes to the model's dtype and device, the value comes back in ``z``'s, and gradients flow
    through both casts.
    """
    from pyro.infer.autoguide import AutoDiagonalNormal
    from pyro.infer.mcmc.util import initialize_model

    init = {} if init_loc_fn is None else {"init_loc_fn": init_loc_fn}
    proto = AutoDiagonalNormal(model, **init)
    proto._setup_prototype(*args, **kwargs)
    shapes = dict(proto._unconstrained_shapes)
    like = proto.prototype_trace.nodes[next(iter(shapes))]["value"]  # the model's dtype and device
    strategy = {} if init_loc_fn is None else {"init_strategy": init_loc_fn}
    _, potential_fn, _, _ = initialize_model(model, model_args=args, model_kwargs=kwargs, **strategy)

    def log_density(z: Tensor) -> Tensor:
        params, i = {}, 0
        zm = z.to(dtype=like.dtype, device=like.device)
        for site, shape in shapes.items():
            n = int(torch.Size(shape).numel())
            params[site] = zm[i:i + n].reshape(shape)
            i += n
        return (-potential_fn(params)).to(dtype=z.dtype, device=z.device)

    return log_density, sum(int(torch.Size(s).numel()) for s in shapes.values())


def set_guide_to(q, guide, owner: str) -> None:
    r"""Set ``guide`` (an :class:`~pyro_fa.infer.AutoLowRankFactorGuide` already set up, rank K) to ``q``, a member
    of the family with ``loc``, ``cov_factor`` (D, r), ``cov_diag`` and ``variance``.

    loc = :math:`\mu`; if r > K, the K leading columns are kept and the dropped columns' diagonal is added to
    :math:`\Psi` (the marginal variances stay); if r < K, small random columns (1e-2 of the scale) fill the rest.
    Then ``scale`` = :math:`\sqrt{\Psi}` (its mean for ``noise="isotropic"``) and ``factor`` =
    :math:`\operatorname{diag}(s)^{-1} F`. A guide built with ``loc_scale=`` (a whitened mean) gets ``loc_scale`` =
    the marginal s.d. of ``q``.

    Raises
    ------
    ValueError
        If the guide's latent dimension is not ``q``'s.
    """
    D, K = guide.latent_dim, guide.rank
    if D != q.loc.shape[0]:
        raise ValueError(f"{owner}: the guide's latent dimension must be {q.loc.shape[0]}, got {D}.")
    F, psi = q.cov_factor, q.cov_diag.clone()
    F = F[:, F.pow(2).sum(0).argsort(descending=True)]
    if F.shape[1] > K:
        psi = psi + F[:, K:].pow(2).sum(-1)
        F = F[:, :K]
    like = guide.loc
    with torch.no_grad():
        s = guide.noise_model.scale_from_variances(psi)
        G = F / s.unsqueeze(-1)
        if G.shape[1] < K:
            G = torch.cat([G, torch.randn(D, K - G.shape[1], dtype=G.dtype, device=G.device) * 1e-2], dim=1)
        if "whitened_loc" in guide._parameters:
            # the guide's loc is whitened: measure it in this posterior's marginal s.d., so that an optimizer's
            # steps on the mean (Adam's: about its rate, whatever the gradient) are s.d.-sized
            guide.loc_scale.copy_(q.variance.sqrt().to(like))
            guide.whitened_loc.data.copy_((q.loc / guide.loc_scale).to(like))
        else:
            guide.loc.data.copy_(q.loc.to(like))
        guide.factor.data.copy_(G.to(like))
        guide.noise_model.assign(guide, s.to(like))


def guide_of_model(fitted, rank: int, args, kwargs):
    """A new :class:`~pyro_fa.infer.AutoLowRankFactorGuide` of ``fitted.model`` (rank ``rank``, the fit's
    ``init_loc_fn``), run once on the model's ``args``/``kwargs`` and set to the fit by ``fitted.init_guide``.

    Raises
    ------
    RuntimeError
        If the fit was built on a log density (no model to build a guide of).
    """
    from pyro_fa.infer.guide import AutoLowRankFactorGuide

    owner = type(fitted).__name__
    if fitted.model is None:
        raise RuntimeError(f"{owner}: to_guide() needs a model, got one built on log_density; build an "
                           "AutoLowRankFactorGuide of your model and call init_guide().")
    init = {} if fitted.init_loc_fn is None else {"init_loc_fn": fitted.init_loc_fn}
    guide = AutoLowRankFactorGuide(fitted.model, rank=rank, **init)
    guide(*args, **kwargs)
    fitted.init_guide(guide)
    return guide
