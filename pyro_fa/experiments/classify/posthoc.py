r"""Rows of the ``pyro-fa classify`` benchmark built on a trained network or on other rows: the Laplace
approximations (ours, :class:`pyro_fa.laplace.FactorLaplace`, and laplace-torch's), IVON, and the "+T" rows
(a temperature fitted on the validation part, Guo et al. 2017).

The recipes are in :mod:`pyro_fa.experiments.classify.methods`; laplace-torch and IVON run from their own
packages (:mod:`pyro_fa.experiments.classify.baselines`).
"""
from __future__ import annotations

import ctypes
import gc
import time
import warnings
from typing import Dict, Optional

import torch
from torch import Tensor

__all__ = ["TEMPERED", "PEERS", "FULL_MAX_WEIGHTS", "ResidentPeak", "peers_available", "tempered_rows",
           "run_factor_laplace", "run_peers"]

#: rows that also get a "+T" row: the same predictive with a temperature fitted on validation (Guo et al. 2017)
TEMPERED = ("map", "ensemble", "dropout", "swa", "swag-em", "swag-em-glm", "multiswag", "multiswag-glm", "vifa",
            "factor-laplace", "factor-laplace-grid", "factor-laplace-lin", "laplace", "laplace-grid", "laplace-diag",
            "laplace-kron", "laplace-full", "ivon", "factor-ivon", "factor-ivon-ensemble")
#: peer methods run from their own packages, and the package each needs
PEERS = {"laplace": "laplace", "laplace-grid": "laplace", "laplace-diag": "laplace", "laplace-kron": "laplace",
         "laplace-full": "laplace", "ivon": "ivon"}
#: the most weights for which "laplace-full" runs: its D x D precision is eigendecomposed (O(D^3)); the digits
#: MLP (7 510 weights) takes it, the MNIST-1D MLP (15 210) would take about 8x as long on one thread
FULL_MAX_WEIGHTS = 8000
#: FactorLaplace's rows: their options of ``optimize_prior_precision`` (the grid search also gets the validation
#: part and :data:`FACTOR_LAPLACE_GRID`)
FACTOR_LAPLACE_ROWS = {
    "factor-laplace": dict(method="marglik"),
    "factor-laplace-grid": dict(method="gridsearch"),
    "factor-laplace-lin": dict(method="marglik", mode="linearized"),
}
#: FactorLaplace's validation grid: 1e-4 ... 1e8, up to the MAP limit
FACTOR_LAPLACE_GRID = tuple(10.0 ** (k / 2) for k in range(-8, 17))
#: laplace-torch's rows: (their options of :func:`~pyro_fa.experiments.classify.baselines.laplace_probs`)
LAPLACE_ROWS = {
    "laplace": dict(prior_method="marglik"),
    "laplace-grid": dict(prior_method="gridsearch"),
    "laplace-diag": dict(prior_method="marglik", subset_of_weights="all", hessian_structure="diag"),
    "laplace-kron": dict(prior_method="marglik", subset_of_weights="all", hessian_structure="kron"),
    "laplace-full": dict(prior_method="marglik", subset_of_weights="all", hessian_structure="full"),
}
_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _status_kib(field: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), or None where it cannot be read."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_high_water_mark() -> bool:
    """Set the process's resident high-water mark (``VmHWM``) to its resident size now (Linux >= 4.0:
    ``echo 5 > /proc/self/clear_refs``). False where that is refused or absent."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _release_free_heap() -> None:
    """Collect garbage and hand the C heap's free pages back (glibc ``malloc_trim``), so that what a fit
    allocates shows as resident growth rather than landing in pages freed earlier."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ResidentPeak:
    """The resident memory a piece of work adds at its peak: the process's resident high-water mark after it
    minus the resident size before it.

    Made just before the work: frees what it can (:func:`gc.collect`, ``malloc_trim``), reads ``VmRSS`` and
    resets ``VmHWM`` to it through ``/proc/self/clear_refs``. :meth:`added_mib` reads ``VmHWM`` then. Where
    the reset is refused (not Linux, a restricted ``/proc``) every reading is None, never a high-water mark
    left over from earlier work.

    Examples
    --------
    >>> peak = ResidentPeak()
    >>> block = bytearray(64 << 20)  # 64 MiB, zeroed: resident
    >>> peak.added_mib() is None or peak.added_mib() >= 48
    True
    """

    def __init__(self) -> None:
        _release_free_heap()
        self.base_kib = _status_kib("VmRSS")
        self.ok = self.base_kib is not None and _reset_high_water_mark()

    def added_mib(self, reset: bool = False) -> Optional[float]:
        """MiB of resident memory added at the peak since the start (or the last ``reset=True``), relative to
        the resident size at the start; None where the high-water mark cannot be reset or read. With
        ``reset``, the high-water mark is reset after reading (to time the next part on its own)."""
        high = _status_kib("VmHWM") if self.ok else None
        if high is None:
            self.ok = False
            return None
        if reset:
            self.ok = _reset_high_water_mark()
        return max(high - self.base_kib, 0) / 1024.0


def _max_or_none(*values: Optional[float]) -> Optional[float]:
    return None if any(v is None for v in values) else max(values)


def _peers():
    try:
        from pyro_fa.experiments.classify import baselines as peers
    except ImportError:
        return None, {"laplace": False, "ivon": False}
    return peers, peers.available()


def peers_available() -> Dict[str, bool]:
    """Which peer packages (laplace-torch, IVON) can run here: ``{"laplace": bool, "ivon": bool}``."""
    return _peers()[1]


def can_run(method: str, have: Dict[str, bool]) -> bool:
    return method not in PEERS or bool(have.get(PEERS[method]))


def average_log_probs(probs: Tensor) -> Tensor:
    """Log of the model average, (N, C) in float64, from draws (S, N, C) or probabilities (N, C)."""
    return (probs.mean(0) if probs.dim() == 3 else probs).double().clamp_min(1e-300).log()


def tempered_rows(out: Dict[str, dict], y_val: Tensor) -> Dict[str, dict]:
    """``<row>+T`` for each row of :data:`TEMPERED`: its model average's log probabilities divided by the
    temperature of least validation NLL (:func:`pyro_fa.predictive.fit_temperature`). A row with ``probs_T``
    (the SWAG family: its scale chosen by the tempered validation NLL, ``tune_scale(temperature=True)``) is
    tempered at that scale, with the search's details from ``extra_T``."""
    from pyro_fa.predictive import fit_temperature

    rows = {}
    for m in TEMPERED:
        if m not in out:
            continue
        t0 = time.perf_counter()
        source = out[m].get("probs_T", out[m]["probs"])
        logs = [average_log_probs(p) for p in source]
        temperature = fit_temperature(logs[0], y_val)
        probs = [(z / temperature).softmax(-1).to(source[0].dtype) for z in logs[1:]]
        rows[f"{m}+T"] = {"probs": probs,
                          "seconds": out[m].get("seconds_T", out[m]["seconds"]) + time.perf_counter() - t0,
                          "extra": {**out[m].get("extra", {}), **out[m].get("extra_T", {}),
                                    "temperature": temperature}}
    return rows


def run_factor_laplace(want, map_net, data, budget, seed, inputs, out, t_map_one) -> None:
    """FactorLaplace (ours) on the MAP network: all weights, GLM probit; marglik (at the MAP, or the linearised
    model's evidence at its own mode) and validation grid search.

    With ``budget.temperature`` the grid-search row also gets its "+T" row's own prior precision, chosen by the
    validation NLL after a temperature fitted at each grid value (``optimize_prior_precision(..., temperature=
    True)``): ``probs_T``, ``extra_T``, ``seconds_T``, which :func:`tempered_rows` honours. laplace-torch's grid
    row gets the same (:func:`run_peers`)."""
    from torch.utils.data import DataLoader, TensorDataset

    from pyro_fa.laplace import FactorLaplace

    rows = [m for m in FACTOR_LAPLACE_ROWS if m in want]
    if not rows:
        return
    t0 = time.perf_counter()
    was_training = map_net.training
    map_net.eval()
    peak = ResidentPeak()
    la = FactorLaplace(map_net, "classification", rank=budget.laplace_rank, seed=seed)
    la.fit(DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=256))
    t_fit = time.perf_counter() - t0
    fit_mib = peak.added_mib(reset=True)
    grid = list(FACTOR_LAPLACE_GRID)
    val = [(data.x_val, data.y_val)]
    start = la.prior_precision.clone()  # where every row's choice starts, whatever the rows before it chose

    def predict():
        with torch.no_grad():
            return [la.predict_proba(x, pred_type="glm", link_approx="probit").detach() for x in inputs]

    for name in rows:
        t0 = time.perf_counter()
        options = dict(FACTOR_LAPLACE_ROWS[name])
        if options["method"] == "gridsearch":
            options.update(val_loader=val, grid=grid)
        la.prior_precision = start.clone()
        la.optimize_prior_precision(**options)
        raw = float(la.prior_precision.reshape(-1)[0])
        probs = predict()
        # the row's peak: the fit's, or that of its prior-precision choice and predictions, if higher
        out[name] = {"probs": probs, "seconds": t_map_one + t_fit + time.perf_counter() - t0,
                     "extra": {"prior_precision": raw,
                               "fit_peak_mib": _max_or_none(fit_mib, peak.added_mib(reset=True))}}
        if name == "factor-laplace-grid" and budget.temperature:
            # the "+T" row's own choice: the precision of least validation NLL after a temperature fitted at it
            t0 = time.perf_counter()
            joint = float(la.optimize_prior_precision("gridsearch", val_loader=val, grid=grid, temperature=True)
                          .reshape(-1)[0])
            out[name]["probs_T"] = predict() if joint != raw else out[name]["probs"]
            out[name]["extra_T"] = {"prior_precision": joint, "tempered_prior_choice": True, "fit_peak_mib":
                                    _max_or_none(out[name]["extra"]["fit_peak_mib"], peak.added_mib(reset=True))}
            out[name]["seconds_T"] = out[name]["seconds"] + time.perf_counter() - t0
    map_net.train(was_training)


def run_peers(want, make, map_net, data, budget, seed, inputs, tick, out, t_map_one) -> None:
    peers, _ = _peers()
    train_xy, val_xy = (data.x_train, data.y_train), (data.x_val, data.y_val)
    for name, options in LAPLACE_ROWS.items():
        if name not in want:
            continue
        n_weights = sum(p.numel() for p in map_net.parameters())  # there is a MAP network whenever a Laplace row runs
        if name == "laplace-full" and n_weights > FULL_MAX_WEIGHTS:
            warnings.warn(f"pyro-fa classify: laplace-full skipped: the network has {n_weights} weights, more "
                          f"than {FULL_MAX_WEIGHTS} (FULL_MAX_WEIGHTS), for which laplace-torch's full GGN "
                          f"({n_weights} x {n_weights}, {4 * n_weights ** 2 / 2 ** 20:.0f} MiB in float32) and its "
                          "eigendecomposition, O(D^3), take too long on one thread.", stacklevel=2)
            continue
        t0 = time.perf_counter()
        info: dict = {}
        tempered = {} if name == "laplace-grid" and budget.temperature else None
        peak = ResidentPeak()  # laplace-torch's fit, prior precision and predictions: one call
        try:
            probs = peers.laplace_probs(map_net, train_xy, val_xy, inputs, seed, info=info, tempered=tempered,
                                        **options)
        except NotImplementedError as exc:  # a layer its curvature backend does not support (e.g. KFAC of Conv1d)
            warnings.warn(f"pyro-fa classify: {name} skipped: laplace-torch cannot fit it on this network "
                          f"({type(exc).__name__}: {exc})", stacklevel=2)
            continue
        info["fit_peak_mib"] = peak.added_mib()
        seconds = t_map_one + time.perf_counter() - t0
        out[name] = {"probs": [p.detach() for p in probs], "seconds": seconds, "extra": info}
        if tempered:  # the "+T" row's own choice, as FactorLaplace's above
            out[name]["seconds"] = seconds - tempered["seconds"]
            out[name].update(probs_T=[p.detach() for p in tempered["probs"]], seconds_T=seconds,
                             extra_T={"prior_precision": tempered["prior_precision"],
                                      "tempered_prior_choice": True})
    if "ivon" in want:
        t0 = time.perf_counter()
        info = {}
        samples = peers.ivon_probs(make, train_xy, val_xy, inputs, budget.epochs, budget.batch_size, seed,
                                   num_samples=budget.samples, lr_grid=budget.ivon_lrs,
                                   hess_init_grid=budget.ivon_hess_inits, info=info)
        tick(budget.epochs * len(budget.ivon_lrs) * len(budget.ivon_hess_inits))
        out["ivon"] = {"probs": [s.detach() for s in samples], "seconds": time.perf_counter() - t0, "extra": info}
