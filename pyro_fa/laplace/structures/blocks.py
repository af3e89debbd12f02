r"""``"blocks"``: a rank per layer, the default for a list, dict or ``"auto"`` ``rank``.

Each module's weights :math:`[a_b, e_b)` get their own :math:`F_b` (D_b, K_b), fitted on the restriction of the
one stream of curvature vectors (:func:`~pyro_fa.laplace._blocks.fit_blocks`; ``"auto"`` allocates a budget by the
fitted spectrum, :func:`~pyro_fa.laplace._blocks.assemble`), held in the buffers ``block_factor_0``, ... and
``block_ranks`` (never as the dense :math:`\mathrm{blockdiag}(F_b)`); the posterior a
:class:`~pyro_fa.distributions.BlockLowRankPrecisionNormal`. See :mod:`pyro_fa.laplace._blocks`.
"""
from __future__ import annotations

import torch

from pyro_fa.distributions import BlockLowRankPrecisionNormal
from pyro_fa.laplace._blocks import assemble, block_ranks, fit_blocks
from pyro_fa.laplace.structures.base import Structure, register_structure

__all__ = ["Blocks"]


@register_structure("blocks")
class Blocks(Structure):
    """A rank per block (:class:`~pyro_fa.laplace._blocks.BlockRanks` ``layout``)."""

    def __init__(self, layout):
        super().__init__(layout.width)
        self.layout = layout

    @classmethod
    def accepts(cls, rank) -> bool:
        return not (isinstance(rank, int) and not isinstance(rank, bool))

    @classmethod
    def build(cls, owner, rank, named, *, curvature_fit, process_group=None, rank_budget=None, rank_max=None):
        return cls(block_ranks(owner, rank, rank_budget, named, curvature_fit, process_group, rank_max))

    def register_factor(self, module, rows, ref):
        # each block's factor (D_b, K_b) on its own (K_b = 0 before a fit with rank="auto")
        for key, (a, e), k in zip(self.layout.factor_names, self.layout.bounds, self.layout.initial):
            module.register_buffer(key, ref.new_zeros(e - a, k))

    def register_extra(self, module, ref):
        module.register_buffer("block_ranks", torch.tensor(self.layout.initial, device=ref.device))

    def fit(self, passes, dim, *, method, num_passes, seed, dtype, device, owner, process_group=None):
        # every block's fitter fed from the one stream
        return fit_blocks(passes, self.layout, num_passes=num_passes, seed=seed, dtype=dtype, device=device,
                          owner=owner)

    def store(self, buffers, factor, psi, ratio, prior, scale, info):
        # each block's factor kept on its own (allocated first for rank="auto"), rescaled
        factors, psi, ranks, info["values"] = assemble(self.layout, factor, psi, ratio, prior, scale)
        for key, F in zip(self.layout.factor_names, factors):  # K_b may differ from the buffer's
            old = buffers[key]
            buffers[key] = F.detach().to(dtype=old.dtype, device=old.device)
        return {"block_ranks": ranks, "cov_diag": psi}

    def _factors(self, buffers):
        return [(a, e, buffers[key]) for key, (a, e) in zip(self.layout.factor_names, self.layout.bounds)]

    def posterior(self, buffers, loc, prec_diag, scale, sharding=None):
        blocks = [(a, e, F * scale.sqrt()) for a, e, F in self._factors(buffers)]
        return BlockLowRankPrecisionNormal(loc, blocks, prec_diag)

    def glm_factor(self, post):
        return post.cov_factors  # by blocks: never densified

    def cov_factor(self, buffers, loc):
        if self.layout.factor_names[0] not in buffers:  # while the buffers are registered
            raise AttributeError("cov_factor")
        return self.layout.dense([F for _, _, F in self._factors(buffers)], loc)

    def block_factors(self, owner, buffers, rank):
        return self._factors(buffers)

    def check_layout(self, owner, state_dict, rank):
        if state_dict.get("block_ranks") is None and "cov_factor" in state_dict:
            shape = getattr(state_dict["cov_factor"], "shape", None)
            raise ValueError(f"{owner}: state_dict must come from a fit with a rank per block, like this one (blocks "
                             f"{self.layout.names!r}), got a fit with one rank (cov_factor of shape "
                             f"{tuple(shape) if shape is not None else shape!r}); nothing was loaded. Construct it "
                             "with the int rank it was fitted with.")

    def prepare_load(self, owner, buffers, state_dict):
        # the block factors take the shapes of the state's ranks ("auto")
        self.layout.check_state(owner, state_dict)
        for key, shape in self.layout.saved_factor_shapes(state_dict).items():
            buffers[key] = buffers[key].new_empty(shape)

    def describe(self, buffers):
        return f", blocks={dict(zip(self.layout.names, buffers['block_ranks'].tolist()))}"
