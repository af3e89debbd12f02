r"""R independent :class:`~pyro_fa.optim.FactorIVON` runs over one small network, trained as one batch of tensors."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from pyro_fa.distributions import LowRankPrecisionNormal
from pyro_fa.optim._batched_lowrank import BatchedWoodbury, factorise_batched, sketch_update_batched
from pyro_fa.optim._checks import check_count, check_curvature, check_hyperparameters

__all__ = ["BatchedFactorIVON"]

NAME = "BatchedFactorIVON"


def _per_replica(name: str, value, replicas: int, like: Tensor) -> Tensor:
    """``value`` (a number, or one per replica) as a (R,) tensor like ``like``, each entry checked as FactorIVON's."""
    if isinstance(value, Tensor) and value.dim() == 0:
        values = [value.item()] * replicas
    elif isinstance(value, Tensor):
        values = value.detach().tolist() if value.dim() == 1 else None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        values = [value] * replicas
    else:
        values = list(value) if isinstance(value, (list, tuple)) else None
    if values is None or len(values) != replicas:
        raise ValueError(f"{NAME}: {name} must be a number or {replicas} numbers (one per replica), got {value!r}.")
    for v in values:
        check_hyperparameters({name: v}, NAME)
    return like.new_tensor([float(v) for v in values])


def _finite_rows(x: Tensor) -> Tensor:
    """Which replicas (rows of ``x``, shape (R, ...)) hold finite numbers only; one sum when all do."""
    if bool(torch.isfinite(x.sum())):  # a finite sum has finite terms only
        return torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    return torch.isfinite(x.reshape(x.shape[0], -1)).all(-1)


class BatchedFactorIVON:
    r""":class:`~pyro_fa.optim.FactorIVON` for R independent replicas of one network, as one batch of tensors.

    Holds R FactorIVON states over weight vectors of shape (R, D) (the layout of
    :class:`pyro_fa.nn.batched.BatchedMLP`): replica :math:`r` learns
    :math:`q_r(\theta) = N(m_r, P_r^{-1})`, :math:`P_r = \lambda_r(\mathrm{diag}(\psi_r) + U_rU_r^\top)`, by
    FactorIVON's update (its docstring has the formulas), with its own ``lr``, ``hess_init``, ``ess`` and
    ``weight_decay`` (so that the points of a grid, prior precisions among them, on splits of different sizes, train
    together) and Hessian decay ``beta2``, and the shared ``rank``, ``update_every``, ``beta1``, ``clip_radius`` and
    ``diag_floor``.
    Every step is, replica by replica, FactorIVON's step on one param group: the same diagonal update, the same
    low-rank refresh and the same Woodbury draws and solve, equal to it to rounding (the :math:`K\times K` and
    :math:`D\times K` algebra is batched over the replica dimension, :mod:`pyro_fa.optim._batched_lowrank`).
    ``rank=0`` is IVON's update.

    Not a :class:`torch.optim.Optimizer`: the loop is the caller's. Each step, :meth:`draw` returns weights
    :math:`\theta = m + z` (R, D) to evaluate the loss at, and :meth:`step` takes the gradients of the replicas'
    losses there (one draw per step, or several draws, then their gradients stacked). A replica whose gradient
    or updated state is not finite *diverges*: its state stays at its last finite value, it is no longer updated,
    and :attr:`diverged` marks it; the others go on unaffected.

    Parameters
    ----------
    loc : Tensor of shape (R, D)
        The initial means (copied); floating point.
    lr, ess : float or sequence of R floats or Tensor of shape (R,)
        FactorIVON's, per replica (one value: every replica's).
    hess_init : float or sequence of R floats or Tensor of shape (R,), default 1.0
    weight_decay : float or sequence of R floats or Tensor of shape (R,), default 1e-4
        The prior precision per training point, per replica (``ess * weight_decay`` is replica r's prior precision).
    beta2 : float or sequence of R floats or Tensor of shape (R,), default 0.99999
        The Hessian decay, per replica (held in ``loc``'s dtype).
    beta1, clip_radius, debias, rescale_lr
        FactorIVON's, shared (defaults 0.9, inf, True, True).
    rank, update_every, diag_floor, curvature, batch_size
        FactorIVON's (keyword only; defaults 10, 1, 0.25, ``"stein"``, None), shared.

    Attributes
    ----------
    loc : Tensor of shape (R, D)
        The means :math:`m_r`.
    lr : Tensor of shape (R,)
        The rates; assign a new tensor between steps to follow a schedule.
    diverged : Tensor of shape (R,), bool
        The replicas that diverged (frozen).

    Raises
    ------
    ValueError, TypeError
        A hyperparameter outside FactorIVON's range or not a number, a per-replica value of the wrong length,
        ``loc`` not a floating (R, D) tensor, ``rank + 2`` x (draws per step) above D; at :meth:`draw` and
        :meth:`step`, ``eps`` or ``grad`` of the wrong shape. RuntimeError: :meth:`step` before any :meth:`draw`.

    See also
    --------
    pyro_fa.optim.FactorIVON : one run, over a module's parameters.
    pyro_fa.nn.batched.BatchedMLP : the networks whose weights are rows of ``loc``.

    Examples
    --------
    >>> from pyro_fa.nn.batched import BatchedMLP
    >>> mlp = BatchedMLP(3, (8,))
    >>> x, y = torch.randn(20, 3), torch.randn(20)
    >>> opt = BatchedFactorIVON(mlp.init(4), lr=[0.1, 0.2, 0.4, 0.8], ess=20.0, rank=2)
    >>> theta = opt.draw().requires_grad_()
    >>> loss = (mlp(theta, x) - y).square().mean(-1).sum()
    >>> opt.step(torch.autograd.grad(loss, theta)[0])
    >>> opt.loc.shape, opt.sample(5).shape
    (torch.Size([4, 41]), torch.Size([5, 4, 41]))
    """

    def __init__(self, loc: Tensor, lr, ess, hess_init=1.0, beta1: float = 0.9, beta2=0.99999,
                 weight_decay=1e-4, clip_radius: float = float("inf"), debias: bool = True,
                 rescale_lr: bool = True, *, rank: int = 10, update_every: int = 1, diag_floor: float = 0.25,
                 curvature: str = "stein", batch_size: Optional[int] = None):
        if not isinstance(loc, Tensor) or loc.dim() != 2 or not loc.dtype.is_floating_point or loc.shape[0] < 1:
            got = tuple(loc.shape) if isinstance(loc, Tensor) else type(loc).__name__
            raise ValueError(f"{NAME}: loc must be a floating-point Tensor of shape (R, D), R >= 1, got {got!r}.")
        check_hyperparameters(dict(beta1=beta1, clip_radius=clip_radius, diag_floor=diag_floor), NAME)
        self.rank = check_count("rank", rank, 0, NAME)
        self.update_every = check_count("update_every", update_every, 1, NAME)
        self.curvature, self.batch_size = check_curvature(curvature, batch_size, NAME)
        R, D = loc.shape
        if self.rank + 2 > D and self.rank:
            raise ValueError(f"{NAME}: rank + 2 * (draws per step) must be at most the number of weights {D}, got "
                             f"rank={self.rank}.")
        self.lr = _per_replica("lr", lr, R, loc)
        self.ess = _per_replica("ess", ess, R, loc)
        self.hess_init = _per_replica("hess_init", hess_init, R, loc)
        self.weight_decay = _per_replica("weight_decay", weight_decay, R, loc)
        self.beta2 = _per_replica("beta2", beta2, R, loc)
        self.beta1 = float(beta1)
        self.clip_radius, self.diag_floor = float(clip_radius), float(diag_floor)
        self.debias, self.rescale_lr = bool(debias), bool(rescale_lr)
        self.loc = loc.detach().clone()
        self.step_count = 0
        self.momentum = torch.zeros_like(self.loc)
        self.hess = self.hess_init.unsqueeze(-1).expand(R, D).clone()
        self.basis = loc.new_zeros(R, self.rank, D)  # Q^T per replica, rows orthonormal or 0
        self.eigvals = loc.new_zeros(R, self.rank)
        self.diverged = torch.zeros(R, dtype=torch.bool, device=loc.device)
        self._factors: Optional[BatchedWoodbury] = None
        self._draws = []  # (z, P z) of the draws since the last step

    # ------------------------------------------------------------------ the posterior
    @property
    def _wd(self) -> Tensor:
        """The weight decay as a column (R, 1), against (R, D) state."""
        return self.weight_decay.unsqueeze(-1)

    @property
    def replicas(self) -> int:
        """R."""
        return self.loc.shape[0]

    @property
    def dim(self) -> int:
        """D, the weights per replica."""
        return self.loc.shape[1]

    def _woodbury(self) -> BatchedWoodbury:
        r"""The factorisation of every replica's :math:`\Psi + UU^\top` (rank > 0; cached until a refresh)."""
        if self._factors is None:
            self._factors = factorise_batched(self.basis, self.eigvals, self.hess + self._wd,
                                              self.diag_floor, self.ess)
        return self._factors

    def _noise(self, eps: Tensor):
        """``(z, P z)`` from standard normals ``eps`` (..., R, D); ``P z`` None at rank 0 (IVON's draw)."""
        if self.rank:
            return self._woodbury().draw(eps)
        return eps / (self.ess.unsqueeze(-1) * (self.hess + self._wd)).sqrt(), None

    @torch.no_grad()
    def keep(self, index) -> None:
        """Keep only the replicas ``index`` (distinct replica numbers, in their new order), as if the run had held
        them alone: every per-replica state and setting and the cached factorisation sliced. Between steps only
        (a grid search drops its worst points this way)."""
        if self._draws:
            raise RuntimeError(f"{NAME}: keep() is called between steps; draw() was called since the last step().")
        index = torch.as_tensor(index, device=self.loc.device)
        if index.dtype.is_floating_point or index.dtype == torch.bool or index.dim() != 1 or not len(index) \
                or not bool(((index >= 0) & (index < self.replicas)).all()) or len(set(index.tolist())) != len(index):
            raise ValueError(f"{NAME}: index must hold distinct replica numbers in [0, {self.replicas}), at least one, "
                             f"got {index.tolist()!r}.")
        for name in ("loc", "lr", "ess", "hess_init", "weight_decay", "beta2", "momentum", "hess", "basis", "eigvals",
                     "diverged"):
            setattr(self, name, getattr(self, name)[index])
        if self._factors is not None:  # P as last factorised (between refreshes it lags h): sliced, not refactorised
            self._factors = BatchedWoodbury(*(field[index] for field in self._factors))

    @torch.no_grad()
    def get_posterior(self, replica: int) -> LowRankPrecisionNormal:
        r"""Replica ``replica``'s :math:`N(m_r, P_r^{-1})`, as :meth:`FactorIVON.get_posterior
        <pyro_fa.optim.FactorIVON.get_posterior>` (a snapshot)."""
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < self.replicas:
            raise ValueError(f"{NAME}: replica must be an integer in [0, {self.replicas}), got {replica!r}.")
        loc, ess = self.loc[replica].clone(), float(self.ess[replica])
        if self.rank:
            w = self._woodbury()
            factor, diag = w.factor_t[replica].T * math.sqrt(ess), ess * w.psi[replica]
        else:
            factor, diag = loc.new_zeros(loc.shape[0], 0), ess * (self.hess[replica] + self.weight_decay[replica])
        return LowRankPrecisionNormal(loc, factor.clone(), diag.clone())

    @torch.no_grad()
    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Weights drawn from every replica's posterior (not kept for :meth:`step`): shape (num_samples, R, D), or
        (R, D) when ``num_samples`` is None."""
        shape = (self.replicas, self.dim) if num_samples is None else \
            (check_count("num_samples", num_samples, 1, NAME), self.replicas, self.dim)
        eps = torch.randn(shape, generator=generator, dtype=self.loc.dtype, device=self.loc.device)
        return self.loc + self._noise(eps)[0]

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def draw(self, eps: Optional[Tensor] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        r"""Weights :math:`\theta = m + z`, :math:`z \sim N(0, P^{-1})`, for the next :meth:`step`: shape (R, D).

        ``eps``: the standard normals (R, D) to use (default: ``torch.randn`` from ``generator``, else the global
        generator). Replica :math:`r`'s draw is FactorIVON's with ``eps[r]``. A new tensor: give it
        ``requires_grad_()`` to differentiate the loss with respect to it.
        """
        if eps is None:
            eps = torch.randn(self.loc.shape, generator=generator, dtype=self.loc.dtype, device=self.loc.device)
        elif not isinstance(eps, Tensor) or eps.shape != self.loc.shape:
            got = tuple(eps.shape) if isinstance(eps, Tensor) else type(eps).__name__
            raise ValueError(f"{NAME}: eps must be a Tensor of shape {tuple(self.loc.shape)}, got {got!r}.")
        if self.rank and len(self._draws) + 1 > (self.dim - self.rank) // 2:
            raise ValueError(f"{NAME}: rank + 2 * (draws per step) must be at most the number of weights "
                             f"{self.dim}, got rank={self.rank} with {len(self._draws) + 1} draw(s).")
        noise, precision_noise = self._noise(eps)
        self._draws.append((noise, precision_noise))
        return self.loc + noise

    @torch.no_grad()
    def step(self, grad: Tensor) -> None:
        """Update every replica from the gradients at the draws since the last step: ``grad`` of shape (R, D) after
        one :meth:`draw`, (M, R, D) after M (in the order drawn). A replica whose gradients or new state are not
        finite is marked in :attr:`diverged` and keeps its state."""
        M = len(self._draws)
        if M == 0:
            raise RuntimeError(f"{NAME}: step() needs the gradient at a draw; call draw() first.")
        want = (self.replicas, self.dim) if M == 1 else (M, self.replicas, self.dim)
        if not isinstance(grad, Tensor) or tuple(grad.shape) != want:
            got = tuple(grad.shape) if isinstance(grad, Tensor) else type(grad).__name__
            raise ValueError(f"{NAME}: grad must be a Tensor of shape {want} (the {M} draw(s) since the last "
                             f"step), got {got!r}.")
        grads = grad.reshape(M, self.replicas, self.dim)
        finite = _finite_rows(grads.transpose(0, 1)) & ~self.diverged
        grads = torch.where(finite.unsqueeze(-1), grads, 0.0)
        old = (self.loc, self.momentum, self.hess, self.basis, self.eigvals)
        refresh = bool(self.rank) and (self.step_count + 1) % self.update_every == 0
        ok = self._update(grads, refresh) & finite
        self._draws = []
        if bool(ok.all()):
            return
        self.diverged |= ~ok
        self.loc, self.momentum, self.hess, self.basis, self.eigvals = (
            torch.where(ok.reshape(-1, *([1] * (new.dim() - 1))), new, before)
            for new, before in zip((self.loc, self.momentum, self.hess, self.basis, self.eigvals), old))
        if refresh:  # refactorised from the kept state where a replica diverged
            self._factors = None

    def _update(self, grads: Tensor, refresh: bool) -> Tensor:
        """FactorIVON's ``_update`` for every replica; returns which replicas' new state is finite."""
        M = grads.shape[0]
        self.step_count += 1
        t = float(self.step_count)
        b1, b2, wd = self.beta1, self.beta2.unsqueeze(-1), self._wd
        noise = torch.stack([z for z, _ in self._draws])
        avg_grad, avg_nxg = grads[0], None
        for j in range(M):  # ivon-opt's running means, as FactorIVON keeps them
            nxg = grads[j] * (self._draws[j][1] if self.rank else noise[j])
            avg_grad = grads[j] if j == 0 else avg_grad + (grads[j] - avg_grad) / (j + 1)
            avg_nxg = nxg if j == 0 else avg_nxg + (nxg - avg_nxg) / (j + 1)
        previous, h = self.momentum, self.hess
        self.momentum = torch.mul(previous, b1).add_(torch.mul(avg_grad, 1.0 - b1))
        f = avg_nxg if self.rank else avg_nxg * (h + wd) * self.ess.unsqueeze(-1)
        new = torch.mul(h, b2).add_(torch.mul(f, 1.0 - b2))
        self.hess = new.add_(torch.sub(h, f).square_().mul_(0.5 * (1 - b2) ** 2).div_(torch.add(h, wd)))
        ok, before = torch.ones_like(self.diverged), (previous, h, self.basis, self.eigvals)
        if refresh:  # FactorIVON's refresh, every update_every steps
            if t > 1.0:
                baseline = previous / (1.0 - math.pow(b1, t - 1.0)) if self.debias else previous
            else:
                baseline = torch.zeros_like(previous)
            centred = grads - baseline
            second = torch.stack([a for _, a in self._draws]) if self.batch_size is None else centred * self.batch_size
            V = torch.cat([centred, second], 0).transpose(0, 1)  # pairs (g - b, Pz) (Stein's) or (g - b, B(g - b))
            total = torch.add(self.hess, wd).clamp_min_(0).sqrt_()
            basis, eigvals, sums, ok = sketch_update_batched(self.basis, self.eigvals, V.contiguous(),
                                                             self.beta2 ** self.update_every, total)
            self.basis, self.eigvals = basis, torch.minimum(eigvals, sums.square())
            self._factors = None
        state = (self.momentum, self.hess, self.basis, self.eigvals)
        for x in state:
            ok = ok & _finite_rows(x)
        if not bool(ok.all()):  # the previous state where it is not finite, so that the solve below stays finite
            self.momentum, self.hess, self.basis, self.eigvals = (
                torch.where(ok.reshape(-1, *([1] * (x.dim() - 1))), x, y) for x, y in zip(state, before))
        self.loc = self._new_mean(self.loc, t)
        return ok & _finite_rows(self.loc)

    def _new_mean(self, mean: Tensor, t: float) -> Tensor:
        wd = self._wd
        debias = 1.0 - math.pow(self.beta1, t) if self.debias else 1.0
        if self.rank:  # the Woodbury solve (refactorised at a refresh, else P as last factorised)
            direction = self._woodbury().solve((self.momentum / debias).add_(mean * wd))
        else:  # ivon-opt's expression, (momentum / debias + wd mean) / (h + wd)
            direction = torch.div(self.momentum, debias).add_(torch.mul(mean, wd)).div_(torch.add(self.hess, wd))
        lr = self.lr * (self.hess_init + self.weight_decay) if self.rescale_lr else self.lr
        step = direction.clamp_(min=-self.clip_radius, max=self.clip_radius).mul_(lr.unsqueeze(-1))
        return torch.sub(mean, step)
