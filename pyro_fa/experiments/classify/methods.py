r"""Methods of the ``pyro-fa classify`` benchmark, each at its best under one stated budget.

Every method trains for ``Budget.epochs`` epochs of minibatches of ``Budget.batch_size``
(MNIST-1D's reference recipe, Greydanus 2020: Adam at a constant rate of 1e-2 on
minibatches of 100; 150 epochs of the 3 600 training signals are 5 400 steps, the
paper's notebook runs 6 000) and returns its predictive for a list of input sets:
the weight draws' or members' class probabilities, (S, N, C), when it samples (so
that the mutual information can score OOD inputs), else the probabilities (N, C).
Every hyperparameter is chosen on the validation part, by the validation NLL of the
method's own predictive, over a small grid of :class:`Budget` (the budget: one
training per grid point):

=================  ===========================================================================
``map``            Adam, constant rate, weight decay = prior precision / N; the prior precision
                   from ``prior_precisions`` (its smallest, 0.01, is the reference's no decay), by
                   the validation NLL after temperature scaling (``map_select="tempered"``, the
                   default; ``"nll"``: the raw validation NLL)
``ensemble``       5 MAP networks at the chosen prior precision, different initialisations
                   (Lakshminarayanan et al. 2017)
``dropout``        MC dropout at the chosen prior precision, rate from ``dropouts``, kept on when
                   predicting (Gal & Ghahramani 2016)
``swa``            the mean of the iterates collected by SWAG (Izmailov et al. 2018)
``swag``           classic SWAG (Maddox et al. 2019), rank 10, scale by ``tune_scale``
``swag-em``        :class:`~pyro_fa.SWAG` with ``method="em"`` (online EM factor analysis), rank 10,
                   scale by ``tune_scale``; the collection rate from ``swag_lrs``
``swag-em-glm``    the same posterior, linearised (GLM) predictive with the probit approximation
                   (Immer, Korzepa & Bauer 2021), its scale tuned for that predictive
``multiswag``      5 SWAG-EM posteriors from different initialisations (Wilson & Izmailov 2020)
``multiswag-glm``  the same mixture, GLM probit predictive
``vifa``           :class:`~pyro_fa.AutoLowRankFactorGuide` (rank 10) with :class:`~pyro_fa.FactorELBO`,
                   Adam rate from ``vi_lrs`` on a half cosine
``autonormal``     Pyro's ``AutoNormal`` with ``Trace_ELBO``, at the rate chosen for VIFA
``lowrank``        Pyro's ``AutoLowRankMultivariateNormal`` (rank 10) with ``Trace_ELBO``, likewise
``factor-laplace`` :class:`pyro_fa.laplace.FactorLaplace` on the MAP network: all weights, GGN fitted
                   by factor analysis (rank 20), GLM probit, prior precision by marginal likelihood
``factor-laplace-grid`` the same, prior precision by validation grid search (1e-4 to 1e8)
``factor-laplace-lin`` the same, prior precision by the marginal likelihood of the linearised model at its
                   own mode (``mode="linearized"``, Antorán et al. 2022)
``laplace``        laplace-torch, last-layer KFAC, GLM probit, prior precision by marginal likelihood
``laplace-grid``   the same, prior precision by laplace-torch's validation grid search (1e-4 to 1e8:
                   the top of the range is the MAP limit)
``laplace-diag``   laplace-torch, all weights, diagonal GGN, GLM probit, marginal likelihood
``laplace-kron``   laplace-torch, all weights, KFAC GGN, GLM probit, marginal likelihood
``laplace-full``   laplace-torch, all weights, full (D x D) GGN, GLM probit, marginal likelihood; only for
                   networks of at most ``FULL_MAX_WEIGHTS`` (8 000) weights, skipped with a warning above
``ivon``           IVON (Shen et al. 2024), ``ivon_lrs`` x ``ivon_hess_inits``
``factor-ivon``    :class:`~pyro_fa.optim.FactorIVON` (ours, rank ``rank``), IVON's recipe and grid
                   (:mod:`~pyro_fa.experiments.classify.factor_ivon_rows`)
``factor-ivon-ensemble`` 5 FactorIVON networks at the chosen setting, different seeds
=================  ===========================================================================

Every row of ``TEMPERED`` also appears as ``<row>+T``: the model average's log
probabilities divided by a temperature fitted on the validation part
(:func:`pyro_fa.predictive.fit_temperature`), for ours and the peers alike.

The variational guides and the SWAG family use the prior precision chosen for MAP
(their Gaussian prior; SWAG's weight decay). SWAG's collection: Adam on the MAP
schedule for the first ``epochs - swag_epochs`` epochs, then a constant Adam rate
reached by ``torch.optim.swa_utils.SWALR`` in one epoch, one collection per epoch;
the scale by :meth:`~pyro_fa.SWAG.tune_scale` (its default rule; scale 0, the mean,
is a candidate). Their "+T" rows choose their own scale by the *tempered* validation
NLL (``tune_scale(temperature=True)``: each candidate scored after its own temperature),
so that the spread is not asked to cure an overconfidence that the temperature cures.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from pyro_fa.experiments._io import pay_lazy_imports
from pyro_fa.experiments.classify.data import ClassifyData
from pyro_fa.experiments.classify.factor_ivon_rows import FACTOR_IVON_ROWS, run_factor_ivon
from pyro_fa.experiments.classify.networks import NETWORKS, CNN1d, make_network
from pyro_fa.experiments.classify.posthoc import FACTOR_LAPLACE_ROWS, LAPLACE_ROWS, PEERS, TEMPERED, \
    average_log_probs, can_run, peers_available, run_factor_laplace, run_peers, tempered_rows

__all__ = ["Budget", "METHODS", "NETWORKS", "PEERS", "TEMPERED", "peers_available", "CNN1d", "make_network", "run_methods", "epochs_of"]

METHODS = ("map", "ensemble", "dropout", "swa", "swag", "swag-em", "swag-em-glm", "multiswag", "multiswag-glm",
           "vifa", "autonormal", "lowrank", "factor-laplace", "factor-laplace-grid", "factor-laplace-lin",
           "laplace", "laplace-grid", "laplace-diag", "laplace-kron", "laplace-full", "ivon", *FACTOR_IVON_ROWS)
#: rows with their own grid, which need neither MAP's network nor its prior precision
OWN_GRID = frozenset({"ivon", *FACTOR_IVON_ROWS})



#: budget fields that change only these rows (and their "+T" rows): a ``--rows-from`` run may differ from the
#: runs it merges into in these fields (see :func:`pyro_fa.experiments.classify.command.merge_runs`)
ROW_ONLY_FIELDS = {"ivon_lrs": ("ivon", *FACTOR_IVON_ROWS), "ivon_hess_inits": ("ivon", *FACTOR_IVON_ROWS),
                   "dropouts": ("dropout",),
                   "vi_lrs": ("vifa", "autonormal", "lowrank"),
                   "laplace_rank": tuple(FACTOR_LAPLACE_ROWS)}


#: the hyperparameter grids of :class:`Budget` (one training per value)
GRIDS = ("prior_precisions", "swag_lrs", "dropouts", "vi_lrs", "ivon_lrs", "ivon_hess_inits")


@dataclass
class Budget:
    """Training budget, shared settings and the hyperparameter grids (one training per grid point)."""

    epochs: int = 150
    batch_size: int = 100
    lr: float = 1e-2
    prior_precisions: Tuple[float, ...] = (1e-2, 1.0, 3.0, 10.0, 30.0)
    map_select: str = "tempered"
    dropouts: Tuple[float, ...] = (0.05, 0.1, 0.2)
    swag_epochs: int = 75
    swag_lrs: Tuple[float, ...] = (1e-3, 3e-3)
    rank: int = 10
    ensemble: int = 5
    samples: int = 30
    vi_lrs: Tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    # IVON's choices sat at the top rate (0.4) of the grid {0.05, ..., 0.4} x {0.03, 0.1, 0.5} on most seeds, and
    # beyond it it gained (benchmarks/bench_ivon_grid.py): the grid where its validation optimum lay
    ivon_lrs: Tuple[float, ...] = (0.4, 0.8, 1.6, 3.2, 6.4)
    ivon_hess_inits: Tuple[float, ...] = (0.01, 0.03, 0.1, 0.5, 2.0)
    # FactorLaplace's rank: at rank 20 the digits MLP's (D = 7 510) GLM predictive at a fixed prior precision
    # fell short of the dense GGN Laplace's spread on OOD inputs; at 100 it is close, at 300 equal (docs/laplace.md)
    laplace_rank: int = 100
    temperature: bool = True
    train_subset: Optional[int] = None  # smoke tests: the first N training points only

    def __post_init__(self):
        if self.map_select not in MAP_SCORES:
            raise ValueError(f"Budget: map_select must be 'tempered' or 'nll', got {self.map_select!r}.")
        for name in GRIDS:
            values = tuple(getattr(self, name))
            if not values or not all(math.isfinite(v) and v > 0 for v in values) or len(set(values)) < len(values):
                raise ValueError(f"Budget: {name} must be distinct positive finite numbers, got {values!r}.")
            if name == "dropouts" and max(values) >= 1:
                raise ValueError(f"Budget: dropouts must be rates in (0, 1), got {values!r}.")
        if isinstance(self.laplace_rank, bool) or not isinstance(self.laplace_rank, int) or self.laplace_rank < 1:
            raise ValueError(f"Budget: laplace_rank must be a positive integer, got {self.laplace_rank!r}.")

    @classmethod
    def quick(cls) -> "Budget":
        """12 epochs, one point per grid and FactorLaplace at rank 20: every method runs, nothing is tuned
        (``--quick``)."""
        return cls(epochs=12, swag_epochs=6, rank=4, samples=10, prior_precisions=(1.0,), dropouts=(0.1,),
                   swag_lrs=(3e-3,), vi_lrs=(3e-3,), ivon_lrs=(0.1,), ivon_hess_inits=(0.5,), laplace_rank=20)


def _nll(probs: Tensor, y: Tensor) -> float:
    """NLL per point of the model average; ``probs`` (N, C) or draws (S, N, C)."""
    p = probs.mean(0) if probs.dim() == 3 else probs
    return float(-p.gather(-1, y[:, None]).clamp_min(torch.finfo(p.dtype).tiny).log().mean())


# ----------------------------------------------------------------------------- training


def _epoch_batches(n: int, batch_size: int, generator: torch.Generator, device=None):
    """One epoch's minibatch indices, drawn by the CPU ``generator`` (the same order on every device)."""
    perm = torch.randperm(n, generator=generator).to(device)
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


def _train_adam(net: nn.Module, data: ClassifyData, budget: Budget, seed: int, prior_precision: float,
                after_epoch: Optional[Callable[[int, torch.optim.Optimizer, dict], None]] = None, tick=None) -> None:
    """The reference recipe: Adam at ``budget.lr`` (constant), weight decay prior_precision / N, ``budget.epochs``.

    ``after_epoch(e, opt, state)`` runs after each epoch; a scheduler it puts in ``state["sched"]`` is stepped
    after every later step (SWAG's constant collection rate).
    """
    x, y = data.x_train, data.y_train
    n = x.shape[0]
    opt = torch.optim.Adam(net.parameters(), lr=budget.lr, weight_decay=prior_precision / n)
    g = torch.Generator().manual_seed(seed)
    state: dict = {}
    net.train()
    for e in range(budget.epochs):
        for idx in _epoch_batches(n, budget.batch_size, g, x.device):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
            if "sched" in state:
                state["sched"].step()
        if after_epoch is not None:
            after_epoch(e, opt, state)
        if tick is not None:
            tick(1)


@torch.no_grad()
def _probs(net: nn.Module, inputs: Sequence[Tensor]) -> List[Tensor]:
    net.eval()
    return [net(x).softmax(-1) for x in inputs]


@torch.no_grad()
def _mc_dropout(net: nn.Module, inputs: Sequence[Tensor], samples: int) -> List[Tensor]:
    net.train()  # dropout on when predicting
    return [torch.stack([net(x).softmax(-1) for _ in range(samples)]) for x in inputs]


def _map_net(make_net, data, budget, seed, prior_precision, tick):
    torch.manual_seed(seed)
    net = make_net()
    _train_adam(net, data, budget, seed, prior_precision, tick=tick)
    return net


def _tempered_nll(probs: Tensor, y: Tensor) -> float:
    """Validation NLL of the model average after temperature scaling on the same points (Guo et al. 2017)."""
    from pyro_fa.predictive import fit_temperature

    logs = average_log_probs(probs)
    return _nll((logs / fit_temperature(logs, y)).softmax(-1), y)


#: ``Budget.map_select`` -> (the key of MAP's grid scores in the results, the score of a grid point)
MAP_SCORES = {"tempered": ("val_nll_tempered", _tempered_nll), "nll": ("val_nll", _nll)}


def _choose(grid, fit, y_val, score=_nll) -> Tuple[object, object, Dict[str, float]]:
    """``fit(value) -> (model, val_probs)`` for each grid value; the value of least ``score(val_probs, y_val)``.

    Returns ``(value, model, {str(value): score})``; a single-value grid is fitted without scoring.
    """
    best, scores = None, {}
    for value in grid:
        model, p_val = fit(value)
        if len(grid) == 1:
            return value, model, {}
        scores[repr(value)] = score(p_val, y_val)
        if best is None or scores[repr(value)] < scores[repr(best[0])]:
            best = (value, model)
    return best[0], best[1], scores


# ----------------------------------------------------------------------------- SWAG


def _swag_run(make_net, data: ClassifyData, budget: Budget, seed: int, prior_precision: float, swag_lr: float,
              tick, classic: bool = True):
    """One SWAG trajectory (module docstring): the network and its SWAG-EM and classic SWAG posteriors."""
    from torch.optim.swa_utils import SWALR

    from pyro_fa import SWAG

    torch.manual_seed(seed)
    net = make_net()
    em = SWAG(net, rank=budget.rank, method="em", warmup=budget.rank, seed=seed)
    cl = SWAG(net, rank=budget.rank, method="swag") if classic else None
    pre = budget.epochs - budget.swag_epochs
    steps = math.ceil(data.x_train.shape[0] / budget.batch_size)

    def after_epoch(e, opt, state):
        if e + 1 == pre:  # start of collection: a constant rate from here on
            state["sched"] = SWALR(opt, swa_lr=swag_lr, anneal_epochs=steps, anneal_strategy="cos")
        elif e + 1 > pre:
            em.collect()
            if cl is not None:
                cl.collect()

    _train_adam(net, data, budget, seed, prior_precision, after_epoch, tick)
    return net, em, cl


def _tune(posterior, data: ClassifyData, budget: Budget, seed: int, pred_type: str = "nn",
          temperature: bool = False):
    """``posterior.tune_scale`` on the validation part: ``(ScaleSearch, its warnings)``; the warnings (a flat
    curve, the best at an edge) are kept for the results instead of printed once per seed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        search = posterior.tune_scale(data.x_val, data.y_val, num_samples=budget.samples, seed=seed,
                                      pred_type=pred_type, temperature=temperature)
    return search, [str(w.message) for w in caught]


def _add_tempered_choice(row: dict, posterior, predict, data, budget, seed, pred_type: str = "nn") -> dict:
    """The "+T" row's own scale: ``tune_scale(temperature=True)`` (each candidate scored after a temperature
    fitted at it), and the probabilities at that scale (``row["probs_T"]``, which the "+T" row tempers); the
    posterior's scale is left as it was."""
    before = posterior.scale
    t0 = time.perf_counter()
    search = _tune(posterior, data, budget, seed, pred_type, temperature=True)
    row["probs_T"] = predict() if search[0].scale != before else row["probs"]
    row["extra_T"] = _search_extra(search, tempered_scale_choice=True)
    row["seconds_T"] = row["seconds"] + time.perf_counter() - t0
    posterior.scale = before
    return row


@torch.no_grad()
def _glm_probs(posterior, inputs) -> List[Tensor]:
    """The linearised (GLM) predictive with the probit approximation, (N, C) per input set."""
    return [posterior.predict_proba(x, pred_type="glm", link_approx="probit") for x in inputs]


def _chosen_ll(search) -> float:
    return float(search.log_likelihoods[list(search.scales).index(search.scale)])


def _swag_choice(make_net, data, budget, seed, prior_precision, tick, classic: bool = True):
    """One trajectory per collection rate of ``budget.swag_lrs``; the one whose SWAG-EM (at its chosen scale)
    has the best validation log-likelihood: ``(rate, net, em, classic, (em's ScaleSearch, its warnings))``."""
    best = None
    for lr in budget.swag_lrs:
        net, em, cl = _swag_run(make_net, data, budget, seed, prior_precision, lr, tick, classic)
        search = _tune(em, data, budget, seed)
        if best is None or _chosen_ll(search[0]) > _chosen_ll(best[4][0]):
            best = (lr, net, em, cl, search)
    best[2].scale = best[4][0].scale
    return best


def _swag_samples(posterior, inputs, samples: int, seed: int) -> List[Tensor]:
    """Per-draw class probabilities, (S, N, C) per input set (MultiSWAG: the draws split over its members)."""
    gen = torch.Generator().manual_seed(seed)  # num_samples counts the draws in all (a mixture splits them)
    return [posterior.predictive_samples(x, num_samples=samples, fn=lambda z: z.softmax(-1), generator=gen)
            for x in inputs]


def _search_extra(tuned, **more) -> dict:
    search, caught = tuned
    return {"scale": search.scale, "rule": getattr(search, "rule", None), "reason": getattr(search, "reason", None),
            "warnings": caught, **more}


# ----------------------------------------------------------------------------- variational inference


def _vi_fit(kind: str, make_net, data: ClassifyData, budget: Budget, seed: int, prior_precision: float, lr: float,
            inputs, tick) -> List[Tensor]:
    """Train one guide (Adam at ``lr`` on a half cosine) and return its draws' probabilities, (S, N, C) per set."""
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
    bnn = BayesianNetwork(net, GaussianPrior(prior_precision), likelihood="categorical", rank=budget.rank,
                          guide_builder=builders[kind], name=f"classify_{kind}")
    x, y = data.x_train, data.y_train
    n = x.shape[0]
    steps = budget.epochs * math.ceil(n / budget.batch_size)
    optim = pyro.optim.PyroLRScheduler(torch.optim.lr_scheduler.CosineAnnealingLR,
                                       {"optimizer": torch.optim.Adam, "optim_args": {"lr": lr}, "T_max": steps})
    elbo = FactorELBO() if kind == "vifa" else Trace_ELBO()
    svi = SVI(bnn.model, bnn.guide, optim, elbo)
    g = torch.Generator().manual_seed(seed)
    for _ in range(budget.epochs):
        for idx in _epoch_batches(n, budget.batch_size, g, x.device):
            svi.step(x[idx], y[idx], dataset_size=n)
            optim.step()
        tick(1)
    with torch.no_grad():
        draws = [bnn.guide() for _ in range(budget.samples)]
        out = [torch.stack([condition(bnn.module, data=w)(xi).softmax(-1) for w in draws]) for xi in inputs]
    pyro.clear_param_store()
    return out


# ----------------------------------------------------------------------------- all methods


#: rows that start from the MAP network itself (the rest use only its prior precision, or neither)
NEED_MAP_NET = ("ensemble", *FACTOR_LAPLACE_ROWS, *LAPLACE_ROWS)


def run_methods(methods: Sequence[str], network: str, data: ClassifyData, budget: Budget, seed: int,
                tick=lambda k: None, prior_precision: Optional[float] = None) -> Dict[str, dict]:
    """Train and predict with every method of ``methods`` on one dataset, network and seed.

    ``prior_precision``: MAP's choice from an earlier run of the same budget and seed (rows added to a table
    later): MAP's grid is not trained again, nor its row produced; the MAP network is trained once at that
    value where a row starts from it (:data:`NEED_MAP_NET`), the network the grid chose (training is
    deterministic).

    Returns
    -------
    dict
        ``method -> {"probs": [test, *OOD sets], "seconds": float, "extra": dict}``, each probability
        tensor of shape (S, N, C) (draws or members) or (N, C) (a deterministic predictive); ``extra`` holds
        the values chosen on validation and their validation NLLs. A peer that is not installed is left out.
        ``seconds`` counts the method's own training and grid; the prior-precision grid is counted in MAP's.
    """
    inputs = [data.x_val, data.x_test, *data.ood.values()]  # the validation part first: for the "+T" rows
    y_val = data.y_val
    make = lambda: make_network(network, data)  # noqa: E731
    out: Dict[str, dict] = {}
    want = [m for m in methods if can_run(m, peers_available())]
    pay_lazy_imports()  # not in MAP's seconds, the unit of every row's cost
    clock = time.perf_counter

    # MAP: the prior precision every other method uses (but IVON, which has its own grid)
    pp, map_net, t_map = budget.prior_precisions[-1], None, 0.0
    if prior_precision is not None:
        if "map" in want:
            raise ValueError(f"run_methods: the map row needs MAP's own grid; leave 'map' out of methods with "
                             f"prior_precision={prior_precision!r}.")
        pp = prior_precision
        if set(want) & set(NEED_MAP_NET):
            t0 = clock()
            map_net = _map_net(make, data, budget, seed, pp, tick)
            t_map = (clock() - t0) * len(budget.prior_precisions)  # as if the grid ran: the rows' share below
    elif set(want) - OWN_GRID:
        t0 = clock()

        def fit_map(value):
            net = _map_net(make, data, budget, seed, value, tick)
            return net, _probs(net, [data.x_val])[0]
        # "tempered": the network that is best once calibrated, as every "+T" row is; the raw NLL prefers
        # strong decay, which costs accuracy (MNIST-1D MLP: 60.7 % against 65 % at the tempered choice)
        key, score = MAP_SCORES[budget.map_select]
        pp, map_net, scores = _choose(budget.prior_precisions, fit_map, y_val, score)
        map_probs = _probs(map_net, inputs)
        t_map = clock() - t0
        if "map" in want:
            out["map"] = {"probs": map_probs, "seconds": t_map, "extra": {"prior_precision": pp, key: scores}}
    if "ensemble" in want:
        t0 = clock()
        nets = [map_net] + [_map_net(make, data, budget, seed + 1000 * m, pp, tick) for m in range(1, budget.ensemble)]
        out["ensemble"] = {"probs": [torch.stack(ps) for ps in zip(*[_probs(net, inputs) for net in nets])],
                           "seconds": clock() - t0 + t_map / len(budget.prior_precisions)}
    if "dropout" in want:
        t0 = clock()

        def fit_dropout(rate):
            torch.manual_seed(seed)
            net = make_network(network, data, dropout=rate)
            _train_adam(net, data, budget, seed, pp, tick=tick)
            return net, _mc_dropout(net, [data.x_val], budget.samples)[0]
        rate, net, scores = _choose(budget.dropouts, fit_dropout, y_val)
        torch.manual_seed(seed)
        out["dropout"] = {"probs": _mc_dropout(net, inputs, budget.samples), "seconds": clock() - t0,
                          "extra": {"dropout": rate, "val_nll": scores}}
    if set(want) & {"swa", "swag", "swag-em", "swag-em-glm", "multiswag", "multiswag-glm"}:
        _run_swag_family(want, make, data, budget, seed, pp, inputs, tick, out)
    vi_lr = budget.vi_lrs[len(budget.vi_lrs) // 2]
    for kind in ("vifa", "autonormal", "lowrank"):
        if kind in want:
            t0 = clock()

            def fit_vi(lr, kind=kind):
                probs = _vi_fit(kind, make, data, budget, seed, pp, lr, inputs, tick)
                return probs, probs[0]
            # VIFA's rate on the grid; Pyro's guides at the rate VIFA chose (the budget: one grid per family)
            grid = budget.vi_lrs if kind == "vifa" else (vi_lr,)
            lr, probs, scores = _choose(grid, fit_vi, y_val)
            vi_lr = lr if kind == "vifa" else vi_lr
            out[kind] = {"probs": probs, "seconds": clock() - t0, "extra": {"lr": lr, "val_nll": scores}}
    run_factor_laplace(want, map_net, data, budget, seed, inputs, out, t_map / len(budget.prior_precisions))
    run_peers(want, make, map_net, data, budget, seed, inputs, tick, out, t_map / len(budget.prior_precisions))
    run_factor_ivon(want, make, data, budget, seed, inputs, tick, out)
    for v in out.values():  # the results on the CPU, whatever device the methods ran on
        for k in ("probs", "probs_T"):
            if k in v:
                v[k] = [p.cpu() for p in v[k]]
    rows = {}
    for m in METHODS:
        if m in out:
            v = out[m]
            rows[m] = {"probs": v["probs"][1:], "seconds": v["seconds"], "extra": v.get("extra", {})}
    if budget.temperature:
        rows.update(tempered_rows(out, y_val.cpu()))
    return rows


def _run_swag_family(want, make, data, budget, seed, pp, inputs, tick, out) -> None:
    want = set(want)
    t0 = time.perf_counter()
    swag_lr, net, em, cl, em_search = _swag_choice(make, data, budget, seed, pp, tick, classic="swag" in want)
    t_traj = time.perf_counter() - t0
    if "swa" in want:
        with em.sampled_weights(em.loc.detach().clone()):
            out["swa"] = {"probs": _probs(net, inputs), "seconds": t_traj, "extra": {"swag_lr": swag_lr}}
    for name, post in (("swag", cl), ("swag-em", em)):
        if name in want:
            t0 = time.perf_counter()
            search = em_search if name == "swag-em" else _tune(post, data, budget, seed)
            out[name] = {"probs": _swag_samples(post, inputs, budget.samples, seed),
                         "seconds": t_traj + time.perf_counter() - t0, "extra": _search_extra(search, swag_lr=swag_lr)}
            if name in TEMPERED and budget.temperature:
                _add_tempered_choice(out[name], post, lambda p=post: _swag_samples(p, inputs, budget.samples, seed),
                                     data, budget, seed)
    if "swag-em-glm" in want:
        t0 = time.perf_counter()
        search = _tune(em, data, budget, seed, pred_type="glm")
        out["swag-em-glm"] = {"probs": _glm_probs(em, inputs), "seconds": t_traj + time.perf_counter() - t0,
                              "extra": _search_extra(search, swag_lr=swag_lr)}
        if budget.temperature:
            _add_tempered_choice(out["swag-em-glm"], em, lambda: _glm_probs(em, inputs), data, budget, seed, "glm")
    if want & {"multiswag", "multiswag-glm"}:
        from pyro_fa import MultiSWAG

        t0 = time.perf_counter()
        members = [em] + [_swag_run(make, data, budget, seed + 1000 * m, pp, swag_lr, tick, classic=False)[1]
                          for m in range(1, budget.ensemble)]
        ms = MultiSWAG(members)
        t_members = time.perf_counter() - t0
        if "multiswag" in want:
            search = _tune(ms, data, budget, seed)
            out["multiswag"] = {"probs": _swag_samples(ms, inputs, budget.samples * len(members) // 2, seed),
                                "seconds": t_traj + time.perf_counter() - t0, "extra": _search_extra(search)}
            if budget.temperature:
                _add_tempered_choice(out["multiswag"], ms, lambda: _swag_samples(
                    ms, inputs, budget.samples * len(members) // 2, seed), data, budget, seed)
        if "multiswag-glm" in want:
            t1 = time.perf_counter()
            search = _tune(ms, data, budget, seed, pred_type="glm")
            out["multiswag-glm"] = {"probs": _glm_probs(ms, inputs),
                                    "seconds": t_traj + t_members + time.perf_counter() - t1,
                                    "extra": _search_extra(search)}
            if budget.temperature:
                _add_tempered_choice(out["multiswag-glm"], ms, lambda: _glm_probs(ms, inputs), data, budget, seed,
                                     "glm")


def epochs_of(methods: Sequence[str], budget: Budget, reuse_prior: bool = False) -> int:
    """Training epochs :func:`run_methods` runs for ``methods`` (for progress bars); ``reuse_prior``: with an
    earlier run's prior precision (MAP trained once, and only for the rows of :data:`NEED_MAP_NET`)."""
    have = peers_available()
    want = {m for m in methods if can_run(m, have)}
    e = budget.epochs
    if reuse_prior:
        total = e * bool(want & set(NEED_MAP_NET))
    else:
        total = e * len(budget.prior_precisions) if want - OWN_GRID else 0
    total += e * (budget.ensemble - 1) * ("ensemble" in want)
    total += e * len(budget.dropouts) * ("dropout" in want)
    if want & {"swa", "swag", "swag-em", "swag-em-glm", "multiswag", "multiswag-glm"}:
        total += e * len(budget.swag_lrs)
    total += e * (budget.ensemble - 1) * bool(want & {"multiswag", "multiswag-glm"})
    total += e * (len(budget.vi_lrs) * ("vifa" in want) + len(want & {"autonormal", "lowrank"}))
    total += e * len(budget.ivon_lrs) * len(budget.ivon_hess_inits) * ("ivon" in want)
    total += e * len(budget.ivon_lrs) * len(budget.ivon_hess_inits) * bool(want & set(FACTOR_IVON_ROWS))
    total += e * (budget.ensemble - 1) * (FACTOR_IVON_ROWS[1] in want)
    return total
