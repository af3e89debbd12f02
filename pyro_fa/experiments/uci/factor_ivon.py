r"""FactorIVON's column of the ``pyro-fa uci`` benchmark: the 1×50 network trained by
:class:`pyro_fa.optim.FactorIVON` (IVON with a low-rank-plus-diagonal precision, rank ``Budget.rank``).

Each fit: the ReLU network with one hidden layer of 50 units (``n_hidden``), a Gaussian likelihood whose noise
scale is learned as in the other methods (a point estimate, here by Adam at :data:`NOISE_LR` on the same
minibatch losses, from 1 in standardised units), FactorIVON with ``ess`` = the number of training points, weight
decay (the prior precision per point) :data:`WEIGHT_DECAY`, one draw per step, the low-rank part refreshed every
:data:`UPDATE_EVERY` steps, IVON's rate following the budget's half cosine over ``Budget.steps``; full batch up to
``Budget.batch_limit`` points, batches of ``Budget.batch_size`` above. The search is the other methods': every
(rate, initial Hessian) of IVON's grid in ``pyro-fa classify`` (:data:`IVON_LRS` x :data:`IVON_HESS_INITS`) on
every tuning split, the validation log-likelihood (``Budget.eval_samples`` draws) every ``steps / checkpoints``
steps, the (setting, step count) of best mean; then every split is trained on its whole training part and tested
once (``Budget.test_samples`` draws). A budget of one Adam rate (``--quick``) tries :data:`QUICK_GRID` only.
"""
from __future__ import annotations

import math
import time
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from pyro_fa.experiments.uci.protocol import Budget, SplitData, _choose, final_data, final_record, heldout_ll, \
    tuning_data

__all__ = ["IVON_LRS", "IVON_HESS_INITS", "QUICK_GRID", "run_factor_ivon"]

#: IVON's grid in ``pyro-fa classify`` (``Budget.ivon_lrs`` x ``Budget.ivon_hess_inits`` there)
IVON_LRS = (0.4, 0.8, 1.6, 3.2, 6.4)
IVON_HESS_INITS = (0.01, 0.03, 0.1, 0.5, 2.0)
QUICK_GRID = ((0.4, 0.5),)
UPDATE_EVERY = 10
#: IVON's Hessian decay in ``pyro-fa classify`` (ivon-opt's default)
BETA2 = 0.99999
WEIGHT_DECAY = 1e-4
NOISE_LR = 1e-2


def _grid(budget: Budget) -> List[dict]:
    pairs = QUICK_GRID if len(budget.lrs) == 1 else [(r, h) for r in IVON_LRS for h in IVON_HESS_INITS]
    return [{"lr": r, "hess_init": h} for r, h in pairs]


def _net(n_in: int, width: int, dtype, device) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, 1)).to(device=device, dtype=dtype)


def _gaussian_nll(pred: Tensor, y: Tensor, log_scale: Tensor) -> Tensor:
    """Mean Gaussian negative log-likelihood per point (without the constant)."""
    return (0.5 * ((y - pred) * torch.exp(-log_scale)).square() + log_scale).mean()


@torch.no_grad()
def _predict(net, opt, x: Tensor, samples: int) -> Tensor:
    """Predictive means of ``samples`` weight draws, (S, M)."""
    out = []
    for _ in range(samples):
        with opt.sampled_params():
            out.append(net(x).squeeze(-1))
    return torch.stack(out)


def _fit(x: Tensor, y: Tensor, width: int, setting: dict, steps: int, budget: Budget, seed: int,
         x_eval: Optional[Tensor] = None, y_eval: Optional[Tensor] = None, y_std: Optional[Tensor] = None,
         progress=None) -> Tuple[nn.Module, object, Tensor, List[Tuple[int, float]]]:
    """One fit of one split: (net, optimizer, log noise scale, [(step, held-out LL)] at the checkpoints)."""
    from pyro_fa.optim import FactorIVON

    torch.manual_seed(seed)
    net = _net(x.shape[1], width, x.dtype, x.device)
    n = x.shape[0]
    opt = FactorIVON(net.parameters(), lr=setting["lr"], ess=float(n), hess_init=setting["hess_init"],
                     beta2=setting.get("beta2", BETA2), weight_decay=WEIGHT_DECAY, rank=budget.rank,
                     update_every=UPDATE_EVERY)
    log_scale = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)
    noise_opt = torch.optim.Adam([log_scale], lr=NOISE_LR)
    rates = [opt, noise_opt]
    base = [opt.param_groups[0]["lr"], NOISE_LR]
    batch = n if n <= budget.batch_limit else budget.batch_size
    gen = torch.Generator().manual_seed(seed)
    every = max(1, budget.steps // budget.checkpoints) if x_eval is not None else None
    curve = []
    for step in range(1, steps + 1):
        frac = 0.5 * (1.0 + math.cos(math.pi * (step - 1) / budget.steps))  # the budget's half cosine
        for o, b in zip(rates, base):
            o.param_groups[0]["lr"] = b * frac
        idx = torch.randperm(n, generator=gen)[:batch].to(x.device) if batch < n else slice(None)
        try:
            with opt.sampled_params(train=True):
                opt.zero_grad()
                noise_opt.zero_grad()
                _gaussian_nll(net(x[idx]).squeeze(-1), y[idx], log_scale).backward()
        except ValueError:  # a non-finite gradient: the fit diverged; its later checkpoints score -inf
            curve += [(s, -math.inf) for s in range(step, steps + 1) if every and s % every == 0]
            if progress is not None:
                progress(steps - step + 1)
            break
        opt.step()
        noise_opt.step()
        if every and step % every == 0:
            means = _predict(net, opt, x_eval, budget.eval_samples)
            nv = torch.exp(2 * log_scale.detach()).reshape(1, 1)
            ll = heldout_ll(means[:, None], nv, SplitData(x, y, x_eval, y_eval[None], y_std.reshape(1)))
            curve.append((step, float(ll[0]) if bool(torch.isfinite(ll[0])) else -math.inf))
        if progress is not None:
            progress(1)
    return net, opt, log_scale.detach(), curve


def run_factor_ivon(method, splits, budget: Budget, seed: int, progress: Optional[Callable] = None, references=None,
                    fidelity: Optional[dict] = None) -> dict:
    """Search on the tuning splits, then train and test every split: FactorIVON on one dataset (the return value
    of :func:`pyro_fa.experiments.uci.protocol.run_vi`'s form; ``references`` and ``fidelity`` as there: each
    split with an HMC reference is scored against it, the prior precision being ``ess * weight_decay``)."""
    width = splits[0].n_hidden or 50
    tune = tuning_data(splits, budget)
    n_tune = tune.y.shape[0]
    configs = _grid(budget)
    by_step = {}
    for c, cfg in enumerate(configs):
        for r in range(n_tune):
            _, _, _, curve = _fit(tune.x[r], tune.y[r], width, cfg, budget.steps, budget, seed + r, tune.x_eval[r],
                                  tune.y_eval[r], tune.y_std[r], progress)
            for step, ll in curve:
                by_step.setdefault(step, torch.full((len(configs), n_tune), -math.inf, dtype=torch.float64))
                by_step[step][c, r] = ll
    curves = [(step, lls.reshape(-1)) for step, lls in sorted(by_step.items())]
    choice, val_ll, table = _choose(curves, configs, n_tune)
    final = final_data(splits)
    means, noise_var = [], []
    start = time.perf_counter()
    for r in range(final.y.shape[0]):
        net, opt, log_scale, _ = _fit(final.x[r], final.y[r], width, choice, choice["steps"], budget, seed + r,
                                      progress=progress)
        torch.manual_seed(seed + r + 1)
        means.append(_predict(net, opt, final.x_eval[r], budget.test_samples))
        noise_var.append(torch.exp(2 * log_scale))
    seconds = (time.perf_counter() - start) / final.y.shape[0]
    dim = sum(p.numel() for p in _net(final.x.shape[-1], width, final.x.dtype, "cpu").parameters())
    noise = torch.stack(noise_var).sqrt().reshape(-1).detach()
    return final_record(method, torch.stack(means, 1), torch.stack(noise_var)[:, None], final, splits,
                        (choice, val_ll, table, n_tune), dim, float(final.x.shape[-2]) * WEIGHT_DECAY, noise, seconds,
                        seed, references, fidelity)
