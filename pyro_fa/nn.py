r"""A Bayesian neural network in a few lines: torch module + prior + likelihood + guide.

The common case that TyXe served (TyXe pins torch 1.12 / Pyro 1.8 and no longer
installs beside current Pyro)::

    net = nn.Sequential(nn.Linear(8, 50), nn.ReLU(), nn.Linear(50, 1))
    bnn = BayesianNetwork(net, GaussianPrior(1.0), likelihood="gaussian", rank=10)
    bnn.fit(loader, pyro.optim.Adam({"lr": 1e-3}), epochs=100)
    bnn.evaluate(x_test, y_test)   # {"rmse": ..., "log_likelihood": ...}

Posterior samples for prediction are drawn one at a time under
``torch.no_grad`` (``Predictive(..., parallel=True)`` fails on ``nn.Linear``
networks in Pyro 1.9).
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
from pyro.infer.autoguide import init_to_median, init_to_value
from pyro.nn import PyroModule
from torch import Tensor

from pyro_fa.infer import AutoLowRankFactorGuide, FactorELBO
from pyro_fa.priors import _FactorisedPrior

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
            if isinstance(noise_scale, bool) or not isinstance(noise_scale, numbers.Real) or not noise_scale > 0:
                raise ValueError(f"BayesianNetwork: noise_scale must be a positive float, got {noise_scale!r}.")
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
        out = self.module(x)
        n = x.shape[0]
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
            history.append(total / max(batches, 1))
            bar.set_postfix(loss=f"{history[-1]:.4g}")
        self._fitted = True
        return history

    # ---------------------------------------------------------------- predict
    @torch.no_grad()
    def predict(self, x: Tensor, num_samples: int = 100) -> Tensor:
        """Network outputs under ``num_samples`` posterior draws of the weights.

        Returns
        -------
        Tensor of shape (num_samples, N, out)
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
            raise ValueError(f"BayesianNetwork.predict: num_samples must be a positive int, got {num_samples!r}.")
        if not self._fitted:
            raise RuntimeError("BayesianNetwork.predict: the network must be fitted first, got an unfitted one. Call fit().")
        outs = []
        for _ in range(num_samples):
            weights = self.guide()
            outs.append(poutine.condition(self.module, data=weights)(x))
        return torch.stack(outs)

    @torch.no_grad()
    def evaluate(self, x: Tensor, y: Tensor, num_samples: int = 100) -> Dict[str, float]:
        """RMSE (Gaussian) or accuracy, and the mean per-point predictive log-likelihood.

        The predictive density is the average of the likelihood over the
        posterior draws: :math:`\\log \\frac1S\\sum_s p(y_n \\mid x_n, \\theta_s)`.
        """
        out = self.predict(x, num_samples)
        S = out.shape[0]
        if self.likelihood == "gaussian":
            mean = out.squeeze(-1)
            noise = self.noise_scale if self.noise_scale is not None else float(pyro.param(f"{self.name}.noise_scale"))
            lp = dist.Normal(mean, noise).log_prob(y)
            metric = {"rmse": float((mean.mean(0) - y).pow(2).mean().sqrt())}
        elif self.likelihood == "bernoulli":
            logits = out.squeeze(-1)
            lp = dist.Bernoulli(logits=logits).log_prob(y.to(logits.dtype))
            metric = {"accuracy": float(((logits.sigmoid().mean(0) > 0.5).to(y.dtype) == y).float().mean())}
        else:
            lp = dist.Categorical(logits=out).log_prob(y)
            probs = out.softmax(-1).mean(0)
            metric = {"accuracy": float((probs.argmax(-1) == y).float().mean())}
        ll = (torch.logsumexp(lp, 0) - math.log(S)).mean()
        metric["log_likelihood"] = float(ll)
        return metric
