r"""Networks and methods of the ``pyro-fa classify`` benchmark.

Every method trains for the same number of epochs (``Budget.epochs``) of
minibatches of ``Budget.batch_size`` and returns the class probabilities of its
predictive (the Bayesian model average over its draws or members) for a list of
input sets; :func:`run_methods` times each one. Training shared between methods
is counted in each method that uses it (the deep ensemble's first member is the
MAP network; SWA, classic SWAG and SWAG-EM follow one trajectory; MultiSWAG's first
member is that trajectory).

=================  ===========================================================================
``map``            Adam (weight decay = prior precision / N), learning rate on a half cosine to 0
``ensemble``       5 MAP networks from different initialisations (Lakshminarayanan et al. 2017)
``dropout``        MC dropout, p = 0.1 after every hidden layer, trained like MAP, kept on when
                   predicting (Gal & Ghahramani 2016)
``swa``            the mean of the iterates collected by SWAG (Izmailov et al. 2018)
``swag``           classic SWAG (Maddox et al. 2019), rank 10, scale tuned on validation data
``swag-em``        :class:`~pyro_fa.SWAG` with ``method="em"`` (online EM factor analysis), rank 10,
                   scale tuned on validation data
``multiswag``      5 SWAG-EM posteriors from different initialisations (Wilson & Izmailov 2020),
                   one scale tuned on validation data
``vifa``           :class:`~pyro_fa.AutoLowRankFactorGuide` (rank 10) with :class:`~pyro_fa.FactorELBO`
``autonormal``     Pyro's ``AutoNormal`` with ``Trace_ELBO``
``lowrank``        Pyro's ``AutoLowRankMultivariateNormal`` (rank 10) with ``Trace_ELBO``
``laplace``        laplace-torch: last-layer KFAC Laplace on the MAP network, GLM predictive,
                   prior precision by marginal likelihood (Daxberger et al. 2021)
``ivon``           IVON (Shen et al. 2024), the variational-learning optimizer ``ivon-opt``
=================  ===========================================================================

SWAG's collection recipe: Adam on the MAP schedule (a half cosine over the whole
budget) for the first ``epochs - swag_epochs`` epochs, then Adam at a constant
rate (reached by ``torch.optim.swa_utils.SWALR`` in one epoch) for
``swag_epochs`` epochs, the weights collected once at the end of each of those
epochs; the posterior scale is then chosen by
:meth:`~pyro_fa.SWAG.tune_scale` (validation log-likelihood of the model
average). The constant rate is chosen among ``swag_lrs`` by the same validation
log-likelihood of SWAG-EM at its tuned scale, one trajectory per candidate; SWA,
classic SWAG and the MultiSWAG members use the chosen rate. The variational methods use a Gaussian prior of precision
``prior_precision``, ``init_scale`` 0.01, Adam at ``vi_lr`` on a half cosine.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from pyro_fa.experiments.classify.data import ClassifyData

__all__ = ["Budget", "METHODS", "NETWORKS", "make_network", "run_methods"]

METHODS = ("map", "ensemble", "dropout", "swa", "swag", "swag-em", "multiswag", "vifa", "autonormal", "lowrank",
           "laplace", "ivon")
PEERS = ("laplace", "ivon")
NETWORKS = ("mlp", "cnn")


@dataclass
class Budget:
    """Training budget and settings shared by all methods."""

    epochs: int = 150
    batch_size: int = 100
    lr: float = 1e-2
    prior_precision: float = 1.0
    dropout: float = 0.1
    swag_epochs: int = 75
    swag_lrs: Tuple[float, ...] = (1e-3, 3e-3)
    rank: int = 10
    ensemble: int = 5
    samples: int = 30
    vi_lr: float = 3e-3
    train_subset: Optional[int] = None  # smoke tests: the first N training points only

    @classmethod
    def quick(cls) -> "Budget":
        return cls(epochs=12, swag_epochs=6, rank=4, samples=10)


# ----------------------------------------------------------------------------- networks


class CNN1d(nn.Module):
    """The small 1-D CNN of the MNIST-1D paper (Greydanus 2020): three strided convolutions of 25 channels.

    Conv1d(1, 25, 5, stride 2, padding 1) - ReLU - Conv1d(25, 25, 3, 2, 1) - ReLU - Conv1d(25, 25, 3, 2, 1) - ReLU -
    Linear(125, C), for inputs of shape (N, 40); optional dropout before each convolution after the first and
    before the linear layer.
    """

    def __init__(self, length: int = 40, num_classes: int = 10, channels: int = 25, dropout: float = 0.0):
        super().__init__()
        drop = (lambda: nn.Dropout(dropout)) if dropout > 0 else nn.Identity
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=1), nn.ReLU(), drop(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(), drop(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(), drop(),
        )
        with torch.no_grad():
            n = self.features(torch.zeros(1, 1, length)).numel()
        self.head = nn.Linear(n, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x.unsqueeze(-2)).flatten(-2))


def make_network(kind: str, data: ClassifyData, dropout: float = 0.0) -> nn.Module:
    """``"mlp"``: ReLU MLP, 2 × 100 hidden units for MNIST-1D (the paper's), 1 × 100 for digits; ``"cnn"``:
    :class:`CNN1d` (MNIST-1D only). ``dropout`` > 0 adds dropout after every hidden layer. The weights take the
    inputs' dtype."""
    if kind == "cnn":
        return CNN1d(data.in_features, data.num_classes, dropout=dropout).to(data.x_train.dtype)
    hidden = (100, 100) if data.name == "mnist1d" else (100,)
    layers, width = [], data.in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout > 0 else [])
        width = h
    layers.append(nn.Linear(width, data.num_classes))
    return nn.Sequential(*layers).to(data.x_train.dtype)


# ----------------------------------------------------------------------------- training


def _epoch_batches(n: int, batch_size: int, generator: torch.Generator):
    perm = torch.randperm(n, generator=generator)
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


def _train_adam(net: nn.Module, x: Tensor, y: Tensor, budget: Budget, seed: int, epochs: Optional[int] = None,
                after_epoch: Optional[Callable[[int, torch.optim.Optimizer], None]] = None, tick=None) -> nn.Module:
    """Adam on the cross-entropy, weight decay prior_precision / N, rate on a half cosine over ``budget.epochs``.

    ``epochs`` (default all) stops early on the same schedule; ``after_epoch(e, opt)`` runs after each epoch.
    """
    n = x.shape[0]
    opt = torch.optim.Adam(net.parameters(), lr=budget.lr, weight_decay=budget.prior_precision / n)
    steps_per_epoch = math.ceil(n / budget.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=budget.epochs * steps_per_epoch)
    g = torch.Generator().manual_seed(seed)
    net.train()
    for e in range(budget.epochs if epochs is None else epochs):
        for idx in _epoch_batches(n, budget.batch_size, g):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
        if after_epoch is not None:
            after_epoch(e, opt)
        if tick is not None:
            tick(1)
    return opt


@torch.no_grad()
def _probs(net: nn.Module, inputs: Sequence[Tensor]) -> List[Tensor]:
    net.eval()
    return [net(x).softmax(-1) for x in inputs]


def _map_net(make_net, data, budget, seed, tick):
    torch.manual_seed(seed)
    net = make_net()
    _train_adam(net, data.x_train, data.y_train, budget, seed, tick=tick)
    return net


def _swag_choice(make_net, data: ClassifyData, budget: Budget, seed: int, tick, classic: bool = True):
    """One trajectory per collection rate of ``budget.swag_lrs``; the one whose SWAG-EM (at its tuned scale)
    has the best validation log-likelihood: ``(rate, net, em, classic, em's ScaleSearch)``."""
    best = None
    for lr in budget.swag_lrs:
        net, em, cl = _swag_run(make_net, data, budget, seed, tick, classic, swag_lr=lr)
        search = em.tune_scale(data.x_val, data.y_val, num_samples=budget.samples, seed=seed)
        if best is None or max(search.log_likelihoods) > max(best[4].log_likelihoods):
            best = (lr, net, em, cl, search)
    best[2].scale = best[4].scale
    return best


def _swag_run(make_net, data: ClassifyData, budget: Budget, seed: int, tick, classic: bool = True,
              swag_lr: Optional[float] = None):
    """One SWAG trajectory (module docstring): returns the network and its SWAG-EM and classic SWAG posteriors."""
    from torch.optim.swa_utils import SWALR

    from pyro_fa import SWAG

    torch.manual_seed(seed)
    net = make_net()
    em = SWAG(net, rank=budget.rank, method="em", warmup=budget.rank, seed=seed)
    cl = SWAG(net, rank=budget.rank, method="swag") if classic else None
    pre = budget.epochs - budget.swag_epochs
    state = {}

    def after_epoch(e, opt):
        if e + 1 == pre:  # start of collection: a constant rate from here on
            steps = math.ceil(data.x_train.shape[0] / budget.batch_size)
            rate = budget.swag_lrs[0] if swag_lr is None else swag_lr
            state["swalr"] = SWALR(opt, swa_lr=rate, anneal_epochs=steps, anneal_strategy="cos")
        elif e + 1 > pre:
            em.collect()
            if cl is not None:
                cl.collect()

    _train_swag(net, data, budget, seed, after_epoch, state, tick)
    return net, em, cl


def _train_swag(net, data, budget, seed, after_epoch, state, tick):
    """:func:`_train_adam`, with the cosine replaced by SWALR's constant rate once collection starts."""
    x, y = data.x_train, data.y_train
    n = x.shape[0]
    opt = torch.optim.Adam(net.parameters(), lr=budget.lr, weight_decay=budget.prior_precision / n)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=budget.epochs * math.ceil(n / budget.batch_size))
    g = torch.Generator().manual_seed(seed)
    net.train()
    for e in range(budget.epochs):
        for idx in _epoch_batches(n, budget.batch_size, g):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
            (state["swalr"] if "swalr" in state else sched).step()
        after_epoch(e, opt)
        tick(1)


def _swag_probs(posterior, inputs, samples: int, seed: int) -> List[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    members = len(getattr(posterior, "members", [posterior]))  # MultiSWAG: the draws split over its members
    for x in inputs:
        out.append(posterior.predict_proba(x, num_samples=max(1, samples // members), generator=gen))
    return out


# ----------------------------------------------------------------------------- variational inference


def _vi_probs(kind: str, make_net, data: ClassifyData, budget: Budget, seed: int, inputs, tick) -> List[Tensor]:
    import pyro
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoLowRankMultivariateNormal, AutoNormal
    from pyro.poutine import condition

    from pyro_fa import FactorELBO, GaussianPrior
    from pyro_fa.nn import BayesianNetwork

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    net = make_net()
    builders = {
        "vifa": None,
        "autonormal": lambda model, init: AutoNormal(model, init_loc_fn=init, init_scale=0.01),
        "lowrank": lambda model, init: AutoLowRankMultivariateNormal(model, init_loc_fn=init, init_scale=0.01,
                                                                      rank=budget.rank),
    }
    bnn = BayesianNetwork(net, GaussianPrior(budget.prior_precision), likelihood="categorical", rank=budget.rank,
                          guide_builder=builders[kind], name=f"classify_{kind}")
    x, y = data.x_train, data.y_train
    n = x.shape[0]
    steps = budget.epochs * math.ceil(n / budget.batch_size)
    optim = pyro.optim.PyroLRScheduler(torch.optim.lr_scheduler.CosineAnnealingLR,
                                       {"optimizer": torch.optim.Adam, "optim_args": {"lr": budget.vi_lr},
                                        "T_max": steps})
    elbo = FactorELBO() if kind == "vifa" else Trace_ELBO()
    svi = SVI(bnn.model, bnn.guide, optim, elbo)
    g = torch.Generator().manual_seed(seed)
    for _ in range(budget.epochs):
        for idx in _epoch_batches(n, budget.batch_size, g):
            svi.step(x[idx], y[idx], dataset_size=n)
            optim.step()
        tick(1)
    out = []
    with torch.no_grad():
        draws = [bnn.guide() for _ in range(budget.samples)]
        for xi in inputs:
            out.append(torch.stack([condition(bnn.module, data=w)(xi).softmax(-1) for w in draws]).mean(0))
    pyro.clear_param_store()
    return out


# ----------------------------------------------------------------------------- all methods


def _peers():
    try:
        from pyro_fa.experiments.classify import baselines as peers
    except ImportError:
        return None, {"laplace": False, "ivon": False}
    return peers, peers.available()


def peers_available() -> Dict[str, bool]:
    """Which peer methods (laplace-torch, IVON) can run here."""
    return _peers()[1]


def run_methods(methods: Sequence[str], network: str, data: ClassifyData, budget: Budget, seed: int,
                tick=lambda k: None) -> Dict[str, dict]:
    """Train and predict with every method of ``methods`` on one dataset, network and seed.

    Returns
    -------
    dict
        ``method -> {"probs": [test, *OOD sets] (N, C) tensors, "seconds": float, "extra": dict}``; a peer
        method that is not installed is left out.
    """
    inputs = [data.x_test, *data.ood.values()]
    make = lambda: make_network(network, data)  # noqa: E731
    out: Dict[str, dict] = {}
    timers: Dict[str, float] = {}

    def timed(key, fn):
        t0 = time.perf_counter()
        value = fn()
        timers[key] = time.perf_counter() - t0
        return value

    want = set(methods)
    maps: List[nn.Module] = []
    if want & {"map", "ensemble", "laplace"}:
        maps.append(timed("map0", lambda: _map_net(make, data, budget, seed, tick)))
        map_probs = timed("map0_pred", lambda: _probs(maps[0], inputs))
        if "map" in want:
            out["map"] = {"probs": map_probs, "seconds": timers["map0"] + timers["map0_pred"]}
    if "ensemble" in want:
        t0 = time.perf_counter()
        for m in range(1, budget.ensemble):
            maps.append(_map_net(make, data, budget, seed + 1000 * m, tick))
        probs = [torch.stack(ps).mean(0) for ps in zip(*[_probs(net, inputs) for net in maps])]
        out["ensemble"] = {"probs": probs, "seconds": timers["map0"] + time.perf_counter() - t0}
    if "dropout" in want:
        def dropout():
            torch.manual_seed(seed)
            net = make_network(network, data, dropout=budget.dropout)
            _train_adam(net, data.x_train, data.y_train, budget, seed, tick=tick)
            net.train()  # dropout on when predicting
            with torch.no_grad():
                return [torch.stack([net(x).softmax(-1) for _ in range(budget.samples)]).mean(0) for x in inputs]
        out["dropout"] = {"probs": timed("dropout", dropout), "seconds": timers["dropout"]}
    if want & {"swa", "swag", "swag-em", "multiswag"}:
        swag_lr, net, em, cl, em_search = timed(
            "traj", lambda: _swag_choice(make, data, budget, seed, tick, classic="swag" in want))
        if "swa" in want:
            def swa():
                with em.sampled_weights(em.loc.detach().clone()):
                    return _probs(net, inputs)
            out["swa"] = {"probs": timed("swa", swa), "seconds": timers["traj"] + timers["swa"]}
        for name, post in (("swag", cl), ("swag-em", em)):
            if name in want:
                def fit(post=post, name=name):
                    search = (em_search if name == "swag-em" else
                              post.tune_scale(data.x_val, data.y_val, num_samples=budget.samples, seed=seed))
                    return _swag_probs(post, inputs, budget.samples, seed), search
                probs, search = timed(name, fit)
                out[name] = {"probs": probs, "seconds": timers["traj"] + timers[name],
                             "extra": {"scale": search.scale, "swag_lr": swag_lr}}
        if "multiswag" in want:
            from pyro_fa import MultiSWAG

            def multi():
                members = [em] + [_swag_run(make, data, budget, seed + 1000 * m, tick, classic=False,
                                            swag_lr=swag_lr)[1] for m in range(1, budget.ensemble)]
                ms = MultiSWAG(members)
                search = ms.tune_scale(data.x_val, data.y_val, num_samples=budget.samples, seed=seed)
                return _swag_probs(ms, inputs, budget.samples * len(members) // 2, seed), search
            probs, search = timed("multiswag", multi)
            out["multiswag"] = {"probs": probs, "seconds": timers["traj"] + timers["multiswag"],
                                "extra": {"scale": search.scale}}
    for kind in ("vifa", "autonormal", "lowrank"):
        if kind in want:
            probs = timed(kind, lambda: _vi_probs(kind, make, data, budget, seed, inputs, tick))
            out[kind] = {"probs": probs, "seconds": timers[kind]}
    peers, have = _peers()
    train_xy, val_xy = (data.x_train, data.y_train), (data.x_val, data.y_val)
    if "laplace" in want and have.get("laplace"):
        probs = timed("laplace", lambda: peers.laplace_probs(maps[0], train_xy, val_xy, inputs, seed))
        out["laplace"] = {"probs": [p.detach() for p in probs], "seconds": timers["map0"] + timers["laplace"]}
    if "ivon" in want and have.get("ivon"):
        def ivon():
            samples = peers.ivon_probs(make, train_xy, val_xy, inputs, budget.epochs, budget.batch_size, seed,
                                       num_samples=budget.samples)
            tick(budget.epochs)
            return [s.detach().mean(0) for s in samples]
        out["ivon"] = {"probs": timed("ivon", ivon), "seconds": timers["ivon"]}
    for v in out.values():
        v.setdefault("extra", {})
    return out


def epochs_of(methods: Sequence[str], budget: Budget) -> int:
    """Training epochs :func:`run_methods` runs for ``methods`` (for progress bars)."""
    want, have = set(methods), peers_available()
    e = budget.epochs
    total = 0
    if want & {"map", "ensemble", "laplace"}:
        total += e
    if "ensemble" in want:
        total += e * (budget.ensemble - 1)
    if "dropout" in want:
        total += e
    if want & {"swa", "swag", "swag-em", "multiswag"}:
        total += e * len(budget.swag_lrs)
    if "multiswag" in want:
        total += e * (budget.ensemble - 1)
    total += e * len(want & {"vifa", "autonormal", "lowrank"})
    if "ivon" in want and have.get("ivon"):
        total += e
    return total
