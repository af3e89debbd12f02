r"""The sharded update of :class:`~pyro_fa.fa.online.OnlineFactorAnalysis` (``process_group=...``).

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

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.fa._sharding import agree_on_group, check_loadable, check_shard_state, make_sharding

__all__ = ["OnlineSharded"]


class OnlineSharded:
    """The collectives of a sharded :class:`~pyro_fa.fa.online.OnlineFactorAnalysis` (a mixin over its state).

    Without a process group every hook does what the single-process code did in place.
    """

    _sharding = None
    _cap_pending = False  # EM: _cap holds this rank's partial sum of F^T Psi^-1 F (no identity)
    _sga_cap_pending = False  # SGA: the cached capacitance is this rank's partial sum
    _sq_dev_total = 0.0  # sum over all D of the running squared deviations, as of the last update
    _stash_u: Optional[Tuple[int, Tensor]] = None  # EM: the reduced projection of this update

    # ------------------------------------------------------------- set-up and state
    def _agree_sharding(self, process_group, shard, fields):
        return agree_on_group(process_group, type(self).__name__, fields, shard)

    def _make_sharding(self, dim: int, group, shards, seed):
        return make_sharding(group, type(self).__name__, dim, shards, seed)

    def _check_shard_state(self, state) -> None:
        check_shard_state(type(self).__name__, state, self._sharding)

    def _check_loadable(self, state_dict, strict: bool) -> Optional[float]:
        return check_loadable(self, state_dict, strict, self._sharding)

    # ------------------------------------------------------------- hooks
    def _cap_done(self, cap: Tensor, sga: bool = False) -> None:
        """A capacitance summed over this rank's rows: add the identity, or leave the sum for the next E-step."""
        if self._sharding is None:
            cap.diagonal().add_(1.0)
        elif sga:
            self._sga_cap_pending = True
        else:
            self._cap_pending = True

    def _commit_cap(self, total: Tensor) -> None:
        self._cap.copy_(total)
        self._cap.diagonal().add_(1.0)
        self._cap_pending = False

    def _var_mean(self, var: Tensor) -> Tensor:
        """Mean over all D of the running variances (the relative noise floor's scale)."""
        if self._sharding is None:
            return var.mean()
        return var.new_tensor(self._sq_dev_total / (max(self._n, 1) * self.dim))

    def _mean_over_dim(self, v: Tensor) -> Tensor:
        """Mean over all D of a per-row quantity (collective when sharded)."""
        if self._sharding is None:
            return v.mean()
        _, (total,) = self._sharding.reduce((), v.sum().reshape(1))
        return total[0] / self.dim

    def _e_step_inputs(self, d: Tensor) -> Tuple[Tensor, Tensor]:
        r"""EM's E-step inputs: the capacitance's Cholesky factor and :math:`F^\top\Psi^{-1}d^\top` (K, B)."""
        from pyro_fa.fa.fitters import cholesky

        if self._sharding is None:
            return cholesky(self._cap), self._F.T @ (d / self._psi).T
        stash, self._stash_u = self._stash_u, None
        if stash is not None and stash[0] == self._n and not self._cap_pending:
            return cholesky(self._cap), stash[1]
        parts = [self._F.T @ (d / self._psi).T]
        if self._cap_pending:
            parts.append(self._cap)
        _, out = self._sharding.reduce((), *parts)
        if self._cap_pending:
            self._commit_cap(out[1])
        return cholesky(self._cap), out[0]

    def _sga_reduce(self, u: Tensor, cap: Tensor) -> Tuple[Tensor, Tensor]:
        """SGA's E-step inputs summed over the ranks: the projection (B, K) and the capacitance."""
        if self._sharding is None:
            return u, cap
        if not self._sga_cap_pending:
            _, (u,) = self._sharding.reduce((), u)
            return u, cap
        _, (u, total) = self._sharding.reduce((), u, cap)
        total.diagonal().add_(1.0)
        self._sga_cap = total  # the cache (same key) now holds the whole capacitance
        self._sga_cap_pending = False
        return u, total

    def _exact_range(self, t: Tensor) -> Tuple[float, float]:
        r"""The exact range bounds: :math:`4\max_b \sum_d t_{bd}^2/\psi_d` and :math:`4\max|t/s|^2`."""
        rows = (t.square() / self._noise_now()).sum(-1).reshape(-1)
        scale = self._fitter.range_scale(self)
        tm = float((t / (scale if scale is not None else 1.0)).abs().max())
        if self._sharding is not None:
            table, (rows,) = self._sharding.reduce([tm], rows)
            tm = max(row[0] for row in table)
        return float(rows.max()) * 4.0, 4.0 * tm ** 2

    # ------------------------------------------------------------- update
    @torch.no_grad()
    def _sharded_update(self, x: Tensor) -> None:
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
                d = torch.mul(t, n_old / n, out=self._scratch("_d", self.loc.dtype)).unsqueeze(0)
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
        scale = self._fitter.range_scale(self)
        scale_min = float(scale.amin()) if scale is not None else 1.0
        fit_sums, context = self._fitter.shard_sums(self, d if usable else None, n_old, B)
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
        self._fitter.shard_reduced(self, out[1:], n, context)
        self._fit_step(d, n_old, B, spread_before)
