r"""``fit_batched``: Adam on the summed negative ELBO of R replicas, one step for all of them.

.. math::

    \min_{\phi_1, \dots, \phi_R} \sum_{r=1}^R \mathcal{L}_r(\phi_r)

Because replica :math:`r`'s loss depends on its own parameters :math:`\phi_r` only, the
gradient of the sum in :math:`\phi_r` is :math:`\nabla\mathcal{L}_r`, and Adam's update is
per coordinate: one step on the sum is R independent Adam steps, each replica with its
own learning rate, minibatches and Monte Carlo draws.
"""
from __future__ import annotations

import numbers
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor
from pyro_fa import _random

from pyro_fa.nn.batched.vi import BatchedVI

__all__ = ["fit_batched", "sample_rows", "take_rows"]



def _constant_schedule(opt, T_max: int):
    return None


def _cosine_schedule(opt, T_max: int):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=T_max)


#: ``lr_schedule`` name -> ``(optimizer, total steps) -> scheduler`` (None: a constant rate)
_SCHEDULES = {"constant": _constant_schedule, "cosine": _cosine_schedule}


def fit_batched(model: BatchedVI, x: Tensor, y: Tensor, steps: int, *, batch_size: Optional[int] = None,
                particles: int = 1, lr_schedule: Union[str, Callable] = "constant", total_steps: Optional[int] = None,
                generator: Optional[torch.Generator] = None, progress: Union[bool, Callable[[int], None]] = False,
                callback: Optional[Callable[[int, BatchedVI, Tensor], Optional[bool]]] = None) -> Tensor:
    r"""Train every replica of ``model`` for ``steps`` Adam steps, all in one batch of tensors.

    Each step draws, for every replica, a minibatch of ``batch_size`` rows of its data
    uniformly with replacement (all rows when ``batch_size`` is None or at least
    :math:`N`), evaluates the negative ELBOs :math:`\mathcal{L}_r` with the likelihood
    scaled by :math:`N / B` (:meth:`BatchedVI.loss`), and takes one step of
    :meth:`BatchedVI.optimizer` on :math:`\sum_r \mathcal{L}_r`, then of the learning-rate
    schedule.

    Parameters
    ----------
    model : BatchedVI
    x : Tensor of shape (N, p) or (R, N, p)
        Inputs shared by all replicas, or one dataset per replica (e.g. the folds of a
        cross-validation). On the model's device, in its dtype.
    y : Tensor of shape (N,) or (R, N)
        Targets; a column (N, 1) or (R, N, 1), as the network's output, is read as (N,) or (R, N).
    steps : int
        Optimiser steps, at least 1.
    batch_size : int, optional
        Rows per replica and step; full batch when omitted.
    particles : int, default 1
        Monte Carlo draws of :math:`\theta` per replica and step.
    lr_schedule : {"constant", "cosine"} or callable, default "constant"
        ``"cosine"``: ``torch.optim.lr_scheduler.CosineAnnealingLR`` over ``total_steps``,
        each rate following :math:`\eta_t = \eta_0 (1 + \cos(\pi t / T)) / 2`; a callable
        ``optimizer -> scheduler`` builds any other (stepped once per step).
    total_steps : int, optional
        :math:`T` of the cosine schedule, at least ``steps``; default ``steps``. A fit stopped
        before :math:`T` has followed the rates of a longer fit up to that step.
    generator : torch.Generator, optional
        Draws the minibatches: on the CPU or on the device of ``x`` (drawn on the generator's
        device, then moved). The ELBO's draws come from torch's
        global RNG (as in Pyro's ``SVI``): seed it with ``torch.manual_seed``.
    progress : bool or callable, default False
        ``True``: a tqdm bar; a callable is called with the number of steps done since
        its last call.
    callback : callable, optional
        ``callback(step, model, loss)`` after every step, ``loss`` the detached per-replica
        losses of shape (R,); training stops when it returns ``True`` (e.g. early stopping on
        :meth:`BatchedVI.predict` scores every few hundred steps).

    Returns
    -------
    Tensor of shape (steps_run, R)
        The negative ELBO of every replica at every step (of its minibatch and draws).

    Raises
    ------
    TypeError
        If ``model`` is not a BatchedVI or ``x`` / ``y`` are not tensors.
    ValueError
        For data of another shape, dtype or device than the model's, non-finite data,
        or ``steps``, ``batch_size``, ``particles``, ``lr_schedule``, ``total_steps``,
        ``generator`` out of range.

    Notes
    -----
    One step costs one fit-step's tensor work times R, with one Python dispatch for all,
    and no Pyro tracing: per fit-step several times less than ``pyro.infer.SVI`` one fit
    at a time for small networks (measured on the online documentation's *Batched training*
    page). No ``.item()`` is called in the loop; the data
    are checked (shapes, dtype, device, finiteness) once, before the first step.

    Examples
    --------
    Five seeds of one model, with a cosine schedule and minibatches of 32:

    >>> from pyro_fa.nn import BatchedMLP, BatchedVI, fit_batched
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> x = torch.randn(200, 3)
    >>> y = x.sum(-1) + 0.1 * torch.randn(200)
    >>> vi = BatchedVI(BatchedMLP(3, (20,)), "fa", precision=1.0, lr=1e-2, replicas=5, rank=2,
    ...                generator=torch.Generator().manual_seed(0), dtype=x.dtype)
    >>> losses = fit_batched(vi, x, y, steps=300, batch_size=32, lr_schedule="cosine")
    >>> bool((losses[-20:].mean(0) < losses[:20].mean(0)).all())
    True
    """
    fn = "fit_batched"
    if not isinstance(model, BatchedVI):
        raise TypeError(f"{fn}: model must be a BatchedVI, got {type(model).__name__}.")
    x, y = _check_data(model, x, y, fn)
    _check_count(steps, "steps", fn)
    if batch_size is not None:
        _check_count(batch_size, "batch_size", fn)
    _check_count(particles, "particles", fn)
    if not (callable(lr_schedule) or (isinstance(lr_schedule, str) and lr_schedule in _SCHEDULES)):
        raise ValueError(f"{fn}: lr_schedule must be one of {tuple(_SCHEDULES)} or a callable optimizer -> scheduler, got "
                         f"{lr_schedule!r}.")
    if total_steps is not None:
        _check_count(total_steps, "total_steps", fn)
        if total_steps < steps:
            raise ValueError(f"{fn}: total_steps must be at least steps ({steps}), got {total_steps}.")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"{fn}: generator must be a torch.Generator (on the CPU or on x's device), got "
                         f"{type(generator).__name__}.")
    if callback is not None and not callable(callback):
        raise TypeError(f"{fn}: callback must be callable, got {type(callback).__name__}.")

    R, N = model.replicas, y.shape[-1]
    batch = N if batch_size is None else min(int(batch_size), N)
    opt = model.optimizer()
    if callable(lr_schedule):
        sched = lr_schedule(opt)
    else:
        sched = _SCHEDULES[lr_schedule](opt, total_steps or steps)
    bar, update = _progress(progress, steps)
    # written in place: a small tensor kept from every step, between the step's large temporaries, would
    # fragment the CPU heap (glibc's), which then grows by about a megabyte a step on a long fit
    losses = torch.empty(steps, R, dtype=model.dtype, device=y.device)
    done = 0
    try:
        for step in range(1, steps + 1):
            xb, yb = take_rows(x, y, sample_rows(R, N, batch, generator, y.device))
            opt.zero_grad(set_to_none=True)
            loss = model.loss(xb, yb, N, particles)
            loss.sum().backward()
            opt.step()
            if sched is not None:
                sched.step()
            losses[step - 1] = loss.detach()
            done = step
            if update is not None:
                update(1)
            if callback is not None and callback(step, model, losses[step - 1]):
                break
    finally:
        if bar is not None:
            bar.close()
    return losses[:done]


def sample_rows(replicas: int, n: int, batch_size: int, generator: Optional[torch.Generator] = None,
                device=None) -> Optional[Tensor]:
    r"""Row indices of one minibatch per replica, drawn uniformly with replacement.

    The draw :func:`fit_batched` makes at every step; a training loop of its own (e.g. the
    SGD collection phase of ``pyro-fa uci``'s SWAG family) calls it to draw the same
    minibatches from the same generator.

    Parameters
    ----------
    replicas : int
        R, the number of replicas (fits).
    n : int
        N, the number of rows of each replica's data.
    batch_size : int
        B, the rows per replica; at least ``n`` means the full batch.
    generator : torch.Generator, optional
        The generator the indices are drawn from (default: torch's global one).
    device : torch.device or str, optional
        Where the indices live: the data's device.

    Returns
    -------
    Tensor or None
        Long tensor of shape (R, B) with entries in [0, N); None when ``batch_size >= n``
        (the full batch, nothing drawn).

    Notes
    -----
    One ``torch.randint`` call; no arguments are checked (it runs inside training loops,
    whose entry checks them).

    Examples
    --------
    >>> idx = sample_rows(3, 10, 4, torch.Generator().manual_seed(0))
    >>> idx.shape, bool((idx < 10).all())
    (torch.Size([3, 4]), True)
    >>> sample_rows(3, 10, 10) is None
    True
    """
    if batch_size >= n:
        return None
    return _random.randint(n, (replicas, batch_size), generator, device)


def take_rows(x: Tensor, y: Tensor, idx: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    r"""The rows ``idx`` of every replica's data: the minibatch :func:`sample_rows` drew.

    Parameters
    ----------
    x : Tensor
        Inputs, of shape (N, P) shared by every replica or (R, N, P), one set per replica.
    y : Tensor
        Targets, of shape (N,) shared or (R, N) per replica.
    idx : Tensor or None
        Long tensor of shape (R, B), as :func:`sample_rows` returns; None for the full batch.

    Returns
    -------
    (Tensor, Tensor)
        ``x`` of shape (R, B, P) and ``y`` of shape (R, B): row ``idx[r]`` of replica r's data
        (of the shared data when ``x`` / ``y`` are shared); ``x``, ``y`` themselves when
        ``idx`` is None.

    Examples
    --------
    >>> x, y = torch.arange(10.).reshape(5, 2), torch.arange(5.)
    >>> xb, yb = take_rows(x, y, torch.tensor([[0, 4], [1, 1]]))
    >>> xb.shape, yb.tolist()
    (torch.Size([2, 2, 2]), [[0.0, 4.0], [1.0, 1.0]])
    """
    if idx is None:
        return x, y
    if x.dim() == 2:  # shared inputs: one gather per replica's rows
        x = x[idx]
    else:
        x = torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return x, (y[idx] if y.dim() == 1 else torch.gather(y, 1, idx))


def _check_count(value, name: str, fn: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{fn}: {name} must be a positive int, got {value!r}.")


def _check_data(model: BatchedVI, x, y, fn: str):
    """x (N, p) or (R, N, p) and y (N,) or (R, N), finite, on the model's dtype and device."""
    from pyro_fa.nn.batched.vi import _check_inputs

    R = model.replicas
    _check_inputs(model, x, fn)
    if not isinstance(y, Tensor):
        raise TypeError(f"{fn}: y must be a torch.Tensor of shape (N,) or ({R}, N), got {type(y).__name__}.")
    N = x.shape[-2]
    if y.dim() in (2, 3) and y.shape[-1] == 1 and y.shape[-2] == N and (y.dim() == 2 or y.shape[0] == R):
        y = y.squeeze(-1)  # a column of targets, (N, 1) or (R, N, 1), as the network's (N, 1) output
    if y.dim() not in (1, 2) or y.shape[-1] != N or (y.dim() == 2 and y.shape[0] != R):
        raise ValueError(f"{fn}: y must have shape ({N},) or ({R}, {N}) (or those with a trailing 1), one target per "
                         f"row of x of shape {tuple(x.shape)}, got {tuple(y.shape)}.")
    if N < 1:
        raise ValueError(f"{fn}: x must hold at least one row, got shape {tuple(x.shape)}.")
    if y.dtype != model.dtype or y.device != model.device:
        raise ValueError(f"{fn}: y must have the model's dtype {model.dtype} and device {model.device}, got "
                         f"{y.dtype} on {y.device}.")
    for name, t in (("x", x), ("y", y)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{fn}: {name} must be finite, got NaN or inf in {int((~torch.isfinite(t)).sum())} "
                             "entries; nothing was trained.")
    if x.dim() == 3 or y.dim() == 2:  # one dataset per replica: both per replica
        x = x if x.dim() == 3 else x.expand(R, *x.shape)
        y = y if y.dim() == 2 else y.expand(R, N)
    return x, y


def _progress(progress, steps: int):
    """``(bar to close, update(n))`` for ``progress``: a tqdm bar, the user's callable, or nothing."""
    if callable(progress):
        return None, progress
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="fit_batched", unit="step", mininterval=1.0)
        return bar, bar.update
    if progress in (False, None):
        return None, None
    raise TypeError(f"fit_batched: progress must be a bool or a callable, got {type(progress).__name__}.")
