r"""FactorIVON's rows of the ``pyro-fa classify`` benchmark: the network trained from scratch by
:class:`pyro_fa.optim.FactorIVON` (IVON with a low-rank-plus-diagonal precision), and an ensemble of such networks.

* ``factor-ivon``: the recipe of the IVON row (:func:`pyro_fa.experiments.classify.baselines.ivon_probs`, the
  same training loop ``_ivon_train``, the same cosine-annealed rate, epochs, minibatches, grid
  ``Budget.ivon_lrs`` x ``Budget.ivon_hess_inits`` chosen by the validation NLL of the model average, the same
  number of weight draws at test), with FactorIVON of rank ``Budget.rank`` in place of ivon-opt's diagonal IVON,
  its low-rank part refreshed every :data:`UPDATE_EVERY` steps (``docs/optim.md``). The predictive is the
  sampled one (``pred_type="nn"``): the network at ``Budget.samples`` weight draws. At ``rank=0`` FactorIVON is
  ivon-opt's IVON bit for bit, and this row is the IVON row.
* ``factor-ivon-ensemble``: ``Budget.ensemble`` such networks at the chosen rate and initial Hessian, trained from
  the seeds ``seed + 1000 m`` (the deep ensemble's), ``Budget.samples`` draws each, pooled (Shen et al. 2024's
  ensembles of IVON, as MultiSWAG pools SWAG posteriors; Wilson & Izmailov 2020).

Both also get "+T" rows (a temperature fitted on validation). The linearised (GLM) predictive of
:meth:`pyro_fa.optim.FactorIVON.posterior` is not a row: it forms the network's Jacobian for every test input, which
the sampled rows do not pay for.
"""
from __future__ import annotations

import functools
import math
import time
import types
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from pyro_fa.experiments.classify import baselines as _ivon_recipe

__all__ = ["FACTOR_IVON_ROWS", "UPDATE_EVERY", "factor_ivon_probs", "run_factor_ivon"]

#: the rows this module makes, in the order of the tables
FACTOR_IVON_ROWS = ("factor-ivon", "factor-ivon-ensemble")
#: steps between refreshes of FactorIVON's low-rank part (docs/optim.md: 10-50 brings the cost near IVON's)
UPDATE_EVERY = 10
#: FactorIVON's default floor on the diagonal part of its precision (a fraction of IVON's diagonal)
DIAG_FLOOR = 0.25
#: seed offset of the ensemble's members (the deep ensemble's and MultiSWAG's)
MEMBER_SEED_STEP = 1000


def _optimizer(rank: int, update_every: int, diag_floor: float = DIAG_FLOOR):
    """What ``_ivon_train`` calls ``ivon.IVON``: FactorIVON at ``rank``, ``update_every`` and ``diag_floor``."""
    from pyro_fa.optim import FactorIVON

    return types.SimpleNamespace(IVON=functools.partial(FactorIVON, rank=rank, update_every=update_every,
                                                        diag_floor=diag_floor))


def _val_nll(probs: Tensor, y: Tensor) -> float:
    """NLL of the model average of draws (S, N, C), as the IVON row scores its grid."""
    p = probs.mean(0).gather(1, y.to(probs.device)[:, None]).squeeze(1)
    return float(-p.clamp_min(torch.finfo(p.dtype).tiny).log().mean())


def factor_ivon_probs(
    make_net: Callable[[], nn.Module],
    train_xy: Tuple[Tensor, Tensor],
    val_xy: Optional[Tuple[Tensor, Tensor]],
    test_inputs: Sequence[Tensor],
    epochs: int,
    batch_size: int,
    seed: int = 0,
    num_samples: int = 30,
    *,
    lr_grid: Sequence[float] = _ivon_recipe.IVON_LR_GRID,
    hess_init_grid: Sequence[float] = (0.5,),
    rank: int = 10,
    update_every: int = UPDATE_EVERY,
    diag_floor: float = DIAG_FLOOR,
    members: int = 1,
    beta2: float = 0.99999,
    weight_decay: float = 1e-4,
    info: Optional[dict] = None,
) -> List[List[Tensor]]:
    r"""Predictive samples of networks trained from scratch by FactorIVON, tuned on validation as the IVON row.

    Every (rate, initial Hessian) of ``lr_grid`` x ``hess_init_grid`` is trained (seed ``seed``); the one whose
    model average of ``num_samples`` draws has the least NLL on ``val_xy`` is kept (the first grid point when
    the grid has one point or ``val_xy`` is None). A grid point whose training meets a non-finite gradient
    (FactorIVON refuses it) has diverged: it scores an infinite validation NLL and is never chosen. With
    ``members > 1``, ``members - 1`` more networks are trained at that setting from the seeds ``seed + 1000 m``.

    Parameters
    ----------
    make_net : callable
        Returns a fresh network (N, ...) -> logits (N, C).
    train_xy, val_xy : (Tensor of shape (N, ...), Tensor of shape (N,))
        Training and validation inputs and integer labels; ``val_xy`` only scores the grid.
    test_inputs : list of Tensor of shape (N_i, ...)
        Inputs to predict.
    epochs, batch_size : int
        Training length (a cosine-annealed rate over ``epochs``) and minibatch size.
    seed : int, default 0
        Seeds initialisation, batch order and draws (torch's global state is restored after the call).
    num_samples : int, default 30
        Weight draws per network and prediction.
    lr_grid, hess_init_grid : sequence of float
        Rates and initial Hessians tried.
    rank, update_every : int
        FactorIVON's rank K (0: IVON) and the steps between refreshes of its low-rank part.
    diag_floor : float, default 0.25
        FactorIVON's ``diag_floor``, in (0, 1].
    members : int, default 1
        Networks of the ensemble (the first is the chosen one).
    beta2, weight_decay : float
        As the IVON row's.
    info : dict, optional
        Receives ``"lr"``, ``"hess_init"``, ``"val_nll"`` ({"(rate, hess_init)": NLL}), ``"rank"``,
        ``"update_every"``, ``"diag_floor"``, ``"seconds_grid"`` (the grid's time) and ``"seconds_members"``
        (the other members').

    Returns
    -------
    list of list of Tensor of shape (num_samples, N_i, C)
        Per member, the softmax probabilities of each draw, one tensor per entry of ``test_inputs``.

    Raises
    ------
    TypeError, ValueError
        Malformed data or options (the messages name ``factor_ivon_probs``).

    References
    ----------
    Shen, Y., Daheim, N., Cong, B., et al. (2024). Variational learning is effective for large deep networks. ICML.
    """
    caller = "factor_ivon_probs"
    x_tr, y_tr = _ivon_recipe._check_xy(caller, "train_xy", train_xy)
    inputs = _ivon_recipe._check_inputs(caller, test_inputs)
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("num_samples", num_samples),
                        ("update_every", update_every), ("members", members)):
        _ivon_recipe._check_positive_int(caller, name, value)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{caller}: rank must be a non-negative integer, got {rank!r}.")
    if isinstance(diag_floor, bool) or not isinstance(diag_floor, (int, float)) or not 0 < diag_floor <= 1:
        raise ValueError(f"{caller}: diag_floor must be a number in (0, 1], got {diag_floor!r}.")
    grid = [(float(r), float(h)) for r in lr_grid for h in hess_init_grid] if val_xy is not None else \
        [(float(next(iter(lr_grid), math.nan)), float(next(iter(hess_init_grid), math.nan)))]
    if not grid or not all(math.isfinite(v) and v > 0 for pair in grid for v in pair):
        raise ValueError(f"{caller}: lr_grid and hess_init_grid must hold finite numbers > 0, got "
                         f"lr_grid={tuple(lr_grid)!r}, hess_init_grid={tuple(hess_init_grid)!r}.")
    train = functools.partial(_ivon_recipe._ivon_train, _optimizer(rank, update_every, float(diag_floor)), make_net,
                              x_tr, y_tr, epochs, batch_size, beta2=beta2, weight_decay=weight_decay)
    predict = _ivon_recipe._ivon_predict
    fork = [torch.device("cuda")] if torch.cuda.is_available() else []
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=fork):
        if len(grid) == 1:
            net, opt = train(lr=grid[0][0], seed=seed, hess_init=grid[0][1])
            best_setting, val_nll = grid[0], {}
        else:
            x_va, y_va = _ivon_recipe._check_xy(caller, "val_xy", val_xy)
            best, val_nll = None, {}
            for setting in grid:  # the IVON row's loop: the same seeds, the same score
                try:
                    net, opt = train(lr=setting[0], seed=seed, hess_init=setting[1])
                except ValueError as err:  # FactorIVON refused a non-finite gradient: this point diverged
                    if "finite" not in str(err):
                        raise
                    val_nll[repr(setting)] = math.inf  # never chosen
                    continue
                torch.manual_seed(seed)
                (p_val,) = predict(net, opt, [x_va], num_samples)
                val_nll[repr(setting)] = _val_nll(p_val, y_va)
                if best is None or val_nll[repr(setting)] < val_nll[repr(best[0])]:
                    best = (setting, net, opt)
            if best is None:
                raise ValueError(f"{caller}: training diverged (non-finite gradients) at every grid point "
                                 f"{', '.join(val_nll)} (rate, initial Hessian); try lower rates or larger initial "
                                 "Hessians.")
            best_setting, net, opt = best
        torch.manual_seed(seed + 1)
        out = [predict(net, opt, inputs, num_samples)]
        t1 = time.perf_counter()
        for m in range(1, members):
            member_seed = seed + MEMBER_SEED_STEP * m
            net, opt = train(lr=best_setting[0], seed=member_seed, hess_init=best_setting[1])
            torch.manual_seed(member_seed + 1)
            out.append(predict(net, opt, inputs, num_samples))
    if info is not None:
        info.update(lr=best_setting[0], hess_init=best_setting[1], val_nll=val_nll, rank=rank,
                    update_every=update_every, diag_floor=float(diag_floor), seconds_grid=t1 - t0,
                    seconds_members=time.perf_counter() - t1)
    return out


def run_factor_ivon(want, make, data, budget, seed: int, inputs, tick, out: dict) -> None:
    """The rows of :data:`FACTOR_IVON_ROWS` that ``want`` names, into ``out`` (as :func:`run_methods` keeps rows:
    ``{"probs": [val, test, *OOD], "seconds", "extra"}``); one grid serves both."""
    rows = [name for name in FACTOR_IVON_ROWS if name in want]
    if not rows:
        return
    members = budget.ensemble if FACTOR_IVON_ROWS[1] in rows else 1
    info: dict = {}
    probs = factor_ivon_probs(make, (data.x_train, data.y_train), (data.x_val, data.y_val), inputs, budget.epochs,
                              budget.batch_size, seed, budget.samples, lr_grid=budget.ivon_lrs,
                              hess_init_grid=budget.ivon_hess_inits, rank=budget.rank, members=members, info=info)
    tick(budget.epochs * (len(budget.ivon_lrs) * len(budget.ivon_hess_inits) + members - 1))
    extra = {k: info[k] for k in ("lr", "hess_init", "val_nll", "rank", "update_every")}
    if FACTOR_IVON_ROWS[0] in rows:
        out[FACTOR_IVON_ROWS[0]] = {"probs": [p.detach() for p in probs[0]], "seconds": info["seconds_grid"],
                                    "extra": extra}
    if FACTOR_IVON_ROWS[1] in rows:
        pooled = [torch.cat([member[k] for member in probs]).detach() for k in range(len(inputs))]
        out[FACTOR_IVON_ROWS[1]] = {"probs": pooled, "seconds": info["seconds_grid"] + info["seconds_members"],
                                    "extra": {**extra, "members": members}}
