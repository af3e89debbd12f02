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

Several copies of one MLP regression (seeds, a grid of prior precisions, an
ensemble) train together, as one batch of tensors, with
:meth:`BayesianNetwork.fit_many`::

    bnns = BayesianNetwork.fit_many(net, [GaussianPrior(a) for a in (0.1, 1, 10)], x, y, steps=2000)
    [b.evaluate(x_val, y_val)["log_likelihood"] for b in bnns]

Prediction and evaluation live in :mod:`pyro_fa.nn._prediction`.
"""
from __future__ import annotations

import copy
import itertools
import math
import numbers
from typing import Callable, List, Optional, Sequence, Union

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import init_to_median, init_to_value
from pyro.nn import PyroModule
from torch import Tensor

from pyro_fa.infer import AutoLowRankFactorGuide, FactorELBO
from pyro_fa.infer.priors import PRIORS, FactorisedPrior
from pyro_fa.nn._prediction import _Prediction
from pyro_fa.nn.batched import BatchedMLP, BatchedVI, fit_batched
from pyro_fa.nn.batched.mlp import _architecture

__all__ = ["BayesianNetwork"]



def _gaussian_likelihood(bnn, out: Tensor, y):
    return pyro.sample("y", dist.Normal(out.squeeze(-1), bnn._noise(out)), obs=y)


def _bernoulli_likelihood(bnn, out: Tensor, y):
    return pyro.sample("y", dist.Bernoulli(logits=out.squeeze(-1)), obs=y)


def _categorical_likelihood(bnn, out: Tensor, y):
    return pyro.sample("y", dist.Categorical(logits=out), obs=y)


#: ``likelihood`` option -> ``(network, its output, y) -> the observed site`` (inside the data plate)
_LIKELIHOODS = {"gaussian": _gaussian_likelihood, "bernoulli": _bernoulli_likelihood,
                "categorical": _categorical_likelihood}


def _module_init_loc(mlp, net, x: Tensor) -> Tensor:
    return mlp.flatten(net).to(x)


def _random_init_loc(mlp, net, x: Tensor) -> None:
    return None


#: ``fit_many``'s ``init`` option -> the initial mean of the batched guide (None: its random initialisation)
_INIT_LOCS = {"random": _random_init_loc, "module": _module_init_loc}
_INSTANCES = itertools.count()


class BayesianNetwork(_Prediction):
    r"""A torch module with a prior on every weight, a likelihood and a Pyro guide.

    Parameters
    ----------
    net : torch.nn.Module
        Maps inputs of shape (N, ...) to outputs of shape (N, 1) (Gaussian,
        Bernoulli: the mean or logit) or (N, C) (categorical logits).
    prior : FactorisedPrior
        :class:`~pyro_fa.GaussianPrior`, :class:`~pyro_fa.LaplacePrior` or any
        :class:`~pyro_fa.infer.priors.FactorisedPrior` (the architecture guide's "Add a prior").
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
        if not isinstance(prior, FactorisedPrior):
            raise TypeError(f"BayesianNetwork: prior must be a pyro_fa.infer.priors.FactorisedPrior (GaussianPrior, "
                            f"LaplacePrior or any subclass), got {prior!r}.")
        if not isinstance(likelihood, str) or likelihood not in _LIKELIHOODS:
            raise ValueError(f"BayesianNetwork: likelihood must be one of {tuple(_LIKELIHOODS)}, got {likelihood!r}.")
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
            self.guide = AutoLowRankFactorGuide(self.model, rank=rank, init_loc_fn=init, init_scale=0.01)
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
            return _LIKELIHOODS[self.likelihood](self, out, y)

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

    # -------------------------------------------------------------- many fits
    @classmethod
    def fit_many(
        cls,
        net: torch.nn.Sequential,
        priors,
        x: Tensor,
        y: Tensor,
        steps: int,
        *,
        copies: int = 1,
        lr: float = 1e-3,
        batch_size: Optional[int] = None,
        lr_schedule: Union[str, Callable] = "constant",
        rank: int = 10,
        num_particles: int = 1,
        noise_scale: Optional[float] = None,
        init: str = "random",
        generator: Optional[torch.Generator] = None,
        progress: bool = True,
        name: Optional[str] = None,
    ) -> List["BayesianNetwork"]:
        r"""Train independent copies of an MLP regression as one batch of tensors; return them as networks.

        Replica :math:`r` is the network ``BayesianNetwork(net, prior_r, "gaussian",
        noise_scale=noise_scale, rank=rank)`` — prior :math:`p_r(\theta)` on every weight,
        :math:`y \mid x, \theta \sim N(f_\theta(x), \sigma^2)`, an
        :class:`~pyro_fa.AutoLowRankFactorGuide` :math:`q_r = N(c_r, F_rF_r^\top + \Psi_r)` —
        trained by :class:`~pyro_fa.FactorELBO` and Adam at rate ``lr``, as :meth:`fit` trains
        one; all :math:`R = \mathrm{len(priors)} \times \mathrm{copies}` replicas run together
        through :class:`~pyro_fa.nn.BatchedVI` and :func:`~pyro_fa.nn.fit_batched`
        for several times less time per fit than :meth:`fit`
        one network at a time.

        Parameters
        ----------
        net : torch.nn.Sequential
            ``nn.Sequential(nn.Linear(p, h), nn.ReLU(), …, nn.Linear(h, 1))`` (``nn.Tanh``
            instead of ``nn.ReLU`` also works); its weights are read only with ``init="module"``.
        priors : FactorisedPrior, or a sequence of them (all of one kind)
            GaussianPrior, LaplacePrior or any prior registered with
            :func:`~pyro_fa.infer.priors.register_prior` that has a ``precision`` and a ``batched`` form.
            One prior per group of ``copies`` replicas, e.g. a grid of precisions.
        x : Tensor of shape (N, p)
            Training inputs, shared by all replicas; in ``net``'s dtype and on its device.
        y : Tensor of shape (N,) or (N, 1)
            Training targets (a column, as the network's output, is read as (N,)).
        steps : int
            Adam steps of every replica.
        copies : int, default 1
            Independent replicas per prior (seeds, ensemble members). The result lists
            them prior by prior: replica ``i * copies + j`` is copy ``j`` of ``priors[i]``.
        lr : float, default 1e-3
        batch_size : int, optional
            Rows per replica and step, drawn with replacement; full batch when omitted.
        lr_schedule : {"constant", "cosine"} or callable, default "constant"
            As in :func:`~pyro_fa.nn.fit_batched` (``"cosine"`` decays to 0 over ``steps``).
        rank : int, default 10
        num_particles : int, default 1
        noise_scale : float, optional
            A fixed likelihood noise :math:`\sigma`; learned (from 1) when omitted.
        init : {"random", "module"}, default "random"
            Initial means: drawn per replica as ``nn.Linear`` draws its weights (independent
            seeds), or ``net``'s own weights for every replica.
        generator : torch.Generator, optional
            A CPU generator for the initial means and factors (and for the minibatches when
            ``x`` is on the CPU); torch's global RNG is used where it is not.
        progress : bool, default True
            Show a tqdm progress bar.
        name : str, optional
            The networks are named ``<name>_0``, ``<name>_1``, … in Pyro's param store;
            default names otherwise (see the class).

        Returns
        -------
        list of BayesianNetwork
            One per replica, trained: ``predict``, ``evaluate``, ``learned_noise_scale``
            work as after :meth:`fit`.

        Raises
        ------
        TypeError
            If ``net`` is not an ``nn.Sequential``, a prior is not a GaussianPrior or
            LaplacePrior, or ``x`` / ``y`` are not tensors.
        ValueError
            If ``net`` is another architecture than the MLP above (train it with
            :meth:`fit`), the priors mix kinds, or an argument is out of range or of another
            shape, dtype or device than ``net``'s.

        Notes
        -----
        Minibatches are drawn with replacement per replica and step, where :meth:`fit`
        goes through a loader's epochs; otherwise the objective, the guide's
        parameterisation and initialisation, and the optimiser are :meth:`fit`'s. The
        fitted :math:`q_r` is written into each network's guide (its coordinates permuted
        to Pyro's packing of the sites).

        Examples
        --------
        >>> from pyro_fa import GaussianPrior
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> x = torch.randn(50, 2)
        >>> y = x[:, 0] - x[:, 1]
        >>> bnns = BayesianNetwork.fit_many(net, [GaussianPrior(a) for a in (0.1, 1.0, 10.0)], x, y, steps=50,
        ...                                 lr=1e-2, rank=2, progress=False)
        >>> [sorted(b.evaluate(x, y, num_samples=5)) for b in bnns][0]
        ['log_likelihood', 'rmse']
        """
        fn = "BayesianNetwork.fit_many"
        mlp = _architecture(net, fn)
        prior_list = [priors] if isinstance(priors, FactorisedPrior) else priors
        if not isinstance(prior_list, Sequence) or not prior_list or not all(
                isinstance(p, FactorisedPrior) for p in prior_list):
            raise TypeError(f"{fn}: priors must be a registered pyro_fa.infer.priors.FactorisedPrior (GaussianPrior, "
                            f"LaplacePrior or a subclass), or a non-empty sequence of them, got {priors!r}.")
        if len({type(p) for p in prior_list}) > 1:
            raise ValueError(f"{fn}: priors must all be of one class (one batched prior for every copy), got "
                             f"{sorted({type(p).__name__ for p in prior_list})}.")
        for arg, value in (("steps", steps), ("copies", copies), ("rank", rank), ("num_particles", num_particles)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{fn}: {arg} must be a positive int, got {value!r}.")
        if rank > mlp.dim:
            raise ValueError(f"{fn}: rank must be at most the number of weights D={mlp.dim}, got {rank}.")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
                                       or batch_size < 1):
            raise ValueError(f"{fn}: batch_size must be a positive int or None, got {batch_size!r}.")
        for arg, value in (("lr", lr), ("noise_scale", noise_scale)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not 0 < value < math.inf):
                raise ValueError(f"{fn}: {arg} must be a positive finite float, got {value!r}.")
        if not isinstance(init, str) or init not in _INIT_LOCS:
            raise ValueError(f"{fn}: init must be 'random' or 'module', got {init!r}.")
        if generator is not None and (not isinstance(generator, torch.Generator) or generator.device.type != "cpu"):
            got = f"one on {generator.device}" if isinstance(generator, torch.Generator) else type(generator).__name__
            raise ValueError(f"{fn}: generator must be a CPU torch.Generator, got {got}.")
        y = _check_shared_data(net, mlp, x, y, fn)
        kind = type(prior_list[0]).name
        if PRIORS.get(kind) is not type(prior_list[0]) or not hasattr(prior_list[0], "precision"):
            raise ValueError(f"{fn}: priors must be of a class registered with register_prior and with a precision, "
                             f"got {type(prior_list[0]).__name__} (registered name {kind!r}).")
        # BatchedVI gives every prior by its precision, one over its variance (Laplace: b = 1 / sqrt(2 alpha))
        alphas = [p.precision for p in prior_list]
        R = len(prior_list) * copies
        vi = BatchedVI(mlp, "fa", kind, x.new_tensor(alphas).repeat_interleave(copies), float(lr), replicas=R,
                       rank=int(rank), init_loc=_INIT_LOCS[init](mlp, net, x),
                       noise_scale=noise_scale, generator=generator, dtype=x.dtype, device=x.device)
        fit_batched(vi, x, y, steps, batch_size=batch_size, particles=num_particles, lr_schedule=lr_schedule,
                    generator=generator if generator is not None and x.device.type == "cpu" else None,
                    progress=progress)
        state = vi.state()
        networks = []
        for r in range(R):
            bnn = cls(copy.deepcopy(net), prior_list[r // copies], "gaussian", noise_scale=noise_scale, rank=int(rank),
                      num_particles=num_particles, name=None if name is None else f"{name}_{r}")
            bnn._load_replica(mlp, state, r, x)
            networks.append(bnn)
        return networks

    def _load_replica(self, mlp: BatchedMLP, state, r: int, x: Tensor) -> None:
        """Build the guide (one trace of the model) and write replica ``r`` of a BatchedVI ``"fa"`` state into it."""
        x0 = x[:1]
        cuda = [x.device] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # building draws from the prior: leave the caller's RNG alone
            self.guide(x0, self._placeholder_targets(x0))
        order = _packing_order(mlp, self.guide).to(x.device)
        with torch.no_grad():
            self.guide.loc.copy_(state["loc"][r][order])
            self.guide.factor.copy_(state["factor"][r][order])
        self.guide.scale = state["log_scale"][r].exp()[order]
        if self.noise_scale is None:
            key, store = f"{self.name}.noise_scale", pyro.get_param_store()
            if key in store:
                del store[key]
            pyro.param(key, state["log_noise"][r].exp(), constraint=dist.constraints.positive)
        self._fitted = True


def _packing_order(mlp: BatchedMLP, guide) -> Tensor:
    """``order`` with ``guide_vector = batched_vector[order]``: the BatchedMLP layout in the guide's site packing."""
    sites = mlp.unflatten(torch.arange(mlp.dim, dtype=torch.float64))  # every coordinate's index, by site
    shapes = guide._unconstrained_shapes  # the sites in the order an AutoContinuous guide packs them
    assert set(shapes) == set(sites) and all(tuple(shapes[k]) == tuple(sites[k].shape) for k in shapes), shapes
    return torch.cat([sites[k].reshape(-1) for k in shapes]).long()


def _check_shared_data(net, mlp: BatchedMLP, x, y, fn: str) -> Tensor:
    """x (N, p) and y (N,) or (N, 1): finite tensors in the network's dtype and on its device; y as (N,)."""
    p = mlp.in_features
    for arg, value in (("x", x), ("y", y)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{fn}: {arg} must be a torch.Tensor, got {type(value).__name__}.")
    if x.dim() != 2 or x.shape[1] != p or x.shape[0] < 1:
        raise ValueError(f"{fn}: x must have shape (N, {p}) with N >= 1, got {tuple(x.shape)}.")
    if tuple(y.shape) == (x.shape[0], 1):
        y = y.squeeze(-1)  # a column of targets, as the network's (N, 1) output (and torch's mse_loss) takes them
    if tuple(y.shape) != (x.shape[0],):
        raise ValueError(f"{fn}: y must have shape ({x.shape[0]},) or ({x.shape[0]}, 1), one target per row of x, "
                         f"got {tuple(y.shape)}." + (" Flatten it (y.reshape(-1))." if y.numel() == x.shape[0] else ""))
    weight = next(net.parameters())
    for arg, value in (("x", x), ("y", y)):
        if value.dtype != weight.dtype or value.device != weight.device:
            raise ValueError(f"{fn}: {arg} must have net's dtype {weight.dtype} and device {weight.device}, got "
                             f"{value.dtype} on {value.device}.")
    return y
