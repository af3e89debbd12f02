r"""The fit of :class:`~pyro_fa.laplace.FactorLaplace`: one curvature source feeding its structure.

The source is :func:`~pyro_fa.laplace.curvature.curvature_vectors` run over the data at the MAP weights (GGN
factors or Monte Carlo Fisher gradients, ``chunk_size`` examples at a time); on its first pass the loss and its
gradient at the MAP are summed too. The approximation's structure (:mod:`pyro_fa.laplace.structures`) fits the
stream (as many passes as its fit asks for) and stores the result in its buffers. A plain function of the
approximation ``la``, its method ``fit`` (bound by :func:`~pyro_fa.laplace._prior.method`).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from pyro_fa.laplace._loaders import n_examples, reiterable, slice_inputs
from pyro_fa.laplace.curvature import curvature_vectors
from pyro_fa.predictive.glm import check_eval_mode

__all__ = ["fit"]


def _theta(la) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in la._params])


def fit(la, train_loader: Iterable):
    """One pass over the data at the current (MAP) weights: the curvature, fitted by factor analysis.

    Parameters
    ----------
    train_loader : iterable of (Tensor, Tensor)
        Batches of inputs (B, ...), or a tuple of such Tensors (given to the network as ``model(*x)``), and
        targets: labels (B,) for classification, values (B,) or (B, C) for regression (a
        ``torch.utils.data.DataLoader`` or a list; a one-shot iterator such as a generator is read into a
        list first, as the fit may pass over it more than once). Works under ``torch.no_grad()`` and
        ``torch.inference_mode()`` (gradients are enabled inside).

    Returns
    -------
    self

    Raises
    ------
    ValueError
        Malformed batches, targets, outputs of more than two dimensions, non-finite weights or curvature,
        an empty loader, a dropout or batch-norm layer in train mode (nothing changed).
    TypeError
        Inputs that are neither a Tensor nor a tuple of Tensors (a dict).
    """
    name = type(la).__name__
    check_eval_mode(name, la.model, "model")  # before any forward pass: its buffers stay as they are
    train_loader = reiterable(name, train_loader, "train_loader")  # passed over more than once
    theta = _theta(la)
    if not bool(torch.isfinite(theta).all()):
        raise ValueError(f"{name}: the model's weights must be finite to fit a Laplace approximation, got "
                         "NaN or inf.")
    generator = torch.Generator(device=theta.device).manual_seed(la.seed)
    totals = {"n": 0, "loss": theta.new_zeros(()), "grad": torch.zeros_like(theta), "outputs": 0, "first": True}
    leaf = theta.clone().requires_grad_(True)

    def passes():
        count, totals["first"] = totals["first"], False
        for batch in train_loader:
            x, y = la._batch(batch, "train_loader")
            for lo in range(0, n_examples(x), la.chunk_size):
                xc, yc = slice_inputs(x, lo, lo + la.chunk_size), y[lo:lo + la.chunk_size]
                if count:  # the loss and its gradient at theta (the linearised evidence's g)
                    with torch.enable_grad():
                        out = la._f(leaf, xc)
                        loss = la._batch_loss(out, yc)
                        totals["grad"] += torch.autograd.grad(loss, leaf)[0]
                    totals["loss"] += loss.detach()
                    out = out.detach()
                    totals["n"] += n_examples(xc)
                    totals["outputs"] = 1 if out.dim() == 1 else out.shape[-1]
                yield curvature_vectors(la._f, theta, xc, la.likelihood, la.curvature,
                                        num_samples=la.mc_samples, generator=generator)

    F, psi, info = la._structure.fit(passes, la.dim, method=la.curvature_fit, num_passes=la.num_passes,
                                       seed=la.seed, dtype=theta.dtype, device=theta.device, owner=name,
                                       process_group=la.process_group)
    if la.process_group is not None:
        import torch.distributed as dist

        sums = torch.stack([totals["loss"].to(torch.float64), torch.tensor(float(totals["n"]), dtype=torch.float64,
                            device=theta.device), torch.tensor(float(totals["outputs"]), dtype=torch.float64,
                            device=theta.device)])
        outputs = sums[2].clone()
        dist.all_reduce(sums, group=la.process_group)
        dist.all_reduce(outputs, op=dist.ReduceOp.MAX, group=la.process_group)
        totals["loss"], totals["n"], totals["outputs"] = sums[0].to(theta.dtype), int(sums[1]), int(outputs)
        dist.all_reduce(totals["grad"], group=la.process_group)
    n_data = totals["n"]
    if n_data == 0:
        raise ValueError(f"{name}: train_loader must yield at least one example, got none.")
    if not bool(torch.isfinite(totals["loss"])):
        raise ValueError(f"{name}: the loss at the MAP must be finite, got {float(totals['loss'])!r}.")
    if not bool(torch.isfinite(totals["grad"]).all()):
        raise ValueError(f"{name}: the gradient of the loss at the MAP must be finite, got NaN or inf.")
    ratio = info["n_vectors"] / n_data  # F F^T + psi fits G / V: rescale to G / N
    la._replace(**la._structure.store(la._buffers, F, psi, ratio, la._prior_diag(la.prior_precision),
                                          n_data / float(la.sigma_noise) ** 2, info))
    lo, hi = la._rows
    la._replace(loc=theta[lo:hi], loss=totals["loss"],
                  loss_grad=totals["grad"][lo:hi], n_data=torch.tensor(n_data),
                  n_outputs=torch.tensor(totals["outputs"]))
    la.fit_info = info
    return la
