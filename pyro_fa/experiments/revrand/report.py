r"""Metrics, the report's numbers, tables and bar checks of ``pyro-fa revrand``.

The numbers are those of Steinberg, Tiao, McCalman, Reid & O'Callaghan,
*revrand: technical report*, CSIRO Data61 (Tables 2, 3 and 4); the SD, SR, PP and
BCM rows of its Table 4 are Rasmussen & Williams (2006, Table 8.1) on SARCOS.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from pyro_fa.experiments._io import markdown_table, mean_se

__all__ = ["r2_score", "smse", "msll", "gaussian_log_density", "REPORT_BOSTON", "REPORT_DIGITS",
           "REPORT_SARCOS_GLM", "REPORT_SARCOS_SD", "LABELS"]

_LOG_2PI = math.log(2 * math.pi)

# ----------------------------------------------------------------------------- metrics


def _as_tensor(x) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float64).reshape(-1)


def r2_score(pred_mean, y) -> float:
    r"""Coefficient of determination :math:`1 - \sum (y - \hat y)^2 / \sum (y - \bar y)^2` (test mean :math:`\bar y`).

    Parameters
    ----------
    pred_mean, y : array-like of shape (M,)
    """
    y, pred_mean = _as_tensor(y), _as_tensor(pred_mean)
    return float(1.0 - ((y - pred_mean) ** 2).sum() / ((y - y.mean()) ** 2).sum())


def smse(pred_mean, y) -> float:
    r"""Standardised mean squared error: the test MSE over the variance of the test targets (``ddof=0``).

    Rasmussen & Williams (2006), §2.5: a trivial predictor that outputs the test mean scores 1.

    Parameters
    ----------
    pred_mean, y : array-like of shape (M,)
    """
    y, pred_mean = _as_tensor(y), _as_tensor(pred_mean)
    return float(((y - pred_mean) ** 2).mean() / y.var(unbiased=False))


def gaussian_log_density(y, mean, var) -> Tensor:
    r""":math:`\log N(y \mid \mu, \sigma^2)` per point, a tensor of shape (M,)."""
    y, mean, var = _as_tensor(y), _as_tensor(mean), _as_tensor(var)
    return -0.5 * (_LOG_2PI + var.log() + (y - mean) ** 2 / var)


def msll(log_density, y, train_mean: float, train_var: float) -> float:
    r"""Mean standardised log loss (Rasmussen & Williams 2006, eq. 2.34 and below).

    .. math::

        \mathrm{MSLL} = \frac1M \sum_{i=1}^M \Bigl[-\log p(y_i \mid \mathcal D, x_i)
        + \log N(y_i \mid \bar y_{\mathrm{train}}, s^2_{\mathrm{train}})\Bigr],

    the mean negative log predictive density minus that of the trivial model, a Gaussian with the
    training targets' mean and variance (``ddof=0``). Negative is better than the trivial model; the
    value does not depend on the units of y (as long as all terms are in the same units).

    Parameters
    ----------
    log_density : array-like of shape (M,)
        :math:`\log p(y_i \mid \mathcal D, x_i)` of each test point (for a Gaussian predictive,
        :func:`gaussian_log_density`; for a mixture, its log mean density).
    y : array-like of shape (M,)
        Test targets.
    train_mean, train_var : float
        Mean and variance of the training targets.
    """
    if not train_var > 0:
        raise ValueError(f"msll: train_var must be > 0, got {train_var!r}.")
    log_density, y = _as_tensor(log_density), _as_tensor(y)
    if log_density.shape != y.shape:
        raise ValueError(f"msll: log_density and y must have the same shape, got {tuple(log_density.shape)} "
                         f"and {tuple(y.shape)}.")
    trivial = gaussian_log_density(y, torch.full_like(y, float(train_mean)), torch.full_like(y, float(train_var)))
    return float((trivial - log_density).mean())


# ----------------------------------------------------------------------------- the report's numbers

#: revrand technical report, Table 2 (Boston housing, 5-fold CV): method -> (R², its s.d., MSLL, its s.d.)
REPORT_BOSTON: Dict[str, tuple] = {
    "slm": (0.9018, 0.0134, -1.504, 0.1191),
    "glm": (0.8411, 0.0491, -0.9209, 0.1530),
    "gp": (0.9027, 0.0137, -1.1792, 0.1581),
    "rf": (0.8467, 0.0709, None, None),
    "svm": (0.6295, 0.0863, None, None),
}
#: revrand technical report, Table 3 (USPS digits 3 vs 5): method -> (log-loss, error %)
REPORT_DIGITS: Dict[str, tuple] = {
    "glm": (0.1138, 2.07), "logistic": (0.1734, 3.62), "svm": (0.1003, 6.99), "gp": (0.1405, 2.59),
    "rf": (0.1368, 2.72),
}
#: revrand technical report, Table 4 (SARCOS): the GLM's approximation size -> (SMSE, MSLL)
REPORT_SARCOS_GLM: Dict[int, tuple] = {256: (0.0358, -1.6644), 512: (0.0252, -1.8397), 1024: (0.0207, -1.9341),
                                       2048: (0.0171, -2.0243), 8192: (0.0152, -1.9804)}
#: the same table's SD row (Rasmussen & Williams 2006, Table 8.1): subset size -> (SMSE, MSLL)
REPORT_SARCOS_SD: Dict[int, tuple] = {256: (0.0813, -1.4291), 512: (0.0532, -1.5834), 1024: (0.0398, -1.7149),
                                      2048: (0.0290, -1.8611), 4096: (0.0200, -2.0241)}

LABELS = {
    "slm": "SLM (ours, evidence)", "glm": "GLM (ours, FA guide)", "gp": "GP (scikit-learn)",
    "rf": "Random forest", "svm": "SVM", "logistic": "Logistic (random features)",
}


# ----------------------------------------------------------------------------- tables

def _num(x, digits=4) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _mean_sd(values: Sequence[Optional[float]], digits=4) -> str:
    """``mean (s.d.)`` over folds, the report's format (it prints the s.d. across folds in brackets)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "N/A"
    m = sum(vals) / len(vals)
    if len(vals) == 1:
        return _num(m, digits)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
    return f"{m:.{digits}f} ({sd:.{digits}f})"


def _report_pair(m, s, digits=4) -> str:
    return "N/A" if m is None else f"{m:.{digits}f} ({s:.{digits}f})"


def boston_table(record: dict) -> str:
    """Table 2: per method, our R² and MSLL (mean (s.d.) over folds) beside the report's, and seconds per fold."""
    rows = []
    for name, r in record["methods"].items():
        rep = REPORT_BOSTON.get(name, (None,) * 4)
        rows.append([LABELS.get(name, name), _mean_sd(r["r2"]), _report_pair(rep[0], rep[1]),
                     _mean_sd(r["msll"]), _report_pair(rep[2], rep[3]), _num(mean_se(r["seconds"])[0], 1)])
    return markdown_table(["algorithm", "R² (ours)", "R² (report)", "MSLL (ours)", "MSLL (report)", "s / fold"],
                          rows)


def digits_table(record: dict) -> str:
    """Table 3: per method, our log-loss and error % (pooled over the folds' test parts) beside the report's."""
    rows = []
    for name, r in record["methods"].items():
        rep = REPORT_DIGITS.get(name, (None, None))
        rows.append([LABELS.get(name, name), _num(r["log_loss"]), _num(rep[0]), _num(r["error_pct"], 2),
                     _num(rep[1], 2), _num(sum(r["seconds"]), 1)])
    return markdown_table(["algorithm", "log-loss (ours)", "log-loss (report, USPS)", "error % (ours)",
                           "error % (report, USPS)", "seconds"], rows)


def large_table(record: dict) -> str:
    """Table 4: per method and size, our SMSE and MSLL on the substitute data beside the report's SARCOS numbers."""
    rows = []
    for name, report in (("glm", REPORT_SARCOS_GLM), ("gp", REPORT_SARCOS_SD)):
        label = "GLM (ours, FA guide)" if name == "glm" else "SD: exact GP on a subset (scikit-learn)"
        for size, r in sorted(record["methods"].get(name, {}).items(), key=lambda kv: int(kv[0])):
            rep = report.get(int(size), (None, None))
            rows.append([label, size, _mean_sd(r["smse"]), _mean_sd(r["msll"]), _num(rep[0]), _num(rep[1]),
                         _num(sum(r["seconds"]) / len(r["seconds"]), 1)])
    return markdown_table(["algorithm", "size", "SMSE (ours)", "MSLL (ours)", "SMSE (report, SARCOS)",
                           "MSLL (report, SARCOS)", "seconds"], rows)


# ----------------------------------------------------------------------------- bars

def _avg(values) -> float:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def bar_checks(tables: Dict[str, dict]) -> List[dict]:
    """The bars of ``pyro-fa revrand`` (see its docstring), on the means over folds / subsets."""
    checks = []

    def add(table, check, ok, detail):
        checks.append({"table": table, "check": check, "ok": bool(ok), "detail": detail})

    boston = tables.get("2")
    if boston:
        have = boston["methods"]
        if "slm" in have:
            r2, ll = _avg(have["slm"]["r2"]), _avg(have["slm"]["msll"])
            add("2", "SLM R² >= 0.90", r2 >= 0.90, f"{r2:.4f}")
            add("2", "SLM MSLL <= -1.5", ll <= -1.5, f"{ll:.4f}")
        if "glm" in have:
            r2, ll = _avg(have["glm"]["r2"]), _avg(have["glm"]["msll"])
            add("2", "GLM R² > the report's GLM (0.8411)", r2 > REPORT_BOSTON["glm"][0], f"{r2:.4f} vs 0.8411")
            add("2", "GLM MSLL < the report's GLM (-0.9209)", ll < REPORT_BOSTON["glm"][2], f"{ll:.4f} vs -0.9209")
    digits = tables.get("3")
    if digits and "glm" in digits["methods"] and "gp" in digits["methods"]:
        a, b = digits["methods"]["glm"]["log_loss"], digits["methods"]["gp"]["log_loss"]
        add("3", "GLM log-loss <= GP classifier (Laplace)", a <= b, f"{a:.4f} vs {b:.4f}")
    large = tables.get("4")
    if large and "glm" in large["methods"] and "gp" in large["methods"]:
        for size in sorted(large["methods"]["glm"], key=int):
            if size in large["methods"]["gp"]:
                a, b = _avg(large["methods"]["glm"][size]["msll"]), _avg(large["methods"]["gp"][size]["msll"])
                add("4", f"GLM MSLL < GP subset (SD), size {size}", a < b, f"{a:.4f} vs {b:.4f}")
    return checks


def bar_summary(checks: List[dict]) -> str:
    rows = [[c["table"], c["check"], c["detail"], "met" if c["ok"] else "NOT met"] for c in checks]
    return markdown_table(["table", "check", "ours (vs other)", "bar"], rows)
