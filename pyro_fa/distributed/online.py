r"""Online factor analysis sharded by coordinates: what ``OnlineFactorAnalysis(..., process_group=...)`` builds.

:class:`ShardedOnlineFactorAnalysis` is the single-process :class:`~pyro_fa.fa.OnlineFactorAnalysis` (any
registered fitter that supports sharding) with the fit's sums over :math:`D` all-reduced.

Each rank holds rows ``[lo, hi)`` of every :math:`D`-length and :math:`D\times K` array and
is fed the same rows of each observation. The M-step, the running moments and the
SGA ascent are row-local; the sums over :math:`D` are all-reduced:

* before anything changes (one ``all_reduce``): every rank's validity, batch size,
  largest deviation and noise floor (for the range check), the summed squared
  deviations after the update (the relative noise floor), the E-step's projection
  :math:`F^\top\Psi^{-1}d` (EM, one vector) and the capacitance
  :math:`\sum_d F_d F_d^\top/\psi_d` left by the last M-step;
* EM with a batch, or at a warm-up rescaling (:math:`n = 2, 4, 8, \dots`): a second one
  for the projection; SGA: a second one for the projection and the capacitance of the
  last ascent step (its standardisation needs the first one's sums);
* the exact range bound, in the rare case the cheap one fails.

So online EM of one vector per update costs one all-reduce of
:math:`6W + 1 + K + K^2` numbers, and every rank ends the update with the same
:math:`K\times K` quantities as a single process on the concatenated vector.
"""
from __future__ import annotations

import inspect
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.distributed.normal import ShardedLowRankNormal
from pyro_fa.distributed.sharding import (agree_on_group, check_loadable, check_shard_state, make_sharding,
                                          raise_agreed, sharded_orthogonal_init)
from pyro_fa.fa import OnlineFactorAnalysis
from pyro_fa.fa.fitters import Fitter, cholesky

__all__ = ["ShardedOnlineFactorAnalysis"]

_SIGNATURE = inspect.signature(OnlineFactorAnalysis.__init__)
#: the constructor's arguments that are not the model's own (its receiver, and where the ranks run and which
#: rows each holds): left out of the agreement of the ranks' arguments
_SELF = frozenset({"self"})
_PLACEMENT = frozenset({"process_group", "shard", "device"})
#: saved entries a rank may hold as its partial sum (the capacitance while cap_pending): not checked for definiteness
_PARTIAL_SUMS = frozenset({"_cap"})


class ShardedOnlineFactorAnalysis(OnlineFactorAnalysis):
    r"""This rank's rows of an :class:`~pyro_fa.fa.OnlineFactorAnalysis` fitted over ``torch.distributed`` ranks.

    ``OnlineFactorAnalysis(dim, rank, ..., process_group=group, shard=None)`` builds one (as does this class
    with the same arguments). The ranks first agree on every argument (one ``all_gather_object``: a mismatch
    raises on every rank), then each holds rows ``[lo, hi)`` (:func:`~pyro_fa.distributed.shard_bounds`, or
    ``shard``) of every length-D and D x K array and is fed the same rows of each observation. The fit equals
    the single-process fit on the whole vectors to rounding; online EM of one vector per update costs one
    all-reduce of :math:`6W + 1 + K + K^2` numbers. :meth:`update`, :meth:`log_prob`, :meth:`sample` and
    ``load_state_dict`` are collective; :meth:`get_posterior` is a
    :class:`~pyro_fa.distributed.ShardedLowRankNormal`; :meth:`covariance` is refused.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`~pyro_fa.fa.OnlineFactorAnalysis`.
    process_group : torch.distributed.ProcessGroup or Sharding
        The ranks (a :class:`~pyro_fa.distributed.Sharding` from an owner that already agreed, e.g. SWAG).
    shard : (int, int), optional
        This rank's rows; they must tile ``[0, dim)`` in rank order.
    """

    _cap_pending = False  # EM: _cap holds this rank's partial sum of F^T Psi^-1 F (no identity)
    _sga_cap_pending = False  # SGA: the cached capacitance is this rank's partial sum
    _sq_dev_total = 0.0  # sum over all D of the running squared deviations, as of the last update
    _stash_u: Optional[Tuple[int, Tensor]] = None  # EM: the reduced projection of this update

    def __init__(self, *args, process_group=None, shard=None, **kwargs):
        bound = _SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if k not in _SELF}
        # the ranks agree on every argument before any is checked: a bad one then raises alike on every rank
        fields = {k: v for k, v in arguments.items() if k not in _PLACEMENT}
        if isinstance(fields.get("method"), Fitter):  # a fitter object: its class and options
            fields["method"] = repr(fields["method"])
        fields["dtype"] = arguments["dtype"] or torch.get_default_dtype()
        device = arguments["device"]
        fields["device_type"] = torch.device(device).type if device is not None else "cpu"
        group, shards, seed = agree_on_group(process_group, type(self).__name__, fields, shard)
        if arguments["seed"] is None:
            arguments["seed"] = seed  # one seed for all ranks: the initial factor is that of the whole vector
        self.__dict__["_agreed"] = (group, shards, seed)  # read by _rows, once the arguments are checked
        super().__init__(**arguments)

    # ------------------------------------------------------------- set-up and state
    def _rows(self, dim: int) -> int:
        group, shards, seed = self.__dict__.pop("_agreed")
        self._sharding = make_sharding(group, type(self).__name__, dim, shards, seed)
        return self._sharding.size

    def _initial_factor(self, rank, init_scale, generator, dtype, device) -> Tensor:
        # this rank's rows of the single-process initial factor
        return sharded_orthogonal_init(self._sharding, rank, scale=init_scale, generator=generator, dtype=dtype,
                                       device=device)

    def _check_shard_state(self, state) -> None:
        check_shard_state(type(self).__name__, state, self._sharding)

    def _check_loadable(self, state_dict, strict: bool) -> Optional[float]:
        return check_loadable(self, state_dict, strict, self._sharding)

    def _agreed(self, check) -> None:
        raise_agreed(self._sharding, type(self).__name__, check)

    def _check_values(self, state_dict, prefix: str = "", owner: Optional[str] = None) -> None:
        # a saved capacitance may be this rank's partial sum (cap_pending): not checked for definiteness
        super()._check_values({k: v for k, v in state_dict.items() if k not in _PARTIAL_SUMS}, prefix, owner)

    def _rows_note(self) -> str:
        return f" (this rank's rows {self._sharding.lo}:{self._sharding.hi})"

    def get_extra_state(self):
        state = super().get_extra_state()
        state.update(shard=self._sharding.descriptor(), cap_pending=self._cap_pending)
        return state

    def set_extra_state(self, state):
        super().set_extra_state(state)
        self._cap_pending = bool(state.get("cap_pending", False))
        self._stash_u = None

    def get_posterior(self) -> ShardedLowRankNormal:
        r"""This rank's rows of the fitted :math:`N(c, FF^\top + \Psi)` (its methods that sum over D are collective)."""
        self._check_fitted("get_posterior()")
        F, psi = self._estimate()
        return ShardedLowRankNormal(self.loc, F, psi, self._sharding)

    def covariance(self) -> Tensor:
        """Refused: the whole D x D matrix is on no rank."""
        raise RuntimeError(f"{type(self).__name__}: covariance() needs the whole D x D matrix, got a model "
                           "sharded over a process group. Use get_posterior().marginal() for this rank's block.")

    def _sq_dev_sum(self) -> float:
        return self._sq_dev_total  # all-reduced by the last update

    # ------------------------------------------------------------- hooks
    def _cap_done(self, cap: Tensor, sga: bool = False) -> None:
        """A capacitance summed over this rank's rows: leave the sum for the next E-step's all-reduce."""
        if sga:
            self._sga_cap_pending = True
        else:
            self._cap_pending = True

    def _commit_cap(self, cap: Tensor, total: Tensor) -> None:
        cap.copy_(total)
        cap.diagonal().add_(1.0)
        self._cap_pending = False

    def _stash_projection(self, n: int, u: Optional[Tensor]) -> None:
        self._stash_u = (n, u) if u is not None else None

    def _var_mean(self, var: Tensor) -> Tensor:
        """Mean over all D of the running variances (the relative noise floor's scale)."""
        return var.new_tensor(self._sq_dev_total / (max(self._n, 1) * self.dim))

    def _mean_over_dim(self, v: Tensor) -> Tensor:
        """Mean over all D of a per-row quantity (collective)."""
        _, (total,) = self._sharding.reduce((), v.sum().reshape(1))
        return total[0] / self.dim

    def _e_step_inputs(self, d: Tensor, F: Tensor, psi: Tensor, cap: Tensor) -> Tuple[Tensor, Tensor]:
        r"""EM's E-step inputs: the capacitance's Cholesky factor and :math:`F^\top\Psi^{-1}d^\top` (K, B)."""
        stash, self._stash_u = self._stash_u, None
        if stash is not None and stash[0] == self._n and not self._cap_pending:
            return cholesky(cap), stash[1]
        parts = [F.T @ (d / psi).T]
        if self._cap_pending:
            parts.append(cap)
        _, out = self._sharding.reduce((), *parts)
        if self._cap_pending:
            self._commit_cap(cap, out[1])
        return cholesky(cap), out[0]

    def _sga_reduce(self, u: Tensor, cap: Tensor) -> Tuple[Tensor, Tensor]:
        """SGA's E-step inputs summed over the ranks: the projection (B, K) and the capacitance."""
        if not self._sga_cap_pending:
            _, (u,) = self._sharding.reduce((), u)
            return u, cap
        _, (u, total) = self._sharding.reduce((), u, cap)
        total.diagonal().add_(1.0)  # the fitter's cache (same key) now holds the whole capacitance
        self._sga_cap_pending = False
        return u, total

    def _exact_range(self, t: Tensor) -> Tuple[float, float]:
        r"""The exact range bounds over all ranks' rows (collective)."""
        rows, tm = self._range_terms(t)
        table, (rows,) = self._sharding.reduce([tm], rows)
        tm = max(row[0] for row in table)
        return float(rows.max()) * 4.0, 4.0 * tm ** 2

    # ------------------------------------------------------------- update
    @torch.no_grad()
    def update(self, x: Tensor) -> None:
        """Update the fit with this rank's rows of one observation or a batch, shape (D_r,) or (B, D_r) (collective).

        Every rank validates its rows, then one all-reduce shares the outcome with the sums over D: a refusal
        on any rank (non-finite input, a shape, a batch size that differs) raises on every rank before
        anything changes.
        """
        sh = self._sharding
        cls = type(self).__name__
        error: Optional[Exception] = None
        kind = 0
        try:
            x = self._validate(x)
        except (TypeError, ValueError) as exc:  # reported to every rank before anyone raises
            error, kind = exc, 1 if isinstance(exc, TypeError) else 2
        moments = self._moments
        n_old = self._n
        spread_before = self._has_spread()  # agreed: it reads the all-reduced total of the last update
        B = 0 if error is not None else x.shape[0]
        n = n_old + B
        tmax, bad, sq_new = 0.0, 0.0, 0.0
        t = d = proposal = None
        usable = False  # x was read and is finite: the fitter may add its sums
        if error is None:
            if B == 1:
                t, tmax = moments.deviation(x[0])
                if not n_old:
                    tmax = tmax * 0.0  # the first vector deviates from nothing (but must be finite)
                d = torch.mul(t, n_old / n, out=self._work.vector("d", self.loc.dtype, self.loc.device)).unsqueeze(0)
                if math.isfinite(tmax):
                    sq_new = float(moments.sq_dev.sum()) + n_old / n * float(torch.dot(t, t))
            else:
                xw = x.to(moments.mean.dtype)
                t = xw - (moments.mean if n_old else xw[0])
                tmax = float(t.abs().max())
                if math.isfinite(tmax):
                    mean, sq_dev, xw = moments.propose(xw, n_old)
                    proposal = (mean, sq_dev)
                    d = (xw - mean).to(self.loc.dtype)
                    sq_new = float(sq_dev.sum())
            if not math.isfinite(tmax):
                tmax = math.inf
                bad = float((~torch.isfinite(x)).sum())
            else:
                usable = True
        floor = self._noise_floor_now()
        fit, ctx = self.fit_state, self._ctx
        scale = self.fitter.range_scale(fit, ctx)
        scale_min = float(scale.amin()) if scale is not None else 1.0
        fit_sums, context = self.fitter.shard_sums(fit, ctx, d if usable else None, n_old, B)
        sums = [torch.tensor([sq_new], dtype=torch.float64), *fit_sums]
        table, out = sh.reduce([kind, B, tmax, bad, floor, scale_min], *sums)

        # every decision below reads the agreed table: all ranks raise, or none does
        failed = [(r, int(row[0])) for r, row in enumerate(table) if row[0]]
        if failed:
            if error is not None:
                try:
                    raise error
                finally:  # no frame <-> traceback cycle (it would keep the process group alive until exit)
                    error = None
            r, k = failed[0]
            raise (TypeError if k == 1 else ValueError)(
                f"{cls}: rank {r} refused its x, so the update was refused on every rank and the model is unchanged.")
        sizes = [int(row[1]) for row in table]
        if any(s != B for s in sizes):
            raise ValueError(f"{cls}: every rank must pass the same number of observations, got "
                             + ", ".join(f"{s} on rank {r}" for r, s in enumerate(sizes))
                             + "; the update was refused on every rank and the model is unchanged.")
        n_bad = int(sum(row[3] for row in table))
        if n_bad:
            ranks = [r for r, row in enumerate(table) if row[3]]
            raise ValueError(f"{cls}: x must be finite, got NaN or inf in {n_bad} entries (on ranks {ranks}); "
                             "the update was refused and the model is unchanged.")
        tmax_all = max(row[2] for row in table)
        floor_all = min(row[4] for row in table)
        scale_all = min(row[5] for row in table)
        self._check_range(x, tmax_all, B, t if (n_old or B > 1) else None, floor=floor_all,
                          scale2=scale_all ** 2)

        # commit: the moments, then the fit (row-local but for the K x K sums above)
        if B == 1:
            moments.add_deviation(t, n_old)
        else:
            moments.commit(*proposal)
        self.loc.copy_(moments.mean)
        self._n = n
        self._cache = None
        self._sq_dev_total = float(out[0][0])
        self.fitter.shard_reduced(self.fit_state, self._ctx, out[1:], n, context)
        self._fit_step(d, n_old, B, spread_before)


OnlineFactorAnalysis.sharded_class = ShardedOnlineFactorAnalysis  # what process_group= builds
