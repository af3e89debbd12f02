"""Online factor analysis against batch FA on the SGD iterates of real training runs.

For each network, dtype and stream, the parameter vectors collected by
:meth:`pyro_fa.SWAG.attach` from an SGD run are recorded once; every method is then
fitted to that same stream, and its covariance :math:`FF^\\top + \\Psi` is compared
with the iterates' own empirical covariance :math:`S` (maximum likelihood, divided
by T) by the relative Frobenius distance :math:`\\|FF^\\top+\\Psi - S\\|_F / \\|S\\|_F`:

- batch FA: scikit-learn's ``FactorAnalysis(n_components=K)`` (defaults) on the
  float64 iterates;
- online EM: ``SWAG(..., method="em")`` with its defaults, the one attached to the
  optimizer during training (float32 runs collect float32 weights);
- scatter sketch: ``SWAG(..., method="sketch")``, fed the same stream (batch FA refitted from a
  rank-2K sketch of the scatter when the posterior is read);
- online SGA: ``SWAG(..., method="sga")``, fed the same stream;
- classic SWAG: ``SWAG(..., method="swag")`` (Maddox et al. 2019), fed the same stream;
- diagonal only: :math:`\\mathrm{diag}(S)`;

and the ratios EM / batch, sketch / batch and SGA / batch (issue 29 asks for 1.1, linear model 1.5, for EM;
1.5 for SGA).

Networks (all trained by minibatch SGD on squared error, in the dtype of the run):

- ``linear``: a 5-input linear regression model (D = 6, K = 2), streams of 480 and
  6000 iterates at learning rate 0.05;
- ``mlp``: a 10-50-1 tanh MLP on a synthetic regression problem (D = 601, K = 10), SGD
  with momentum 0.9, 3000 steps of pre-training, then 1000 iterates at lr 0.01, 1000
  at lr 0.05, 3000 at lr 0.01 and 300 at lr 0.01 (each stream starts from the
  pre-trained weights);
- ``yacht``: a 6-50-1 ReLU MLP on the bundled UCI yacht data, split 0 (D = 401,
  K = 10), 3000 steps of pre-training, then 1000 and 3000 iterates at lr 0.01.

The streams are built by :func:`make_streams` (importable: the tests reuse it), the
fits by :func:`fit_methods`, the distances by :func:`relative_distance`.

    python benchmarks/bench_swag_streams.py                  # both dtypes, all streams (a few minutes)
    python benchmarks/bench_swag_streams.py --quick          # a subset, under a minute
    python benchmarks/bench_swag_streams.py --dtype float32
"""
from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from pyro_fa import SWAG

METHODS = ("batch", "em", "sketch", "sga", "swag", "diag")


@dataclass
class Stream:
    """The iterates of one SGD run, as collected by an attached :class:`~pyro_fa.SWAG`.

    Attributes
    ----------
    network, label : str
        Which network, and a description of the run (length and learning rate).
    rank : int
        :math:`K` of the fits.
    dtype : torch.dtype
        Of the training run (and of the collected vectors).
    iterates : np.ndarray of shape (T, D), float64
        The collected parameter vectors (exact copies of the run's values).
    swag_em : SWAG or None
        The online-EM posterior that was attached to the optimizer during the run.
    """

    network: str
    label: str
    rank: int
    dtype: torch.dtype
    iterates: np.ndarray
    swag_em: Optional[SWAG] = field(default=None, repr=False)

    @property
    def T(self) -> int:
        return self.iterates.shape[0]

    @property
    def dim(self) -> int:
        return self.iterates.shape[1]


def _flat(net: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).double().numpy().copy()


def record(net: nn.Module, opt: torch.optim.Optimizer, step: Callable[[], None], n_steps: int, rank: int,
           swag_kwargs: Optional[dict] = None) -> (np.ndarray, SWAG):
    """Run ``n_steps`` optimizer steps with an online-EM SWAG attached, recording what it collects.

    Parameters
    ----------
    net : nn.Module
    opt : torch.optim.Optimizer
        Over ``net.parameters()``.
    step : callable
        One training step (zero_grad, loss, backward, ``opt.step()``).
    n_steps : int
    rank : int
    swag_kwargs : dict, optional
        Extra arguments of the attached ``SWAG(net, rank, "em", ...)``.

    Returns
    -------
    iterates : np.ndarray of shape (n_steps, D), float64
    swag : SWAG
        The attached online-EM posterior (detached again).
    """
    swag = SWAG(net, rank=rank, method="em", seed=0, **(swag_kwargs or {}))
    handle = swag.attach(opt)
    rows: List[np.ndarray] = []
    rec = opt.register_step_post_hook(lambda *_: rows.append(_flat(net)))
    try:
        for _ in range(n_steps):
            step()
    finally:
        handle.remove()
        rec.remove()
    return np.stack(rows), swag


def _sgd_step(net, opt, x, y, batch, gen):
    def step():
        idx = torch.randint(x.shape[0], (batch,), generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(net(x[idx]).squeeze(-1), y[idx]).backward()
        opt.step()
    return step


def _pretrained(make_net, x, y, dtype, pretrain, lr, momentum, batch, seed):
    torch.manual_seed(seed)
    net = make_net().to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    step = _sgd_step(net, opt, x, y, batch, gen)
    for _ in range(pretrain):
        step()
    return net.state_dict()


def _streams_for(network, make_net, x, y, rank, dtype, pretrain, pre_lr, momentum, batch, runs, seed,
                 swag_kwargs):
    state = _pretrained(make_net, x, y, dtype, pretrain, pre_lr, momentum, batch, seed)
    out = []
    for i, (T, lr) in enumerate(runs):
        net = make_net().to(dtype)
        net.load_state_dict(state)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        gen = torch.Generator().manual_seed(seed + 100 + i)
        iterates, swag = record(net, opt, _sgd_step(net, opt, x, y, batch, gen), T, rank, swag_kwargs)
        out.append(Stream(network, f"T={T}, lr {lr:g}", rank, dtype, iterates, swag))
    return out


def linear_streams(dtype=torch.float64, runs=((480, 0.05), (6000, 0.05)), seed=0, swag_kwargs=None) -> List[Stream]:
    """SGD iterates of a 5-input linear regression model (D = 6, K = 2).

    200 points :math:`y = x^\\top w + 0.3 + 0.5\\varepsilon`, :math:`x \\sim N(0, I_5)`; plain SGD
    (batch 16) for 500 steps of pre-training, then one stream per ``(T, lr)`` in ``runs``.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, generator=g, dtype=torch.float64)
    y = x @ w + 0.3 + 0.5 * torch.randn(200, generator=g, dtype=torch.float64)
    return _streams_for("linear", lambda: nn.Linear(5, 1), x.to(dtype), y.to(dtype), 2, dtype, 500, 0.05, 0.0,
                        16, runs, seed, swag_kwargs)


def mlp_streams(dtype=torch.float64, runs=((1000, 0.01), (1000, 0.05), (3000, 0.01), (300, 0.01)), seed=0,
                swag_kwargs=None) -> List[Stream]:
    """SGD iterates of a 10-50-1 tanh MLP (D = 601, K = 10) on a synthetic regression problem.

    500 points, :math:`x \\sim N(0, I_{10})`, target a random 10-20-1 tanh network plus noise
    0.1; SGD with momentum 0.9 (batch 32) at lr 0.01 for 3000 steps of pre-training, then one
    stream per ``(T, lr)`` in ``runs``, each from the pre-trained weights.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(500, 10, generator=g, dtype=torch.float64)
    teacher_w1 = torch.randn(10, 20, generator=g, dtype=torch.float64) / 10 ** 0.5
    teacher_w2 = torch.randn(20, generator=g, dtype=torch.float64) / 20 ** 0.5
    y = torch.tanh(x @ teacher_w1) @ teacher_w2 + 0.1 * torch.randn(500, generator=g, dtype=torch.float64)

    def make():
        return nn.Sequential(nn.Linear(10, 50), nn.Tanh(), nn.Linear(50, 1))

    return _streams_for("mlp 10-50-1", make, x.to(dtype), y.to(dtype), 10, dtype, 3000, 0.01, 0.9, 32, runs,
                        seed, swag_kwargs)


def yacht_streams(dtype=torch.float64, runs=((1000, 0.01), (3000, 0.01)), seed=0, swag_kwargs=None) -> List[Stream]:
    """SGD iterates of a 6-50-1 ReLU MLP on UCI yacht, split 0 (D = 401, K = 10).

    The bundled data, standardised on the training part; SGD with momentum 0.9 (batch 32)
    at lr 0.01 for 3000 steps of pre-training, then one stream per ``(T, lr)`` in ``runs``.
    """
    from pyro_fa.datasets import load_uci

    d = load_uci("yacht", split=0, dtype=torch.float64)

    def make():
        return nn.Sequential(nn.Linear(d.x_train.shape[1], 50), nn.ReLU(), nn.Linear(50, 1))

    return _streams_for("yacht 1x50", make, d.x_train.to(dtype), d.y_train.to(dtype), 10, dtype, 3000, 0.01, 0.9,
                        32, runs, seed, swag_kwargs)


NETWORKS = {"linear": linear_streams, "mlp": mlp_streams, "yacht": yacht_streams}
QUICK_RUNS = {"linear": ((480, 0.05),), "mlp": ((1000, 0.01), (300, 0.01)), "yacht": ((1000, 0.01),)}


def make_streams(networks: Sequence[str] = tuple(NETWORKS), dtypes=(torch.float32, torch.float64),
                 quick: bool = False, swag_kwargs: Optional[dict] = None) -> List[Stream]:
    """The benchmark's streams, for each network in ``networks`` and dtype in ``dtypes``.

    Parameters
    ----------
    networks : sequence of {"linear", "mlp", "yacht"}
    dtypes : sequence of torch.dtype
    quick : bool, default False
        Only the streams of ``QUICK_RUNS``.
    swag_kwargs : dict, optional
        Extra arguments of the online-EM SWAG attached during training.

    Returns
    -------
    list of Stream
    """
    out = []
    for name in networks:
        kwargs = {"runs": QUICK_RUNS[name]} if quick else {}
        for dtype in dtypes:
            out.extend(NETWORKS[name](dtype=dtype, swag_kwargs=swag_kwargs, **kwargs))
    return out


# ------------------------------------------------------------------------ fits
def empirical_covariance(iterates: np.ndarray) -> np.ndarray:
    """The iterates' covariance, maximum likelihood (divided by T), float64."""
    X = iterates - iterates.mean(0)
    return X.T @ X / X.shape[0]


def relative_distance(F: np.ndarray, psi: np.ndarray, S: np.ndarray) -> float:
    """:math:`\\|FF^\\top + \\mathrm{diag}(\\psi) - S\\|_F / \\|S\\|_F`, dense in float64."""
    F = np.asarray(F, dtype=np.float64)
    C = F @ F.T
    C[np.diag_indices_from(C)] += np.asarray(psi, dtype=np.float64)
    return float(np.linalg.norm(C - S) / np.linalg.norm(S))


def feed(stream: Stream, method: str, **kwargs) -> SWAG:
    """A fresh ``SWAG(..., method)`` fed the stream's vectors (cast to its dtype) through :meth:`SWAG.collect`.

    The SWAG follows one leaf tensor of length D into which each vector is copied
    before ``collect()``: the same code path as an attached SWAG, on identical values.
    """
    buf = torch.zeros(stream.dim, dtype=stream.dtype)
    kwargs.setdefault("seed", 0)
    with warnings.catch_warnings():  # SWAG(method="sga") warns that it is far from batch FA: this table shows it
        warnings.simplefilter("ignore", UserWarning)
        swag = SWAG([buf], rank=stream.rank, method=method, **kwargs)
    with torch.no_grad():
        for row in stream.iterates:
            buf.copy_(torch.from_numpy(row))
            swag.collect()
    return swag


def _cov_of(swag: SWAG):
    return swag.cov_factor.double().numpy(), swag.cov_diag.double().numpy()


def fit_methods(stream: Stream, methods: Sequence[str] = METHODS) -> Dict[str, float]:
    """Relative covariance distance to the stream's empirical covariance, for each method.

    Returns
    -------
    dict
        ``method -> distance`` for each of ``methods``.
    """
    from sklearn.decomposition import FactorAnalysis

    S = empirical_covariance(stream.iterates)
    out = {}
    for m in methods:
        if m == "batch":
            fa = FactorAnalysis(n_components=stream.rank).fit(stream.iterates)
            out[m] = relative_distance(fa.components_.T, fa.noise_variance_, S)
        elif m == "diag":
            out[m] = relative_distance(np.zeros((stream.dim, 1)), np.diag(S), S)
        elif m == "em" and stream.swag_em is not None:
            out[m] = relative_distance(*_cov_of(stream.swag_em), S)
        else:
            out[m] = relative_distance(*_cov_of(feed(stream, m)), S)
    return out


def _table(rows) -> str:
    head = ("network", "dtype", "stream", "D", "K", "batch FA (sklearn)", "online EM", "scatter sketch",
            "online SGA", "classic SWAG", "diagonal only", "EM / batch", "sketch / batch", "SGA / batch")
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for s, r in rows:
        cells = [s.network, str(s.dtype).replace("torch.", ""), s.label, str(s.dim), str(s.rank)]
        cells += [f"{r[m]:.3f}" for m in METHODS]
        cells += [f"{r['em'] / r['batch']:.2f}", f"{r['sketch'] / r['batch']:.2f}", f"{r['sga'] / r['batch']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a subset of the streams (under a minute)")
    p.add_argument("--dtype", choices=("float32", "float64", "both"), default="both")
    p.add_argument("--networks", nargs="+", choices=tuple(NETWORKS), default=list(NETWORKS))
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(args.threads)
    except ImportError:
        pass
    dtypes = {"float32": (torch.float32,), "float64": (torch.float64,),
              "both": (torch.float32, torch.float64)}[args.dtype]
    t0 = time.perf_counter()
    rows = []
    for name in args.networks:
        for s in make_streams((name,), dtypes, quick=args.quick):
            rows.append((s, fit_methods(s)))
    print("Relative distance ||FF^T + Psi - S||_F / ||S||_F to the iterates' empirical covariance S:")
    print()
    print(_table(rows))
    print()
    print(f"({time.perf_counter() - t0:.0f} s, {torch.get_num_threads()} thread(s))")


if __name__ == "__main__":
    main()
