r"""Factor analysis of the *uncentred* second moment of a stream of curvature vectors.

The curvature of :math:`N` examples is :math:`G = \sum_v vv^\top` over their :math:`V` vectors; here
:math:`G/V \approx FF^\top + \Psi` is fitted (the caller rescales by :math:`V/N`). The FA core fits a covariance
around a mean; two routes give it the uncentred moment:

* ``"scatter"`` (exact, small :math:`D`): :math:`S = G/N` is accumulated as a :math:`D\times D` matrix in one
  pass (float64) and handed to :func:`pyro_fa.fa.batch.em_from_covariance` (Barber's exact-F iteration,
  run to convergence: the fit of the curvature converges, not one pass of it). With ``rank >= D`` the
  curvature is kept exactly, :math:`F = U\Lambda^{1/2}` from the eigendecomposition of :math:`S` and
  :math:`\psi = 0`.
* ``"exact"`` (the default up to :math:`D = 1024`): the same :math:`D\times D` :math:`G` in one pass, then
  its exact top :math:`3K` eigenpairs and exact diagonal refitted by the batch FA of ``"randomized"``: the
  estimand of ``"randomized"`` without its range finder's error (its limit as the power iteration
  converges), at one pass of the data, one symmetric eigendecomposition (:math:`O(D^3)`) and
  :math:`O(DK^2)` per FA iteration, instead of ``"scatter"``'s :math:`O(D^2K)` per iteration, which needs
  hundreds of them. Where the curvature beyond its top :math:`3K` eigenvalues is small next to the
  :math:`K`-th, it agrees with ``"scatter"``. Its :math:`O(D^3)` eigendecomposition makes it the default only
  up to :math:`D = 1024` (``benchmarks/bench_laplace_cost.py``; measured times and errors in
  ``benchmarks/results/measurements_from_docstrings.md``).
* ``"online"`` / ``"sketch"`` (:math:`O(DK)` memory, any :math:`D`): the stream :math:`\pm v` (each vector
  and its negative, so the mean is exactly zero and the centred covariance *is* the uncentred moment) is
  fed to :class:`pyro_fa.fa.online.OnlineFactorAnalysis`, by online EM (``"online"``, ``num_passes``
  passes, shardable) or by its scatter sketch refitted by batch FA (``"sketch"``, one pass).
* ``"randomized"`` (:math:`O(DK)` memory, any :math:`D`, shardable): the uncentred moment itself, with no
  :math:`\pm v` doubling, through a randomized range finder and a Nyström approximation (Halko, Martinsson &
  Tropp, *Finding structure with randomness*, SIAM Review 2011, Alg. 4.3; Tropp, Yurtsever, Udell & Cevher,
  *Fixed-rank approximation of a positive-semidefinite matrix from streaming data*, NeurIPS 2017, Alg. 3):
  each pass over the data computes :math:`GQ` for a :math:`D\times 3K` orthonormal :math:`Q` as two matrix
  products per block of vectors, the first pass also the exact diagonal; then batch FA (the iteration of
  ``"sketch"``'s refit) on :math:`G \approx EE^\top` off the diagonal and the exact diagonal. Every pass but
  the last refines :math:`Q` (a power iteration).
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.fa.batch import ConvergenceWarning, em_from_covariance, gaussian_loglike
from pyro_fa.fa.fitters import Fitter, curvature_fitters
from pyro_fa.fa.linalg import check_dense_dim
from pyro_fa.fa.moments import wide_dtype
from pyro_fa.fa.online import OnlineFactorAnalysis

__all__ = ["fit_second_moment", "MOMENT_FITS", "DENSE_FITS", "moment_fits", "resolve_fit"]

#: elements of one online update's rows (the vectors and their negatives): the fitter's float64 temporaries are a
#: few such (rows, D) arrays, 32 MB each
_ONLINE_ELEMENTS = 1 << 22



def moment_fits() -> Tuple[str, ...]:
    """The ways of fitting the second moment, by name: the dense and randomized fits and every registered fitter
    with a ``curvature_fit`` name (``"online"``: online EM, ``"sketch"``); ``"auto"`` picks ``"exact"`` up to
    ``dense_max_dim``."""
    return ("auto", "scatter", *curvature_fitters(), "randomized", "exact")


#: the ways of fitting the second moment as of import (the built-in fitters); :func:`moment_fits` is current
MOMENT_FITS = moment_fits()

#: the fits that form the D x D moment (any rank up to D; ``"auto"`` picks ``"exact"`` up to ``dense_max_dim``)
DENSE_FITS = ("scatter", "exact")

#: batch FA on a low-rank moment: scikit-learn FactorAnalysis's stopping rule, as ``method="sketch"``'s refit
_FA_MAX_ITER, _FA_TOL, _FA_RTOL = 1000, 1e-2, 1e-7
#: columns of the randomized range finder per factor (oversampling: the FA refit needs more than the top K)
_WIDTH_PER_RANK = 3
#: the floor of psi relative to each coordinate's second moment (OnlineFactorAnalysis's min_variance)
_MIN_VARIANCE = 1e-4


def _check_block(V: Tensor, D: int, owner: str) -> None:
    if V.dim() != 2 or V.shape[-1] != D:
        raise ValueError(f"{owner}: curvature vectors must have shape (V, {D}), got {tuple(V.shape)!r}.")
    if not bool(torch.isfinite(V).all()):
        raise ValueError(f"{owner}: curvature vectors must be finite, got NaN or inf; the network's outputs or "
                         "its Jacobian at these weights are not finite. Nothing was fitted.")


def _check_count(n_vec: int, owner: str) -> None:
    if n_vec == 0:
        raise ValueError(f"{owner}: train_loader must yield at least one example, got none.")


def _agree(ok: bool, group, device) -> bool:
    """Whether every rank's ``ok`` holds (one all-reduce); ``ok`` itself without a group."""
    if group is None:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, group=group)
    return float(flag) == 0.0


def _scatter(passes: Callable[[], Iterator[Tensor]], D: int, dtype, device, owner: str,
             group=None) -> Tuple[Tensor, int]:
    wide = wide_dtype(device)
    G = torch.zeros(D + 1, D, dtype=wide, device=device)  # the last row carries the vector count
    error = None
    try:
        for V in passes():
            _check_block(V, D, owner)
            W = V.to(wide)
            G[:D].addmm_(W.T, W)
            G[D, 0] += V.shape[0]
    except ValueError as exc:  # raised on every rank below, after agreeing (no rank left in a collective)
        if group is None:
            raise
        error = exc
    if not _agree(error is None, group, device):
        raise error or ValueError(f"{owner}: another rank's curvature vectors were refused (not finite or of the "
                                  "wrong shape); nothing was fitted.")
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(G, group=group)
    return G[:D], int(G[D, 0])


def _exchanged_blocks(passes: Callable[[], Iterator[Tensor]], D: int, owner: str, group, device, dtype):
    """This rank's columns ``[lo, hi)`` of every rank's next block of vectors, concatenated in rank order, until
    every rank's stream is exhausted: one all-to-all of column slices per block (each rank receives about
    ``1 / W`` of the vectors' numbers), after an all-gather of the block sizes and refusals."""
    import torch.distributed as dist

    W, me = dist.get_world_size(group), dist.get_rank(group)
    bounds = [_rows(D, group, r) for r in range(W)]
    it = iter(passes())
    while True:
        V, error = None, None
        try:
            V = next(it, None)
            if V is not None:
                _check_block(V, D, owner)
        except ValueError as exc:  # raised on every rank after agreeing (no rank left in a collective)
            error = exc
        head = torch.tensor([0.0 if V is None or error else float(V.shape[0]), 1.0 if error else 0.0], device=device)
        heads = [torch.zeros_like(head) for _ in range(W)]
        dist.all_gather(heads, head, group=group)
        if any(float(h[1]) for h in heads):
            raise error or ValueError(f"{owner}: another rank's curvature vectors were refused (not finite or of "
                                      "the wrong shape); nothing was fitted.")
        sizes = [int(h[0]) for h in heads]
        if not any(sizes):
            return
        rows = max(sizes)
        mine = torch.zeros(rows, D, dtype=dtype, device=device)
        if V is not None:
            mine[:V.shape[0]] = V.to(dtype)
        # rank j's slice: the (rows, hi_j - lo_j) columns it holds, flattened, in rank order
        send = torch.cat([mine[:, lo:hi].reshape(-1) for lo, hi in bounds])
        width = bounds[me][1] - bounds[me][0]
        recv = torch.empty(W * rows * width, dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, output_split_sizes=[rows * width] * W,
                               input_split_sizes=[rows * (hi - lo) for lo, hi in bounds], group=group)
        parts = recv.view(W, rows, width)
        yield torch.cat([parts[r, :n] for r, n in enumerate(sizes)])


def fit_second_moment(passes: Callable[[], Iterator[Tensor]], dim: int, rank: int, *,
                      method: str = "auto", num_passes: Optional[int] = None, dense_max_dim: int = 1024,
                      tol: float = 1e-3, max_iter: int = 2000, seed: int = 0, dtype=None, device=None,
                      owner: str = "fit_second_moment", process_group=None) -> Tuple[Tensor, Tensor, dict]:
    r"""Fit :math:`FF^\top + \Psi \approx \frac1V\sum_v vv^\top` to the :math:`V` curvature vectors.

    Parameters
    ----------
    passes : callable
        ``passes()`` yields one pass over the data as blocks of curvature vectors, Tensors of shape (V_b, D).
    dim : int
        :math:`D`.
    rank : int
        :math:`K \ge 1`.
    method : {"auto", "scatter", "online", "sketch", "randomized", "exact"}, default "auto"
        ``"auto"``: ``"exact"`` when ``dim <= dense_max_dim``, else ``"randomized"`` (shardable; as
        accurate as the sketch and faster: ``docs/laplace.md``). ``"exact"`` and
        ``"scatter"`` form the :math:`D\times D` moment; ``"exact"`` fits what ``"randomized"`` fits, from
        the exact top :math:`3K` eigenpairs, ``"scatter"`` runs batch FA on the whole moment.
    num_passes : int, optional
        Passes over the data for ``"online"`` (default 4), ``"sketch"`` (default 1) and ``"randomized"``
        (default 2: the range, then the projection).
    dense_max_dim : int, default 1024
        Above it the eigendecomposition (:math:`O(D^3)`) of ``"exact"`` costs more than ``"randomized"``'s
        passes several times over (``benchmarks/bench_laplace_cost.py``).
    tol, max_iter : float, int
        Convergence of the batch fit (on the total log-likelihood of the FA model).
    seed : int, default 0
    dtype, device
        Of the returned factors (the model's); default torch's default dtype, on the CPU.
    owner : str
        Name starting error messages.
    process_group : torch.distributed process group, optional
        Data parallel: each rank's ``passes()`` yields the vectors of its own examples, and every rank returns
        the fit of all ranks' vectors. ``"scatter"``: the :math:`D\times D` sums are all-reduced (one
        collective), so the fit equals a single process's on the concatenated vectors. ``"online"``: each rank
        receives its coordinates :math:`[lo, hi)` of every rank's block of vectors (one all-to-all of column
        slices per block) and feeds them to
        :class:`~pyro_fa.fa.online.OnlineFactorAnalysis` ``(process_group=...)``, sharded by coordinates
        (the fitter's state is :math:`O(DK/W)` per rank). Either way each rank returns only its rows
        :math:`[lo, hi)` of :math:`F` and :math:`\psi` (:func:`~pyro_fa.distributed.shard_bounds`), never
        the whole factor.

    Returns
    -------
    cov_factor : Tensor of shape (D, K), or this rank's rows (D_r, K) with a ``process_group``
    cov_diag : Tensor of shape (D,) or (D_r,), non-negative
    info : dict
        ``method``, ``n_vectors``, ``rows`` (this rank's ``(lo, hi)``; ``(0, D)`` without a group), and for the
        batch fit ``n_iter`` and ``converged``.

    Notes
    -----
    ``"scatter"``: :math:`O(D^2)` memory, :math:`O(VD^2)` per pass and :math:`O(D^2K)` per EM iteration.
    ``"exact"``: :math:`O(D^2)` memory, :math:`O(VD^2)` for its one pass, :math:`O(D^3)` once and
    :math:`O(DK^2)` per FA iteration.
    ``"online"``: :math:`O(DK)` memory and :math:`O(VDK)` per pass.
    """
    dtype = torch.get_default_dtype() if dtype is None else dtype
    device = torch.device("cpu") if device is None else torch.device(device)
    if isinstance(method, str):
        method = resolve_fit(method, dim, dense_max_dim)
    fitter = method if isinstance(method, Fitter) and method.curvature_fit else curvature_fitters().get(method)
    fit = _FITS.get(method) if isinstance(method, str) else None
    if fit is None and fitter is None:
        raise ValueError(f"{owner}: curvature_fit must be one of {moment_fits()}, got {method!r}.")
    if num_passes is None:
        num_passes = fitter.curvature_passes if fitter is not None else {"randomized": 2}.get(method, 1)
    if fitter is not None:  # a registered fitter of the stream +-v (a name: the class with its default options)
        return _fit_streamed(passes, dim, rank, method=fitter.curvature_fit, num_passes=num_passes, tol=tol,
                             max_iter=max_iter, seed=seed, dtype=dtype, device=device, owner=owner,
                             process_group=process_group, fitter=fitter if isinstance(fitter, Fitter) else fitter.name)
    return fit(passes, dim, rank, method=method, num_passes=num_passes, tol=tol, max_iter=max_iter, seed=seed,
               dtype=dtype, device=device, owner=owner, process_group=process_group)


def resolve_fit(method: str, dim: int, dense_max_dim: int = 1024) -> str:
    """The fit ``"auto"`` stands for at ``dim`` weights (``"exact"`` up to ``dense_max_dim``, else
    ``"randomized"``); any other name as it is."""
    resolve = _AUTOMATIC.get(method)
    return method if resolve is None else resolve(dim, dense_max_dim)


#: the fits chosen by the size of the problem: name -> ``(dim, dense_max_dim) -> the fit it stands for``
_AUTOMATIC: Dict[str, Callable[[int, int], str]] = {
    "auto": lambda dim, dense_max_dim: "exact" if dim <= dense_max_dim else "randomized"}


def _fit_scatter(passes, dim, rank, *, method, num_passes, tol, max_iter, seed, dtype, device, owner,
                 process_group):
    r"""The exact :math:`D\times D` moment, then batch FA to convergence (or its eigendecomposition at full rank)."""
    check_dense_dim(owner, "fit(curvature_fit='scatter')", dim, torch.float64,
                    "Use curvature_fit='online' (O(DK) memory).")
    G, n_vec = _scatter(passes, dim, dtype, device, owner, process_group)
    _check_count(n_vec, owner)
    S = G / max(n_vec, 1)
    lo, hi = _rows(dim, process_group)
    if rank >= dim:
        lam, U = torch.linalg.eigh(S)
        F = U * lam.clamp_min(0).sqrt()
        return F[lo:hi].to(dtype), torch.zeros(hi - lo, dtype=dtype, device=device), {
            "method": "exact", "n_vectors": n_vec, "n_iter": 0, "converged": True, "rows": (lo, hi)}
    generator = torch.Generator(device=S.device).manual_seed(seed)
    result = em_from_covariance(S, rank, n_vec, tol=tol, max_iter=max_iter, method="svd",
                                svd_method="randomized", generator=generator)
    if not result.converged:
        warnings.warn(f"{owner}: the factor analysis of the curvature did not converge in max_iter={max_iter} "
                      f"iterations (tol={tol}); the fit is the last iterate.", ConvergenceWarning, stacklevel=4)
    return result.cov_factor[lo:hi].to(dtype), result.cov_diag[lo:hi].to(dtype), {
        "method": "scatter", "n_vectors": n_vec, "n_iter": result.n_iter, "converged": result.converged,
        "rows": (lo, hi)}


def _fit_exact(passes, dim, rank, *, method, num_passes, tol, max_iter, seed, dtype, device, owner,
               process_group):
    r"""The exact :math:`D\times D` moment :math:`G`, its top :math:`3K` eigenpairs, then the batch FA of
    ``"randomized"`` (:func:`_fa_low_rank`).

    :math:`G = U\Lambda U^\top` (one ``eigh``), :math:`E = U_W\Lambda_W^{1/2}` for the :math:`W = \min(D, 3K)`
    largest eigenvalues and the exact :math:`\mathrm{diag}(G)`: the input ``"randomized"`` builds from its
    range finder, here without the range's error. Batch FA from two starts (``"randomized"``'s and
    ``"scatter"``'s), the one of larger likelihood kept (``n_iter`` counts both). With a ``process_group`` the
    :math:`D\times D` sums are all-reduced (as ``"scatter"``) and every rank fits the same whole factor,
    returning its rows.
    """
    check_dense_dim(owner, "fit(curvature_fit='exact')", dim, torch.float64,
                    "Use curvature_fit='randomized' (O(DK) memory).")
    G, n_vec = _scatter(passes, dim, dtype, device, owner, process_group)
    _check_count(n_vec, owner)
    lo, hi = _rows(dim, process_group)
    diag = G.diagonal().clone()
    lam, U = torch.linalg.eigh(G)  # ascending
    del G  # at most two D x D matrices at a time: G and U, then U, then M below
    lam = lam.clamp_min(0)
    if rank >= dim:  # the curvature itself: F F^T = G / V, psi = 0
        F = U * (lam / n_vec).sqrt()
        return F[lo:hi].to(dtype), torch.zeros(hi - lo, dtype=dtype, device=device), {
            "method": "exact", "n_vectors": n_vec, "passes": 1, "n_iter": 0, "converged": True, "rows": (lo, hi)}
    width = min(dim, _WIDTH_PER_RANK * rank)
    E = U[:, -width:] * lam[-width:].sqrt()
    del U
    # the floor of psi as "scatter"'s (sqrt(eps) of the largest second moment), not the sketches' relative one:
    # a curvature of rank <= K is then kept (psi ~ 0 off its range) as "scatter" and "exact" at rank >= D keep it
    floor = float(diag.max()) / n_vec * torch.finfo(diag.dtype).eps ** 0.5
    # the likelihood has local optima: started from psi = diag (as "randomized") and from probabilistic PCA's
    # isotropic noise (the tail's mean eigenvalue, Tipping & Bishop 1999, as "scatter" starts), the fit of the
    # larger likelihood of M = E E^T + diag(G - E E^T) kept (at a rank near D the first stops far from the optimum)
    M = E @ E.T
    M.diagonal().copy_(diag)
    M /= n_vec
    best, n_iter, converged = None, 0, True
    for init in (None, float(lam[:dim - rank].sum()) / (dim - rank) / n_vec):
        F, psi, it, ok = _fa_low_rank(E, diag, n_vec, rank, floor=floor, init=init)
        ll = float(gaussian_loglike(F, psi, M, n_vec))
        n_iter, converged = n_iter + it, converged and ok
        if best is None or ll > best[0]:
            best = (ll, F, psi)
    del M
    _, F, psi = best
    if not converged:
        warnings.warn(f"{owner}: the factor analysis of the curvature did not converge in {n_iter} iterations; "
                      "the fit is the last iterate.", ConvergenceWarning, stacklevel=4)
    return F[lo:hi].to(dtype), psi[lo:hi].to(dtype), {
        "method": "exact", "n_vectors": n_vec, "passes": 1, "n_iter": n_iter, "converged": converged,
        "rows": (lo, hi)}


def _fit_streamed(passes, dim, rank, *, method, num_passes, tol, max_iter, seed, dtype, device, owner,
                  process_group, fitter):
    r"""The stream :math:`\pm v` fed to :class:`~pyro_fa.fa.online.OnlineFactorAnalysis` (``"online"``: online EM;
    ``"sketch"``: its scatter sketch refitted by batch FA), :math:`O(DK)` memory."""
    if rank >= dim:
        raise ValueError(f"{owner}: rank must be < dim={dim} for curvature_fit={method!r}, got {rank!r}; use "
                         "curvature_fit='scatter' for a full-rank curvature.")
    fa = OnlineFactorAnalysis(dim, rank, method=fitter, seed=seed, dtype=dtype, device=device,
                              process_group=process_group)
    lo, hi = _rows(dim, process_group)
    n_vec = 0
    for _ in range(num_passes):
        n_vec = 0
        if process_group is None:
            stream = passes()
        else:  # this rank's columns of every rank's vectors (checked on the rank that computed them)
            stream = _exchanged_blocks(passes, dim, owner, process_group, device, dtype)
        for V in stream:
            if process_group is None:
                _check_block(V, dim, owner)
            V = V[:, lo:hi].to(dtype) if process_group is None else V
            step = max(1, _ONLINE_ELEMENTS // (2 * (hi - lo)))  # bounded updates: bounded temporaries
            for i in range(0, V.shape[0], step):
                block = V[i:i + step]
                fa.update(torch.cat([block, -block]))
            n_vec += V.shape[0]
    _check_count(n_vec, owner)
    F, psi = fa.cov_factor.detach().clone(), fa.cov_diag.detach().clone()  # this rank's rows with a group
    return F, psi, {"method": method, "n_vectors": n_vec, "passes": num_passes, "rows": (lo, hi)}


def _fit_randomized(passes, dim, rank, *, method, num_passes, tol, max_iter, seed, dtype, device, owner,
                    process_group):
    r"""Randomized range finder and Nyström approximation of :math:`G`, then batch FA; :math:`O(DK)` memory.

    Each pass: :math:`Z = GQ = \sum_b V_b^\top (V_b Q)` (in the vectors' dtype per block, summed in float64),
    :math:`Q \leftarrow \mathrm{qr}(Z)` between passes; after the last, with a shift :math:`\nu` for
    stability, :math:`G \approx EE^\top`, :math:`E = U\,(\Sigma^2 - \nu)_+^{1/2}` from the SVD of
    :math:`(Z + \nu Q)R^{-1}`, :math:`R^\top R = Q^\top(Z + \nu Q)` (Tropp et al. 2017, Alg. 3).

    With a ``process_group`` every :math:`D\times 3K` matrix is held by rows: each rank receives its columns
    of every rank's vectors (as ``"online"``), :math:`V_bQ` is all-reduced per block (:math:`3K` numbers per
    vector), the QR is a Cholesky QR done twice (Fukaya et al., *CholeskyQR2*, 2014) on all-reduced
    :math:`3K\times 3K` Gram matrices, the SVD one more Gram, and the FA one all-reduce per iteration. The
    starting :math:`Q` is drawn per rank, so the fit equals one process's where the range is captured
    exactly, and is another draw of the same approximation otherwise.
    """
    if rank >= dim:
        raise ValueError(f"{owner}: rank must be < dim={dim} for curvature_fit='randomized', got {rank!r}; use "
                         "curvature_fit='scatter' for a full-rank curvature.")
    wide = wide_dtype(device)
    width = min(dim, _WIDTH_PER_RANK * rank)
    lo, hi = _rows(dim, process_group)
    reduce = _summer(process_group)
    if process_group is None:
        generator = torch.Generator(device=device).manual_seed(seed)
        Q = torch.linalg.qr(torch.randn(dim, width, generator=generator, dtype=wide, device=device))[0]
    else:
        import torch.distributed as dist

        generator = torch.Generator(device=device).manual_seed(seed + 7919 * dist.get_rank(process_group))
        Q = _cholesky_qr2(torch.randn(hi - lo, width, generator=generator, dtype=wide, device=device), reduce)
    diag = torch.zeros(hi - lo, dtype=wide, device=device)
    rows = max(1, 2 ** 19 // width)
    n_vec = 0
    for p in range(num_passes):
        Z = torch.zeros(hi - lo, width, dtype=wide, device=device)
        Qv = Q.to(dtype)
        n_vec = 0
        stream = passes() if process_group is None else _exchanged_blocks(passes, dim, owner, process_group,
                                                                           device, dtype)
        for V in stream:  # (rows, D), or this rank's columns of every rank's rows (checked where computed)
            if process_group is None and (V.dim() != 2 or V.shape[-1] != dim):
                _check_block(V, dim, owner)  # raises: the wrong shape
            V = V.to(dtype)
            VQ = V @ Qv if process_group is None else reduce(V @ Qv).to(dtype)
            product = V.T @ VQ
            sq = V.pow(2).sum(0) if p == 0 else None  # the exact diagonal, from the first pass
            # a non-finite vector makes its row of V Q non-finite (NaN * q, inf * 0 = NaN): checked there, on
            # (rows, width) numbers instead of the product's (D, width); the full check only then (it raises)
            if process_group is None and (not bool(torch.isfinite(VQ).all())
                                          or (sq is not None and not bool(torch.isfinite(sq).all()))):
                _check_block(V, dim, owner)
            for i in range(0, product.shape[0], rows):  # in row slices: no D x width temporary in the wide dtype
                Z[i:i + rows] += product[i:i + rows]
            del VQ, product
            if sq is not None:
                diag += sq.to(wide)
            n_vec += V.shape[0]
        _check_count(n_vec, owner)
        # finite vectors whose products or squares overflowed the vectors' dtype (on any rank: all raise)
        finite = bool(torch.isfinite(Z).all()) and (p > 0 or bool(torch.isfinite(diag).all()))
        if not _agree(finite, process_group, device):
            raise ValueError(f"{owner}: the curvature's sketch overflowed {dtype} (finite curvature vectors, "
                             f"products beyond its range); fit in float64. Nothing was fitted.")
        if p < num_passes - 1:
            Q = torch.linalg.qr(Z)[0] if process_group is None else _cholesky_qr2(Z, reduce)
            del Z, Qv  # the next pass's are allocated after these are freed
    nu = torch.finfo(dtype).eps * float(reduce(Z.pow(2).sum()).sqrt())
    Z += nu * Q
    M = reduce(Q.T @ Z)
    R = torch.linalg.cholesky((M + M.T) / 2, upper=True)
    B = torch.linalg.solve_triangular(R, Z, upper=True, left=False)
    # only B goes on: the D x width sketches freed before the SVD and the FA allocate their own (the peak memory
    # at rank 100, docs/laplace.md)
    del Z, Q, Qv
    if process_group is None:
        U, sv, _ = torch.linalg.svd(B, full_matrices=False)
        E = U * (sv.pow(2) - nu).clamp_min(0).sqrt()  # G ~ E E^T
        del U
    else:  # the SVD of a matrix held by rows, from its Gram: B = U S V^T, U S = B V
        s2, Vr = torch.linalg.eigh(reduce(B.T @ B))
        keep = (s2 - nu).clamp_min(0).sqrt() / s2.clamp_min(torch.finfo(wide).tiny).sqrt()
        E = (B @ Vr) * keep
    del B
    F, psi, n_iter, converged = _fa_low_rank(E, diag, n_vec, rank, reduce=reduce, dim=dim)
    return F.to(dtype), psi.to(dtype), {"method": "randomized", "n_vectors": n_vec, "passes": num_passes,
                                        "n_iter": n_iter, "converged": converged, "rows": (lo, hi)}


def _summer(group) -> Callable[[Tensor], Tensor]:
    """``x`` summed over the ranks of ``group`` (in float64, a new tensor), or ``x`` itself without one."""
    if group is None:
        return lambda x: x
    import torch.distributed as dist

    def reduce(x: Tensor) -> Tensor:
        buf = x.to(torch.float64).clone()
        dist.all_reduce(buf, group=group)
        return buf

    return reduce


def _cholesky_qr2(Z: Tensor, reduce: Callable[[Tensor], Tensor]) -> Tensor:
    r"""The orthonormal factor of a matrix held by rows: :math:`Q = ZR^{-1}`, :math:`R^\top R = Z^\top Z`, twice."""
    for _ in range(2):
        G = reduce(Z.T @ Z)
        shift = 1e-14 * float(G.diagonal().sum()) if _ == 0 else 0.0  # a rank-deficient Z still factorises
        R = torch.linalg.cholesky(G + shift * torch.eye(G.shape[0], dtype=G.dtype, device=G.device), upper=True)
        Z = torch.linalg.solve_triangular(R, Z, upper=True, left=False)
    return Z


def _fa_low_rank(E: Tensor, diag: Tensor, n: int, rank: int, reduce: Optional[Callable[[Tensor], Tensor]] = None,
                 dim: Optional[int] = None, floor: Optional[float] = None,
                 init: Optional[float] = None) -> Tuple[Tensor, Tensor, int, bool]:
    r"""Batch FA of :math:`S = G/n` given :math:`G \approx EE^\top` off the diagonal and its exact diagonal.

    Barber's iteration (*Bayesian Reasoning and Machine Learning*, 2012, §21.2.2; scikit-learn's
    ``FactorAnalysis``), as ``OnlineFactorAnalysis(method="sketch")``'s refit: the top :math:`K` eigenpairs
    :math:`(\lambda_k, u_k)` of :math:`E^\top\Psi^{-1}E/n`, :math:`F = E\,U_K\,\mathrm{diag}(\sqrt{(\lambda_k-1)_+
    /\lambda_k})/\sqrt n`, :math:`\psi = s - \sum_k F_{\cdot k}^2` (floored), until the log-likelihood gains
    less than 0.01 or :math:`10^{-7}` of its magnitude (at most 1000 iterations). With ``reduce`` (a sum
    over ranks) ``E`` and ``diag`` are this rank's rows of a ``dim``-dimensional moment. ``psi`` is kept above
    ``floor`` (one number) if given, else above ``_MIN_VARIANCE`` times each coordinate's second moment. The
    iteration starts from :math:`\psi = s` (the diagonal), or from :math:`\psi = ` ``init`` (one number) if given.
    """
    import math

    reduce = reduce or (lambda x: x)
    D, K = (E.shape[0] if dim is None else dim), rank
    var = diag / n
    info = torch.finfo(E.dtype)
    if floor is None:
        floor = (_MIN_VARIANCE * var).clamp_min(float((info.eps * reduce(var.sum()) / D).clamp_min(info.tiny)))
    else:
        floor = torch.full_like(var, max(floor, info.tiny))
    psi = torch.maximum(var if init is None else torch.full_like(var, init), floor)
    const = D * math.log(2 * math.pi) + K
    old_ll, converged, it = -math.inf, False, 0
    for it in range(1, _FA_MAX_ITER + 1):
        width = E.shape[-1]
        # one sum over the rows: the Gram of E / sqrt(psi), the trace of S Psi^-1 and log det Psi
        sums = reduce(torch.cat([(E.T @ (E / psi.unsqueeze(-1))).reshape(-1), (var / psi).sum().reshape(1),
                                 psi.log().sum().reshape(1)]))
        lam, U = torch.linalg.eigh(sums[:-2].reshape(width, width) / n)
        k = min(K, lam.shape[0])
        lam_k = lam[-k:].flip(-1).clamp_min(info.tiny)
        C = U[:, -k:].flip(-1) * ((lam_k - 1).clamp_min(0) / lam_k).sqrt() / math.sqrt(n)
        F = E @ C  # (D, k)
        ll = -0.5 * n * (const + float(lam_k.log().sum()) + float(sums[-2]) - float(lam_k.sum()) + float(sums[-1]))
        psi = torch.maximum(var - F.pow(2).sum(-1), floor)
        if ll - old_ll < max(_FA_TOL, _FA_RTOL * abs(ll)):
            converged = True
            break
        old_ll = ll
    if F.shape[1] < K:
        F = torch.cat([F, F.new_zeros(F.shape[0], K - F.shape[1])], -1)
    return F, psi, it, converged


#: name -> fit of the fits that are not a registered fitter's (``"auto"`` resolves to one of them by the dimension,
#: the registered fitters with a ``curvature_fit`` name run through _fit_streamed); every fit takes the same keywords
_FITS: Dict[str, Callable[..., Tuple[Tensor, Tensor, dict]]] = {
    "scatter": _fit_scatter,
    "randomized": _fit_randomized,
    "exact": _fit_exact,
}


def _rows(dim: int, group, rank: Optional[int] = None) -> Tuple[int, int]:
    """This rank's (or ``rank``'s) rows ``[lo, hi)``: the default layout of ``OnlineFactorAnalysis(process_group=...)``."""
    if group is None:
        return 0, dim
    import torch.distributed as dist

    from pyro_fa.distributed import shard_bounds

    return shard_bounds(dim, dist.get_world_size(group), dist.get_rank(group) if rank is None else rank)
