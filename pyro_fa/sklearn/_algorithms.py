"""The fitting algorithms of :class:`~pyro_fa.sklearn.FactorAnalysis` (``algorithm=``), by name.

Each entry builds the torch model of one estimator and feeds it a batch of rows:
``"svd"`` / ``"em"`` refit :class:`~pyro_fa.fa.batch.BatchFactorAnalysis` on the merged sufficient
statistics; ``"online_em"`` / ``"sga"`` stream the rows through
:class:`~pyro_fa.fa.online.OnlineFactorAnalysis`.
"""
from __future__ import annotations

import copy
import warnings
from typing import Dict

import torch
from sklearn.exceptions import ConvergenceWarning

from pyro_fa.fa.batch import BatchFactorAnalysis

__all__ = ["ALGORITHMS", "SKLEARN_NOISE_FLOOR"]

#: scikit-learn's floor on the noise variances (``SMALL`` in sklearn/decomposition/_factor_analysis.py)
SKLEARN_NOISE_FLOOR = 1e-12


class _BatchAlgorithm:
    """Batch fits on the exact sufficient statistics of all rows seen."""

    online = False

    def __init__(self, method: str):
        self.method = method

    def build(self, est, n_features: int, k: int, psi0, dtype, device) -> BatchFactorAnalysis:
        return BatchFactorAnalysis(
            n_features,
            k,
            self.method,
            tol=est.tol,
            max_iter=est.max_iter,
            svd_method=est.svd_method,
            iterated_power=est.iterated_power,
            noise_variance_init=None if psi0 is None else torch.as_tensor(psi0),
            seed=est._seed(),
            # scikit-learn's floor on the noise variances (its SMALL): constant columns get psi = 1e-12
            # as there, so scores match; float32 keeps the relative floor it needs to stay stable
            noise_floor=SKLEARN_NOISE_FLOOR if dtype == torch.float64 else None,
            dtype=dtype,
            device=device,
        )

    def update(self, est, model, x: torch.Tensor, fresh: bool) -> None:
        """Merge ``x`` into the statistics, refit, and set ``loglike_`` / ``n_iter_`` of ``est``."""
        model.update(x)
        model.fit(warn=False)
        est.loglike_ = model.loglike.tolist()
        est.n_iter_ = model.n_iter
        if not model.converged:
            warnings.warn(
                f"{type(est).__name__}: {est.algorithm!r} did not converge in max_iter={est.max_iter} "
                "iterations; you might want to increase max_iter or tol.",
                ConvergenceWarning,
            )


class _OnlineAlgorithm:
    """One pass over the rows in order, ``batch_size`` rows per update (Brownlie 2021, Algorithms 1 and 2)."""

    online = True

    def __init__(self, method: str):
        self.method = method

    def build(self, est, n_features: int, k: int, psi0, dtype, device):
        from pyro_fa.fa.online import OnlineFactorAnalysis

        return OnlineFactorAnalysis(
            n_features,
            k,
            method=self.method,
            warmup=est.warmup,
            lr=est.learning_rate,
            seed=est._seed(),
            dtype=dtype,
            device=device,
        )

    def update(self, est, model, x: torch.Tensor, fresh: bool) -> None:
        """Stream ``x`` through ``model`` as one transaction; append to ``loglike_`` / ``n_iter_`` of ``est``."""
        # an update refused part-way (one that would overflow the state's dtype) restores the state from
        # before the batch
        saved = None if fresh else copy.deepcopy(model.state_dict())
        n_steps = 0
        try:
            for chunk in torch.split(x, est.batch_size):
                model.update(chunk)
                n_steps += 1
        except ValueError as err:
            if saved is not None:
                model.load_state_dict(saved)
            raise ValueError(
                f"{type(est).__name__}: X must fit the model's dtype, got row {n_steps * est.batch_size} or "
                f"after refused ({str(err).split(': ', 1)[-1]}) The model is left as it was before this call."
            ) from None
        ll = float(model.log_prob(x).sum())
        est.n_iter_ = n_steps if fresh else est.n_iter_ + n_steps
        est.loglike_ = [ll] if fresh else est.loglike_ + [ll]


#: ``algorithm`` option -> its implementation
ALGORITHMS: Dict[str, object] = {
    "svd": _BatchAlgorithm("svd"),
    "em": _BatchAlgorithm("em"),
    "online_em": _OnlineAlgorithm("em"),
    "sga": _OnlineAlgorithm("sga"),
}
