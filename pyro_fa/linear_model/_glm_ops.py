r"""The computational helpers of :class:`~pyro_fa.linear_model.GeneralizedLinearModel` (private): the linear
predictor over vectorised particles, its moments and draws at new inputs in blocks, the SVI row batches and loop."""
from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Tuple

import pyro
import torch
from pyro.infer import SVI
from torch import Tensor

from pyro_fa import FactorELBO
from pyro_fa.linear_model._validation import integer

_CHUNK_ELEMENTS = 2 ** 22  # rows x columns of one block of features or of samples x rows at prediction


def _linear_predictor(Phi: Tensor, w: Tensor) -> Tensor:
    r""":math:`f = \Phi w` for ``w`` of shape (D,) or (..., 1, D) (vectorised particles): shape (M,) or (..., M)."""
    if w.dim() == 1:
        return Phi @ w
    # the latent sits outside the data plate, so its batch shape ends in a 1 at the plate's dim
    return (w @ Phi.T).squeeze(-2)


class _Batches:
    """Row indices for SVI: epochs of a random permutation cut into batches (None: the full data)."""

    def __init__(self, n: int, batch_size: Optional[int], device):
        self.n, self.batch_size, self.device = n, batch_size, device
        self._perm: Optional[Tensor] = None
        self._pos = n

    def next(self) -> Optional[Tensor]:
        if self.batch_size is None:
            return None
        if self._pos + self.batch_size > self.n:
            self._perm = torch.randperm(self.n, device=self.device)
            self._pos = 0
        idx = self._perm[self._pos:self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx


def run_svi(model: Callable, guide: Callable, X: Tensor, y: Tensor, n_steps: int, batch_size: Optional[int],
            lr: float, lr_decay: float, num_particles: int, bar=None) -> List[float]:
    r"""``n_steps`` of :class:`pyro.infer.SVI` on :class:`~pyro_fa.FactorELBO` with Adam, its learning rate decaying
    exponentially from ``lr`` to ``lr * lr_decay``, on batches of ``batch_size`` rows (None: all); the losses.

    Runs in the caller's Pyro parameter store; ``bar`` (a tqdm bar or None) shows the loss per data point."""
    N = X.shape[0]
    batches = _Batches(N, batch_size, X.device)
    optim = pyro.optim.ExponentialLR(
        {"optimizer": torch.optim.Adam, "optim_args": {"lr": lr}, "gamma": lr_decay ** (1.0 / n_steps)}
    )
    elbo = FactorELBO(num_particles=num_particles, vectorize_particles=num_particles > 1, max_plate_nesting=1)
    svi = SVI(model, guide, optim, elbo)
    losses = []
    for _ in range(n_steps):
        loss = svi.step(X, y, batches.next())
        optim.step()
        losses.append(loss)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss_per_point=loss / N)
    return losses


def progress_bar(progress: bool, total: int, desc: str):
    """A tqdm bar of ``total`` steps, or None without ``progress``."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc)


class LatentPredictive:
    r"""The linear predictor :math:`f_* = \phi(x_*)^\top w` under :math:`q(w)` at new inputs: what a likelihood
    predicts from (:class:`~pyro_fa.linear_model.likelihoods.Likelihood`).

    ``moments(X)``: mean and variance of :math:`f_*`, :math:`O(DK)` per row; ``samples(X, n)``: blocks of joint
    draws, shape (n, rows), one set of weight draws for all blocks; ``n_samples(value)``: a checked count;
    ``noise_scale``: the model's :math:`\sigma`. Features are computed in blocks of ``_CHUNK_ELEMENTS``.
    """

    def __init__(self, cls: str, basis, q, noise_scale: Tensor):
        self.cls, self.basis, self.q, self.noise_scale = cls, basis, q, noise_scale

    def _feature_chunks(self, X: Tensor, per_row: int) -> Iterator[Tensor]:
        rows = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
        with torch.no_grad():
            for start in range(0, X.shape[0], rows):
                yield self.basis(X[start:start + rows])

    @torch.no_grad()
    def moments(self, X: Tensor) -> Tuple[Tensor, Tensor]:
        """Mean and variance of f under q, each of shape (M,)."""
        q = self.q
        means, variances = [], []
        for Phi in self._feature_chunks(X, self.basis.out_features):
            means.append(Phi @ q.loc)
            variances.append((Phi @ q.cov_factor).pow(2).sum(-1) + Phi.pow(2) @ q.cov_diag)
        return torch.cat(means), torch.cat(variances)

    @torch.no_grad()
    def samples(self, X: Tensor, n_samples: int) -> Iterator[Tensor]:
        """Blocks of joint samples of f, shape (n_samples, rows), one set of weight draws for all blocks."""
        w = self.q.sample((n_samples,))
        for Phi in self._feature_chunks(X, max(self.basis.out_features, n_samples)):
            yield w @ Phi.T

    def n_samples(self, value) -> int:
        """``value`` checked as a count of at least 1."""
        return integer(self.cls, "n_samples", value, 1)
