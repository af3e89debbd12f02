r"""Streamed sufficient statistics of a sample: count, mean and scatter matrix, merged exactly.

Batch factor analysis depends on the data only through :math:`N`, :math:`\bar x` and
:math:`S = \frac1N\sum_n (x_n-\bar x)(x_n-\bar x)^\top`; :class:`ScatterStatistics` accumulates
them in chunks with the pairwise update of Chan, Golub & LeVeque, *Updating formulae and a
pairwise algorithm for computing sample variances*, Stanford CS-79-773, 1979, so a stream of
batches gives the same :math:`S` as the whole data set.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

__all__ = ["ScatterStatistics"]


def _check_finite(x: Tensor, owner: str, name: str = "x") -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{owner}: {name} must be finite (no NaN or inf), got a tensor with non-finite entries.")


def _merged(n_a: int, mean_a, scatter_a, n_b: int, mean_b: Tensor, scatter_b: Tensor):
    """Count, mean and scatter of two merged samples (Chan, Golub & LeVeque 1983), out of place."""
    if n_a == 0:
        return n_b, mean_b, scatter_b
    n = n_a + n_b
    delta = mean_b - mean_a
    mean = torch.add(mean_a, delta, alpha=n_b / n)
    scatter = torch.add(scatter_a, scatter_b).addr_(delta, delta, alpha=n_a * n_b / n)
    return n, mean, scatter


class ScatterStatistics(nn.Module):
    r"""Sample size, mean and scatter matrix of a stream of vectors.

    .. math::

        N, \qquad \bar x = \frac1N \sum_n x_n, \qquad
        M = \sum_n (x_n - \bar x)(x_n - \bar x)^\top,

    accumulated chunk by chunk with the pairwise update of Chan, Golub &
    LeVeque (1979): for two parts :math:`a, b` with
    :math:`\delta = \bar x_b - \bar x_a`,

    .. math::

        \bar x = \bar x_a + \delta\,\frac{N_b}{N}, \qquad
        M = M_a + M_b + \delta\delta^\top \frac{N_a N_b}{N}.

    Batches in any split give the same statistics up to rounding.

    Parameters
    ----------
    dim : int
        :math:`D \ge 1`.
    chunk_size : int, optional
        Rows per chunk in :meth:`update` (default ``max(1024, dim)``), which
        bounds the working memory to ``chunk_size × D`` besides :math:`M`.
    dtype, device : optional
        Of the statistics (default: torch's default dtype, CPU).

    Attributes
    ----------
    n_samples : Tensor of shape (), int64
    mean : Tensor of shape (D,)
    scatter : Tensor of shape (D, D)

    Notes
    -----
    Cost :math:`O(BD^2)` per batch of :math:`B` rows; memory :math:`O(D^2)`.

    Examples
    --------
    >>> x = torch.randn(100, 3, dtype=torch.float64)
    >>> stats = ScatterStatistics(3, dtype=torch.float64)
    >>> _ = stats.update(x[:30]); _ = stats.update(x[30:])
    >>> bool(torch.allclose(stats.covariance(), torch.cov(x.T, correction=0)))
    True
    """

    def __init__(
        self,
        dim: int,
        *,
        chunk_size: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
    ):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"ScatterStatistics: dim must be an int, got {dim!r}.")
        if dim < 1:
            raise ValueError(f"ScatterStatistics: dim must be >= 1, got {dim!r}.")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
            raise TypeError(f"ScatterStatistics: chunk_size must be an int or None, got {chunk_size!r}.")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"ScatterStatistics: chunk_size must be >= 1, got {chunk_size!r}.")
        self.dim = dim
        self.chunk_size = chunk_size or max(1024, dim)
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("n_samples", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("mean", torch.zeros(dim, dtype=dtype, device=device))
        self.register_buffer("scatter", torch.zeros(dim, dim, dtype=dtype, device=device))

    def reset(self) -> "ScatterStatistics":
        """Forget everything seen so far."""
        self.n_samples.zero_()
        self.mean.zero_()
        self.scatter.zero_()
        return self

    def _merge(self, n_b: int, mean_b: Tensor, scatter_b: Tensor) -> None:
        n_a = int(self.n_samples)
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean.add_(delta, alpha=n_b / n)
        self.scatter.add_(scatter_b)
        self.scatter.add_(torch.outer(delta, delta), alpha=n_a * n_b / n)
        self.n_samples.fill_(n)

    def update(self, x: Tensor) -> "ScatterStatistics":
        """Add the vectors ``x`` to the statistics.

        Parameters
        ----------
        x : Tensor of shape (D,) or (B, D)
            On the device and of the dtype of the statistics (other dtypes
            are converted).

        Returns
        -------
        self

        Raises
        ------
        ValueError
            If ``x`` has the wrong shape or non-finite entries; the
            statistics are then left unchanged.
        """
        x = self._validate(x)
        # the batch's own statistics, merged chunk by chunk, then merged into the state out of place
        # and checked: a finite x whose squares overflow the dtype must not leave inf behind
        n_b, mean_b, scatter_b = 0, None, None
        for chunk in torch.split(x, self.chunk_size):
            m = chunk.mean(0)
            centred = chunk - m
            n_b, mean_b, scatter_b = _merged(n_b, mean_b, scatter_b, chunk.shape[0], m, centred.T @ centred)
        n, mean, scatter = _merged(int(self.n_samples), self.mean, self.scatter, n_b, mean_b, scatter_b)
        if not bool(torch.isfinite(scatter).all() and torch.isfinite(mean).all()):
            raise ValueError(
                f"{type(self).__name__}: x must have squared deviations that fit {scatter.dtype}, got values up to "
                f"{float(x.abs().max()):.3g} whose scatter overflows; the statistics are left unchanged."
            )
        self.mean.copy_(mean)
        self.scatter.copy_(scatter)
        self.n_samples.fill_(n)
        return self

    def merge(self, other: "ScatterStatistics") -> "ScatterStatistics":
        """Add the statistics of another stream (same ``dim``, dtype, device)."""
        if not isinstance(other, ScatterStatistics):
            raise TypeError(f"ScatterStatistics: other must be a ScatterStatistics, got {type(other).__name__!r}.")
        if other.dim != self.dim:
            raise ValueError(f"ScatterStatistics: other must have dim={self.dim}, got {other.dim!r}.")
        if int(other.n_samples) > 0:
            self._merge(int(other.n_samples), other.mean.to(self.mean), other.scatter.to(self.scatter))
        return self

    def covariance(self) -> Tensor:
        """The biased sample covariance :math:`S = M / N`, a Tensor of shape (D, D).

        Raises
        ------
        RuntimeError
            Before any update.
        """
        if int(self.n_samples) == 0:
            raise RuntimeError("ScatterStatistics: no data seen yet; call update(x) first.")
        return self.scatter / self.n_samples.to(self.scatter.dtype)

    def _validate(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"ScatterStatistics: x must be a torch.Tensor, got {type(x).__name__!r}.")
        if x.dim() == 1:
            x = x.unsqueeze(0)
        if x.dim() != 2 or x.shape[-1] != self.dim:
            raise ValueError(
                f"ScatterStatistics: x must have shape (D,) or (B, D) with D={self.dim}, got {tuple(x.shape)!r}."
            )
        if x.device != self.mean.device:
            raise ValueError(
                f"ScatterStatistics: x must be on device {self.mean.device}, got {x.device}. Move it with x.to(...)."
            )
        x = x.to(self.mean.dtype)
        _check_finite(x, "ScatterStatistics")
        return x
