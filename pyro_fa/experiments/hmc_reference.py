r"""pyro-fa hmc-reference: full-batch HMC reference predictives for small networks, with their diagnostics.

For a torch MLP with the Gaussian prior :math:`N(0, 1/\alpha)` on every weight and a likelihood (regression:
Gaussian with a fixed noise :math:`\sigma`; classification: softmax), :func:`pyro_fa.infer.hmc.hmc` samples
the flattened weights (the network run by ``torch.func.functional_call``) on the whole training set, as
Izmailov, Vikram, Hoffman & Wilson (2021) make the reference that approximations are scored against
(:func:`pyro_fa.metrics.agreement`, :func:`~pyro_fa.metrics.total_variation`,
:func:`~pyro_fa.metrics.predictive_wasserstein2`).

Tasks (``--tasks``):

* ``yacht``, ``boston``, ``concrete``, ``energy``: the UCI 1x50 ReLU regression network of ``pyro-fa uci``
  on the standard splits (``--splits``), with the prior precision and the noise of that benchmark's MAP
  network: the prior precision and Adam schedule searched on the tuning splits as ``pyro-fa uci`` searches
  them for its MAP fit, then the noise scale the MAP fit of the split learns (standardised units);
* ``digits``: the 64-100-10 ReLU MLP of ``pyro-fa classify`` on scikit-learn's digits (its training part;
  ``--splits`` are the validation-cut seeds) at the prior precision ``pyro-fa classify``'s MAP grid picks;
* ``mnist1d``: the reference MLP of ``pyro-fa classify`` on MNIST-1D (40-100-100-10, residual), the same way.

``--device cuda`` runs the chains on a GPU (the task's data and network moved there; the MAP choices stay the CPU
runs of the benchmarks they come from); the references of a device run are units of their own.

Each chain starts from its own random initialisation (``nn.Linear``'s), moved by ``--init-steps`` Adam steps on the
log posterior, then runs HMC (warm-up adapting the step size and a diagonal mass matrix). The chains a run lacks
run as one batch (one gradient evaluation serves them all); one unit file per task x split x chain (``units/``),
written when they end: a run again reuses them. When every chain of a task is there, ``<task>-split<k>.pt`` holds
the reference (classification: the mean probabilities (N_test, C); regression: the predictive mean and variance per
test point, in standardised units, with ``y_std``, and f at every draw, ``f_draws`` (S, N_test), and ``noise``: the
competition's predictive samples are f at a random draw plus noise times a standard normal), per chain too, and
``checks`` (the prior precision, the network's weight shapes and SHA-256 digests of the test and training parts,
by which ``pyro-fa classify --hmc-reference`` checks that a reference is of its run), and ``<task>-split<k>.json``
the diagnostics: the split R-hat and bulk ESS of the test predictive over chains (R-hat < 1.05 required:
``rhat_ok``), acceptance, step sizes, divergences, the agreement / total variation (classification)
or W2 (regression) between every two chains' predictives, the reference's test metrics, and seconds.

References
----------
P. Izmailov, S. Vikram, M. D. Hoffman & A. G. Wilson (2021), *What are Bayesian neural network posteriors
really like?*, ICML.
"""
from __future__ import annotations

import dataclasses
import io
import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor, nn

from pyro_fa.experiments._io import (OutputFolder, atomic_write_json, check_device, nonnegative_int, positive_int,
                                     unit_path)
from pyro_fa.infer.hmc import MASS_MATRICES, RHAT_LIMIT

HELP = ("Full-batch HMC reference predictives (UCI 1x50 regression, digits and MNIST-1D MLPs) with R-hat and chain "
        "agreement.")

UCI_TASKS = ("yacht", "boston", "concrete", "energy")


# ----------------------------------------------------------------------------- settings
@dataclass
class Settings:
    """How long each chain runs (``--quick``: a smoke-test size).

    The defaults are sized for a shared 2-core machine: (400 + 250 x 4) iterations of 100 leapfrog steps, about
    140 000 gradient evaluations of the full training set per task, all chains batched into each. Trajectories
    of 25 steps were too short for these posteriors (the chains moved by a random walk); a task whose R-hat
    stays above 1.05 needs ``--num-steps`` larger still.
    """

    chains: int = 4
    warmup: int = 400
    samples: int = 250
    thin: int = 4
    num_steps: int = 100
    init_steps: int = 2000
    init_lr: float = 1e-2
    target_accept: float = 0.8
    mass: str = "diag"
    device: str = "cpu"

    @classmethod
    def quick(cls) -> "Settings":
        return cls(chains=2, warmup=30, samples=20, thin=1, num_steps=5, init_steps=20)


# ----------------------------------------------------------------------------- likelihoods
class Regression:
    """Gaussian likelihood of fixed noise ``noise`` (standardised units); the collected prediction is f(x)."""

    def log_likelihood(self, out: Tensor, y: Tensor, task: "Task") -> Tensor:
        z = (y - out.squeeze(-1)) / task.noise  # no validation: a divergent state's NaN is a rejected proposal
        return -0.5 * z.pow(2).sum(-1) - y.shape[-1] * (math.log(task.noise) + 0.5 * math.log(2 * math.pi))

    def collect(self, out: Tensor) -> Tensor:
        return out.squeeze(-1)  # (C, N_test)

    def predictive(self, draws: Tensor, task: "Task") -> Dict[str, Tensor]:
        """Mean and variance of the mixture of N(f_s(x), noise^2) over the draws (S, N_test)."""
        return {"mean": draws.mean(0), "var": draws.var(0, unbiased=False) + task.noise ** 2}

    def kept(self, draws: Tensor, task: "Task") -> Dict[str, Tensor]:
        """What the reference keeps of the pooled draws: f at every draw (S, N_test), float32, and the noise, to
        draw predictive samples (the competition's score, :func:`pyro_fa.metrics.competition_wasserstein`)."""
        return {"f_draws": draws.float(), "noise": torch.tensor(task.noise)}

    def compare(self, a: Dict[str, Tensor], b: Dict[str, Tensor]) -> Dict[str, float]:
        from pyro_fa.metrics import predictive_wasserstein2

        return {"w2": float(predictive_wasserstein2(a["mean"], a["var"], b["mean"], b["var"]))}

    def scores(self, ref: Dict[str, Tensor], task: "Task") -> Dict[str, float]:
        from pyro_fa.metrics import gaussian_log_likelihood, rmse

        y_std = task.meta["y_std"]
        return {"rmse": float(rmse(ref["mean"], task.y_test, y_std=y_std)),
                "ll_moment_matched": float(gaussian_log_likelihood(ref["mean"], ref["var"], task.y_test,
                                                                   y_std=y_std))}


class Classification:
    """Categorical likelihood of the softmax of the outputs; the collected prediction is the probabilities."""

    def log_likelihood(self, out: Tensor, y: Tensor, task: "Task") -> Tensor:
        return out.log_softmax(-1).gather(-1, y.expand(*out.shape[:-2], -1).unsqueeze(-1)).sum((-2, -1))

    def collect(self, out: Tensor) -> Tensor:
        return out.softmax(-1)  # (C, N_test, K)

    def predictive(self, draws: Tensor, task: "Task") -> Dict[str, Tensor]:
        return {"probs": draws.mean(0)}

    def kept(self, draws: Tensor, task: "Task") -> Dict[str, Tensor]:
        return {}  # the mean probabilities are the reference (the draws are in the unit files)

    def compare(self, a: Dict[str, Tensor], b: Dict[str, Tensor]) -> Dict[str, float]:
        from pyro_fa.metrics import agreement, total_variation

        return {"agreement": float(agreement(a["probs"], b["probs"])),
                "total_variation": float(total_variation(a["probs"], b["probs"]))}

    def scores(self, ref: Dict[str, Tensor], task: "Task") -> Dict[str, float]:
        from pyro_fa.metrics import accuracy, negative_log_likelihood

        return {"accuracy": float(accuracy(ref["probs"], task.y_test)),
                "nll": float(negative_log_likelihood(ref["probs"], task.y_test))}


#: likelihood name -> what HMC needs of it (the task names one)
LIKELIHOODS = {"regression": Regression(), "classification": Classification()}


# ----------------------------------------------------------------------------- tasks
@dataclass
class Task:
    """One posterior: a network (its architecture; the weights are HMC's), data, prior precision and noise."""

    name: str
    split: int
    make_net: Callable[[], nn.Module]
    x: Tensor
    y: Tensor
    x_test: Tensor
    y_test: Tensor
    likelihood: str
    precision: float
    noise: Optional[float] = None
    meta: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.name}-split{self.split}"


def _uci_map_choice(name: str, data_dir, quick: bool, seed: int) -> dict:
    """``pyro-fa uci``'s MAP search (its SWAG family's step 1): prior precision x Adam rate x steps on the tuning
    splits, by the mean validation log-likelihood (AutoDelta replicas of the batched trainer, float32)."""
    from pyro_fa.datasets import load_uci, uci_n_splits
    from pyro_fa.experiments.uci.protocol import Budget, train, tuning_data
    from pyro_fa.nn import BatchedMLP, BatchedVI

    budget = Budget.quick() if quick else Budget()
    splits = [load_uci(name, s, data_dir=data_dir, dtype=torch.float32)
              for s in range(min(uci_n_splits(name, data_dir), budget.max_tune_splits))]
    spec = BatchedMLP(splits[0].x_train.shape[1], (splits[0].n_hidden or 50,))
    tune = tuning_data(splits, budget)
    n_tune = tune.y.shape[0]
    configs = [{"precision": a, "lr": lr} for a in budget.precisions for lr in budget.lrs]
    prec = tune.x.new_tensor([c["precision"] for c in configs]).repeat_interleave(n_tune)
    lr = tune.x.new_tensor([c["lr"] for c in configs]).repeat_interleave(n_tune)
    gen, cpu_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = BatchedVI(spec, "delta", "gaussian", prec, lr, generator=cpu_gen, dtype=tune.x.dtype)
    curves = train(model, tune.take(torch.arange(n_tune).repeat(len(configs))), budget.steps, budget, gen,
                   budget.checkpoints, None, patience=True, n_configs=len(configs))
    best = max(((float(torch.nan_to_num(ll.reshape(len(configs), n_tune), nan=-1e30).mean(1)[c]), step, c)
                for step, ll in curves for c in range(len(configs))), key=lambda t: t[0])
    return {**configs[best[2]], "steps": best[1], "val_ll": best[0], "tune_splits": n_tune}


def _uci_noise(name: str, split: int, choice: dict, data_dir, quick: bool, seed: int) -> float:
    """The noise scale (standardised units) the MAP fit of ``split`` learns at the chosen configuration."""
    from pyro_fa.datasets import load_uci
    from pyro_fa.experiments.uci.protocol import Budget, final_data, train
    from pyro_fa.nn import BatchedMLP, BatchedVI

    budget = Budget.quick() if quick else Budget()
    d = load_uci(name, split, data_dir=data_dir, dtype=torch.float32)
    spec = BatchedMLP(d.x_train.shape[1], (d.n_hidden or 50,))
    gen, cpu_gen = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 1)
    model = BatchedVI(spec, "delta", "gaussian", choice["precision"], choice["lr"], replicas=1, generator=cpu_gen,
                      dtype=torch.float32)
    train(model, final_data([d]), max(int(choice["steps"]), 1), budget, gen)
    return float(model.likelihood_scale().detach()[0])


def _uci_task(name: str, split: int, args, cache: dict) -> Task:
    from pyro_fa.datasets import load_uci

    data_dir = getattr(args, "data_dir", None)
    d = load_uci(name, split, data_dir=data_dir, dtype=torch.float64)
    key = ("map", name)
    if key not in cache:
        cache[key] = _cached(args, {"kind": "uci-map", "dataset": name, "quick": bool(args.quick),
                                    "seed": args.seed}, f"{name}__map",
                             lambda: _uci_map_choice(name, data_dir, args.quick, args.seed))
    choice = cache[key]
    noise = _cached(args, {"kind": "uci-noise", "dataset": name, "split": split, "choice": choice,
                           "seed": args.seed}, f"{name}-split{split}__noise",
                    lambda: {"noise": _uci_noise(name, split, choice, data_dir, args.quick, args.seed)})["noise"]
    p, width = d.x_train.shape[1], d.n_hidden or 50

    def make_net():
        return nn.Sequential(nn.Linear(p, width), nn.ReLU(), nn.Linear(width, 1)).double()

    return Task(name, split, make_net, d.x_train, d.y_train, d.x_test, d.y_test, "regression",
                float(choice["precision"]), noise, {"y_std": d.y_std, "y_mean": d.y_mean, "map": choice})


def _classify_task(name: str, split: int, args, cache: dict) -> Task:
    """The MLP of ``pyro-fa classify`` on the dataset ``name`` (``"digits"`` or ``"mnist1d"``)."""
    from pyro_fa.experiments.classify.data import load_classify
    from pyro_fa.experiments.classify.methods import Budget, run_methods
    from pyro_fa.experiments.classify.networks import make_network

    data = load_classify(name, seed=split)
    if args.precision is not None:
        precision = float(args.precision)
    else:
        budget = Budget.quick() if args.quick else Budget()
        precision = _cached(args, {"kind": f"{name}-map", "split": split, "quick": bool(args.quick)},
                            f"{name}-split{split}__map",
                            lambda: {"precision": float(run_methods(["map"], "mlp", data, budget, split)["map"]
                                                        ["extra"]["prior_precision"])})["precision"]
    x, x_test = data.x_train.double(), data.x_test.double()

    def make_net():
        return make_network("mlp", data).double()

    return Task(name, split, make_net, x, data.y_train, x_test, data.y_test, "classification", precision, None,
                {"num_classes": data.num_classes})


#: task name -> its builder (name, split, args, cache) -> Task
TASKS: Dict[str, Callable] = {**{n: _uci_task for n in UCI_TASKS}, "digits": _classify_task, "mnist1d": _classify_task}


def _cached(args, key: dict, stem: str, compute: Callable[[], dict]) -> dict:
    """A small JSON unit (a MAP choice, a noise): read when its key matches, else computed and written."""
    import json

    from pyro_fa.experiments._io import read_record

    path = unit_path(args.output_dir, key, stem)
    if path.is_file():
        record = read_record(path, {"key": dict, "value": dict}, "pyro-fa hmc-reference")
        if record is not None and record["key"] == json.loads(json.dumps(key)):
            return record["value"]
    value = compute()
    atomic_write_json(path, {"key": key, "value": value})
    return value


# ----------------------------------------------------------------------------- the posterior
class NetworkPosterior:
    """The log posterior of a network's flattened weights, for a batch of C weight vectors at once.

    Parameters
    ----------
    task : Task
        Its ``make_net()`` gives the architecture (and an initialisation), ``precision`` the prior
        N(0, 1/precision) on every weight, ``likelihood`` a name of :data:`LIKELIHOODS`.
    """

    def __init__(self, task: Task):
        from torch.func import functional_call, vmap

        self.task, self.likelihood = task, LIKELIHOODS[task.likelihood]
        self.net = task.make_net()
        self.names = [n for n, _ in self.net.named_parameters()]
        self.shapes = [p.shape for _, p in self.net.named_parameters()]
        self.sizes = [p.numel() for _, p in self.net.named_parameters()]
        self.dim = sum(self.sizes)

        def one(theta, x):
            params = {n: t.reshape(s) for n, t, s in zip(self.names, theta.split(self.sizes), self.shapes)}
            return functional_call(self.net, params, (x,))

        self.outputs = vmap(one, in_dims=(0, None))  # (C, D), (N, p) -> (C, N, out)

    def init(self, generator: torch.Generator) -> Tensor:
        """Weights as the network's own initialisation draws them, from ``generator``'s seed; shape (D,)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2 ** 62, (1,), generator=generator)))
            net = self.task.make_net()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).to(self.task.x.dtype)

    def log_prob(self, theta: Tensor) -> Tensor:
        """Log prior + log likelihood of the whole training set, shape (C,) for ``theta`` of shape (C, D)."""
        t = self.task
        prior = -0.5 * t.precision * theta.pow(2).sum(-1) + 0.5 * self.dim * math.log(t.precision / (2 * math.pi))
        return prior + self.likelihood.log_likelihood(self.outputs(theta, t.x), t.y, t)

    def collect(self, theta: Tensor) -> Tensor:
        return self.likelihood.collect(self.outputs(theta, self.task.x_test))


class _Progress:
    """HMC's ``progress`` callback for the command: a bar over the iterations on a terminal, and where no one
    watches (a log, a pipe) one line every tenth of the run, with the warm-up phase, step sizes and acceptance."""

    def __init__(self, label: str, total: int, enabled: bool):
        from pyro_fa.experiments._io import progress_bar

        self.label, self.total, self.enabled = label, total, enabled
        self.bar = progress_bar(total=total, desc=label, unit="it", enabled=enabled)
        self.every = max(1, total // 10)

    def __call__(self, it: int, stats: dict) -> None:
        self.bar.update(1)
        if self.enabled and self.bar.disable and (it % self.every == 0 or it == self.total):
            step = stats["step_size"]
            print(f"{self.label}: iteration {it}/{self.total} ({'warm-up' if stats['warmup'] else 'sampling'}), "
                  f"step sizes {float(step.min()):.3g}-{float(step.max()):.3g}, acceptance "
                  f"{float(stats['accept'].mean()):.2f}, divergences {int(stats['divergences'].sum())}, "
                  f"{stats['seconds']:.0f} s", flush=True)
        if it == self.total:
            self.bar.close()


def on_device(task: Task, device) -> Task:
    """``task`` with its data on ``device`` and its networks made there (initialised on the CPU, as on the CPU
    path, then moved); ``task`` itself on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return task
    make_net = task.make_net
    return dataclasses.replace(task, make_net=lambda: make_net().to(device), x=task.x.to(device),
                               y=task.y.to(device), x_test=task.x_test.to(device), y_test=task.y_test.to(device))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_chains(task: Task, chains: List[int], settings: Settings, seed: int, progress: bool = False) -> List[dict]:
    """The chains ``chains`` of ``task``, run as one batch on ``settings.device``: each from its own random
    initialisation moved by ``settings.init_steps`` Adam steps, then HMC with its own generator (seeded by
    ``seed``, the split and the chain: a chain's draws do not depend on the chains beside it); per chain its test
    predictive draws (float32, on the CPU) and diagnostics. ``progress``: report the iterations
    (:class:`_Progress`)."""
    from pyro_fa.infer.hmc import hmc

    device = torch.device(settings.device)
    task = on_device(task, device)
    post = NetworkPosterior(task)
    seeds = [seed * 100_003 + 7919 * task.split + c for c in chains]
    gens = [torch.Generator().manual_seed(s) for s in seeds]  # the initialisations: the same on every device
    start = time.perf_counter()
    theta = torch.stack([post.init(g) for g in gens]).requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=settings.init_lr)  # elementwise: the chains' fits are independent
    for _ in range(settings.init_steps):
        opt.zero_grad()
        (-post.log_prob(theta).sum() / task.x.shape[0]).backward()
        opt.step()
    _synchronize(device)
    init_seconds = time.perf_counter() - start
    if device.type != "cpu":  # HMC's generators live where its draws are made
        gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    res = hmc(post.log_prob, theta.detach(), num_samples=settings.samples, num_warmup=settings.warmup,
              num_steps=settings.num_steps, target_accept=settings.target_accept, thin=settings.thin,
              mass=settings.mass, collect=post.collect, generator=gens,
              progress=_Progress(task.label, settings.warmup + settings.samples * settings.thin, progress))
    if device.type != "cpu":
        res = dataclasses.replace(res, **{k: v.cpu() for k, v in vars(res).items() if isinstance(v, Tensor)})
    return [{"draws": res.draws[i].float(), "log_prob": res.log_prob[i].float(),
             "accept_rate": float(res.accept_rate[i]), "warmup_accept": float(res.warmup_accept[i]),
             "step_size": float(res.step_size[i]), "divergences": int(res.divergences[i]),
             "init_seconds": init_seconds, "seconds": res.seconds + init_seconds, "ran_with": list(chains),
             "dim": post.dim} for i in range(len(chains))]


def summarize(task: Task, chains: List[dict]) -> tuple:
    """The reference (all chains pooled) and the per-chain predictives, and the diagnostics (a JSON dict)."""
    from pyro_fa.infer.hmc import chain_diagnostics

    like = LIKELIHOODS[task.likelihood]
    draws = torch.stack([c["draws"].double() for c in chains])  # (C, S, N_test[, K])
    per_chain = [like.predictive(d, task) for d in draws]
    pooled = draws.reshape(-1, *draws.shape[2:])
    ref = like.predictive(pooled, task)
    diag = {"task": task.label, "dim": chains[0]["dim"], "precision": task.precision, "noise": task.noise,
            "chains": len(chains), "draws_per_chain": draws.shape[1]}
    diag.update(chain_diagnostics(draws) if len(chains) > 1 else {})
    diag["rhat_ok"] = bool(diag.get("rhat_max", math.inf) < RHAT_LIMIT)
    for k in ("accept_rate", "warmup_accept", "step_size", "divergences", "seconds", "ran_with"):
        diag[k] = [c[k] for c in chains]
    batches = {tuple(c["ran_with"]): c["seconds"] for c in chains}  # chains run together share their seconds
    diag["total_seconds"] = sum(batches.values())
    pairs = {f"{i}-{j}": like.compare(per_chain[i], per_chain[j])
             for i, j in itertools.combinations(range(len(chains)), 2)}
    diag["between_chains"] = pairs
    diag["scores"] = like.scores(ref, task)
    diag["meta"] = {k: v for k, v in task.meta.items()}
    from pyro_fa.experiments.classify.fidelity import digest_of, parameter_shapes

    # what a run scored against the reference checks it by (pyro-fa classify --hmc-reference)
    checks = {"precision": task.precision, "parameter_shapes": parameter_shapes(task.make_net()),
              "test_digest": digest_of(task.x_test, task.y_test), "train_digest": digest_of(task.x, task.y)}
    return {"reference": ref, "per_chain": per_chain, "meta": task.meta, "likelihood": task.likelihood,
            "checks": checks, **like.kept(pooled, task)}, diag


# ----------------------------------------------------------------------------- the command
def add_arguments(parser) -> None:
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=None,
                        help="tasks (default: yacht boston; quick: yacht)")
    parser.add_argument("--splits", nargs="+", type=nonnegative_int, default=None, help="splits (default 0)")
    parser.add_argument("--chains", type=positive_int, default=None, help="chains per task (default 4)")
    parser.add_argument("--warmup", type=nonnegative_int, default=None, help="warm-up iterations (default 400)")
    parser.add_argument("--samples", type=positive_int, default=None, help="kept draws per chain (default 250)")
    parser.add_argument("--thin", type=positive_int, default=None, help="iterations per kept draw (default 4)")
    parser.add_argument("--num-steps", type=positive_int, default=None,
                        help="leapfrog steps per iteration (default 100)")
    parser.add_argument("--init-steps", type=nonnegative_int, default=None,
                        help="Adam steps before HMC from each random initialisation (default 2000)")
    parser.add_argument("--mass", choices=sorted(MASS_MATRICES), default=None,
                        help="the HMC mass matrix adapted in the warm-up (default diag)")
    parser.add_argument("--precision", type=float, default=None,
                        help="digits, mnist1d: the prior precision (default: pyro-fa classify's MAP choice)")
    parser.add_argument("--device", default=None,
                        help="where the chains run: cpu (default), cuda, cuda:1, ... (units of their own)")
    parser.add_argument("--data-dir", default=None, help="UCI data folder (default $PYRO_FA_DATA)")


#: Settings added after references were written: left out of a unit's key at their defaults (old unit files match).
_KEYED_WHEN_SET = frozenset({"mass", "device"})


def _settings_key(settings: Settings) -> dict:
    return {k: v for k, v in vars(settings).items() if k not in _KEYED_WHEN_SET or v != getattr(Settings, k)}


def _settings(args) -> Settings:
    s = Settings.quick() if args.quick else Settings()
    for name in ("chains", "warmup", "samples", "thin", "num_steps", "init_steps", "mass"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    if getattr(args, "device", None) is not None:
        s.device = str(check_device(args.device, "pyro-fa hmc-reference"))
    return s


def _save_pt(path: Path, obj) -> None:
    from pyro_fa._files import atomic_write_bytes

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def _load_unit(path: Path, key: dict) -> Optional[dict]:
    import warnings

    try:
        record = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - a damaged unit file is computed again, never fatal
        warnings.warn(f"pyro-fa hmc-reference: ignoring {path}, which is not a readable unit file ({err}); its "
                      "chain is run again.", stacklevel=2)
        return None
    return record["value"] if isinstance(record, dict) and record.get("key") == key else None


def run(args) -> int:
    settings = _settings(args)
    if args.precision is not None and not (math.isfinite(args.precision) and args.precision > 0):
        raise SystemExit(f"pyro-fa hmc-reference: --precision must be a positive finite number, got "
                         f"{args.precision!r}.")
    tasks = args.tasks or (["yacht"] if args.quick else ["yacht", "boston"])
    splits = args.splits or [0]
    with OutputFolder(args.output_dir, "pyro-fa hmc-reference", subfolders=("units",)) as out:
        return _run_locked(args, out, settings, tasks, splits)


def _run_locked(args, out: OutputFolder, settings: Settings, tasks, splits) -> int:
    """The work of :func:`run` inside its locked output folder."""
    cache: dict = {}
    for name, split in itertools.product(tasks, splits):
        try:
            task = TASKS[name](name, split, args, cache)
        except (FileNotFoundError, ValueError) as err:
            raise SystemExit(f"pyro-fa hmc-reference: {err}") from err
        units = {}
        for chain in range(settings.chains):
            key = {"task": name, "split": split, "chain": chain, "seed": args.seed,
                   "settings": _settings_key(settings), "precision": task.precision, "noise": task.noise}
            path = unit_path(out.path, key, f"{task.label}__chain{chain}").with_suffix(".pt")
            units[chain] = (key, path, _load_unit(path, key) if path.is_file() else None)
        missing = [c for c, (_, _, value) in units.items() if value is None]
        if missing:  # run together (one gradient serves every chain), each written to its own file
            for chain, value in zip(missing, run_chains(task, missing, settings, args.seed,
                                                          not getattr(args, "no_progress", False))):
                key, path, _ = units[chain]
                _save_pt(path, {"key": key, "value": value})
                units[chain] = (key, path, value)
                print(f"{task.label} chain {chain}: {value['seconds']:.0f} s, accept "
                      f"{value['accept_rate']:.2f}, step {value['step_size']:.3g}, "
                      f"divergences {value['divergences']}", flush=True)
        chains = [units[c][2] for c in range(settings.chains)]
        reference, diag = summarize(task, chains)
        diag["mass"] = settings.mass
        _save_pt(out.path / f"{task.label}.pt", reference)
        atomic_write_json(out.path / f"{task.label}.json", diag)
        print(f"{task.label}: R-hat max {diag.get('rhat_max', float('nan')):.3f} "
              f"({'ok' if diag['rhat_ok'] else 'NOT below ' + str(RHAT_LIMIT)}), ESS min "
              f"{diag.get('ess_min', float('nan')):.0f}, {diag['total_seconds']:.0f} s", flush=True)
    return 0
