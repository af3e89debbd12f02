"""The test scores of ``pyro-fa uci``'s fits, shared by the protocol and the fidelity-to-HMC scoring (a module
of its own so that neither imports the other)."""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from pyro_fa.nn.batched import replica_metrics

__all__ = ["evaluate"]


def evaluate(means: Tensor, noise_var: Tensor, data: "SplitData") -> Dict[str, Tensor]:
    """Test log-likelihood, RMSE (original units) and calibration error of every replica.

    Parameters
    ----------
    means : Tensor of shape (S, R, M)
        Predictive means of S posterior draws (standardised units).
    noise_var : Tensor of shape (R, 1) or (S, R, 1)
    data : SplitData
        ``y_eval`` (R, M) standardised targets, ``y_std`` (R,).

    Returns
    -------
    dict of Tensors of shape (R,): ``ll``, ``rmse``, ``calibration_error`` (:func:`pyro_fa.nn.replica_metrics`).

    Raises
    ------
    FloatingPointError
        If a replica's predictions are not finite (its training diverged).
    """
    if not (torch.isfinite(means).all() and torch.isfinite(noise_var).all()):
        raise FloatingPointError("pyro-fa uci: a final fit diverged (non-finite predictions).")
    scores = replica_metrics(means, noise_var, data.y_eval, y_std=data.y_std)
    return {"ll": scores["log_likelihood"], "rmse": scores["rmse"], "calibration_error": scores["calibration_error"]}
