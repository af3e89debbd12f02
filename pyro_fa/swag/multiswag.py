r"""MultiSWAG: an equally weighted mixture of independently trained SWAG posteriors.

Wilson & Izmailov (2020): M runs from different random initialisations, each
with its own (factor-analysis or classic) SWAG posterior; the Bayesian model
average is taken over the mixture

.. math::

    q(\theta) = \frac1M \sum_{m=1}^M N(c_m, F_mF_m^\top + \Psi_m).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.distributions import Categorical
from pyro_fa import _random

from pyro_fa.distributions import FactorNormalMixture, PointMassNormal, StableLowRankMultivariateNormal
from pyro_fa.predictive.glm import check_pred_type
from pyro_fa.predictive.posterior import Posterior
from pyro_fa.predictive.sampled import SampledPredictive
from pyro_fa.swag.guide import FactorPosteriorGuide
from pyro_fa.swag.swag import SWAG

__all__ = ["MultiSWAG"]


class MultiSWAG(Posterior, nn.Module):
    r"""An equally weighted mixture of :class:`SWAG` posteriors.

    Parameters
    ----------
    members : sequence of SWAG
        Posteriors of the same dimension :math:`D`, rank, dtype and device; one
        per independent training run. Each member keeps its own model (for
        :meth:`predict`).

    Examples
    --------
    >>> def train(net, swag):
    ...     opt = torch.optim.SGD(net.parameters(), lr=0.1); swag.attach(opt)
    ...     for _ in range(4):
    ...         opt.zero_grad(); net(torch.randn(8, 3)).pow(2).mean().backward(); opt.step()
    >>> ms = MultiSWAG.from_training(lambda: torch.nn.Linear(3, 1), train, num_models=3, rank=2, method="swag")
    >>> ms.predict(torch.randn(5, 3), num_samples=6).shape
    torch.Size([5, 1])

    Predictions are :class:`~pyro_fa.predictive.Posterior`'s (``predict``, ``predict_proba``,
    ``predict_log_proba``, ``log_likelihood``, ``tune_scale``): ``num_samples`` draws in all, split evenly
    over the members; the closed-form GLM predictive mixes the members' Gaussians with equal weights.

    References
    ----------
    A. G. Wilson and P. Izmailov, "Bayesian deep learning and a probabilistic
    perspective of generalization", NeurIPS 2020.
    """

    def __init__(self, members: Sequence[SWAG]):
        super().__init__()
        cls = type(self).__name__
        members = list(members)
        if not members:
            raise ValueError(f"{cls}: members must hold at least one SWAG, got none.")
        first_index = {}
        for i, m in enumerate(members):
            if not isinstance(m, SWAG):
                raise TypeError(f"{cls}: members must be SWAG posteriors, got {type(m).__name__}.")
            first = first_index.setdefault(id(m), i)
            if first != i:
                raise ValueError(f"{cls}: members must be distinct posteriors, got the same SWAG as members {first} "
                                 f"and {i} (it would be weighted twice). Pass each independently trained run once.")
            if m._rows.distributed:
                raise ValueError(f"{cls}: members must not be sharded over a process group (not supported), got a "
                                 f"SWAG sharded as {m.sharding!r}. Use SWAG.predict on each sharded member instead.")
        dims = {(m.dim, m.rank) for m in members}
        if len(dims) > 1:
            raise ValueError(f"{cls}: members must share (dim, rank), got {sorted(dims, key=str)!r}.")
        kinds = {(m.loc.dtype, m.loc.device) for m in members if m.dim is not None}
        if len(kinds) > 1:
            raise ValueError(f"{cls}: members must share one dtype and device, got "
                             f"{sorted(map(str, kinds))!r}. Move them with member.to(...) first.")
        self.members = nn.ModuleList(members)

    @classmethod
    def from_training(cls, make_module: Callable[[], nn.Module], train_fn: Callable[[nn.Module, SWAG], None],
              num_models: int = 5, seed: int = 0, **swag_kwargs) -> "MultiSWAG":
        """Train ``num_models`` runs and collect a SWAG posterior from each.

        Parameters
        ----------
        make_module : callable
            ``make_module() -> nn.Module``, called after ``torch.manual_seed(seed + m)``
            so that each run starts from its own initialisation.
        train_fn : callable
            ``train_fn(module, swag)``: the user's training loop, which calls
            ``swag.attach(optimizer)`` (or ``swag.collect()``).
        num_models : int, default 5
        seed : int, default 0
        **swag_kwargs
            For :class:`SWAG` (``rank``, ``method``, ``start_after``, ...).
        """
        if isinstance(num_models, bool) or not isinstance(num_models, int) or num_models < 1:
            raise ValueError(f"{cls.__name__}: num_models must be an integer >= 1, got {num_models!r}.")
        members = []
        for m in range(num_models):
            torch.manual_seed(seed + m)
            module = make_module()
            swag = SWAG(module, seed=seed + m, **swag_kwargs)
            train_fn(module, swag)
            members.append(swag)
        return cls(members)

    def __len__(self) -> int:
        return len(self.members)

    @property
    def scale(self) -> float:
        """The members' common posterior scale (see :attr:`SWAG.scale`); setting it sets every member's."""
        scales = {m.scale for m in self.members}
        if len(scales) > 1:
            raise RuntimeError(f"{type(self).__name__}: scale is per member here, got {sorted(scales)!r}; set "
                               "ms.scale = value to share one.")
        return scales.pop()

    @scale.setter
    def scale(self, value: float) -> None:
        for m in self.members:
            m.scale = value

    def get_posterior(self) -> FactorNormalMixture:
        """The equally weighted mixture of the members' :meth:`SWAG.get_posterior` over the flattened parameters.

        Returns
        -------
        FactorNormalMixture
            Its components one batched :class:`~pyro_fa.distributions.StableLowRankMultivariateNormal` (the
            capacitance in float64), or at scale 0 one batched :class:`~pyro_fa.distributions.PointMassNormal`
            (the mixture of the members' means).

        Raises
        ------
        ValueError
            If some members are at scale 0 and others not (one batched form holds all components).
        """
        dists = [m.get_posterior() for m in self.members]
        points = [isinstance(d, PointMassNormal) for d in dists]
        if any(points) and not all(points):
            raise ValueError(f"{type(self).__name__}: the members' scales must be all 0 or all > 0 for get_posterior(), "
                             f"got {[m.scale for m in self.members]!r}. Set MultiSWAG.scale.")
        if all(points):
            comp = PointMassNormal(torch.stack([d.loc for d in dists]))
        else:
            comp = StableLowRankMultivariateNormal(
                torch.stack([d.loc for d in dists]),
                torch.stack([d.cov_factor for d in dists]),
                torch.stack([d.cov_diag for d in dists]),
            )
        logits = comp.loc.new_zeros(len(dists))
        return FactorNormalMixture(Categorical(logits=logits), comp)

    @torch.no_grad()
    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Draw flattened parameter vectors: members chosen uniformly, then a draw of each chosen member's
        :meth:`SWAG.sample`; shape (num_samples, D), or (D,) for ``num_samples=None``."""
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                        or num_samples < 1):
            raise ValueError(f"{type(self).__name__}: num_samples must be an integer >= 1 or None, got "
                             f"{num_samples!r}.")
        S = 1 if num_samples is None else num_samples
        ref = self.members[0].loc
        idx = _random.randint(len(self.members), (S,), generator, ref.device)
        out = ref.new_empty(S, ref.shape[0])
        for m, member in enumerate(self.members):
            rows = (idx == m).nonzero().flatten()
            if rows.numel():
                out[rows] = member.sample(rows.numel(), generator=generator)
        return out[0] if num_samples is None else out

    def predictive(self, pred_type: str = "nn", *, loader=None) -> SampledPredictive:
        r"""The mixture's predictive: ``num_samples`` draws split evenly over the members (the first
        ``num_samples % M`` members one more), each run in its own member's network (or its linearisation).

        A draw is a pair ``(member index, weight vector)``; ``loc`` and ``deviations`` are ``None`` (the scale
        search reads the members' own predictives). See :meth:`SWAG.predictive`.
        """
        check_pred_type(type(self).__name__, pred_type)
        parts = [m.predictive(pred_type, loader=loader) for m in self.members]
        M = len(parts)

        def sample(num_samples: int, generator: Optional[torch.Generator] = None):
            draws = []
            for m, part in enumerate(parts):
                S_m = num_samples // M + (1 if m < num_samples % M else 0)
                if S_m:
                    draws += [(m, theta) for theta in part.sample(S_m, generator)]
            return draws

        def network(draw):
            m, theta = draw
            return parts[m].network(theta)

        return SampledPredictive(sample, network, module=parts[0].module)

    def _linearized_marginals(self, inputs, chunk_size):
        """Each member's linearised outputs' means and variances: the mixture's components."""
        return [part for m in self.members for part in m._linearized_marginals(inputs, chunk_size)]

    def to_guide(self, model: Callable) -> FactorPosteriorGuide:
        """A Pyro guide drawing the model's latent sites from the mixture (a member per call)."""
        return FactorPosteriorGuide(model, list(self.members))

    # ------------------------------------------------------------------ state
    def _check_state(self, state_dict, strict: bool, prefix: str = "") -> List[Tuple[nn.Module, tuple]]:
        """Check the whole saved mixture (keys relative to this module) before any member is written."""
        cls = type(self).__name__
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{cls}: state_dict must be a mapping from names to tensors, got "
                            f"{type(state_dict).__name__}.")
        if strict:
            own = set(self.state_dict(keep_vars=True))
            missing, unexpected = sorted(own - set(state_dict)), sorted(set(state_dict) - own)
            if missing or unexpected:
                saved = sorted({k.split(".")[1] for k in state_dict if k.startswith("members.")}, key=str)
                raise ValueError(
                    f"{cls}: state_dict must hold the entries of this mixture's {len(self)} members, got entries "
                    f"for members {saved!r} (missing keys {missing[:6]!r}{' ...' if len(missing) > 6 else ''}, "
                    f"unexpected keys {unexpected[:6]!r}{' ...' if len(unexpected) > 6 else ''}); nothing was "
                    "loaded."
                )
        marks = []
        for i, member in enumerate(self.members):
            head = f"members.{i}."
            sub = {k[len(head):]: v for k, v in state_dict.items() if k.startswith(head)}
            if not sub and not strict:
                continue
            try:
                total, member_marks = member._check_state(sub, strict, prefix + head)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{cls}: member {i} (the entries under {prefix + head!r}) cannot be loaded, so "
                                f"no member was: {exc}") from exc
            marks += member_marks + [(member, (total,))]
        return marks

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # runs for a direct load_state_dict and for a parent module's alike, before any member loads: every
        # member's state is checked first, then the members are marked as checked and written
        hint = self.__dict__.get("_load_strict")
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if mine or hint is not None:
            for module, mark in self._check_state(mine, True if hint is None else hint, prefix):
                module.__dict__["_load_checked"] = mark
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state saved by :meth:`state_dict`, every member checked first: on error no member is loaded.

        The same checks run when a parent module loads its state.

        Raises
        ------
        ValueError, TypeError
            If the state holds another number of members, or any member's state would be
            refused by :meth:`SWAG.load_state_dict`; every member is then unchanged.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{type(self).__name__}: state_dict must be a mapping from names to tensors, got "
                            f"{type(state_dict).__name__}.")
        self.__dict__["_load_strict"] = bool(strict)
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self.__dict__.pop("_load_strict", None)
