"""The linearised (GLM) predictive's cost against sampled networks, on a digits-size MLP.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_glm_predictive.py [--samples 30] [--rank 20]

Trains a 64-100-100-10 ReLU MLP (D = 17 610) on scikit-learn's digits (pixels / 16; the first
1 437 digits) with SGD, collects a SWAG-EM posterior (rank K) from its iterates, and times
``predict_proba`` on the other 360 digits: sampled networks (``pred_type="nn"``, S draws),
the linearised network (``pred_type="glm"``, S draws) and the probit (``link_approx="probit"``,
no draws). Each is run 8 times, interleaved, and the minimum of the last 7 is reported, as
ratios to the sampled predictive measured in the same run (the CPU may be shared), beside the
test accuracy and NLL of each at scale 1 (not tuned: a cost measurement, not a comparison).
"""
import argparse
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

from pyro_fa import SWAG


def main(samples: int = 30, rank: int = 20) -> None:
    torch.manual_seed(0)
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)
    x_train, y_train, x_test, y_test = X[:1437], y[:1437], X[1437:], y[1437:]
    net = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    swag = SWAG(net, rank=rank, method="em", start_after=300, collect_every=10, seed=0)
    swag.attach(opt)
    for _ in range(900):
        i = torch.randint(0, len(x_train), (64,))
        opt.zero_grad()
        nn.functional.cross_entropy(net(x_train[i]), y_train[i]).backward()
        opt.step()
    print(f"D={swag.dim} K={swag.rank} test points={len(x_test)} collected={swag.n_collected} "
          f"threads={torch.get_num_threads()}")

    def gen():
        return torch.Generator().manual_seed(0)

    runs = {
        f"nn, {samples} draws": lambda: swag.predict_proba(x_test, num_samples=samples, generator=gen()),
        f"glm-mc, {samples} draws": lambda: swag.predict_proba(x_test, num_samples=samples, generator=gen(),
                                                               pred_type="glm", link_approx="mc"),
        "glm-probit": lambda: swag.predict_proba(x_test, pred_type="glm", link_approx="probit"),
    }
    best = {name: float("inf") for name in runs}
    probs = {}
    for rep in range(8):
        for name, run in runs.items():
            start = time.perf_counter()
            probs[name] = run()
            if rep:
                best[name] = min(best[name], time.perf_counter() - start)
    base = next(iter(best.values()))
    for name, seconds in best.items():
        p = probs[name]
        acc = (p.argmax(-1) == y_test).double().mean().item()
        nll = -p.clamp_min(1e-12).log().gather(1, y_test[:, None]).mean().item()
        print(f"{name:>16}: {seconds:.3f} s ({seconds / base:5.2f}x nn)  accuracy {acc:.4f}  NLL {nll:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--rank", type=int, default=20)
    args = parser.parse_args()
    main(args.samples, args.rank)
