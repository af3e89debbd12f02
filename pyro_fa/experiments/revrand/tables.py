r"""The three tables of ``pyro-fa revrand``: data, folds, and every method run on the same folds.

Each runner returns a record ``{"dataset", "protocol", "n", "methods": {...}}`` with per-fold (or
per-subset) metrics, wall times and the hyperparameters each fit chose; the metrics come from
:mod:`pyro_fa.experiments.revrand.report`. Everything is chosen on training data only.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from pyro_fa.experiments.revrand import baselines as peers
from pyro_fa.experiments.revrand import report as rep
from pyro_fa.experiments.revrand.models import fit_glm, fit_slm, make_basis, median_distance, timed


def _standardise(train: Tensor, test: Tensor):
    """Both parts standardised with the training part's mean and standard deviation (``ddof=0``; constant columns 1)."""
    mean, std = train.mean(0), train.std(0, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return (train - mean) / std, (test - mean) / std


def _np(t: Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _record(names):
    return {name: {"seconds": [], "info": []} for name in names}


def _add(rec: dict, name: str, seconds: float, info=None, **metrics) -> None:
    r = rec[name]
    r["seconds"].append(seconds)
    r["info"].append(info)
    for k, v in metrics.items():
        r.setdefault(k, []).append(None if v is None else float(v))


# ----------------------------------------------------------------------------- Table 2: Boston housing

def run_boston(budget, seed: int, device, data_dir=None, tick: Callable[[], None] = lambda: None) -> dict:
    """Table 2: Boston housing, ``budget.folds``-fold CV (shuffled, ``seed``); R² and MSLL on each held-out fold."""
    from sklearn.model_selection import KFold

    from pyro_fa.datasets import load_uci_raw

    x_all, y_all = load_uci_raw("boston", data_dir=data_dir, dtype=torch.float64)
    methods = _record(("slm", "glm", "gp", "rf", "svm"))
    folds = KFold(budget.folds, shuffle=True, random_state=seed).split(_np(x_all))
    for k, (tr, te) in enumerate(folds):
        tr, te = torch.as_tensor(tr), torch.as_tensor(te)
        x, x_test = _standardise(x_all[tr], x_all[te])
        y, y_test = _standardise(y_all[tr].unsqueeze(-1), y_all[te].unsqueeze(-1))
        y, y_test = y.squeeze(-1), y_test.squeeze(-1)  # standardised: training mean 0, variance 1
        xd, yd, xtd = x.to(device), y.to(device), x_test.to(device)
        fold_seed = seed * 1000 + k

        (slm, info), sec = timed(fit_slm, xd, yd, n_components=budget.slm_components, n_starts=budget.slm_starts,
                                 n_iter=budget.slm_iter, seed=fold_seed)
        mean, std = slm.predict(xtd, return_std=True)
        mean, var = mean.cpu(), std.cpu() ** 2
        _add(methods, "slm", sec, info, r2=rep.r2_score(mean, y_test),
             msll=rep.msll(rep.gaussian_log_density(y_test, mean, var), y_test, 0.0, 1.0))
        tick()

        xf, yf, xtf = (t.to(budget.glm_dtype) for t in (xd, yd, xtd))
        (glm, info), sec = timed(fit_glm, xf, yf, "gaussian", n_components=budget.glm_components,
                                 priors=budget.priors, rank=budget.rank, n_steps=budget.steps, lr=budget.lr,
                                 batch_size=None, seed=fold_seed, ard=True, linear=True,
                                 particles=budget.particles, tick=tick)
        mean = glm.predict(xtf).double().cpu()
        log_p = glm.log_predictive(xtf, y_test.to(device=device, dtype=budget.glm_dtype)).double().cpu()
        _add(methods, "glm", sec, info, r2=rep.r2_score(mean, y_test), msll=rep.msll(log_p, y_test, 0.0, 1.0))

        xn, yn, xtn = _np(x), _np(y), _np(x_test)
        (mean, var, kernel), sec = timed(peers.gp_regressor, xn, yn, xtn, seed=fold_seed, ard=True, linear=True,
                                         restarts=budget.gp_restarts, maxiter=budget.gp_maxiter)
        _add(methods, "gp", sec, {"kernel": kernel}, r2=rep.r2_score(mean, y_test),
             msll=rep.msll(rep.gaussian_log_density(y_test, mean, var), y_test, 0.0, 1.0))
        tick()
        mean, sec = timed(peers.random_forest_regressor, xn, yn, xtn, seed=fold_seed)
        _add(methods, "rf", sec, None, r2=rep.r2_score(mean, y_test), msll=None)
        tick()
        (mean, params), sec = timed(peers.svr, xn, yn, xtn, seed=fold_seed)
        _add(methods, "svm", sec, params, r2=rep.r2_score(mean, y_test), msll=None)
        tick()
    return {"dataset": "boston", "n": {"rows": int(x_all.shape[0]), "features": int(x_all.shape[1]),
                                       "folds": budget.folds}, "methods": methods}


# ----------------------------------------------------------------------------- Table 3: digits 3 vs 5

def load_digits_35():
    """scikit-learn's 8×8 digits '3' (label 0) and '5' (label 1): inputs (365, 64) float64 and labels (365,)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    keep = (bunch.target == 3) | (bunch.target == 5)
    x = torch.as_tensor(bunch.data[keep], dtype=torch.float64)
    y = torch.as_tensor(bunch.target[keep] == 5, dtype=torch.float64)
    return x, y


def _log_loss(p: Tensor, y: Tensor) -> float:
    p = p.double().clamp(1e-12, 1 - 1e-12)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def run_digits(budget, seed: int, device, tick: Callable[[], None] = lambda: None) -> dict:
    """Table 3: digits 3 vs 5, stratified ``budget.folds``-fold CV; log-loss and error % of the pooled predictions."""
    from sklearn.model_selection import StratifiedKFold

    x_all, y_all = load_digits_35()
    names = ("glm", "logistic", "svm", "gp", "rf")
    methods = _record(names)
    probs = {name: torch.full_like(y_all, float("nan")) for name in names}
    folds = StratifiedKFold(budget.folds, shuffle=True, random_state=seed).split(_np(x_all), _np(y_all))
    for k, (tr, te) in enumerate(folds):
        tr, te = torch.as_tensor(tr), torch.as_tensor(te)
        x, x_test = _standardise(x_all[tr], x_all[te])
        y, y_test = y_all[tr], y_all[te]
        fold_seed = seed * 1000 + k
        xd, xtd = x.to(device), x_test.to(device)

        def done(name, p, sec, info=None):
            p = torch.as_tensor(np.asarray(p), dtype=torch.float64).reshape(-1)
            probs[name][te] = p
            _add(methods, name, sec, info, fold_log_loss=_log_loss(p, y_test),
                 fold_error_pct=100 * float(((p > 0.5).double() != y_test).double().mean()))

        xf, xtf = xd.to(budget.glm_dtype), xtd.to(budget.glm_dtype)
        (glm, info), sec = timed(fit_glm, xf, y.to(device=device, dtype=budget.glm_dtype), "bernoulli",
                                 n_components=budget.digits_components, priors=budget.digits_priors, rank=budget.rank,
                                 n_steps=budget.digits_steps, lr=budget.lr, batch_size=None, seed=fold_seed,
                                 ard=False, linear=False, particles=budget.particles, tick=tick)
        done("glm", glm.predict_proba(xtf, n_samples=budget.n_samples)[:, 1].double().cpu(), sec, info)

        def logistic():
            basis = make_basis(x.shape[1], budget.digits_components, median_distance(x, seed=fold_seed), ard=False,
                               linear=False, seed=fold_seed, like=x, learn=False)
            with torch.no_grad():
                return peers.logistic_regression(_np(basis(x)), _np(y), _np(basis(x_test)), seed=fold_seed)

        (p, c), sec = timed(logistic)
        done("logistic", p, sec, {"C": c})
        tick()
        xn, yn, xtn = _np(x), _np(y).astype(int), _np(x_test)
        (p, params), sec = timed(peers.svc, xn, yn, xtn, seed=fold_seed)
        done("svm", p, sec, params)
        tick()
        (p, kernel), sec = timed(peers.gp_classifier, xn, yn, xtn, seed=fold_seed, restarts=budget.gp_restarts,
                                 maxiter=budget.gp_maxiter)
        done("gp", p, sec, {"kernel": kernel})
        tick()
        p, sec = timed(peers.random_forest_classifier, xn, yn, xtn, seed=fold_seed)
        done("rf", p, sec)
        tick()
    for name in names:
        p = probs[name]
        methods[name]["log_loss"] = _log_loss(p, y_all)
        methods[name]["error_pct"] = 100 * float(((p > 0.5).double() != y_all).double().mean())
    return {"dataset": "digits-3-vs-5", "n": {"rows": int(x_all.shape[0]), "features": int(x_all.shape[1]),
                                              "folds": budget.folds, "fives": int(y_all.sum())}, "methods": methods}


# ----------------------------------------------------------------------------- Table 4: protein

def run_large(budget, seed: int, device, data_dir=None, tick: Callable[[], None] = lambda: None) -> dict:
    """Table 4: UCI protein, standard split 0; SMSE and MSLL of the GLM per number of components and of an exact
    GP on a random training subset of each size (the SD row)."""
    from pyro_fa.datasets import load_uci

    data = load_uci("protein", split=0, data_dir=data_dir, dtype=torch.float64)
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    g = torch.Generator().manual_seed(seed)
    if budget.large_rows is not None and budget.large_rows < x.shape[0]:
        keep = torch.randperm(x.shape[0], generator=g)[:budget.large_rows]
        x, y = x[keep], y[keep]
    if budget.large_test_rows is not None and budget.large_test_rows < x_test.shape[0]:
        keep = torch.randperm(x_test.shape[0], generator=g)[:budget.large_test_rows]
        x_test, y_test = x_test[keep], y_test[keep]
    train_mean, train_var = float(y.mean()), float(y.var(unbiased=False))
    xd, yd, xtd, ytd = (t.to(device=device, dtype=budget.glm_dtype) for t in (x, y, x_test, y_test))
    methods = {"glm": {}, "gp": {}}
    for size in budget.components:
        key = str(size)
        methods["glm"][key] = _record(["glm"])["glm"]
        (glm, info), sec = timed(fit_glm, xd, yd, "gaussian", n_components=size, priors=budget.large_priors,
                                 rank=budget.rank, n_steps=budget.large_steps, lr=budget.lr,
                                 batch_size=budget.large_batch, seed=seed * 1000 + size, ard=True, linear=False,
                                 particles=budget.particles, tick=tick)
        mean = glm.predict(xtd).double().cpu()
        log_p = glm.log_predictive(xtd, ytd).double().cpu()
        _add(methods["glm"], key, sec, info, smse=rep.smse(mean, y_test),
             msll=rep.msll(log_p, y_test, train_mean, train_var))
        methods["gp"][key] = _record(["gp"])["gp"]
        for r in range(budget.sd_subsets):
            sub = torch.randperm(x.shape[0], generator=g)[:size]
            (mean, var, kernel), sec = timed(peers.gp_regressor, _np(x[sub]), _np(y[sub]), _np(x_test),
                                             seed=seed * 1000 + size + r, ard=True, linear=False,
                                             restarts=budget.gp_restarts, maxiter=budget.gp_maxiter)
            _add(methods["gp"], key, sec, {"kernel": kernel}, smse=rep.smse(mean, y_test),
                 msll=rep.msll(rep.gaussian_log_density(y_test, mean, var), y_test, train_mean, train_var))
            tick()
    return {"dataset": "protein", "n": {"train": int(x.shape[0]), "test": int(x_test.shape[0]),
                                        "features": int(x.shape[1]), "split": 0}, "methods": methods}
