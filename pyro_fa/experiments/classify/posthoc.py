r"""Rows of the ``pyro-fa classify`` benchmark built on a trained network or on other rows: the Laplace
approximations (ours, :class:`pyro_fa.laplace.FactorLaplace`, and laplace-torch's), IVON, and the "+T" rows
(a temperature fitted on the validation part, Guo et al. 2017).

The recipes are in :mod:`pyro_fa.experiments.classify.methods`; laplace-torch and IVON run from their own
packages (:mod:`pyro_fa.experiments.classify.baselines`).
"""
from __future__ import annotations

import time
from typing import Dict

import torch
from torch import Tensor

__all__ = ["TEMPERED", "PEERS", "peers_available", "tempered_rows", "run_factor_laplace", "run_peers"]

#: rows that also get a "+T" row: the same predictive with a temperature fitted on validation (Guo et al. 2017)
TEMPERED = ("map", "ensemble", "dropout", "swa", "swag-em", "swag-em-glm", "multiswag", "multiswag-glm", "vifa",
            "factor-laplace", "factor-laplace-grid", "laplace", "laplace-grid", "laplace-diag", "ivon")
#: peer methods run from their own packages, and the package each needs
PEERS = {"laplace": "laplace", "laplace-grid": "laplace", "laplace-diag": "laplace", "ivon": "ivon"}


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
    """FactorLaplace (ours) on the MAP network: all weights, GLM probit; marglik and validation grid search.

    With ``budget.temperature`` the grid-search row also gets its "+T" row's own prior precision, chosen by the
    validation NLL after a temperature fitted at each grid value (``optimize_prior_precision(..., temperature=
    True)``): ``probs_T``, ``extra_T``, ``seconds_T``, which :func:`tempered_rows` honours. laplace-torch's grid
    row gets the same (:func:`run_peers`)."""
    from torch.utils.data import DataLoader, TensorDataset

    from pyro_fa.laplace import FactorLaplace

    rows = [m for m in ("factor-laplace", "factor-laplace-grid") if m in want]
    if not rows:
        return
    t0 = time.perf_counter()
    was_training = map_net.training
    map_net.eval()
    la = FactorLaplace(map_net, "classification", rank=budget.laplace_rank, seed=seed)
    la.fit(DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=256))
    t_fit = time.perf_counter() - t0
    grid = [10.0 ** (k / 2) for k in range(-8, 17)]  # 1e-4 ... 1e8: up to the MAP limit
    val = [(data.x_val, data.y_val)]

    def predict():
        with torch.no_grad():
            return [la.predict_proba(x, pred_type="glm", link_approx="probit").detach() for x in inputs]

    for name in rows:
        t0 = time.perf_counter()
        if name == "factor-laplace":
            la.optimize_prior_precision("marglik")
        else:
            la.optimize_prior_precision("gridsearch", val_loader=val, grid=grid)
        raw = float(la.prior_precision.reshape(-1)[0])
        out[name] = {"probs": predict(), "seconds": t_map_one + t_fit + time.perf_counter() - t0,
                     "extra": {"prior_precision": raw}}
        if name == "factor-laplace-grid" and budget.temperature:
            # the "+T" row's own choice: the precision of least validation NLL after a temperature fitted at it
            t0 = time.perf_counter()
            joint = float(la.optimize_prior_precision("gridsearch", val_loader=val, grid=grid, temperature=True)
                          .reshape(-1)[0])
            out[name]["probs_T"] = predict() if joint != raw else out[name]["probs"]
            out[name]["extra_T"] = {"prior_precision": joint, "tempered_prior_choice": True}
            out[name]["seconds_T"] = out[name]["seconds"] + time.perf_counter() - t0
    map_net.train(was_training)


def run_peers(want, make, map_net, data, budget, seed, inputs, tick, out, t_map_one) -> None:
    peers, _ = _peers()
    train_xy, val_xy = (data.x_train, data.y_train), (data.x_val, data.y_val)
    laplace_rows = {"laplace": dict(prior_method="marglik"), "laplace-grid": dict(prior_method="gridsearch"),
                    "laplace-diag": dict(prior_method="marglik", subset_of_weights="all", hessian_structure="diag")}
    for name, options in laplace_rows.items():
        if name in want:
            t0 = time.perf_counter()
            info: dict = {}
            tempered = {} if name == "laplace-grid" and budget.temperature else None
            probs = peers.laplace_probs(map_net, train_xy, val_xy, inputs, seed, info=info, tempered=tempered,
                                        **options)
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
