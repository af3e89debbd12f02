r"""IVON with a factor-analysis precision: variational online Newton learning a low-rank-plus-diagonal Gaussian."""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, List, Optional

import torch
from torch import Tensor

from pyro_fa.distributions import LowRankPrecisionNormal
from pyro_fa.optim._checks import (NAME, check_count, check_curvature, check_dimension, check_hyperparameters,
                                   check_params, check_shared)
from pyro_fa.optim._distributed import NO_AVERAGE, StepAverage, refused_together, sync_group
from pyro_fa.optim._lowrank import Woodbury, factorise, kept_buffer, sketch_update_stacked, welford_mean

__all__ = ["FactorIVON"]


def _join(parts: List[Tensor]) -> Tensor:
    """``torch.cat(parts)``, without the copy for one part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _flatten(params: List[Tensor], loaded: Optional[Tensor]) -> Tensor:
    """The weights as one vector: ``loaded`` itself (no copy) while every parameter is still its view, in order."""
    if loaded is not None and loaded.dtype == params[0].dtype and loaded.device == params[0].device:
        start, size = loaded.data_ptr(), loaded.element_size()
        for p in params:
            if p.data_ptr() != start or not p.is_contiguous():
                break
            start += p.numel() * size
        else:
            return loaded
    return _join([p.detach().flatten() for p in params])



def _refresh(opt: "FactorIVON", mean: Tensor, t: float, before: dict) -> None:
    """FactorIVON's refresh of the low-rank part from the step's pairs, and P refactorised; where that fails (an
    eigenproblem that does not converge, draws that overflowed), the state ``before`` the step is restored and the
    step refused (``ValueError``)."""
    opt._factors = None  # refactorised below: its buffers are free until then
    spare = [kept_buffer(opt._factor_buffers, name, mean) for name in ("root", "inv_root")]
    baseline = _baseline(opt._previous_momentum, t, opt.param_groups[0]["beta1"], opt.debias, spare[0])
    M = len(opt._pairs)
    V = opt.state["hess"].new_empty(2 * M, opt.dim)  # [g_1 - b, ..., g_M - b, a_1, ..., a_M]
    for j, (grad, a) in enumerate(opt._pairs):
        torch.sub(grad, baseline, out=V[j])
        if opt.batch_size is None:  # Stein's sym((g - b) a^T)
            V[M + j].copy_(a)
        else:  # the Fisher estimate B (g - b)(g - b)^T
            torch.mul(V[j], opt.batch_size, out=V[M + j])
    total = torch.add(opt.state["hess"], opt.param_groups[0]["weight_decay"], out=spare[1])
    total.clamp_min_(0).sqrt_()
    # the new basis goes into a second (K, D) buffer, the old one kept until P is factorised; then the old one is
    # the next refresh's buffer (a new tensor of this size at every refresh cost as much as the rotation in page
    # faults: 3.7 against 21 ms at K = 10, D = 10^6)
    spare_basis = kept_buffer(opt._factor_buffers, "basis", opt.state["basis"])
    try:
        if not bool(torch.isfinite(V).all()):
            raise FloatingPointError("a draw's precision times its noise overflowed")
        basis, eigvals, sums = sketch_update_stacked(
            opt.state["basis"], opt.state["eigvals"], V, opt.param_groups[0]["beta2"] ** opt.update_every,
            out=spare_basis, cap_weights=total)
        # each eigenvalue capped at (sum_d |q_d| sqrt(h_d + delta))^2, the most q^T H q any positive
        # semi-definite H with diagonal h + delta allows (Cauchy-Schwarz, |H_de| <= sqrt(H_dd H_ee))
        opt.state["basis"], opt.state["eigvals"] = basis, torch.minimum(eigvals, sums.square())
        opt._woodbury()  # P factorised now, so that a failure is refused before the mean moves
        opt._factor_buffers["basis"] = before["basis"]
    except (FloatingPointError, torch.linalg.LinAlgError) as err:
        opt.state.update(before)
        opt._factors = None
        opt._reset_samples()
        raise ValueError(f"{NAME}: the update of the curvature's low-rank part is not finite ({err}): the "
                         "run has diverged (try a lower lr, a larger hess_init or beta2 closer to 1); the "
                         "step's draws are dropped and the state is unchanged.") from None


def _new_mean(opt: "FactorIVON", mean: Tensor, t: float) -> Tensor:
    """FactorIVON's new mean: the (Woodbury, or at rank 0 ivon-opt's diagonal) Newton step from ``mean``."""
    hess, momentum = opt.state["hess"], opt.state["momentum"]
    parts = []
    if opt.rank:  # the natural-gradient direction couples the groups: one Woodbury solve
        g0 = opt.param_groups[0]
        rhs = _join([momentum[s] / (1.0 - math.pow(g["beta1"], t) if opt.debias else 1.0)
                     for g, s in opt._groups()]).add_(mean, alpha=g0["weight_decay"])
        direction = opt._woodbury().solve(rhs, True, kept_buffer(opt._scratch_buffers, "noise", hess))
    for g, s in opt._groups():  # the step below is a new tensor of ours: updated in place, same arithmetic
        lr = g["lr"] * (g["hess_init"] + g["weight_decay"]) if opt.rescale_lr else g["lr"]
        if opt.rank:
            step = direction[s]
        else:  # ivon-opt's expression, (momentum / debias + wd mean) / (h + wd)
            debias = 1.0 - math.pow(g["beta1"], t) if opt.debias else 1.0
            wd = g["weight_decay"]
            step = torch.div(momentum[s], debias).add_(torch.mul(mean[s], wd)).div_(torch.add(hess[s], wd))
        step = step.clamp_(min=-g["clip_radius"], max=g["clip_radius"]).mul_(lr)
        parts.append(torch.sub(mean[s], step))
    return _join(parts)


def _baseline(previous: Optional[Tensor], t: float, beta1: float, debias: bool, out: Tensor) -> Tensor:
    r"""The previous step's debiased momentum (zero at the first step): subtracted from the gradients before they
    enter the low-rank part. It does not depend on this step's draws, so :math:`\mathbb E[(g - b)a^\top] =
    \mathbb E[ga^\top]` (a control variate, not a bias); it removes the gradient at the mean, whose product with
    :math:`a` is pure noise. Written into ``out`` where it is not the previous momentum itself."""
    if t <= 1.0 or previous is None:
        return out.zero_()
    return torch.div(previous, 1.0 - math.pow(beta1, t - 1.0), out=out) if debias else previous


class FactorIVON(torch.optim.Optimizer):
    r"""IVON (Shen et al. 2024) whose Gaussian posterior has a low-rank-plus-diagonal precision.

    Learns :math:`q(\theta) = N(m, P^{-1})` over the flattened weights (parameter order) while training, at about
    Adam's cost, with

    .. math::

        P = \lambda\,\big(\mathrm{diag}(\psi) + UU^\top\big), \qquad
        \psi = h + \delta - \mathrm{rowsq}(U), \qquad U \in \mathbb{R}^{D\times K},

    :math:`\lambda` = ``ess``, :math:`\delta` = ``weight_decay``, :math:`\mathrm{rowsq}(U)_d = \sum_k U_{dk}^2`.
    :math:`h` is IVON's diagonal curvature, updated as IVON updates it; :math:`U = \mathrm{diag}(c)\,Q\,
    \mathrm{diag}(\lambda^+)^{1/2}` comes from the top-:math:`K` part :math:`Q\Lambda Q^\top` of an exponential
    moving average of the same reparameterisation Hessian estimates, full matrices kept at rank :math:`K`, its
    rows shrunk (:math:`c_d \le 1`) where they would claim more than :math:`1 - \rho` of :math:`h_d + \delta`
    (:math:`\rho` = ``diag_floor``), so that :math:`\psi \ge \rho(h + \delta)`. The diagonal of :math:`P` is
    therefore always IVON's, :math:`\lambda(h + \delta)`: no curvature is counted twice, and :math:`UU^\top` adds
    the correlations. With ``rank=0`` the updates, the draws and the random numbers are IVON's. With
    ``curvature="fisher"`` the low-rank part tracks a Fisher estimate instead (below), :math:`h` still IVON's.

    Each step, after :math:`M` draws :math:`\theta_j = m + z_j`, :math:`z_j \sim N(0, P^{-1})` and their
    minibatch gradients :math:`g_j` (inside :meth:`sampled_params`), with :math:`a_j = Pz_j`:

    .. math::

        \bar g &= \tfrac1M \textstyle\sum_j g_j, \qquad
        \hat H = \tfrac1M \textstyle\sum_j \mathrm{sym}(g_j a_j^\top)
        \quad (\mathbb E\,\hat H = \mathbb E_q \nabla^2 \ell \text{ by Stein's lemma}), \\
        \mu &\leftarrow \beta_1 \mu + (1 - \beta_1)\,\bar g, \\
        h &\leftarrow \beta_2 h + (1-\beta_2) f + \tfrac12(1-\beta_2)^2 \frac{(h - f)^2}{h + \delta},
        \qquad f = \mathrm{diag}\,\hat H, \\
        Q\Lambda Q^\top &\leftarrow \mathrm{top}_K\big(\beta_2\, Q\Lambda Q^\top + (1 - \beta_2)\hat H_b\big), \\
        m &\leftarrow m - \alpha\, \mathrm{clip}\Big(\big(\mathrm{diag}(\psi) + UU^\top\big)^{-1}
        \big(\mu / (1 - \beta_1^t) + \delta m\big),\ \pm r\Big),

    :math:`\alpha` = ``lr`` times :math:`h_0 + \delta` with ``rescale_lr`` (Shen et al. 2024, Algorithm 1;
    Khan et al. 2018 for the variational online Newton step). :math:`\mathrm{top}_K` keeps the :math:`K` largest
    eigenvalues (:func:`pyro_fa.optim._lowrank.sketch_update`, SLANG's truncation, Mishkin et al. 2018, made
    deterministic), each then capped at :math:`(\sum_d |Q_{dk}|\sqrt{h_d+\delta})^2`, the most any positive
    semi-definite matrix with diagonal :math:`h + \delta` allows. :math:`\hat H_b` is :math:`\hat H` with
    :math:`g_j - b` for :math:`g_j`, :math:`b` the previous step's debiased momentum: a control variate
    (:math:`\mathbb E[b\,a_j^\top] = 0`) that removes the gradient at the mean, whose product with :math:`a_j` is
    noise only. (The diagonal :math:`h` keeps IVON's estimate: its noise per coordinate is about :math:`D` times
    smaller than the rank-two estimate's along its own direction.) With ``curvature="fisher"``, :math:`\hat H_b =
    \tfrac BM\sum_j (g_j - b)(g_j - b)^\top`, :math:`B` = ``batch_size``: a minibatch gradient's covariance
    times :math:`B` estimates the per-example gradients' (the Fisher, a Gauss-Newton matrix for softmax
    cross-entropy and Gaussian likelihoods), as SLANG's per-example gradients do (Mishkin et al. 2018); always
    positive semi-definite, where Stein's estimate is indefinite and noisier. The draws use the Woodbury square root,
    :math:`z = \lambda^{-1/2}\Psi^{-1/2}(I + AA^\top)^{-1/2}\varepsilon`, :math:`A = \Psi^{-1/2}U`, and the step
    the Woodbury solve; nothing :math:`D\times D` is formed.

    Parameters
    ----------
    params : iterable of Tensors or of dicts
        As for any :class:`torch.optim.Optimizer`; with ``rank`` > 0 the groups must share ``ess``,
        ``weight_decay`` and ``beta2`` (the low-rank part spans them all).
    lr : float
        Learning rate (ivon-opt's).
    ess : float
        Effective sample size :math:`\lambda`, usually the number of training examples.
    hess_init : float, default 1.0
        :math:`h_0`.
    beta1, beta2 : float, default 0.9, 0.99999
        Decay of the gradient momentum, of the curvature (diagonal and low rank).
    weight_decay : float, default 1e-4
        :math:`\delta`, the prior precision per example.
    mc_samples : int, default 1
        Draws per step when :meth:`step` is given a closure.
    clip_radius : float, default inf
        Elementwise clip :math:`r` of the preconditioned step.
    debias : bool, default True
        Divide the momentum by :math:`1 - \beta_1^t`.
    rescale_lr : bool, default True
        Multiply ``lr`` by :math:`h_0 + \delta`.
    rank : int, default 10
        :math:`K` (keyword only); 0 is IVON.
    update_every : int, default 1
        (keyword only) Fold the curvature into the low-rank part, and refactorise :math:`P`, every this many
        steps (with the step's draws, the decay :math:`\beta_2^{T}` and weight :math:`1 - \beta_2^{T}`); in
        between, :math:`P` (its diagonal too) stays as last factorised while :math:`h` keeps learning. 1 is
        the update above; 10 to 50 cut the :math:`O(DK^2)` work to :math:`O(DK)` per step on large networks.
    diag_floor : float, default 0.25
        :math:`\rho` (keyword only): the diagonal part :math:`\psi` never drops below this fraction of IVON's
        :math:`h + \delta`. It bounds by :math:`1/\rho` how far the Newton step off the low-rank directions may
        exceed IVON's while the low-rank part is still mostly noise; a lower value lets strongly correlated
        posteriors be matched more closely, at the risk of an unstable start. At 1 the rows of :math:`U` are shrunk
        to zero: IVON, with :math:`P` refreshed every ``update_every`` steps (docs/optim.md).
    curvature : {"stein", "fisher"}, default "stein"
        (keyword only) What the low-rank part tracks: Stein's Hessian estimate, or the Fisher estimate above
        (which removed the low-rank part's breakdown at :math:`\beta_2` = 0.9995 on MNIST-1D; docs/optim.md).
    batch_size : int, optional
        (keyword only) :math:`B`, the examples each gradient averages over (with a process group, the whole
        minibatch's over the ranks); required with ``"fisher"`` only.
    sync : bool, default False
        (keyword only) ivon-opt's: average each step's statistics over torch.distributed's default group.
    process_group : torch.distributed.ProcessGroup, optional
        (keyword only) Average over this group instead. Data parallel: the ranks, seeded alike, draw the same weights,
        each on its equal share of the minibatch, and the step is one process's on the whole minibatch, on every
        rank. Building and :meth:`step` are then collective (:mod:`pyro_fa.optim._distributed`).

    Raises
    ------
    ValueError, TypeError
        A hyperparameter outside its range or not a number; no parameters, parameters on several devices or
        dtypes; with ``rank`` > 0, groups that disagree on ``ess``, ``weight_decay`` or ``beta2``; with a group,
        ranks that disagree on these, or (at :meth:`step`, on every rank) draw unlike. RuntimeError: ``sync`` or
        ``process_group`` without an initialised torch.distributed.

    Notes
    -----
    Memory: IVON's :math:`3D` (mean, momentum, :math:`h`) plus :math:`DK` for :math:`Q^\top` (stored (K, D), rows
    contiguous) and :math:`DK` for a second buffer a refresh rotates it into (the old basis is kept until :math:`P`
    is factorised, so that a refresh that fails leaves the state as it was; the two then swap), :math:`DK + 4D` for
    the factorisation of :math:`P` and
    :math:`3D` for the draw's vectors, kept between steps (a new tensor of megabytes costs about as much in page
    faults as the arithmetic on it), and :math:`2MD` for the step's curvature vectors. Time per step beyond
    IVON's: three passes over :math:`U` per draw and two for the step (:math:`O(DK)`), and every ``update_every``
    steps :math:`O(DK^2)` for the sketch's rotation and the :math:`K\times K` Gram matrix, both by chunks of
    columns that stay in cache.

    References
    ----------
    Shen, Y., Daheim, N., Cong, B., Nickl, P., Marconi, G. M., Bazan, C., Yokota, R., Gurevych, I., Cremers, D.,
    Khan, M. E. & Möllenhoff, T. (2024). Variational learning is effective for large deep networks. ICML.
    Mishkin, A., Kunstner, F., Nielsen, D., Schmidt, M. & Khan, M. E. (2018). SLANG: Fast structured covariance
    approximations for Bayesian deep learning with natural gradient. NeurIPS.
    Khan, M. E., Nielsen, D., Tangkaratt, V., Lin, W., Gal, Y. & Srivastava, A. (2018). Fast and scalable Bayesian
    deep learning by weight-perturbation in Adam. ICML.
    Lin, W., Schmidt, M. & Khan, M. E. (2020). Handling the positive-definite constraint in the Bayesian learning
    rule. ICML.

    See also
    --------
    pyro_fa.optim.WeightPosterior : what :meth:`posterior` returns (the prediction protocol).
    pyro_fa.distributions.LowRankPrecisionNormal : what :meth:`get_posterior` returns.

    Examples
    --------
    >>> net = torch.nn.Linear(4, 1)
    >>> opt = FactorIVON(net.parameters(), lr=0.1, ess=100, rank=2)
    >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
    >>> with opt.sampled_params(train=True):
    ...     opt.zero_grad()
    ...     torch.nn.functional.mse_loss(net(x), y).backward()
    >>> opt.step()
    >>> opt.get_posterior().prec_factor.shape
    torch.Size([5, 2])
    """

    def __init__(self, params, lr: float, ess: float, hess_init: float = 1.0, beta1: float = 0.9,
                 beta2: float = 0.99999, weight_decay: float = 1e-4, mc_samples: int = 1,
                 clip_radius: float = float("inf"), debias: bool = True, rescale_lr: bool = True, *,
                 rank: int = 10, diag_floor: float = 0.25, update_every: int = 1, curvature: str = "stein",
                 batch_size: Optional[int] = None, sync: bool = False, process_group=None):
        over = sync_group(sync, process_group)  # checked locally; None: no averaging
        with refused_together(over):  # with a group, a refusal on one rank stops every rank
            check_hyperparameters(dict(lr=lr, ess=ess, hess_init=hess_init, beta1=beta1, beta2=beta2,
                                       weight_decay=weight_decay, clip_radius=clip_radius, diag_floor=diag_floor))
            self.mc_samples = check_count("mc_samples", mc_samples, 1)
            self.rank = check_count("rank", rank, 0)
            self.update_every = check_count("update_every", update_every, 1)
            self.curvature, self.batch_size = check_curvature(curvature, batch_size)
            defaults = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, hess_init=hess_init, ess=ess,
                            clip_radius=clip_radius)
            super().__init__(params, defaults)
            for group in self.param_groups:
                check_hyperparameters({k: group[k] for k in defaults})
            self._params: List[Tensor] = [p for g in self.param_groups for p in g["params"]]
            D, dtype, device = check_params(self._params)
            check_shared(self.param_groups, self.rank)
            check_dimension(D, self.rank, self.mc_samples)
            self.debias, self.rescale_lr, self.diag_floor = bool(debias), bool(rescale_lr), float(diag_floor)
            self._sizes = [sum(p.numel() for p in g["params"]) for g in self.param_groups]
        self.state["step"] = 0
        self.state["momentum"] = torch.zeros(D, dtype=dtype, device=device)
        self.state["hess"] = torch.cat([torch.zeros(n, dtype=dtype, device=device).add(torch.as_tensor(g["hess_init"]))
                                        for g, n in zip(self.param_groups, self._sizes)])
        self.state["basis"] = torch.zeros(self.rank, D, dtype=dtype, device=device)  # Q^T, rows orthonormal or 0
        self.state["eigvals"] = torch.zeros(self.rank, dtype=dtype, device=device)
        self._factors: Optional[Woodbury] = None
        self._factor_buffers = {}  # the factorisation's storage (U^T, psi, ...), reused at every refactorisation
        self._scratch_buffers = {}  # name -> a D-vector reused at every step (rank > 0), see kept_buffer
        self._mean: Optional[Tensor] = None  # the mean while a draw is loaded into the parameters
        self._loaded: Optional[Tensor] = None  # the vector whose views the parameters were made by _load
        self._previous_momentum: Optional[Tensor] = None
        self._reset_samples()
        self._averager = NO_AVERAGE if over is None else StepAverage(over, self)  # collective

    # ------------------------------------------------------------------ the posterior's parts
    @property
    def dim(self) -> int:
        """:math:`D`, the number of weights."""
        return self.state["momentum"].shape[0]

    def _groups(self):
        """``(group, slice of the flat vector)`` per param group."""
        start = 0
        for group, n in zip(self.param_groups, self._sizes):
            yield group, slice(start, start + n)
            start += n

    def _flat(self) -> Tensor:
        return _flatten(self._params, self._loaded)

    def _woodbury(self) -> Woodbury:
        r"""The factorisation of :math:`\mathrm{diag}(\psi) + UU^\top` at the current state (cached until a step)."""
        if self._factors is None:
            g, state = self.param_groups[0], self.state
            self._factors = factorise(state["basis"], state["eigvals"], state["hess"] + g["weight_decay"],
                                      self.diag_floor, g["ess"], self._factor_buffers)
        return self._factors

    @torch.no_grad()
    def get_posterior(self) -> LowRankPrecisionNormal:
        r"""The variational posterior :math:`N(m, P^{-1})` over the flattened weights, parameter order.

        A :class:`~pyro_fa.distributions.LowRankPrecisionNormal` with ``prec_diag`` :math:`\lambda\psi` and
        ``prec_factor`` :math:`\sqrt\lambda\,U` (shape (D, K)); a snapshot, sharing no storage with the state.
        Inside :meth:`sampled_params` the mean is still :math:`m`, not the draw.
        """
        loc, ess, hess = (self._flat() if self._mean is None else self._mean).clone(), self.param_groups[0]["ess"], \
            self.state["hess"]
        if self.rank:
            factor, diag = self._woodbury().factor_t.T * math.sqrt(ess), ess * self._woodbury().psi
        else:  # lambda (h + delta), per group's lambda and delta
            factor = loc.new_zeros(loc.shape[0], 0)
            diag = torch.cat([g["ess"] * (hess[s] + g["weight_decay"]) for g, s in self._groups()])
        return LowRankPrecisionNormal(loc, factor.clone(), diag.clone())

    def posterior(self, module: torch.nn.Module):
        """The posterior over ``module`` (whose parameters this optimizer trains) as the prediction protocol's
        :class:`~pyro_fa.optim.WeightPosterior` (``predict``, ``predict_proba``, ...), a snapshot."""
        from pyro_fa.optim.posterior import WeightPosterior

        return WeightPosterior(module, self.get_posterior(), self._params)

    # ------------------------------------------------------------------ drawing weights
    def _reset_samples(self) -> None:
        self.state["count"] = 0
        self.state["avg_grad"] = None
        self.state["avg_nxg"] = None  # rank 0: the mean of z * g (ivon-opt's); rank > 0: of g * Pz
        self._pairs = []  # (g_j, a_j = P z_j) of this step's draws, on the steps that update the low-rank part

    @contextmanager
    def sampled_params(self, train: bool = False):
        r"""Load a draw :math:`\theta = m + z`, :math:`z \sim N(0, P^{-1})`, into the parameters for the block.

        With ``train=True`` the block must leave the gradient of the loss at :math:`\theta` in ``.grad``
        (``loss.backward()``); on leaving, the mean is restored and the gradient is kept for :meth:`step`
        (several blocks before one step: several draws). The random numbers are IVON's (``torch.randn`` of each
        group's size, in group order, from the global generator).

        Raises
        ------
        ValueError
            On leaving with ``train=True``, a gradient holding NaN or inf (the mean is restored, the state
            untouched; with a process group, at :meth:`step` on every rank).
        """
        mean, noise, precision_noise = self._sample_params()
        self._mean = mean
        try:
            yield
        finally:
            self._mean = None
            self._load(mean)
        if train:
            self._collect(noise, precision_noise)

    def _sample_params(self):
        hess, kept = self.state["hess"], self._scratch_buffers
        if self.rank and len(self.param_groups) == 1:  # the same numbers as torch.randn(D), into a kept vector
            eps = [torch.randn(self.dim, device=hess.device, dtype=hess.dtype, out=kept_buffer(kept, "eps", hess))]
        else:
            eps = [torch.randn(s.stop - s.start, device=hess.device, dtype=hess.dtype) for _, s in self._groups()]
        if self.rank:  # z ~ N(0, P^-1) into a kept vector (only mean + z is kept), and P z (kept on refresh steps)
            refresh = (self.state["step"] + 1) % self.update_every == 0
            out = (kept_buffer(kept, "noise", hess), None if refresh else kept_buffer(kept, "precision_noise", hess))
            noise, precision_noise = self._woodbury().draw(_join(eps), out)
        else:  # ivon-opt's expression
            precision_noise = None
            noise = torch.cat([e / (g["ess"] * (hess[s] + g["weight_decay"])).sqrt()
                               for e, (g, s) in zip(eps, self._groups())])
        mean = self._flat()
        self._load(mean + noise)
        return mean, noise, precision_noise

    def _load(self, flat: Tensor) -> None:
        self._loaded = flat
        start = 0
        for p in self._params:
            p.data = flat[start:start + p.numel()].view(p.shape)
            start += p.numel()

    @torch.no_grad()
    def _collect(self, noise: Tensor, precision_noise: Optional[Tensor]) -> None:
        grad = torch.cat([p.grad.flatten() if p.requires_grad and p.grad is not None
                          else torch.zeros_like(p).flatten() for p in self._params])
        finite = bool(torch.isfinite(grad.sum())) or bool(torch.isfinite(grad).all())  # one pass when finite
        if not self._averager.record(noise, finite):
            return  # under a process group: refused at step(), on every rank alike
        if not finite:
            raise ValueError(f"{NAME}: the gradients must be finite, got NaN or inf at the drawn weights; the draw "
                             "is dropped and the state is unchanged.")
        count = self.state["count"] + 1
        self.state["count"] = count
        self.state["avg_grad"] = welford_mean(self.state["avg_grad"], grad, count)
        if self.rank:
            a = precision_noise
            self.state["avg_nxg"] = welford_mean(self.state["avg_nxg"], grad * a, count)
            if (self.state["step"] + 1) % self.update_every == 0:
                self._pairs.append((grad, a))
        else:
            self.state["avg_nxg"] = welford_mean(self.state["avg_nxg"], noise * grad, count)

    # ------------------------------------------------------------------ the update
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:
        """Update the posterior from the gradients of the draws since the last step.

        ``closure``, if given, is called ``mc_samples`` times (with gradients enabled) and must draw with
        :meth:`sampled_params` itself; the mean of its losses is returned. Collective with a process group.

        Raises
        ------
        RuntimeError
            No gradient was collected (no ``sampled_params(train=True)`` block since the last step).
        ValueError
            With a process group, on every rank: ranks that drew unlike, or a non-finite gradient (state unchanged).
        """
        loss = None
        if closure is not None:
            losses = []
            for _ in range(self.mc_samples):
                with torch.enable_grad():
                    losses.append(closure())
            loss = sum(losses) / self.mc_samples
        self._averager.average(self)  # with a process group: every rank's statistics averaged (collective)
        if self.state["count"] == 0:
            raise RuntimeError(f"{NAME}: step() needs the gradient of at least one draw; draw inside "
                               "`with optimizer.sampled_params(train=True):` and call loss.backward() there.")
        if self.rank and self._pairs:
            check_dimension(self.dim, self.rank, len(self._pairs))
        self._update()
        self._reset_samples()
        return loss

    def _update(self) -> None:
        before = {k: self.state[k] for k in ("step", "momentum", "hess", "basis", "eigvals")}  # kept if a refresh fails
        self.state["step"] += 1
        t = float(self.state["step"])
        mean, hess, avg_grad = self._flat(), self.state["hess"], self.state["avg_grad"]
        momentum, new_hess = [], []
        self._previous_momentum = self.state["momentum"]
        for g, s in self._groups():
            b1, b2, wd = g["beta1"], g["beta2"], g["weight_decay"]
            # ivon-opt's arithmetic, operation for operation, with fewer new D-vectors (each costs page faults)
            momentum.append(torch.mul(self.state["momentum"][s], b1).add_(torch.mul(avg_grad[s], 1.0 - b1)))
            h = hess[s]
            f = self.state["avg_nxg"][s] if self.rank else self.state["avg_nxg"][s] * (h + wd) * g["ess"]
            new = torch.mul(h, b2).add_(torch.mul(f, 1.0 - b2))  # b2 h + (1 - b2) f + c (h - f)^2 / (h + wd)
            new_hess.append(new.add_(torch.sub(h, f).square_().mul_(0.5 * (1 - b2) ** 2).div_(torch.add(h, wd))))
        self.state["momentum"], self.state["hess"] = _join(momentum), _join(new_hess)
        if self.rank and self._pairs:  # every update_every steps: the low-rank part, and P refactorised
            _refresh(self, mean, t, before)
        if not self.rank:
            self._factors = None
        self._load(_new_mean(self, mean, t))

    def state_dict(self):
        """As :meth:`torch.optim.Optimizer.state_dict`, with a copy of the basis :math:`Q^\\top` (it is rotated in
        place at a refresh): the returned state does not change with later steps."""
        state_dict = super().state_dict()
        state_dict["state"]["basis"] = state_dict["state"]["basis"].clone()
        return state_dict

    def load_state_dict(self, state_dict) -> None:
        """As :meth:`torch.optim.Optimizer.load_state_dict`; the cached factorisation is recomputed."""
        super().load_state_dict(state_dict)
        self.state["basis"] = self.state["basis"].clone()  # updated in place: never shared with the source
        self._factors = None
        self._reset_samples()
