r"""What a trained :class:`~pyro_fa.nn.BayesianNetwork` predicts: draws, probabilities, test metrics.

Posterior samples for prediction are drawn one at a time under ``torch.no_grad``
(``Predictive(..., parallel=True)`` fails on ``nn.Linear`` networks in Pyro 1.9) and run
through :class:`~pyro_fa.predictive.SampledPredictive`, the predictive every posterior shares;
a loader's batches go through the same draws. The guide is built on first use from
Pyro's param store when it was trained elsewhere (a user's own SVI loop, a saved store).
"""
from __future__ import annotations

import contextlib
import numbers
from typing import Callable, Dict, Optional

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide
from torch import Tensor

from pyro_fa import metrics
from pyro_fa.predictive import SampledPredictive, log_mean_exp

__all__ = []


class _Outputs:
    """What a network likelihood does with the stacked outputs (S, N, ...) of the sampled networks; one instance
    per likelihood in :data:`_LIKELIHOODS`, chosen once from ``BayesianNetwork.likelihood``."""

    name = ""
    #: the class probabilities of one draw's output, None for a likelihood without classes
    probs: Optional[Callable[[Tensor], Tensor]] = None

    def placeholder(self, x: Tensor) -> Tensor:
        """Observed values for the guide's first trace of the model: only their shape matters."""
        dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
        return torch.zeros(x.shape[0], dtype=dtype, device=x.device)

    def outputs(self, out: Tensor, fn: str) -> Tensor:
        """The outputs as the likelihood reads them: (S, N) means or logits."""
        if out.dim() == 3 and out.shape[-1] == 1:
            return out.squeeze(-1)
        if out.dim() != 2:
            raise ValueError(f"{fn}: the network's output must have shape (N, 1) or (N,) for likelihood="
                             f"{self.name!r}, got {tuple(out.shape[1:])}.")
        return out

    def targets(self, y: Tensor, pred: Tensor, name: str, fn: str) -> Tensor:
        y = y.to(pred.dtype)
        if not bool(torch.isfinite(y).all()):
            raise ValueError(f"{fn}: {name} must be finite, got NaN or inf in {int((~torch.isfinite(y)).sum())} "
                             "entries.")
        return y


class _GaussianOutputs(_Outputs):
    name = "gaussian"

    def log_prob(self, out: Tensor, y: Tensor, noise: float) -> Tensor:
        return dist.Normal(out, out.new_tensor(noise)).log_prob(y)


class _BernoulliOutputs(_Outputs):
    name = "bernoulli"

    @staticmethod
    def probs(out: Tensor) -> Tensor:
        p = out.sigmoid()
        return torch.stack([1 - p, p], -1)

    def targets(self, y, pred, name, fn):
        if not bool(((y == 0) | (y == 1)).all()):
            raise ValueError(f"{fn}: {name} must hold 0/1 labels for likelihood='bernoulli', got other values.")
        return y.to(pred.dtype)

    def log_prob(self, out, y, noise):
        return dist.Bernoulli(logits=out).log_prob(y)


class _CategoricalOutputs(_Outputs):
    name = "categorical"

    @staticmethod
    def probs(out: Tensor) -> Tensor:
        return out.softmax(-1)

    def placeholder(self, x):
        return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)

    def outputs(self, out, fn):
        if out.dim() != 3 or out.shape[-1] < 2:
            raise ValueError(f"{fn}: the network's output must be logits of shape (N, C) with C >= 2 for "
                             f"likelihood='categorical', got {tuple(out.shape[1:])}.")
        return out

    def targets(self, y, pred, name, fn):
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise TypeError(f"{fn}: {name} must hold integer class labels for likelihood='categorical', got "
                            f"dtype {y.dtype}.")
        c, n = pred.shape[-1], pred.shape[1]
        if n and (int(y.min()) < 0 or int(y.max()) >= c):
            raise ValueError(f"{fn}: {name} must be class labels in [0, {c}), got values from {int(y.min())} "
                             f"to {int(y.max())}.")
        return y

    def log_prob(self, out, y, noise):
        return out.log_softmax(-1).gather(-1, y.expand(out.shape[0], -1).unsqueeze(-1)).squeeze(-1)


#: BayesianNetwork's likelihood -> what its predictions do with the outputs (dispatched once, here)
_LIKELIHOODS: Dict[str, _Outputs] = {o.name: o for o in (_GaussianOutputs(), _BernoulliOutputs(),
                                                         _CategoricalOutputs())}


class _Prediction:
    """``predict``, ``predictive_samples``, ``predict_proba`` and ``evaluate`` of :class:`BayesianNetwork`.

    A mixin: it reads ``guide``, ``module``, ``likelihood``, ``name``, ``noise_scale`` and
    ``_fitted`` of the network.
    """

    def _device(self) -> Optional[torch.device]:
        """Where the guide's parameters live (and predictions run); ``None`` for a guide without parameters."""
        if isinstance(self.guide, torch.nn.Module):
            for p in self.guide.parameters():
                return p.device
        return None

    def predictive(self) -> SampledPredictive:
        """The network's predictive by sampled networks: guide draws of the weights, the module conditioned on each.

        Returns
        -------
        SampledPredictive
            ``sample(S, generator)`` calls the guide ``S`` times (Pyro's global RNG: the
            generator is not used); ``network(draw)`` is the module with its weight sites
            conditioned on the draw.
        """
        module = self.module
        return SampledPredictive(lambda S, generator=None: [self.guide() for _ in range(S)],
                                 lambda draw: contextlib.nullcontext(poutine.condition(module, data=draw)),
                                 module=module)

    @property
    def _likelihood_ops(self) -> _Outputs:
        return _LIKELIHOODS[self.likelihood]

    def _placeholder_targets(self, x: Tensor) -> Tensor:
        return self._likelihood_ops.placeholder(x)

    def _built(self) -> bool:
        # a guide of the user's own (not an autoguide) keeps its parameters where it likes
        guide = self.guide
        return self._fitted or not isinstance(guide, AutoGuide) or guide.prototype_trace is not None

    def _ready(self, x: Tensor, fn: str) -> None:
        """Make sure the guide can draw weights: trained by :meth:`fit` or by the user's own SVI loop, or stored.

        An autoguide is built by its first call, which runs the model once (one
        ``svi.step`` does that) and takes its parameters from Pyro's param store
        where they are already there (``<name>.guide.*``, e.g. loaded with
        ``pyro.get_param_store().load(path)``); it then holds them itself.
        """
        if self._built():
            return
        store = pyro.get_param_store()
        stored = [k for k in store.keys() if k.startswith(f"{self.name}.guide.")]
        if not stored:
            raise RuntimeError(
                f"{fn}: the guide must be trained first, got one with no parameters (it has never run, and Pyro's "
                f"param store holds none named '{self.name}.guide.*'). Call fit(), or run your own "
                "SVI(bnn.model, bnn.guide, ...) loop, or load the trained parameters into the param store."
            )
        x = x.to(store[stored[0]].device)
        cuda = [x.device] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # building draws from the prior: leave the caller's RNG alone
            self.guide(x, self._placeholder_targets(x))  # builds the guide around the stored parameters

    @staticmethod
    def _batches(data, y, fn: str):
        """``(x, y)`` pairs: one for a tensor ``data``; the loader's batches otherwise."""
        if isinstance(data, Tensor):
            yield data, y
            return
        if y is not None:
            raise ValueError(f"{fn}: y must be None when data is a loader of (x, y) batches, got a "
                             f"{type(y).__name__}.")
        try:
            batches = iter(data)
        except TypeError:
            raise TypeError(f"{fn}: data must be a Tensor of inputs or an iterable of (x, y) batches (e.g. a "
                            f"DataLoader), got {type(data).__name__}.") from None
        for batch in batches:
            if isinstance(batch, Tensor):
                yield batch, None
            elif isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
                yield batch[0], (batch[1] if len(batch) > 1 else None)
            else:
                raise TypeError(f"{fn}: data's batches must be Tensors or (x, y) pairs of Tensors, got "
                                f"{type(batch).__name__}.")

    def _likelihood_outputs(self, out: Tensor, fn: str) -> Tensor:
        """Stacked outputs (S, N, ...) as the likelihood reads them: (S, N) means / logits, or (S, N, C) logits."""
        return self._likelihood_ops.outputs(out, fn)

    def _check_targets(self, y, pred: Tensor, name: str, fn: str) -> Tensor:
        """Targets of shape (N,) for predictions (S, N) or (S, N, C), checked for the likelihood."""
        n = pred.shape[1]
        if y is None:
            raise ValueError(f"{fn}: {name} must be given: targets of shape ({n},), got None.")
        if not isinstance(y, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor of shape ({n},), got {type(y).__name__}.")
        if tuple(y.shape) != (n,):
            raise ValueError(
                f"{fn}: {name} must have shape ({n},), one target per input like the prediction of shape "
                f"{tuple(pred.shape[1:])}, got {tuple(y.shape)}."
                + (" Flatten it (y.reshape(-1))." if y.numel() == n else "")
            )
        return self._likelihood_ops.targets(y.to(pred.device), pred, name, fn)

    def _outputs(self, data, num_samples: int, fn: str, y=None, targets: bool = False):
        """Raw network outputs (S, N, ...) under ``num_samples`` weight draws, the same draws for every batch.

        With ``targets``: also the concatenated, checked targets of shape (N,).
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
            raise ValueError(f"{fn}: num_samples must be a positive int, got {num_samples!r}.")
        predictive = self.predictive()
        weights, device, outs, ys = None, None, [], []
        if self._built():  # draw before iterating: a DataLoader's iterator takes a seed from torch's RNG
            device = self._device()
            weights = predictive.sample(num_samples, None)
        for i, (x, yb) in enumerate(self._batches(data, y, fn)):
            if weights is None:
                self._ready(x, fn)
                device = self._device()
                weights = predictive.sample(num_samples, None)
            if device is not None:
                x = x.to(device)
            out = predictive.outputs(weights, x)
            if targets:
                name = "y" if isinstance(data, Tensor) else f"the targets of batch {i}"
                ys.append(self._check_targets(yb, self._likelihood_outputs(out, fn), name, fn))
            outs.append(out)
        if not outs:
            raise ValueError(f"{fn}: data must hold at least one batch, got none.")
        return torch.cat(outs, 1), (torch.cat(ys) if targets else None)

    @torch.no_grad()
    def predict(self, data, num_samples: int = 100) -> Tensor:
        """Network outputs under ``num_samples`` posterior draws of the weights.

        Parameters
        ----------
        data : Tensor of shape (N, ...) or iterable of batches
            Inputs, or a ``DataLoader`` (any iterable) of ``(x, y)`` batches or of
            input tensors; batches are moved to the guide's device and go through
            the same weight draws, in order.
        num_samples : int, default 100

        Returns
        -------
        Tensor of shape (num_samples, N, out)
            On the guide's device.

        Raises
        ------
        RuntimeError
            If the guide has never been trained (see :meth:`fit`); a guide trained by
            your own ``SVI(bnn.model, bnn.guide, ...)`` loop, or whose parameters
            ``<name>.guide.*`` are in Pyro's param store, is accepted.
        """
        return self._outputs(data, num_samples, "BayesianNetwork.predict")[0]

    @torch.no_grad()
    def predictive_samples(self, data, num_samples: int = 100) -> Tensor:
        """Per-draw predictions in the form that :mod:`pyro_fa.metrics` takes.

        Parameters
        ----------
        data : Tensor of shape (N, ...) or iterable of batches
            As for :meth:`predict`.
        num_samples : int, default 100

        Returns
        -------
        Tensor
            ``"categorical"``: class probabilities (the softmax of the logits), shape
            (S, N, C); ``"bernoulli"``: :math:`(1 - p, p)`, shape (S, N, 2);
            ``"gaussian"``: the means, shape (S, N) (``pred_means`` of
            :func:`pyro_fa.metrics.gaussian_log_likelihood`, with the noise variance
            ``noise_scale ** 2`` or ``learned_noise_scale ** 2``).
        """
        return self._predictive_samples(data, num_samples, "BayesianNetwork.predictive_samples")

    def _predictive_samples(self, data, num_samples: int, fn: str) -> Tensor:
        out = self._likelihood_outputs(self._outputs(data, num_samples, fn)[0], fn)
        probs = self._likelihood_ops.probs
        return out if probs is None else probs(out)

    @torch.no_grad()
    def predict_proba(self, data, num_samples: int = 100) -> Tensor:
        r"""Class probabilities of the Bayesian model average, :math:`\frac1S\sum_s p(y \mid x, \theta_s)`.

        Parameters
        ----------
        data : Tensor of shape (N, ...) or iterable of batches
            As for :meth:`predict`.
        num_samples : int, default 100

        Returns
        -------
        Tensor of shape (N, C)
            ``C = 2`` for ``"bernoulli"`` (column 1: :math:`P(y = 1)`).

        Raises
        ------
        ValueError
            For ``likelihood="gaussian"`` (use :meth:`predictive_samples`).
        """
        if self._likelihood_ops.probs is None:
            raise ValueError("BayesianNetwork.predict_proba: likelihood must be 'categorical' or 'bernoulli', got "
                             "'gaussian'. Use predictive_samples() for the sampled means.")
        return self._predictive_samples(data, num_samples, "BayesianNetwork.predict_proba").mean(0)

    def _noise_value(self, fn: str) -> float:
        if self.noise_scale is not None:
            return self.noise_scale
        key = f"{self.name}.noise_scale"
        if key not in pyro.get_param_store():
            raise RuntimeError(f"{fn}: the learned noise scale must be in Pyro's param store as {key!r}, got none "
                               "there (was the store cleared?). Pass noise_scale to fix it, or train again.")
        return float(pyro.param(key))

    @torch.no_grad()
    def evaluate(self, data, y: Optional[Tensor] = None, num_samples: int = 100) -> Dict[str, float]:
        r"""Test metrics of the Bayesian model average over ``num_samples`` posterior draws.

        .. math::

            \mathrm{LL} = \frac1N \sum_{n=1}^N \log \frac1S \sum_{s=1}^S p(y_n \mid x_n, \theta_s),
            \qquad \theta_s \sim q,

        the log-likelihood per point of the model average (for ``"gaussian"`` a
        mixture of :math:`N(f_{\theta_s}(x_n), \sigma^2)` with the fixed or learned
        noise :math:`\sigma`), evaluated with ``logsumexp``.

        Parameters
        ----------
        data : Tensor of shape (N, ...) or iterable of (x, y) batches
            Inputs (then ``y`` is required) or a ``DataLoader`` of ``(x, y)``
            batches; all batches go through the same weight draws.
        y : Tensor of shape (N,), optional
            Targets for tensor inputs: real values (``"gaussian"``), 0/1
            (``"bernoulli"``) or integer class labels (``"categorical"``).
        num_samples : int, default 100

        Returns
        -------
        dict
            ``"gaussian"``: ``rmse`` (of the BMA mean) and ``log_likelihood``;
            classification: ``accuracy``, ``log_likelihood``, ``brier`` and ``ece``
            (15 bins) of the BMA probabilities, as :mod:`pyro_fa.metrics` computes them.

        Raises
        ------
        ValueError, TypeError
            Targets of another shape than (N,) (e.g. (N, 1): refused, not broadcast),
            dtype or range than the likelihood takes; network outputs of a shape the
            likelihood cannot read.
        """
        fn = "BayesianNetwork.evaluate"
        raw, y = self._outputs(data, num_samples, fn, y=y, targets=True)
        out = self._likelihood_outputs(raw, fn)
        ops = self._likelihood_ops
        lp = ops.log_prob(out, y, self._noise_value(fn) if ops.probs is None else None)
        if ops.probs is None:  # regression
            metric = {"rmse": float((out.mean(0) - y).pow(2).mean().sqrt())}
        else:
            bma, y = ops.probs(out).mean(0), y.long()
            metric = {"accuracy": float(metrics.accuracy(bma, y)), "brier": float(metrics.brier_score(bma, y)),
                      "ece": float(metrics.expected_calibration_error(bma, y))}
        metric["log_likelihood"] = float(log_mean_exp(lp).mean())
        return metric
