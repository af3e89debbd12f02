"""The loaders :class:`~pyro_fa.laplace.FactorLaplace` reads, and what a batch of them may hold.

A fit by online EM or the randomized range finder passes over ``train_loader`` several times, and the grid search
of the prior precision scores every grid value on all of ``val_loader``: a one-shot iterator (a generator,
``iter(list)``, ``map(...)``) would give its batches to the first pass only and nothing to the others. Such an
iterator is read into a list once (:func:`reiterable`); a loader that iterates afresh each time (a list, a
``torch.utils.data.DataLoader``) is used as it is.

Inputs are a Tensor of shape (B, ...) or a tuple of such Tensors, given to the network as ``model(*x)``
(:func:`check_inputs`), as :func:`pyro_fa.predictive.glm.linearized_moments` takes them.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Tuple, Union

import torch
from torch import Tensor, nn

__all__ = ["reiterable", "check_inputs", "slice_inputs", "n_examples", "check_batch", "batch_loss", "BATCH_LOSSES"]

Inputs = Union[Tensor, Tuple[Tensor, ...]]


def reiterable(owner: str, loader, argument: str) -> Iterable:
    """``loader`` if iterating it again starts afresh; a one-shot iterator (a ``collections.abc.Iterator``: a generator,
    ``iter(list)``, ``map(...)``) read into a list (its batches then held in memory).

    Raises
    ------
    TypeError
        ``loader`` is not iterable.
    """
    if not isinstance(loader, Iterable):
        raise TypeError(f"{owner}: {argument} must be an iterable of batches (a list or a DataLoader), got "
                        f"{type(loader).__name__}.")
    return list(loader) if isinstance(loader, Iterator) else loader  # not iterated here otherwise


def check_inputs(owner: str, x, ref: Tensor) -> Inputs:
    """``x`` on ``ref``'s device (floating Tensors in its dtype; inference tensors copied into ordinary ones, for
    autograd): a Tensor, or a tuple of Tensors with one first dimension (the network's positional arguments).

    Raises
    ------
    TypeError
        A dict (laplace-torch passes a Hugging Face batch to the model whole: wrap such a model so that it takes
        tensors) or anything else.
    ValueError
        Tuple members of different first dimensions.
    """
    if torch.is_tensor(x):
        return _to(x, ref)
    if isinstance(x, (tuple, list)) and x and all(torch.is_tensor(t) and t.dim() for t in x):
        if len({t.shape[0] for t in x}) != 1:
            raise ValueError(f"{owner}: the inputs of a tuple must share their first (batch) dimension, got shapes "
                             f"{[tuple(t.shape) for t in x]!r}.")
        return tuple(_to(t, ref) for t in x)
    what = type(x).__name__ + (f" with keys {list(x)[:4]!r}" if isinstance(x, Mapping) else "")
    raise TypeError(f"{owner}: inputs must be a Tensor or a tuple of Tensors (passed as model(*x)), got {what}; "
                    "for a model taking a dict, wrap it in a module whose forward takes the tensors.")


def _to(t: Tensor, ref: Tensor) -> Tensor:
    t = t.to(ref.device, ref.dtype) if t.is_floating_point() else t.to(ref.device)
    return t.clone() if t.is_inference() and not torch.is_inference_mode_enabled() else t


def slice_inputs(x: Inputs, lo: int, hi: int) -> Inputs:
    """Examples ``[lo, hi)`` of a Tensor or of each Tensor of a tuple."""
    return x[lo:hi] if torch.is_tensor(x) else tuple(t[lo:hi] for t in x)


def n_examples(x: Inputs) -> int:
    """The batch size B of a Tensor or a tuple of them."""
    return x.shape[0] if torch.is_tensor(x) else x[0].shape[0]


def check_batch(la, batch, what: str):
    """A batch of ``what`` as ``(inputs, targets)`` on ``la``'s device, checked."""
    name = type(la).__name__
    if isinstance(batch, Mapping):  # laplace-torch's Hugging Face batches: refused as inputs, in one line
        check_inputs(name, batch, la.loc)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"{name}: {what} must yield (inputs, targets) pairs, got "
                         f"{type(batch).__name__}{'' if not isinstance(batch, (tuple, list)) else f' of length {len(batch)}'}.")
    x, y = batch
    x = check_inputs(name, x, la.loc)
    y = y.to(la.loc.device)
    if y.is_inference() and not torch.is_inference_mode_enabled():
        y = y.clone()
    if n_examples(x) != y.shape[0]:
        raise ValueError(f"{name}: inputs and targets of a batch must have the same length, got "
                         f"{n_examples(x)} and {y.shape[0]}.")
    return x, y


def batch_loss(la, out: Tensor, y: Tensor) -> Tensor:
    """The loss of ``la``'s likelihood summed over a batch: cross-entropy, or the sum of squared errors."""
    name = type(la).__name__
    if out.dim() > 2:  # the curvature would count every output, the evidence only the last dimension's
        raise ValueError(f"{name}: the model's outputs must have shape (B, C) or (B,), got {tuple(out.shape)!r}; "
                         "flatten them (end the model with nn.Flatten()) and the targets alike.")
    out = out.unsqueeze(-1) if out.dim() == 1 else out
    return BATCH_LOSSES[la.likelihood](name, out, y)


def _squared_errors(name: str, out: Tensor, y: Tensor) -> Tensor:
    """A Gaussian likelihood's loss (at unit noise): the sum of squared errors of outputs (B, C)."""
    y = y.to(out.dtype)
    y = y.unsqueeze(-1) if y.dim() == 1 else y
    if y.shape != out.shape:
        raise ValueError(f"{name}: regression targets must have the outputs' shape {tuple(out.shape)!r} "
                         f"(or ({out.shape[0]},) for one output), got {tuple(y.shape)!r}.")
    return (y - out).pow(2).sum()


def _cross_entropy(name: str, out: Tensor, y: Tensor) -> Tensor:
    """A categorical likelihood's loss of logits (B, C), summed (a Bernoulli's for one logit)."""
    C = out.shape[-1]
    if y.is_floating_point() and bool((y != y.round()).any()):
        raise ValueError(f"{name}: classification targets must be integer class labels, got non-integer values.")
    y = y.long().reshape(-1)
    hi = 2 if C == 1 else C
    if y.numel() != out.shape[0] or bool(((y < 0) | (y >= hi)).any()):
        raise ValueError(f"{name}: classification targets must be labels in [0, {hi}) of shape "
                         f"({out.shape[0]},), got values in [{int(y.min())}, {int(y.max())}].")
    if C == 1:
        return nn.functional.binary_cross_entropy_with_logits(out.reshape(-1), y.to(out.dtype), reduction="sum")
    return nn.functional.cross_entropy(out, y, reduction="sum")


#: likelihood -> ``(owner, outputs (B, C), targets) -> the batch's summed loss``
BATCH_LOSSES = {"classification": _cross_entropy, "regression": _squared_errors}
