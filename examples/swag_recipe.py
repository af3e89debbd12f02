"""SWAG's recipe end to end: pre-train, collect once per epoch at a constant rate, tune the scale, predict.

The recipe of Maddox et al. (2019, Algorithm 1), as ``pyro-fa classify`` runs it, on scikit-learn's
bundled digits (8 x 8 images, 10 classes) with a small MLP:

1. train with SGD to a good point (pre-training);
2. hold the learning rate at a constant, fairly high value (``torch.optim.swa_utils.SWALR``) and let
   :class:`pyro_fa.SWAG` collect the weights once per epoch (``start_after`` = pre-training steps,
   ``collect_every`` = steps per epoch): its mean is SWA, its factor-analysis fit the spread;
3. choose the posterior scale on validation data (:meth:`pyro_fa.SWAG.tune_scale`);
4. predict: SWA by loading the mean into the model (``swag.sampled_weights(swag.loc)``), SWAG by
   the Bayesian model average (``swag.predict_log_proba``).

Prints the test NLL and accuracy of the last iterate, SWA and SWAG. Runs in a few seconds with
``--quick`` (30 epochs, 20 collected), about half a minute without (150 epochs, 75 collected)::

    python examples/swag_recipe.py --quick

References: W. Maddox, T. Garipov, P. Izmailov, D. Vetrov, A. G. Wilson, "A simple baseline for
Bayesian uncertainty in deep learning", NeurIPS 2019; P. Izmailov et al., "Averaging weights leads
to wider optima and better generalization", UAI 2018.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.optim.swa_utils import SWALR

from pyro_fa import SWAG


def evaluate(log_proba: torch.Tensor, y: torch.Tensor):
    """Test NLL per point and accuracy of log class probabilities (N, C)."""
    return float(F.nll_loss(log_proba, y)), float((log_proba.argmax(-1) == y).float().mean())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 epochs (20 collected) instead of 150 (75)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=10, help="factors of the SWAG-EM posterior")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)
    perm = torch.randperm(len(y))
    train, val, test = perm[:1000], perm[1000:1300], perm[1300:]  # never tune on the test split

    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    epochs, swa_epochs = (30, 20) if args.quick else (150, 75)
    batch = 50
    steps_per_epoch = math.ceil(len(train) / batch)
    pretrain = epochs - swa_epochs
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    # recipe:start (docs/swag.md shows these lines; the tests check that they agree)
    # collect once per epoch after pre-training (the default warmup, = rank, fits such runs)
    swag = SWAG(net, rank=args.rank, start_after=pretrain * steps_per_epoch, collect_every=steps_per_epoch,
                seed=args.seed)
    swag.attach(opt)  # collects after the optimizer's steps
    swa_sched = SWALR(opt, swa_lr=0.02, anneal_epochs=1)  # a constant rate from the first SWA epoch on

    for epoch in range(epochs):
        for idx in train[torch.randperm(len(train))].split(batch):
            opt.zero_grad()
            F.cross_entropy(net(X[idx]), y[idx]).backward()
            opt.step()
        if epoch >= pretrain:
            swa_sched.step()

    # the posterior's scale, chosen by the validation log-likelihood of the model average
    search = swag.tune_scale(X[val], y[val], num_samples=30)

    with torch.no_grad():
        last = evaluate(net(X[test]).log_softmax(-1), y[test])  # the last SGD iterate
        with swag.sampled_weights(swag.loc):  # SWA: the posterior mean loaded into the model
            swa = evaluate(net(X[test]).log_softmax(-1), y[test])
        # SWAG: the Bayesian model average over 30 sampled networks (for batch norm, pass loader=)
        log_proba = swag.predict_log_proba(X[test], num_samples=30,
                                           generator=torch.Generator().manual_seed(args.seed))
        bma = evaluate(log_proba, y[test])
    # recipe:end

    print(f"collected {swag.n_collected} epochs; scale chosen on validation: {search.scale:g}")
    print(f"{'':12} {'test NLL':>9} {'accuracy':>9}")
    for name, (nll, acc) in (("last iterate", last), ("SWA", swa), ("SWAG", bma)):
        print(f"{name:12} {nll:9.4f} {acc:9.3f}")
    return {"last": last, "swa": swa, "swag": bma, "scale": search.scale, "n_collected": swag.n_collected}


if __name__ == "__main__":
    main()
