r"""A Bayesian neural network in a few lines: torch module + prior + likelihood + guide.

The common case that TyXe served (TyXe pins torch 1.12 / Pyro 1.8 and no longer
installs beside current Pyro)::

    net = nn.Sequential(nn.Linear(8, 50), nn.ReLU(), nn.Linear(50, 1))
    bnn = BayesianNetwork(net, GaussianPrior(1.0), likelihood="gaussian", rank=10)
    bnn.fit(loader, pyro.optim.Adam({"lr": 1e-3}), epochs=100)
    bnn.evaluate(x_test, y_test)   # {"rmse": ..., "log_likelihood": ...}

For classification (``likelihood="categorical"``, the network returning logits)
``bnn.predict_proba(x_or_loader)`` gives the model average's class probabilities
and ``bnn.predictive_samples(x_or_loader)`` the per-draw probabilities (S, N, C)
that :mod:`pyro_fa.metrics` takes. A network trained by your own
``SVI(bnn.model, bnn.guide, optim, FactorELBO())`` loop predicts as well as one
trained by :meth:`BayesianNetwork.fit`.

Posterior samples for prediction are drawn one at a time under
``torch.no_grad`` (``Predictive(..., parallel=True)`` fails on ``nn.Linear``
networks in Pyro 1.9); a loader's batches go through the same draws.
"""
from __future__ import annotations

import itertools
import math
import numbers
from typing import Callable, Dict, Optional

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoGuide, init_to_median, init_to_value
from pyro.nn import PyroModule
from torch import Tensor

from pyro_fa import metrics
from pyro_fa.infer import AutoLowRankFactorGuide, FactorELBO
from pyro_fa.infer.priors import _FactorisedPrior

__all__ = ["BayesianNetwork"]

_LIKELIHOODS = ("gaussian", "bernoulli", "categorical")
_INSTANCES = itertools.count()


class BayesianNetwork:
    r"""A torch module with a prior on every weight, a likelihood and a Pyro guide.

    Parameters
    ----------
    net : torch.nn.Module
        Maps inputs of shape (N, ...) to outputs of shape (N, 1) (Gaussian,
        Bernoulli: the mean or logit) or (N, C) (categorical logits).
    prior : GaussianPrior or LaplacePrior
    likelihood : {"gaussian", "bernoulli", "categorical"}, default "gaussian"
    noise_scale : float, optional
        Gaussian likelihood only: a fixed noise standard deviation; learned
        (as a point estimate, starting at 1) when omitted.
    guide_builder : callable, optional
        ``guide_builder(model, init_loc_fn) -> guide``; by default an
        :class:`~pyro_fa.AutoLowRankFactorGuide` of rank ``rank`` starting at
        the module's own initial weights.
    rank : int, default 10
    num_particles : int, default 1
        Particles of the :class:`~pyro_fa.FactorELBO` used by :meth:`fit`.
    name : str, optional
        Prefix of this network's entries in Pyro's param store (the guide's
        parameters ``<name>.guide.*`` and the learned noise
        ``<name>.noise_scale``), so that several networks live side by side.
        Default: ``"BayesianNetwork"``, then ``"BayesianNetwork_1"``, … for
        further networks made in the same process.

    Raises
    ------
    TypeError
        If ``net`` is not a module or ``prior`` not one of pyro_fa's priors.
    ValueError
        If ``likelihood`` is unknown, or ``noise_scale`` is not positive or is
        given for a non-Gaussian likelihood.
    """

    def __init__(
        self,
        net: torch.nn.Module,
        prior,
        likelihood: str = "gaussian",
        *,
        noise_scale: Optional[float] = None,
        guide_builder: Optional[Callable] = None,
        rank: int = 10,
        num_particles: int = 1,
        name: Optional[str] = None,
    ):
        if not isinstance(net, torch.nn.Module):
            raise TypeError(f"BayesianNetwork: net must be a torch.nn.Module, got {net!r}.")
        if not isinstance(prior, _FactorisedPrior):
            raise TypeError(f"BayesianNetwork: prior must be a GaussianPrior or LaplacePrior, got {prior!r}.")
        if likelihood not in _LIKELIHOODS:
            raise ValueError(f"BayesianNetwork: likelihood must be one of {_LIKELIHOODS}, got {likelihood!r}.")
        if noise_scale is not None:
            if likelihood != "gaussian":
                raise ValueError(
                    f"BayesianNetwork: noise_scale must be None for likelihood={likelihood!r}, got {noise_scale!r}."
                )
            if (isinstance(noise_scale, bool) or not isinstance(noise_scale, numbers.Real)
                    or not (math.isfinite(noise_scale) and noise_scale > 0)):
                raise ValueError(f"BayesianNetwork: noise_scale must be a positive finite float, got {noise_scale!r}.")
        if isinstance(num_particles, bool) or not isinstance(num_particles, numbers.Integral) or num_particles < 1:
            raise ValueError(f"BayesianNetwork: num_particles must be an integer >= 1, got {num_particles!r}.")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"BayesianNetwork: name must be a non-empty str, got {name!r}.")
        if name is None:
            count = next(_INSTANCES)
            name = "BayesianNetwork" if count == 0 else f"BayesianNetwork_{count}"
        self.name = name
        self.likelihood = likelihood
        self.noise_scale = noise_scale
        self.prior = prior
        self.module = prior.bayesianize(net)
        init = init_to_value(values=self.module.initial_values, fallback=init_to_median)
        if guide_builder is None:
            self.guide = AutoLowRankFactorGuide(self.model, rank=rank, init_loc_fn=init)
        else:
            self.guide = guide_builder(self.model, init)
        if isinstance(self.guide, PyroModule):
            self.guide._pyro_name = f"{name}.guide"  # its parameters: <name>.guide.loc, ...
        self.num_particles = num_particles
        self._fitted = False

    # ------------------------------------------------------------------ model
    def _noise(self, like: Tensor) -> Tensor:
        if self.noise_scale is not None:
            return like.new_tensor(self.noise_scale)
        return pyro.param(f"{self.name}.noise_scale", like.new_tensor(1.0), constraint=dist.constraints.positive)

    @property
    def learned_noise_scale(self) -> Optional[Tensor]:
        """The Gaussian noise standard deviation learned by :meth:`fit` (``None`` before, or when it is fixed)."""
        key = f"{self.name}.noise_scale"
        if self.noise_scale is not None or key not in pyro.get_param_store():
            return None
        return pyro.param(key).detach()

    def model(self, x: Tensor, y: Optional[Tensor] = None, dataset_size: Optional[int] = None):
        """The Pyro model: weights from the prior, then ``y`` given ``net(x)``; the batch scaled to ``dataset_size``."""
        n = x.shape[0]
        if y is not None and tuple(y.shape) != (n,):
            raise ValueError(f"BayesianNetwork.model: y must have shape ({n},), one target per row of x, got "
                             f"{tuple(y.shape)}." + (" Flatten it (y.reshape(-1))." if y.numel() == n else ""))
        out = self.module(x)
        size = dataset_size or n
        with pyro.plate("data", size, subsample=torch.arange(n, device=x.device)):
            if self.likelihood == "gaussian":
                return pyro.sample("y", dist.Normal(out.squeeze(-1), self._noise(out)), obs=y)
            if self.likelihood == "bernoulli":
                return pyro.sample("y", dist.Bernoulli(logits=out.squeeze(-1)), obs=y)
            return pyro.sample("y", dist.Categorical(logits=out), obs=y)

    # ------------------------------------------------------------------ train
    def fit(self, loader, optim, epochs: int, device=None, progress: bool = True):
        """Train by SVI with :class:`~pyro_fa.FactorELBO`.

        Parameters
        ----------
        loader : iterable of (x, y) batches (e.g. a ``DataLoader``); its
            ``dataset`` length, when present, scales the likelihood.
        optim : pyro.optim.PyroOptim
        epochs : int
        device : torch.device or str, optional
            Batches (and the model) are moved there.
        progress : bool, default True
            Show a tqdm progress bar.

        Returns
        -------
        list of float
            The mean loss per epoch.
        """
        from tqdm.auto import tqdm

        if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 1:
            raise ValueError(f"BayesianNetwork.fit: epochs must be a positive int, got {epochs!r}.")
        if device is not None:
            self.module.to(device)
            self.guide.to(device)
        dataset_size = len(loader.dataset) if hasattr(loader, "dataset") else None
        svi = SVI(self.model, self.guide, optim, FactorELBO(num_particles=self.num_particles))
        history = []
        bar = tqdm(range(epochs), desc="fit", disable=not progress)
        for _ in bar:
            total, batches = 0.0, 0
            for x, y in loader:
                if device is not None:
                    x, y = x.to(device), y.to(device)
                total += svi.step(x, y, dataset_size=dataset_size)
                batches += 1
            if batches == 0:
                raise ValueError("BayesianNetwork.fit: loader must yield at least one (x, y) batch, got none; "
                                 "nothing was trained.")
            history.append(total / batches)
            bar.set_postfix(loss=f"{history[-1]:.4g}")
        self._fitted = True
        return history

    # ---------------------------------------------------------------- predict
    def _device(self) -> Optional[torch.device]:
        """Where the guide's parameters live (and predictions run); ``None`` for a guide without parameters."""
        if isinstance(self.guide, torch.nn.Module):
            for p in self.guide.parameters():
                return p.device
        return None

    def _placeholder_targets(self, x: Tensor) -> Tensor:
        # observed values for the guide's first trace of the model: only their shape matters
        if self.likelihood == "categorical":
            return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
        return torch.zeros(x.shape[0], dtype=dtype, device=x.device)

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
        if self.likelihood == "categorical":
            if out.dim() != 3 or out.shape[-1] < 2:
                raise ValueError(f"{fn}: the network's output must be logits of shape (N, C) with C >= 2 for "
                                 f"likelihood='categorical', got {tuple(out.shape[1:])}.")
            return out
        if out.dim() == 3 and out.shape[-1] == 1:
            return out.squeeze(-1)
        if out.dim() != 2:
            raise ValueError(f"{fn}: the network's output must have shape (N, 1) or (N,) for likelihood="
                             f"{self.likelihood!r}, got {tuple(out.shape[1:])}.")
        return out

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
        y = y.to(pred.device)
        if self.likelihood == "categorical":
            if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
                raise TypeError(f"{fn}: {name} must hold integer class labels for likelihood='categorical', got "
                                f"dtype {y.dtype}.")
            c = pred.shape[-1]
            if n and (int(y.min()) < 0 or int(y.max()) >= c):
                raise ValueError(f"{fn}: {name} must be class labels in [0, {c}), got values from {int(y.min())} "
                                 f"to {int(y.max())}.")
            return y
        if self.likelihood == "bernoulli":
            if not bool(((y == 0) | (y == 1)).all()):
                raise ValueError(f"{fn}: {name} must hold 0/1 labels for likelihood='bernoulli', got other values.")
            return y.to(pred.dtype)
        y = y.to(pred.dtype)
        if not bool(torch.isfinite(y).all()):
            raise ValueError(f"{fn}: {name} must be finite, got NaN or inf in {int((~torch.isfinite(y)).sum())} "
                             "entries.")
        return y

    def _outputs(self, data, num_samples: int, fn: str, y=None, targets: bool = False):
        """Raw network outputs (S, N, ...) under ``num_samples`` weight draws, the same draws for every batch.

        With ``targets``: also the concatenated, checked targets of shape (N,).
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
            raise ValueError(f"{fn}: num_samples must be a positive int, got {num_samples!r}.")
        weights, device, outs, ys = None, None, [], []
        if self._built():  # draw before iterating: a DataLoader's iterator takes a seed from torch's RNG
            device = self._device()
            weights = [self.guide() for _ in range(num_samples)]
        for i, (x, yb) in enumerate(self._batches(data, y, fn)):
            if weights is None:
                self._ready(x, fn)
                device = self._device()
                weights = [self.guide() for _ in range(num_samples)]
            if device is not None:
                x = x.to(device)
            out = torch.stack([poutine.condition(self.module, data=w)(x) for w in weights])
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
        if self.likelihood == "categorical":
            return out.softmax(-1)
        if self.likelihood == "bernoulli":
            p = out.sigmoid()
            return torch.stack([1 - p, p], -1)
        return out

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
        if self.likelihood == "gaussian":
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
        S = out.shape[0]
        if self.likelihood == "gaussian":
            lp = dist.Normal(out, out.new_tensor(self._noise_value(fn))).log_prob(y)
            metric = {"rmse": float((out.mean(0) - y).pow(2).mean().sqrt())}
            probs = None
        elif self.likelihood == "bernoulli":
            lp = dist.Bernoulli(logits=out).log_prob(y)
            p = out.sigmoid()
            probs, y = torch.stack([1 - p, p], -1), y.long()
        else:
            lp = out.log_softmax(-1).gather(-1, y.expand(S, -1).unsqueeze(-1)).squeeze(-1)
            probs = out.softmax(-1)
        if probs is not None:
            bma = probs.mean(0)
            metric = {"accuracy": float(metrics.accuracy(bma, y)), "brier": float(metrics.brier_score(bma, y)),
                      "ece": float(metrics.expected_calibration_error(bma, y))}
        metric["log_likelihood"] = float((torch.logsumexp(lp, 0) - math.log(S)).mean())
        return metric
