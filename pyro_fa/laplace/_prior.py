r"""The evidence of :class:`~pyro_fa.laplace.FactorLaplace` and the choice of its prior precision: marginal
likelihood (at the MAP, or the linearised model's at its own mode) or validation grid.

Plain functions of the approximation ``la`` (its methods are these, bound by :func:`method`): they read it
through its buffers (``prior_precision``, ``loc``, ``loss``, ``loss_grad``, ...), ``_posterior``, its structure's
``log_det`` and ``predict_proba`` / ``predict``, and store a choice only once it is checked (positive and
finite, :func:`check_prior_precision`), in new storage (``_replace``).

``optimize_prior_precision("gridsearch", ..., temperature=True)`` scores each grid value *after* a temperature
(Guo, Pleiss, Sun & Weinberger, "On calibration of modern neural networks", 2017) fitted on the validation points
to the predictive's log class probabilities: the raw validation NLL rewards a small prior precision (a wide
posterior) for curing the MAP network's overconfidence, which one temperature cures at no cost, so the raw choice
followed by a temperature can end worse than the MAP network with a temperature; the joint choice falls back to
the MAP limit (a huge precision) when the spread brings nothing a temperature does not.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from pyro_fa.distributed import all_reduce_sum, replicated
from pyro_fa.fa.batch import ConvergenceWarning
from pyro_fa.laplace._laplace_torch import raise_laplace_torch_only
from pyro_fa.laplace._gridsearch import gridsearch_prior_precision
from pyro_fa.laplace.curvature import CURVATURES
from pyro_fa.fa.fitters import Fitter
from pyro_fa.laplace.moment import moment_fits
from pyro_fa.predictive.glm import check_pred_type
from pyro_fa.predictive.registry import PREDICTIVES

__all__ = ["train_log_likelihood", "log_marginal_likelihood", "optimize_prior_precision", "check_prior_precision",
           "check_sigma", "check_options", "method", "PRIOR_METHODS", "EVIDENCE_MODES"]

#: the ways of choosing the prior precision (:func:`optimize_prior_precision`; :data:`_PRIOR_SEARCHES` holds them)
PRIOR_METHODS = ("marglik", "gridsearch")
#: where the marginal likelihood's fit and prior terms are evaluated (:func:`log_marginal_likelihood`;
#: :data:`_EVIDENCE_CORRECTIONS` holds what each adds)
EVIDENCE_MODES = ("map", "linearized")

#: the exponents of the common prior precisions the marginal-likelihood search may start from instead (1e-8 ... 1e8)
_START_DECADES = tuple(range(-8, 9))


def show(value) -> str:
    """A hyperparameter for an error message: its values, without a tensor's grad_fn."""
    if torch.is_tensor(value):
        return repr(value.detach().cpu().reshape(-1).tolist()) if value.numel() <= 8 else f"a Tensor of shape {tuple(value.shape)}"
    return repr(value)


def ascend_log_evidence(objective, u: Tensor, start, n_steps: int, max_step: float, tol: Tensor,
                        prior_sq: Optional[Tensor] = None):
    r"""Maximise the log evidence in :math:`u = \log\delta` by BFGS with a trust radius and a backtracking line search.

    With ``prior_sq`` (:math:`c_l = \sum_{d \in l}\theta_{*d}^2`), MacKay's fixed point first (MacKay 1992,
    eq. 4.9; the gradient in :math:`u_l` is :math:`A_l - \tfrac12\delta_l c_l`, so :math:`\delta_l \leftarrow
    2A_l/c_l` where :math:`A_l > 0`), kept while it raises the evidence and moves some :math:`u_l` by more
    than 0.1: from a start far on either side it lands near the optimum in a few steps, where BFGS, which
    crosses the wall :math:`-\tfrac12 e^{u}c` one e-fold a step, would take tens. Then each step goes along
    :math:`H g` (:math:`H` the BFGS estimate of the inverse of minus the Hessian, Nocedal &
    Wright, *Numerical Optimization*, 2006, eq. 6.17; the first step along :math:`g` itself), shortened to change
    no :math:`u_l` by more than ``max_step`` (so a start 27 e-folds away, :math:`\delta = 10^{12}`, is left in a
    few steps where the evidence is nearly linear in :math:`u`), then halved until the evidence rises by
    :math:`10^{-4}` of the step's predicted gain (Armijo; a non-finite evidence counts as no rise). It stops
    when every :math:`|g_l| \le` ``tol[l]``, after ``n_steps`` steps, or when no step rises (the evidence's
    rounding).

    Parameters
    ----------
    objective : callable
        ``objective(u)`` -> ``(value, gradient)`` (a float and a Tensor shaped as ``u``), or None where either is
        not finite.
    u : Tensor of shape (L,)
        The start.
    start : (float, Tensor)
        ``objective(u)``.
    n_steps : int
    max_step : float
    tol : Tensor of shape (L,) or (1,)

    Returns
    -------
    (Tensor, Tensor, int, bool)
        The last point, its gradient, the steps taken and whether it stopped because no step rose.
    """
    f, g = start
    H = None
    done = 0
    while prior_sq is not None and done < n_steps and not bool((g.abs() <= tol).all()):
        A = g + 0.5 * u.exp() * prior_sq
        ok = (A > 0) & (prior_sq > 0)
        proposal = torch.where(ok, (2 * A.clamp_min(torch.finfo(u.dtype).tiny) / prior_sq.clamp_min(
            torch.finfo(u.dtype).tiny)).log(), u)
        trial = objective(proposal) if bool(ok.any()) else None
        if trial is None or trial[0] <= f:
            break
        far = float((proposal - u).abs().max()) > 0.1
        u, (f, g), done = proposal, trial, done + 1
        if not far:
            break
    steps = done
    for steps in range(done, n_steps):
        if bool((g.abs() <= tol).all()):
            return u, g, steps, False
        new = None
        for restart in (False, True):  # a BFGS direction that does not rise: once more along the gradient
            if restart:
                if H is None:
                    break
                H = None
            d = g.sign() if H is None else H @ g
            if float(g @ d) <= 0:  # not an ascent direction (a non-concave stretch): one e-fold each
                H, d = None, g.sign()
            d = d * min(1.0, max_step / float(d.abs().max()))
            slope, t = float(g @ d), 1.0
            for _ in range(40):
                trial = objective(u + t * d)
                if trial is not None and trial[0] >= f + 1e-4 * t * slope:
                    new = trial
                    break
                t *= 0.5
            if new is not None:
                break
        if new is None:
            return u, g, steps, True
        s, y = t * d, g - new[1]  # y: the change of minus the gradient
        sy = float(s @ y)
        if sy > 1e-12 * float(s.norm() * y.norm()):
            if H is None:  # each coordinate's own secant where it is positive (the scales differ by e-folds)
                own = s * y
                H = torch.diag(torch.where(own > 0, s / y, (sy / float(y @ y)) * torch.ones_like(s)))
            V = torch.eye(u.numel(), dtype=u.dtype, device=u.device) - torch.outer(s, y) / sy
            H = V @ H @ V.T + torch.outer(s, s) / sy
        u, (f, g) = u + s, new
    return u, g, n_steps, False


def with_grad(method):
    """``method`` run with gradients enabled, outside inference mode: under ``torch.no_grad()`` or
    ``torch.inference_mode()`` its autograd still works and the tensors it stores are ordinary ones."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            return method(*args, **kwargs)

    return wrapped


def positive_int(owner: str, arg: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {arg} must be an integer >= {minimum}, got {value!r}.")
    return value


def method(function):
    """``function(la, ...)`` as a method of the approximation: its name, signature and docstring."""
    @functools.wraps(function)
    def bound(self, *args, **kwargs):
        return function(self, *args, **kwargs)

    return bound


# ------------------------------------------------------------------ hyperparameters
def check_options(owner: str, rank, full: bool, curvature: str, curvature_fit: str, process_group):
    """``FactorLaplace``'s ``rank`` (default 20; an int checked positive) after its curvature options are checked."""
    if curvature not in CURVATURES:
        raise ValueError(f"{owner}: curvature must be one of {CURVATURES}, got {curvature!r}.")
    if not (isinstance(curvature_fit, Fitter) and curvature_fit.curvature_fit) and curvature_fit not in moment_fits():
        raise ValueError(f"{owner}: curvature_fit must be one of {moment_fits()}, got {curvature_fit!r}.")
    if curvature_fit == "sketch" and process_group is not None:
        raise ValueError(f"{owner}: curvature_fit='sketch' cannot be sharded; with a process_group use "
                         "curvature_fit='online', 'randomized' or 'scatter', got curvature_fit='sketch'.")
    if full and rank is not None:
        raise ValueError(f"{owner}: hessian_structure='full' keeps the curvature exactly (rank=D); pass it or "
                         f"rank, got rank={rank!r} too.")
    rank = 20 if rank is None else rank
    return positive_int(owner, "rank", rank) if isinstance(rank, int) else rank


def check_prior_precision(la, value, ref: Tensor, differentiable: bool = False) -> Tensor:
    """``value`` as a Tensor of shape (1,) or (L,), checked (positive, finite); a detached copy unless
    ``differentiable`` and ``value`` requires grad (then reshaped only, its graph kept)."""
    name = type(la).__name__
    if isinstance(value, bool) or not (isinstance(value, (int, float)) or torch.is_tensor(value)):
        raise TypeError(f"{name}: prior_precision must be a positive float or a Tensor of shape (1,) or "
                        f"({la.n_layers},), got {type(value).__name__}.")
    keep = differentiable and torch.is_tensor(value) and value.requires_grad
    t = value.reshape(-1) if keep else torch.as_tensor(value, dtype=ref.dtype).to(ref.device).detach().reshape(-1).clone()
    if t.numel() not in (1, la.n_layers):
        raise ValueError(f"{name}: prior_precision must be a scalar or have one value per parameter tensor "
                         f"(shape (1,) or ({la.n_layers},)), got shape {tuple(torch.as_tensor(value).shape)!r}.")
    if not bool(torch.isfinite(t.detach()).all() and (t.detach() > 0).all()):
        raise ValueError(f"{name}: prior_precision must be positive and finite, got {show(value)}.")
    return t


def check_sigma(la, value, ref: Tensor, differentiable: bool = False) -> Tensor:
    """``value`` as a Tensor of shape (), checked (positive, finite, 1 for classification); a detached copy
    unless ``differentiable`` and ``value`` requires grad."""
    name = type(la).__name__
    if isinstance(value, bool) or not (isinstance(value, (int, float)) or torch.is_tensor(value)):
        raise TypeError(f"{name}: sigma_noise must be a positive float, got {type(value).__name__}.")
    keep = differentiable and torch.is_tensor(value) and value.requires_grad
    t = value if keep else torch.as_tensor(value, dtype=ref.dtype).to(ref.device).detach().clone()
    if t.numel() != 1 or not bool(torch.isfinite(t.detach()).all() and (t.detach() > 0).all()):
        raise ValueError(f"{name}: sigma_noise must be a positive finite scalar, got {show(value)}.")
    if la.likelihood == "classification" and float(t.detach()) != 1.0:
        raise ValueError(f"{name}: sigma_noise must be 1 for likelihood='classification', got {show(value)}.")
    return t.reshape(())


# ------------------------------------------------------------------ evidence


def train_log_likelihood(la, sigma_noise=None) -> Tensor:
    r""":math:`\log p(\mathcal D \mid \theta_*)` of the training data at the MAP, a scalar (differentiable in
    ``sigma_noise``); laplace-torch's ``la.log_likelihood``. (``log_likelihood(inputs, targets, ...)`` is the
    predictive's, every posterior's: :class:`~pyro_fa.predictive.Posterior`.)"""
    la._check_fitted("train_log_likelihood()")
    return _TRAIN_LOG_LIKELIHOODS[la.likelihood](la, sigma_noise)


def _gaussian_log_likelihood(la, sigma_noise) -> Tensor:
    """A Gaussian's, from the sum of squared errors at the MAP:
    :math:`-\\mathrm{SSE}/2\\sigma^2 - \\tfrac{NC}2\\log 2\\pi\\sigma^2`."""
    _, sg = la._resolve(None, sigma_noise)
    n_out = la.n_outputs.to(la.loc.dtype)
    N = la.n_data.to(la.loc.dtype)
    return -la.loss / (2 * sg.pow(2)) - 0.5 * N * n_out * torch.log(2 * math.pi * sg.pow(2))


#: likelihood -> ``(la, sigma_noise) -> log p(D | theta_*)`` (a classifier's: minus the summed cross-entropy)
_TRAIN_LOG_LIKELIHOODS = {"classification": lambda la, sigma_noise: -la.loss, "regression": _gaussian_log_likelihood}
#: likelihood -> the gradient of minus the log-likelihood at the MAP from the stored loss's (a Gaussian's loss is
#: the sum of squared errors: divided by 2 sigma^2)
_LOG_LIKELIHOOD_GRADIENTS = {"classification": lambda la, sg: la.loss_grad,
                             "regression": lambda la, sg: la.loss_grad / (2 * sg.pow(2))}


def _at_the_linearized_mode(la, lml: Tensor, post, delta: Tensor, sg: Tensor) -> Tensor:
    """``mode="linearized"``: :math:`+\\tfrac12 b^\\top P^{-1} b`, :math:`b = g + \\delta\\odot\\theta_*`."""
    grad = _LOG_LIKELIHOOD_GRADIENTS[la.likelihood](la, sg)
    return lml + 0.5 * post.covariance_quadratic(grad + delta * la.loc)


#: evidence mode -> ``(la, the evidence at theta_*, posterior, prior per weight, sigma) -> the evidence``
_EVIDENCE_CORRECTIONS = {"map": lambda la, lml, post, delta, sg: lml, "linearized": _at_the_linearized_mode}


def log_marginal_likelihood(la, prior_precision=None, sigma_noise=None, mode: str = "map") -> Tensor:
    r"""The Laplace approximation of the log evidence, a scalar, differentiable in both hyperparameters.

    ``mode="map"`` (MacKay 1992, §4; Daxberger et al. 2021, eq. 5; laplace-torch's):

    .. math::

        \log p(\mathcal D) \approx \log p(\mathcal D \mid \theta_*) - \tfrac12\big(\log\det P
        - \textstyle\sum_d \log \delta_d + \sum_d \delta_d \theta_{*d}^2\big),

    with :math:`\log\det P` by the matrix determinant lemma in :math:`O(DK^2)` and :math:`\theta_*` the
    weights at :meth:`fit`. It assumes :math:`\theta_*` is the mode of the posterior under the prior
    :math:`\delta` being scored, which a network trained with another weight decay (or not to convergence)
    is not: the prior term :math:`\delta\|\theta_*\|^2` then counts the many weights the data do not
    determine, and the chosen :math:`\delta` comes out small and the predictive underconfident.

    ``mode="linearized"``: the evidence of the linearised model at *its own* mode (Antorán et al.,
    *Adapting the linearised Laplace model evidence for modern deep learning*, ICML 2022, §3-4), the loss
    taken to second order about :math:`\theta_*` with the fitted curvature
    :math:`G = \tfrac{N}{\sigma^2}(FF^\top + \Psi)` and the loss's gradient :math:`g` at
    :math:`\theta_*` (kept by :meth:`fit`):

    .. math::

        \log p(\mathcal D) \approx \text{the above} + \tfrac12\, b^\top P^{-1} b, \qquad
        b = g + \delta \odot \theta_*,

    which is :math:`-\mathcal L(\hat\theta) - \tfrac12\log\det P + \tfrac12\sum_d\log\delta_d` at the mode
    :math:`\hat\theta = \theta_* - P^{-1}b` of :math:`\mathcal L(\theta) = -\log p(\mathcal D\mid\theta_*)
    + g^\top(\theta-\theta_*) + \tfrac12(\theta-\theta_*)^\top G(\theta-\theta_*) +
    \tfrac12\sum_d\delta_d\theta_d^2`. The prior term weighs :math:`\hat\theta`, whose weights the data
    do not determine are shrunk to the prior. For a Gaussian likelihood of a model linear in its weights
    (and a curvature of full rank) this is the exact evidence, whatever :math:`\theta_*` is; for a
    categorical one the second-order model of the loss stands in for the linearised model's. Also
    :math:`O(DK^2)`.

    Parameters
    ----------
    prior_precision : float or Tensor of shape (1,) or (L,), optional
        Default: :attr:`prior_precision`.
    sigma_noise : float or Tensor of shape (), optional
        Default: :attr:`sigma_noise`.
    mode : {"map", "linearized"}, default "map"
        Where the fit and prior terms are evaluated: at :math:`\theta_*`, or at the linearised model's mode.

    Returns
    -------
    Tensor of shape ()
    """
    la._check_fitted("log_marginal_likelihood()")
    if mode not in EVIDENCE_MODES:
        raise ValueError(f"{type(la).__name__}: mode must be one of {EVIDENCE_MODES}, got {mode!r}.")
    pp, sg = la._resolve(prior_precision, sigma_noise)
    log_lik = la.train_log_likelihood(sg)
    if la._sharding is not None:  # they enter this rank's partial sums: their gradients summed over ranks
        pp, sg = replicated(pp, la._sharding), replicated(sg, la._sharding)
    delta = la._prior_diag(pp)
    post = la._posterior(pp, sg)
    sums = torch.stack([delta.log().sum(), (delta * la.loc.pow(2)).sum()])
    if la._sharding is not None:  # this rank's weights: the sums over D all-reduced
        sums = all_reduce_sum(sums, la._sharding)
    log_det_ratio = la._structure.log_det(post) - sums[0]
    lml = log_lik - 0.5 * (log_det_ratio + sums[1])
    return _EVIDENCE_CORRECTIONS[mode](la, lml, post, delta, sg)


@with_grad


def optimize_prior_precision(la, method: str = "marglik", *, n_steps: int = 100, lr: float = 2.0,
                             val_loader: Optional[Iterable] = None, grid: Optional[Sequence[float]] = None,
                             pred_type: str = "glm", link_approx: Optional[str] = None,
                             num_samples: int = 100, temperature: bool = False, mode: str = "map",
                             grid_size: Optional[int] = None, log_prior_prec_min: float = -4.0,
                             log_prior_prec_max: float = 4.0, **laplace_torch) -> Tensor:
    r"""Choose the prior precision :math:`\delta` (scalar or per layer, the shape of :attr:`prior_precision`).

    Parameters
    ----------
    method : {"marglik", "gridsearch"}, default "marglik"
        ``"marglik"``: MacKay's fixed point then BFGS on :math:`u = \log\delta` maximising
        :meth:`log_marginal_likelihood` (its ``mode``), from the stored :math:`\delta` or, where the evidence
        is higher there, the common value :math:`10^{-8}, 10^{-7}, \dots, 10^{8}` of most evidence, until the gradient in :math:`u` is zero to
        :math:`\sqrt{\epsilon}\,(1 + D_l/2)` per group of :math:`D_l` weights (each of the gradient's two terms
        is at most :math:`D_l/2`), with a ``ConvergenceWarning`` naming the gradient where it stops short
        (:func:`ascend_log_evidence`); from :math:`\delta = 10^{\pm 12}` it reaches the optimum in about 20
        steps. ``"gridsearch"``: the scalar :math:`\delta` of ``grid`` with the lowest validation negative
        log-likelihood of the predictive (``pred_type``, ``link_approx``).
    n_steps, lr : int, float
        ``"marglik"``: the most BFGS steps, and the most any :math:`\log\delta_l` changes in one step (a
        trust radius in e-folds; the step is halved until the evidence rises).
    val_loader : iterable of (Tensor, Tensor)
        Needed by ``"gridsearch"``. Read once: a one-shot iterator (a generator) is read into a list, whose
        batches every grid value is scored on.
    grid : sequence of float, optional
        Default :math:`10^{-4}, 10^{-3.75}, \dots, 10^4`.
    grid_size, log_prior_prec_min, log_prior_prec_max : int, float, float
        laplace-torch's names for a grid: without ``grid``, ``grid_size`` values :math:`10^{\min}, \dots,
        10^{\max}` evenly spaced in the exponent.
    pred_type, link_approx, num_samples
        The predictive scored by ``"gridsearch"`` (see :meth:`predict_proba`; ``link_approx=None`` is
        ``"probit"`` for ``"glm"`` and ``"mc"`` for ``"nn"``). laplace-torch's ``n_samples`` is accepted for
        ``num_samples``.
    temperature : bool, default False
        ``"gridsearch"`` of a classifier only: score each grid value by the validation NLL *after* a
        temperature :math:`T` fitted there (:func:`pyro_fa.predictive.fit_temperature` on the log of the
        predictive's probabilities, :math:`T \in [0.01, 100]`), and keep the :math:`T` of the chosen value
        in :attr:`temperature`. :meth:`predict_proba` itself is never tempered; apply it as
        ``(la.predict_proba(x, pred_type="glm").log() / la.temperature).softmax(-1)``. The raw scores stay in
        ``grid_scores_``; the tempered ones and the temperatures go to ``grid_tempered_`` (values, NLLs,
        temperatures). :attr:`temperature` is saved by :meth:`state_dict` (``fitted_temperature``).
    mode : {"map", "linearized"}, default "map"
        ``"marglik"`` only: the evidence maximised, at :math:`\theta_*` (laplace-torch's) or at the
        linearised model's own mode (Antorán et al. 2022), which does not take the weights the data leave
        undetermined for evidence of a small prior precision (see :meth:`log_marginal_likelihood`).

    Returns
    -------
    Tensor of shape (1,) or (L,)
        The chosen :attr:`prior_precision` (also stored, in new storage: a tensor taken earlier keeps its
        values).

    Raises
    ------
    ValueError
        An unknown ``method``; bad ``n_steps``, ``lr``, ``grid`` (``grid_size``) or a missing or empty
        ``val_loader``; a log marginal likelihood or gradient that is not finite where ``"marglik"`` starts
        (trial points where it is not finite are stepped back from), or a non-finite validation NLL in
        ``"gridsearch"``; laplace-torch's arguments with no counterpart here (``init_prior_prec``, ``loss``,
        ...); ``temperature`` not a bool, or True with ``"marglik"`` or a
        regression; an unknown ``mode``, or ``"linearized"`` with ``"gridsearch"``. Nothing is stored
        then: :attr:`prior_precision` and :attr:`temperature` stay as they were.

    Warns
    -----
    ConvergenceWarning
        ``"marglik"`` stopped (``n_steps``, or no step raised the evidence) with its gradient in
        :math:`\log\delta` above the tolerance: the message names the gradient and its ratio to it.

    Examples
    --------
    >>> net = torch.nn.Linear(3, 4)
    >>> x, y = torch.randn(60, 3), torch.randint(4, (60,))
    >>> la = FactorLaplace(net, "classification", rank=2).fit([(x[:40], y[:40])])
    >>> delta = la.optimize_prior_precision("gridsearch", val_loader=[(x[40:], y[40:])], temperature=True)
    >>> p = (la.predict_proba(x[40:], pred_type="glm").log() / la.temperature).softmax(-1)  # the tempered predictive
    >>> p.shape
    torch.Size([20, 4])
    >>> delta = la.optimize_prior_precision("marglik", mode="linearized")  # the linearised model's evidence
    """
    name = type(la).__name__
    la._check_fitted("optimize_prior_precision()")
    if "n_samples" in laplace_torch:  # laplace-torch's name for num_samples
        if num_samples != 100:
            raise TypeError(f"{name}: pass num_samples or laplace-torch's n_samples, not both.")
        num_samples = laplace_torch.pop("n_samples")
    if laplace_torch:
        raise_laplace_torch_only(name, "optimize_prior_precision", laplace_torch)
    if method not in PRIOR_METHODS:
        hint = (" (laplace-torch's first argument is pred_type: pass pred_type=... by keyword here)"
                if isinstance(method, str) and method in PREDICTIVES else "")
        raise ValueError(f"{name}: method must be one of {PRIOR_METHODS}, got {method!r}{hint}.")
    if grid_size is not None:
        if grid is not None:
            raise ValueError(f"{name}: grid and grid_size are two ways of giving the grid; pass one, got both.")
        positive_int(name, "grid_size", grid_size)
        lo, hi = float(log_prior_prec_min), float(log_prior_prec_max)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ValueError(f"{name}: log_prior_prec_min must be <= log_prior_prec_max, both finite, got "
                             f"{log_prior_prec_min!r} and {log_prior_prec_max!r}.")
        grid = torch.logspace(lo, hi, grid_size, dtype=torch.float64).tolist()
    if not isinstance(temperature, bool):
        raise ValueError(f"{name}: temperature must be True or False, got {temperature!r}.")
    if temperature and method != "gridsearch":
        raise ValueError(f"{name}: temperature=True needs method='gridsearch' (the temperature is fitted on "
                         f"val_loader at each grid value), got method={method!r}.")
    if temperature and la.likelihood != "classification":
        raise ValueError(f"{name}: temperature=True needs likelihood='classification' (a temperature divides "
                         f"log class probabilities), got {la.likelihood!r}.")
    if mode not in EVIDENCE_MODES:
        raise ValueError(f"{name}: mode must be one of {EVIDENCE_MODES}, got {mode!r}.")
    if mode != "map" and method != "marglik":
        raise ValueError(f"{name}: mode={mode!r} chooses the evidence of method='marglik', got "
                         f"method={method!r}.")
    best, chosen_t = _PRIOR_SEARCHES[method](la, dict(
        n_steps=n_steps, lr=lr, mode=mode, val_loader=val_loader, grid=grid, pred_type=pred_type,
        link_approx=link_approx, num_samples=num_samples, temperature=temperature))
    # the choice is checked before it touches the fitted state: nothing changes when it is refused
    best = la._check_prior_precision(best, la.loc)
    la._replace(prior_precision=best)
    la.temperature = chosen_t
    return la.prior_precision.clone()


def _marglik_prior_precision(la, n_steps: int, lr: float, mode: str = "map") -> Tensor:
    """The maximiser of the evidence in :math:`u = \\log\\delta` by :func:`ascend_log_evidence`, from the stored
    :math:`\\delta`; gradients enabled whatever the caller's context (``torch.no_grad``, ``inference_mode``)."""
    name = type(la).__name__
    positive_int(name, "n_steps", n_steps)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"{name}: lr must be a positive finite float, got {lr!r}.")
    # each group's weights: the natural scale of its gradient (each of its two terms is at most D_l / 2)
    pp0 = la.prior_precision.detach()
    sizes = [la.dim] if pp0.numel() == 1 else list(la._sizes)
    with torch.inference_mode(False), torch.enable_grad():
        u0 = pp0.log().clone()

        def objective(u: Tensor):
            leaf = u.detach().clone().requires_grad_(True)
            pp = leaf.exp()
            if not bool(torch.isfinite(pp).all() and (pp > 0).all()):
                return None
            lml = la.log_marginal_likelihood(prior_precision=pp, mode=mode)
            if not bool(torch.isfinite(lml)):
                return None
            g, = torch.autograd.grad(lml, leaf)
            if not bool(torch.isfinite(g).all()):
                return None
            return float(lml.detach()), g.detach()

        start = objective(u0)
        # the best of the start and one common value per decade: a local search cannot leave the plateau of
        # the linearised evidence at a huge precision (its gradient there is 0 to rounding)
        for e in _START_DECADES:
            if start is None:
                break
            trial = _evidence_at(la, u0.new_full(u0.shape, e * math.log(10)), mode)
            if trial is not None and trial > start[0]:
                u0, start = u0.new_full(u0.shape, e * math.log(10)), None
                start = objective(u0)
        if start is None:
            raise ValueError(f"{name}: optimize_prior_precision('marglik'): the log marginal likelihood or its "
                             f"gradient is not finite at the prior precision {show(pp0)} it starts from; the "
                             "fitted curvature or loss is not usable. The prior precision was left as it was.")
        tol = torch.finfo(u0.dtype).eps ** 0.5 * (1 + 0.5 * torch.tensor(sizes, dtype=u0.dtype, device=u0.device))
        u, g, steps, stalled = ascend_log_evidence(objective, u0, start, n_steps, lr, tol, _prior_sq(la, pp0))
    excess = float((g.abs() / tol).max())
    if excess > 1:
        where = (f"after {steps} of n_steps={n_steps} steps: no step increased the evidence"
                 if stalled else f"after n_steps={n_steps} steps")
        warnings.warn(f"{name}: optimize_prior_precision('marglik') stopped {where}, with the gradient of the log "
                      f"evidence in log(prior_precision) at {float(g.abs().max()):.3g}, {excess:.3g} times its "
                      f"tolerance from zero; the choice {show(u.exp())} may be off the optimum. Raise n_steps or "
                      "start from another prior_precision.", ConvergenceWarning, stacklevel=3)
    return u.exp()


def _marglik_search(la, o: dict):
    return _marglik_prior_precision(la, o["n_steps"], o["lr"], o["mode"]), None


def _gridsearch_search(la, o: dict):
    return gridsearch_prior_precision(la, o["val_loader"], o["grid"], o["pred_type"], o["link_approx"],
                                       o["num_samples"], o["temperature"])


#: method -> ``(la, the options) -> (the chosen prior precision, its temperature or None)``
_PRIOR_SEARCHES = {"marglik": _marglik_search, "gridsearch": _gridsearch_search}


def _evidence_at(la, u: Tensor, mode: str) -> Optional[float]:
    """The log evidence at :math:`\\delta = e^u` without its gradient, None where not finite."""
    with torch.no_grad():
        lml = float(la.log_marginal_likelihood(prior_precision=u.exp(), mode=mode))
    return lml if math.isfinite(lml) else None


def _prior_sq(la, pp: Tensor) -> Tensor:
    r""":math:`c_l = \sum_{d\in l}\theta_{*d}^2` for each prior precision (one, or one per parameter tensor),
    shape of ``pp`` (summed over the ranks when sharded)."""
    sq = la.loc.detach().pow(2)
    if pp.numel() == 1:
        sums = sq.sum().reshape(1)
    else:  # each weight's group, read off the per-weight expansion of 0, 1, ..., L-1
        group = la._prior_diag(torch.arange(pp.numel(), dtype=sq.dtype, device=sq.device)).round().long()
        sums = sq.new_zeros(pp.numel()).index_add_(0, group, sq)
    return sums if la._sharding is None else all_reduce_sum(sums, la._sharding)
