r"""Choosing the prior precision of :class:`~pyro_fa.laplace.FactorLaplace`: marginal likelihood or validation grid.

A mixin (kept apart so that the approximation's state, fit and predictives stay readable): it reads the
approximation through ``prior_precision``, ``loc``, ``log_marginal_likelihood``, ``predict_proba`` /
``predict`` and ``_check_prior_precision``, and stores its choice only once the choice is checked (positive
and finite), in new storage (``_replace``).

``optimize_prior_precision("gridsearch", ..., temperature=True)`` scores each grid value *after* a temperature
(Guo, Pleiss, Sun & Weinberger, "On calibration of modern neural networks", 2017) fitted on the validation points
to the predictive's log class probabilities: the raw validation NLL rewards a small prior precision (a wide
posterior) for curing the MAP network's overconfidence, which one temperature cures at no cost, so the raw choice
followed by a temperature can end worse than the MAP network with a temperature; the joint choice falls back to
the MAP limit (a huge precision) when the spread brings nothing a temperature does not.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from pyro_fa.predictive.glm import check_pred_type

__all__ = ["PriorPrecisionSelection", "PRIOR_METHODS"]

#: the ways of choosing the prior precision (:meth:`PriorPrecisionSelection.optimize_prior_precision`)
PRIOR_METHODS = ("marglik", "gridsearch")

_DEFAULT_GRID = tuple(10.0 ** (k / 4) for k in range(-16, 17))  # 1e-4 ... 1e4


def show(value) -> str:
    """A hyperparameter for an error message: its values, without a tensor's grad_fn."""
    if torch.is_tensor(value):
        return repr(value.detach().cpu().reshape(-1).tolist()) if value.numel() <= 8 else f"a Tensor of shape {tuple(value.shape)}"
    return repr(value)


def positive_int(owner: str, arg: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {arg} must be an integer >= {minimum}, got {value!r}.")
    return value


class PriorPrecisionSelection:
    """Prior-precision selection of :class:`~pyro_fa.laplace.FactorLaplace` (see there)."""

    #: the temperature fitted with the prior precision by ``optimize_prior_precision(..., temperature=True)``;
    #: None until then, and again after any choice made without it
    temperature: Optional[float] = None

    def optimize_prior_precision(self, method: str = "marglik", *, n_steps: int = 100, lr: float = 0.1,
                                 val_loader: Optional[Iterable] = None, grid: Optional[Sequence[float]] = None,
                                 pred_type: str = "glm", link_approx: str = "probit",
                                 n_samples: int = 100, temperature: bool = False) -> Tensor:
        r"""Choose the prior precision :math:`\delta` (scalar or per layer, the shape of :attr:`prior_precision`).

        Parameters
        ----------
        method : {"marglik", "gridsearch"}, default "marglik"
            ``"marglik"``: Adam on :math:`\log\delta` maximising :meth:`log_marginal_likelihood`;
            ``"gridsearch"``: the scalar :math:`\delta` of ``grid`` with the lowest validation negative
            log-likelihood of the predictive (``pred_type``, ``link_approx``).
        n_steps, lr : int, float
            Adam steps and learning rate of ``"marglik"``.
        val_loader : iterable of (Tensor, Tensor)
            Needed by ``"gridsearch"``.
        grid : sequence of float, optional
            Default :math:`10^{-4}, 10^{-3.75}, \dots, 10^4`.
        pred_type, link_approx, n_samples
            The predictive scored by ``"gridsearch"`` (see :meth:`predict_proba`).
        temperature : bool, default False
            ``"gridsearch"`` of a classifier only: score each grid value by the validation NLL *after* a
            temperature :math:`T` fitted there (:func:`pyro_fa.predictive.fit_temperature` on the log of the
            predictive's probabilities, :math:`T \in [0.01, 100]`), and keep the :math:`T` of the chosen value
            in :attr:`temperature`. :meth:`predict_proba` itself is never tempered; apply it as
            ``(la.predict_proba(x).log() / la.temperature).softmax(-1)``. The raw scores stay in
            ``grid_scores_``; the tempered ones and the temperatures go to ``grid_tempered_`` (values, NLLs,
            temperatures). :attr:`temperature` is a plain attribute, not part of :meth:`state_dict`: save it
            beside.

        Returns
        -------
        Tensor of shape (1,) or (L,)
            The chosen :attr:`prior_precision` (also stored, in new storage: a tensor taken earlier keeps its
            values).

        Raises
        ------
        ValueError
            An unknown ``method``; bad ``n_steps``, ``lr``, ``grid`` or a missing ``val_loader``; a non-finite
            prior precision, log marginal likelihood or gradient during ``"marglik"``, or a non-finite
            validation NLL in ``"gridsearch"``; ``temperature`` not a bool, or True with ``"marglik"`` or a
            regression. Nothing is stored then: :attr:`prior_precision` and :attr:`temperature` stay as they were.

        Examples
        --------
        >>> net = torch.nn.Linear(3, 4)
        >>> x, y = torch.randn(60, 3), torch.randint(4, (60,))
        >>> la = FactorLaplace(net, "classification", rank=2).fit([(x[:40], y[:40])])
        >>> delta = la.optimize_prior_precision("gridsearch", val_loader=[(x[40:], y[40:])], temperature=True)
        >>> p = (la.predict_proba(x[40:]).log() / la.temperature).softmax(-1)  # the tempered predictive
        >>> p.shape
        torch.Size([20, 4])
        """
        name = type(self).__name__
        self._check_fitted("optimize_prior_precision()")
        if method not in PRIOR_METHODS:
            raise ValueError(f"{name}: method must be one of {PRIOR_METHODS}, got {method!r}.")
        if not isinstance(temperature, bool):
            raise ValueError(f"{name}: temperature must be True or False, got {temperature!r}.")
        if temperature and method != "gridsearch":
            raise ValueError(f"{name}: temperature=True needs method='gridsearch' (the temperature is fitted on "
                             f"val_loader at each grid value), got method={method!r}.")
        if temperature and self.likelihood != "classification":
            raise ValueError(f"{name}: temperature=True needs likelihood='classification' (a temperature divides "
                             f"log class probabilities), got {self.likelihood!r}.")
        chosen_t = None
        if method == "marglik":
            best = self._marglik_prior_precision(n_steps, lr)
        else:
            best, chosen_t = self._gridsearch_prior_precision(val_loader, grid, pred_type, link_approx, n_samples,
                                                              temperature)
        # the choice is checked before it touches the fitted state: nothing changes when it is refused
        best = self._check_prior_precision(best, self.loc)
        self._replace(prior_precision=best)
        self.temperature = chosen_t
        return self.prior_precision.clone()

    def _marglik_prior_precision(self, n_steps: int, lr: float) -> Tensor:
        name = type(self).__name__
        positive_int(name, "n_steps", n_steps)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"{name}: lr must be a positive finite float, got {lr!r}.")
        log_pp = self.prior_precision.detach().log().clone().requires_grad_(True)
        opt = torch.optim.Adam([log_pp], lr=lr)
        for step in range(n_steps):
            opt.zero_grad()
            pp = log_pp.exp()
            if not bool(torch.isfinite(pp).all() and (pp > 0).all()):
                raise ValueError(f"{name}: optimize_prior_precision('marglik') reached a non-finite or zero prior "
                                 f"precision {show(pp)} at step {step}; try a smaller lr (got {lr!r}). The "
                                 "prior precision was left as it was.")
            lml = self.log_marginal_likelihood(prior_precision=pp)
            if not bool(torch.isfinite(lml)):
                raise ValueError(f"{name}: optimize_prior_precision('marglik'): the log marginal likelihood is "
                                 f"{float(lml)!r} at prior precision {show(pp)} (step {step}); the fitted "
                                 "curvature or loss is not usable. The prior precision was left as it was.")
            (-lml).backward()
            if not bool(torch.isfinite(log_pp.grad).all()):
                raise ValueError(f"{name}: optimize_prior_precision('marglik'): the gradient of the log marginal "
                                 f"likelihood is not finite at prior precision {show(pp)} (step {step}). The "
                                 "prior precision was left as it was.")
            opt.step()
        return log_pp.detach().exp()

    def _gridsearch_prior_precision(self, val_loader, grid, pred_type, link_approx, n_samples, temperature=False):
        """``(the chosen prior precision, its temperature or None)``; the scores kept in ``grid_scores_`` (and
        ``grid_tempered_`` with ``temperature``)."""
        name = type(self).__name__
        if val_loader is None:
            raise ValueError(f"{name}: method='gridsearch' needs val_loader, got None.")
        # link_approx as predict_proba reads it: only for a classifier's GLM ("nn" always samples)
        check_pred_type(name, pred_type,
                        link_approx if self.likelihood == "classification" and pred_type == "glm" else None)
        values = list(_DEFAULT_GRID if grid is None else grid)
        if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                             or not math.isfinite(v) for v in values):
            raise ValueError(f"{name}: grid must be a non-empty sequence of positive finite floats, got {grid!r}.")
        saved = self._buffers["prior_precision"]
        scores, tempered = [], []
        try:
            for v in values:  # a fresh tensor per value: the saved one is never written
                self._buffers["prior_precision"] = torch.full_like(saved, v)
                if temperature:
                    raw, t_nll, t = self._tempered_validation_nll(val_loader, pred_type, link_approx, n_samples)
                    scores.append(raw)
                    tempered.append((t_nll, t))
                else:
                    scores.append(self._validation_nll(val_loader, pred_type, link_approx, n_samples))
        finally:
            self._buffers["prior_precision"] = saved
        bad = [v for v, sc in zip(values, scores) if not math.isfinite(sc)]
        bad += [v for v, (sc, _) in zip(values, tempered) if not math.isfinite(sc) and v not in bad]
        if bad:
            raise ValueError(f"{name}: optimize_prior_precision('gridsearch'): the validation NLL is not finite at "
                             f"prior precision(s) {bad!r} of grid (val_loader holds non-finite inputs or targets, "
                             "or the predictive failed). The prior precision was left as it was.")
        self.grid_scores_ = (values, scores)
        if not temperature:
            return saved.new_full(saved.shape, values[int(torch.tensor(scores).argmin())]), None
        self.grid_tempered_ = (values, [sc for sc, _ in tempered], [t for _, t in tempered])
        k = min(range(len(values)), key=lambda i: tempered[i][0])  # the first of equal scores, as argmin
        return saved.new_full(saved.shape, values[k]), tempered[k][1]

    def _tempered_validation_nll(self, loader, pred_type, link_approx, n_samples):
        """``(raw NLL, tempered NLL, temperature)`` per validation point of the classifier's predictive: the
        temperature of least NLL fitted to the log of its probabilities (float64, floored at 1e-300)."""
        from pyro_fa.predictive.temperature import fit_temperature

        logs, ys = [], []
        for batch in loader:
            x, y = self._batch(batch, "val_loader")
            p = self.predict_proba(x, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples)
            logs.append(p.detach().to(torch.float64).clamp_min(1e-300).log())
            ys.append(y.long().reshape(-1).to(p.device))
        if not logs:
            raise ValueError(f"{type(self).__name__}: val_loader must yield at least one batch, got none.")
        z, y = torch.cat(logs), torch.cat(ys)
        raw = float(-z.gather(-1, y[:, None]).mean())
        if not (math.isfinite(raw) and bool(torch.isfinite(z).all())):
            return math.nan, math.nan, math.nan
        t = fit_temperature(z, y)
        return raw, float(-(z / t).log_softmax(-1).gather(-1, y[:, None]).mean()), t

    def _validation_nll(self, loader, pred_type, link_approx, n_samples) -> float:
        total, count = 0.0, 0
        for batch in loader:
            x, y = self._batch(batch, "val_loader")
            if self.likelihood == "classification":
                p = self.predict_proba(x, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples)
                total += float(-p.gather(-1, y.long().reshape(-1, 1)).clamp_min(1e-300).log().sum())
            else:
                mean, var = self.predict(x, pred_type=pred_type, n_samples=n_samples)
                y = y.to(mean.dtype).reshape(mean.shape)
                total += float(0.5 * ((y - mean).pow(2) / var + var.log() + math.log(2 * math.pi)).sum())
            count += x.shape[0]
        return total / max(count, 1)

