r"""The two peer methods of the ``pyro-fa classify`` benchmark, run from their own packages.

* **Laplace** (Daxberger, Kristiadi, Immer, Eschenhagen, Bauer & Hennig 2021,
  "Laplace Redux -- Effortless Bayesian Deep Learning", package ``laplace-torch``):
  a Gaussian over the last linear layer's weights around the MAP network, with a
  Kronecker-factored (KFAC) generalised Gauss-Newton precision, the scalar prior
  precision fitted by the marginal likelihood, and the linearised (GLM) predictive
  with the probit approximation of the softmax (MacKay 1992, "The evidence framework
  applied to classification networks"), the settings the paper recommends by default:

  .. math::

      p(y \mid x) \approx \operatorname{softmax}\Big(
      \frac{f_\mu(x)}{\sqrt{1 + \tfrac{\pi}{8}\operatorname{diag} J_x \Sigma J_x^\top}}\Big).

* **IVON** (Shen, Daheim, Cong, Nickl, Marconi, Bazan, Yokota, Gurevych, Cremers,
  Khan & Möllenhoff 2024, "Variational learning is effective for large deep networks",
  package ``ivon-opt``): the network is trained from scratch by the IVON optimizer,
  which learns a diagonal Gaussian over all weights, then predicts with weights drawn
  from it. Settings follow the package README and the authors' small-network scripts
  (``ivon-experiments``): ``ess`` = number of training points, ``hess_init=0.5``,
  ``beta1=0.9``, ``beta2=0.99999``, ``weight_decay=1e-4``, one Monte Carlo sample per
  step, a cosine-annealed learning rate; the learning rate is chosen from
  ``(0.05, 0.1, 0.2)`` by the validation NLL of the model average unless given.

Installing them beside a chosen torch build: ``pip install -c <torch==X> -e ".[peers]"``
then ``pip install --no-deps laplace-torch==0.3 backpack-for-pytorch==1.7.1
curvlinops-for-pytorch==3.0.1`` (what ``make setup`` does). The last three declare
``torchvision``, which they do not import for last-layer Laplace; PyPI's torchvision
wheel fails to import beside a CPU torch build ("operator torchvision::nms does not
exist"), and ``torchmetrics`` (which ``laplace`` imports) then fails with it.
"""
from __future__ import annotations

import functools
import importlib
import math
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["available", "unavailable_reasons", "laplace_probs", "ivon_probs"]

INSTALL_HINT = (
    'install the `peers` extra beside your torch build: `pip install -c <(echo torch==X.Y.Z) -e ".[peers]"` '
    "then `pip install --no-deps laplace-torch==0.3 backpack-for-pytorch==1.7.1 "
    "curvlinops-for-pytorch==3.0.1` (`make setup` does both)"
)
IVON_LR_GRID = (0.05, 0.1, 0.2)
#: base-10 range of laplace-torch's prior-precision grid search: up to the MAP limit
GRID_LOG10_RANGE = (-4.0, 8.0)
_MODULES = {"laplace": "laplace", "ivon": "ivon"}
_EVAL_BATCH = 1024


@functools.lru_cache(maxsize=None)
def _import_error(key: str) -> Optional[str]:
    try:
        with warnings.catch_warnings():  # asdl (a laplace-torch backend) calls torch.jit.script on import
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module(_MODULES[key])
    except Exception as exc:  # noqa: BLE001 -- a broken torchvision raises RuntimeError, not ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def unavailable_reasons() -> Dict[str, Optional[str]]:
    """Why each peer cannot be imported: ``{"laplace": str | None, "ivon": str | None}`` (None when it can).

    Never raises; the import is attempted once per process.
    """
    return {key: _import_error(key) for key in _MODULES}


def available() -> Dict[str, bool]:
    """Which peers import here: ``{"laplace": bool, "ivon": bool}``. Never raises.

    Examples
    --------
    >>> sorted(available())
    ['ivon', 'laplace']
    """
    return {key: reason is None for key, reason in unavailable_reasons().items()}


def _require(key: str, caller: str):
    reason = _import_error(key)
    if reason is not None:
        raise ImportError(f"{caller}: the package for {key!r} does not import ({reason}); {INSTALL_HINT}.")
    return importlib.import_module(_MODULES[key])


def _check_xy(caller: str, name: str, xy) -> Tuple[Tensor, Tensor]:
    if not (isinstance(xy, (tuple, list)) and len(xy) == 2 and all(isinstance(t, Tensor) for t in xy)):
        raise TypeError(f"{caller}: {name} must be a pair (X, y) of tensors, got {type(xy).__name__}.")
    x, y = xy
    if y.dim() != 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(
            f"{caller}: {name} must be X of shape (N, ...) and integer labels y of shape (N,) with N > 0, "
            f"got X {tuple(x.shape)} and y {tuple(y.shape)}."
        )
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        raise TypeError(f"{caller}: {name}'s labels must be an integer tensor, got {y.dtype}.")
    return x, y.long()


def _check_inputs(caller: str, test_inputs) -> List[Tensor]:
    if isinstance(test_inputs, Tensor) or not all(isinstance(t, Tensor) for t in test_inputs):
        raise TypeError(
            f"{caller}: test_inputs must be a list of tensors (N_i, ...), got {type(test_inputs).__name__}."
        )
    return list(test_inputs)


def _check_positive_int(caller: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{caller}: {name} must be a positive integer, got {value!r}.")
    return value


def _device_dtype(net: nn.Module) -> Tuple[torch.device, torch.dtype]:
    p = next(net.parameters())
    return p.device, p.dtype


def _loader(x: Tensor, y: Tensor, batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _index_loader(n: int, batch_size: int, seed: int) -> DataLoader:
    """The minibatch indices of a shuffled ``DataLoader(TensorDataset(x, y), batch_size)`` with a generator seeded
    by ``seed``, epoch after epoch, as index tensors: the same draws from the same generator, so the same order
    (what IVON's rows were recorded with), and ``x[idx]`` gathers a batch
    in one operation on any device, where the loader of ``TensorDataset(x, y)`` indexes it one example at a
    time (a kernel per example on a GPU)."""
    return DataLoader(torch.arange(n), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def laplace_probs(
    net_map: nn.Module,
    train_xy: Tuple[Tensor, Tensor],
    val_xy: Optional[Tuple[Tensor, Tensor]],
    test_inputs: Sequence[Tensor],
    seed: int = 0,
    *,
    prior_precision: Optional[float] = None,
    prior_method: str = "marglik",
    link_approx: str = "probit",
    n_samples: int = 100,
    batch_size: int = 256,
    subset_of_weights: str = "last_layer",
    hessian_structure: str = "kron",
    prior_structure: Optional[str] = None,
    log_prior_prec_range: Tuple[float, float] = GRID_LOG10_RANGE,
    info: Optional[dict] = None,
    tempered: Optional[dict] = None,
) -> List[Tensor]:
    r"""Predictive probabilities of Laplace (laplace-torch; by default last-layer KFAC) around a MAP network.

    Parameters
    ----------
    net_map : nn.Module
        Trained to MAP; maps (N, ...) to logits (N, C); its last module must be an
        ``nn.Linear`` (the layer the posterior is put on). Left unchanged (the
        Laplace object works on a copy; its train/eval mode is restored).
    train_xy : (Tensor of shape (N, ...), Tensor of shape (N,))
        Training inputs and integer labels; the curvature is summed over them.
    val_xy : (Tensor, Tensor) or None
        Validation part, used only by ``prior_method="gridsearch"`` (NLL of the
        predictive on it).
    test_inputs : list of Tensor of shape (N_i, ...)
        Inputs to predict (test part, OOD sets).
    seed : int, default 0
        Seeds torch's generator inside this call (only ``link_approx="mc"`` draws).
    prior_precision : float, optional
        Fixes the prior precision instead of fitting it (a huge value gives back
        the MAP's probabilities).
    prior_method : {"marglik", "gridsearch"}, default "marglik"
        How the scalar prior precision is fitted when ``prior_precision`` is None:
        by the Laplace marginal likelihood (100 Adam steps on its log, laplace-torch's
        default) or by laplace-torch's grid search of the validation NLL
        (``optimize_prior_precision(method="gridsearch", val_loader=...)``, 100 values
        log-spaced over ``log_prior_prec_range``).
    link_approx : {"probit", "mc"}, default "probit"
        The GLM predictive's approximation of the softmax integral: probit
        (deterministic) or ``n_samples`` Monte Carlo draws of the linearised logits.
    n_samples : int, default 100
        Draws for ``link_approx="mc"``.
    batch_size : int, default 256
        Batch size of the DataLoaders handed to laplace-torch and of prediction.
    subset_of_weights : {"last_layer", "all"}, default "last_layer"
        Which weights get the Gaussian (laplace-torch's option of that name).
    hessian_structure : {"kron", "diag", "full"}, default "kron"
        KFAC, diagonal or full (D x D, D the weights it covers) generalised Gauss-Newton (laplace-torch's
        option of that name). "full" over all weights stores D² numbers and eigendecomposes them, O(D³).
    prior_structure : {"scalar", "layerwise", "diag"}, optional
        Passed to laplace-torch's ``optimize_prior_precision`` (one prior precision, one per parameter
        tensor, one per weight); by default none is passed, and laplace-torch 0.3 keeps the scalar it was
        built with.
    log_prior_prec_range : (float, float), default (-4, 8)
        Base-10 logarithms of the smallest and largest prior precision of the grid search: the default
        reaches far past the MAP limit (at 1e8 the last layer's posterior variance is negligible), which
        laplace-torch's own default (-4, 4) may not.
    info : dict, optional
        If given, receives ``"prior_precision"`` (the value used) and ``"link_approx"``.
    tempered : dict, optional
        With ``prior_method="gridsearch"``: also choose the prior precision by the *tempered* validation NLL
        (for each of the grid search's 100 values, laplace-torch's GLM predictive of ``val_xy``, a temperature
        fitted to its log probabilities by :func:`pyro_fa.predictive.fit_temperature`, the NLL after it; the
        least wins) and put here ``"probs"`` (the probabilities of ``test_inputs`` at that value, untempered),
        ``"prior_precision"``, ``"temperature"``, ``"val_nll_tempered"`` and ``"seconds"`` (its time). The returned probabilities (the
        raw choice) are computed first and are unchanged by it.

    Returns
    -------
    list of Tensor of shape (N_i, C)
        Probabilities, one tensor per entry of ``test_inputs``, on ``net_map``'s device.

    Raises
    ------
    ImportError
        laplace-torch does not import here (the reason and the install command are in the message).
    TypeError, ValueError
        Malformed data or options.

    Notes
    -----
    Cost: one pass over the training data for the KFAC factors (features ``A`` of
    size (H, H) and output Hessians ``G`` of size (C, C), H the last hidden width),
    eigendecompositions of both, then O(H² + C²) per test input.

    References
    ----------
    Daxberger, E., Kristiadi, A., Immer, A., Eschenhagen, R., Bauer, M. & Hennig, P. (2021).
    Laplace Redux -- Effortless Bayesian Deep Learning. NeurIPS.
    Ritter, H., Botev, A. & Barber, D. (2018). A Scalable Laplace Approximation for Neural Networks. ICLR.
    MacKay, D. J. C. (1992). The evidence framework applied to classification networks. Neural Computation.
    """
    caller = "laplace_probs"
    laplace = _require("laplace", caller)
    x_tr, y_tr = _check_xy(caller, "train_xy", train_xy)
    inputs = _check_inputs(caller, test_inputs)
    if prior_method not in ("marglik", "gridsearch"):
        raise ValueError(f"{caller}: prior_method must be 'marglik' or 'gridsearch', got {prior_method!r}.")
    if subset_of_weights not in ("last_layer", "all"):
        raise ValueError(f"{caller}: subset_of_weights must be 'last_layer' or 'all', got {subset_of_weights!r}.")
    if hessian_structure not in ("kron", "diag", "full"):
        raise ValueError(f"{caller}: hessian_structure must be 'kron', 'diag' or 'full', got {hessian_structure!r}.")
    lo, hi = log_prior_prec_range
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"{caller}: log_prior_prec_range must be two finite numbers (low, high) with low < high, "
                         f"got {log_prior_prec_range!r}.")
    if link_approx not in ("probit", "mc"):
        raise ValueError(f"{caller}: link_approx must be 'probit' or 'mc', got {link_approx!r}.")
    if prior_precision is not None and not (math.isfinite(prior_precision) and prior_precision > 0):
        raise ValueError(f"{caller}: prior_precision must be a finite number > 0 or None, got {prior_precision!r}.")
    _check_positive_int(caller, "n_samples", n_samples)
    _check_positive_int(caller, "batch_size", batch_size)
    if tempered is not None and (prior_precision is not None or prior_method != "gridsearch"):
        raise ValueError(f"{caller}: tempered needs prior_method='gridsearch' and prior_precision=None, got "
                         f"prior_method={prior_method!r} and prior_precision={prior_precision!r}.")
    val_loader = None
    if prior_precision is None and prior_method == "gridsearch":
        if val_xy is None:
            raise ValueError(f"{caller}: val_xy is required for prior_method='gridsearch'.")
        x_va, y_va = _check_xy(caller, "val_xy", val_xy)
        val_loader = _loader(x_va, y_va, batch_size)

    device, dtype = _device_dtype(net_map)
    was_training = net_map.training
    net_map.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            la = laplace.Laplace(
                net_map,
                "classification",
                subset_of_weights=subset_of_weights,
                hessian_structure=hessian_structure,
                prior_precision=1.0 if prior_precision is None else float(prior_precision),
            )
            la.fit(_loader(x_tr.to(device, dtype), y_tr.to(device), batch_size))
            if hessian_structure == "full":
                _eigen_log_det(la)
            if prior_precision is None:
                with warnings.catch_warnings():  # a reminder to pass link_approx, which we do
                    warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")
                    la.optimize_prior_precision(
                        pred_type="glm",
                        method=prior_method,
                        val_loader=val_loader,
                        link_approx=link_approx,
                        n_samples=n_samples,
                        **({} if prior_structure is None else {"prior_structure": prior_structure}),
                        **({"log_prior_prec_min": lo, "log_prior_prec_max": hi}
                           if prior_method == "gridsearch" else {}),
                    )
            predict = functools.partial(_laplace_predict, la, device=device, dtype=dtype, batch_size=batch_size,
                                        link_approx=link_approx, n_samples=n_samples)
            out = [predict(x) for x in inputs]
            if info is not None:
                info["prior_precision"] = la.prior_precision.detach().cpu().reshape(-1).tolist()
                info["link_approx"] = link_approx
                info["prior_method"] = "fixed" if prior_precision is not None else prior_method
            if tempered is not None:
                t0 = time.perf_counter()
                tempered.update(_tempered_gridsearch(la, predict, x_va, y_va, (lo, hi)))
                tempered["probs"] = [predict(x) for x in inputs]
                tempered["seconds"] = time.perf_counter() - t0
    finally:
        net_map.train(was_training)
    return out


def _eigen_log_det(la) -> None:
    r"""Give a fitted full-GGN Laplace (laplace-torch's ``FullLaplace``) a log determinant of its posterior
    precision that costs O(D) per prior precision: the eigenvalues :math:`\lambda_i` of the GGN ``la.H``,
    computed once, give :math:`\log\det(h H + \delta I) = \sum_i \log(h \lambda_i + \delta)` for a scalar
    prior precision :math:`\delta` (h: laplace-torch's ``_H_factor``, one over the noise variance times the
    temperature). laplace-torch's own property factorises the D x D matrix at every value its marginal-
    likelihood search tries (100 Adam steps): about 100 times the eigendecomposition. The same number up to
    round-off (the GGN's eigenvalues clamped at 0, their round-off below it); a layer-wise or diagonal prior
    precision falls back to laplace-torch's. Changes ``la``'s class to a subclass of its own."""
    la._pyro_fa_eigenvalues = torch.linalg.eigvalsh(la.H).clamp_min(0)
    la.__class__ = _eigen_log_det_class(type(la))


@functools.lru_cache(maxsize=None)
def _eigen_log_det_class(base: type) -> type:
    """The subclass of ``base`` whose log determinant reads the instance's cached eigenvalues; one per base, with
    a ``_key`` of its own, so that ``laplace.Laplace`` (which maps the ``_key`` of every subclass of its Laplace
    classes to a class) never builds it in place of ``base``."""

    class EigenLogDetLaplace(base):
        _key = ("pyro_fa", f"eigen-log-det-{base.__name__}")

        @property
        def log_det_posterior_precision(self) -> Tensor:
            delta = self.prior_precision
            if delta.numel() != 1:
                return super().log_det_posterior_precision
            return (self._H_factor * self._pyro_fa_eigenvalues + delta.reshape(())).log().sum()

    EigenLogDetLaplace.__name__ = EigenLogDetLaplace.__qualname__ = f"EigenLogDet{base.__name__}"
    return EigenLogDetLaplace


def _laplace_predict(la, x: Tensor, *, device, dtype, batch_size: int, link_approx: str, n_samples: int) -> Tensor:
    """laplace-torch's GLM predictive of ``x`` in batches, (N, C)."""
    x = x.to(device, dtype)
    probs = [la(x[i : i + batch_size], pred_type="glm", link_approx=link_approx, n_samples=n_samples).detach()
             for i in range(0, x.shape[0], batch_size)]
    return torch.cat(probs) if probs else torch.empty(0, la.n_outputs, device=device, dtype=dtype)


def _tempered_gridsearch(la, predict, x_va: Tensor, y_va: Tensor, log10_range: Tuple[float, float],
                         grid_size: int = 100) -> dict:
    """The prior precision of laplace-torch's grid (``grid_size`` values log-spaced over ``log10_range``, as its
    ``optimize_prior_precision(method="gridsearch")``) whose validation NLL after a temperature fitted there is
    least; set on ``la``. A value where the predictive fails (a linear-algebra error, as laplace-torch's search
    treats it) or is not finite scores +inf."""
    from pyro_fa.predictive import fit_temperature

    y = y_va.to(torch.long)
    best = (math.inf, None, None)
    for value in torch.logspace(log10_range[0], log10_range[1], grid_size):
        la.prior_precision = value
        try:
            z = predict(x_va).to(torch.float64).clamp_min(1e-300).log().cpu()
        except RuntimeError as err:  # torch.linalg.LinAlgError is one
            if isinstance(err, torch.linalg.LinAlgError) or "not positive definite" in str(err):
                continue
            raise
        if not bool(torch.isfinite(z).all()):
            continue
        t = fit_temperature(z, y)
        nll = float(-(z / t).log_softmax(-1).gather(1, y[:, None]).mean())
        if nll < best[0]:
            best = (nll, value, t)
    if best[1] is None:
        raise ValueError("laplace_probs: the tempered grid search found no prior precision whose validation "
                         "predictive is finite.")
    la.prior_precision = best[1]
    return {"prior_precision": la.prior_precision.detach().cpu().reshape(-1).tolist(), "temperature": best[2],
            "val_nll_tempered": best[0]}


def _ivon_train(ivon, make_net, x, y, epochs, batch_size, lr, seed, hess_init, beta2, weight_decay):
    """Train ``make_net()`` from scratch with IVON; returns (net, optimizer)."""
    torch.manual_seed(seed)
    net = make_net()
    device, dtype = _device_dtype(net)
    x, y = x.to(device, dtype), y.to(device)
    opt = ivon.IVON(
        net.parameters(), lr=lr, ess=float(x.shape[0]), hess_init=hess_init,
        beta1=0.9, beta2=beta2, weight_decay=weight_decay, mc_samples=1,
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    loader = _index_loader(x.shape[0], batch_size, seed)
    net.train()
    for _ in range(epochs):
        for idx in loader:
            idx = idx.to(device)
            xb, yb = x[idx], y[idx]
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(net(xb), yb).backward()
            opt.step()
        sched.step()
    net.eval()
    return net, opt


@torch.no_grad()
def _ivon_predict(net, opt, inputs, num_samples) -> List[Tensor]:
    device, dtype = _device_dtype(net)
    inputs = [x.to(device, dtype) for x in inputs]
    draws = [[] for _ in inputs]
    for _ in range(num_samples):
        with opt.sampled_params():
            for k, x in enumerate(inputs):
                logits = torch.cat([net(x[i : i + _EVAL_BATCH]) for i in range(0, x.shape[0], _EVAL_BATCH)])
                draws[k].append(F.softmax(logits, dim=-1))
    return [torch.stack(d) for d in draws]


def ivon_probs(
    make_net: Callable[[], nn.Module],
    train_xy: Tuple[Tensor, Tensor],
    val_xy: Optional[Tuple[Tensor, Tensor]],
    test_inputs: Sequence[Tensor],
    epochs: int,
    batch_size: int,
    seed: int = 0,
    num_samples: int = 30,
    lr: Optional[float] = None,
    *,
    lr_grid: Sequence[float] = IVON_LR_GRID,
    hess_init: float = 0.5,
    hess_init_grid: Optional[Sequence[float]] = None,
    beta2: float = 0.99999,
    weight_decay: float = 1e-4,
    info: Optional[dict] = None,
) -> List[Tensor]:
    r"""Predictive samples of a network trained from scratch by IVON (ivon-opt).

    IVON learns a diagonal Gaussian :math:`q(\theta) = N(m, \operatorname{diag}(1 / (\lambda (h + \delta))))`
    by natural-gradient variational learning, with :math:`\lambda` = ``ess`` the
    number of training points, :math:`h` a running Hessian estimate (initial value
    ``hess_init``, decay ``beta2``) and :math:`\delta` = ``weight_decay``; the
    predictive is averaged over ``num_samples`` weight draws.

    Parameters
    ----------
    make_net : callable
        Returns a fresh network (N, ...) -> logits (N, C); called once per learning
        rate tried, under ``torch.manual_seed(seed)``.
    train_xy : (Tensor of shape (N, ...), Tensor of shape (N,))
        Training inputs and integer labels.
    val_xy : (Tensor, Tensor) or None
        Validation part, used to choose ``lr`` from ``lr_grid`` when ``lr`` is None
        (the validation NLL of the model average of ``num_samples`` draws).
    test_inputs : list of Tensor of shape (N_i, ...)
        Inputs to predict.
    epochs, batch_size : int
        Training length (a cosine-annealed learning rate over ``epochs``) and mini-batch size.
    seed : int, default 0
        Seeds initialisation, batch order and weight draws (torch's global state is restored after the call).
    num_samples : int, default 30
        Weight draws per prediction.
    lr : float, optional
        IVON's learning rate; None chooses it on ``val_xy`` (0.1, the README's value, if ``val_xy`` is None).
    lr_grid : sequence of float, default (0.05, 0.1, 0.2)
        Learning rates tried when ``lr`` is None.
    hess_init, beta2, weight_decay : float
        IVON's initial Hessian, Hessian decay and weight decay (the authors' small-network values).
    hess_init_grid : sequence of float, optional
        Initial Hessians tried (with every rate tried) when ``val_xy`` is given; default ``(hess_init,)``.
    info : dict, optional
        If given, receives ``"lr"`` and ``"hess_init"`` (the values used) and ``"val_nll"``
        ({"(rate, hess_init)": NLL} of those tried).

    Returns
    -------
    list of Tensor of shape (num_samples, N_i, C)
        Softmax probabilities of each weight draw, one tensor per entry of ``test_inputs``.

    Raises
    ------
    ImportError
        ivon-opt does not import here.
    TypeError, ValueError
        Malformed data or options.

    Notes
    -----
    Cost: ``epochs`` passes over the training data per learning rate tried (a little
    more than SGD: one extra vector of the size of the weights), then
    ``num_samples`` forward passes per input.

    References
    ----------
    Shen, Y., Daheim, N., Cong, B., Nickl, P., Marconi, G. M., Bazan, C., Yokota, R., Gurevych, I.,
    Cremers, D., Khan, M. E. & Möllenhoff, T. (2024). Variational learning is effective for large
    deep networks. ICML.
    """
    caller = "ivon_probs"
    ivon = _require("ivon", caller)
    x_tr, y_tr = _check_xy(caller, "train_xy", train_xy)
    inputs = _check_inputs(caller, test_inputs)
    _check_positive_int(caller, "epochs", epochs)
    _check_positive_int(caller, "batch_size", batch_size)
    _check_positive_int(caller, "num_samples", num_samples)
    if lr is not None:
        rates = [lr]
    elif val_xy is None:
        rates = [0.1]
    else:
        rates = list(lr_grid)
    hessians = [hess_init] if hess_init_grid is None or val_xy is None else list(hess_init_grid)
    for name, values in (("lr and lr_grid", rates), ("hess_init and hess_init_grid", hessians)):
        if not values or not all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for r in values):
            raise ValueError(f"{caller}: {name} must hold finite numbers > 0, got lr={lr!r}, lr_grid={lr_grid!r}, "
                             f"hess_init={hess_init!r}, hess_init_grid={hess_init_grid!r}.")
    grid = [(r, h) for r in rates for h in hessians]

    train = functools.partial(
        _ivon_train, ivon, make_net, x_tr, y_tr, epochs, batch_size,
        seed=seed, beta2=beta2, weight_decay=weight_decay,
    )
    fork = [torch.device("cuda")] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=fork):
        if len(grid) == 1:
            net, opt = train(lr=grid[0][0], hess_init=grid[0][1])
            best_setting, val_nll = grid[0], {}
        else:
            x_va, y_va = _check_xy(caller, "val_xy", val_xy)
            best, val_nll = None, {}
            for setting in grid:
                net, opt = train(lr=setting[0], hess_init=setting[1])
                torch.manual_seed(seed)
                (p_val,) = _ivon_predict(net, opt, [x_va], num_samples)
                p_bma = p_val.mean(0).gather(1, y_va.to(p_val.device)[:, None]).squeeze(1)
                val_nll[repr(setting)] = float(-p_bma.clamp_min(torch.finfo(p_bma.dtype).tiny).log().mean())
                if best is None or val_nll[repr(setting)] < val_nll[repr(best[0])]:
                    best = (setting, net, opt)
            best_setting, net, opt = best
        torch.manual_seed(seed + 1)
        out = _ivon_predict(net, opt, inputs, num_samples)
    if info is not None:
        info["lr"], info["hess_init"] = best_setting
        info["val_nll"] = val_nll
    return out
