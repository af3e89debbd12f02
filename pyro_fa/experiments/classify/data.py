r"""Datasets of the ``pyro-fa classify`` benchmark: train / validation / test splits and out-of-distribution sets.

Two datasets, both made offline:

* ``"mnist1d"``: MNIST-1D (Greydanus 2020, "Scaling down deep learning"), generated
  procedurally by the ``mnist1d`` package's ``make_dataset`` with its default
  arguments (5 000 signals of 40 points, 10 classes, the package's own seed 42): the
  first 4 000 are the training part, the last 1 000 the test part, as in the paper.
  ``make_dataset`` downloads nothing (only ``get_dataset`` fetches the pickled copy);
  it uses NumPy's and Python's global random generators, whose states are restored
  afterwards. The paper reports about 68 % test accuracy for an MLP and 94 % for a
  small CNN.
  The signals come out of the generator centred with a standard deviation of about
  1 (values in about [-5.5, 4.5]) and are used as generated.
* ``"digits"``: scikit-learn's bundled 8×8 handwritten digits (1 797 images, 10
  classes), a stratified 70 % / 30 % train / test split (fixed), pixel intensities
  (0 to 16) divided by 16, into [0, 1]. (Standardising each pixel instead divides by
  standard deviations near 0.03 on the border pixels, so that rotated or shuffled
  digits land tens of times farther from the origin than real ones: "far away"
  inputs that any variance growing with the input detects, whatever its quality.)
* ``"mnist1d-8"``, ``"digits-8"``: the same data with the classes 8 and 9 held out:
  training, validation and test parts hold the classes 0 to 7 only (8 outputs), and
  the test part's 8s and 9s form the OOD set ``"heldout"``.

The validation part is cut at random from the training part (``val_fraction``, by
default 10 % for MNIST-1D and 20 % for digits; the cut depends on ``seed``) and is
used for every choice the benchmark makes (the SWAG posterior scale); the test part
is seen once, for the reported metrics.

Out-of-distribution (OOD) sets, built from the test part (the held-out classes'
set from the test part's 8s and 9s):

* MNIST-1D ``"reversed"``: each test signal read backwards (time reversal,
  ``x[:, ::-1]``; a signal of the same marginal statistics whose templates no longer
  match); ``"shuffled"``: the 40 points of each test signal in a random order of
  its own (the values kept, all temporal structure destroyed).
* digits ``"rotated"``: each test image rotated by 90 degrees counter-clockwise;
  ``"shuffled"``: the 64 pixels of each test image in a random order of its own. Both
  in [0, 1] like the in-distribution images; rotation and shuffling keep each
  input's norm, so every OOD set sits at the test part's distance from the origin
  (:func:`median_norms` reports it).

An OOD detector scores each input (the benchmark uses the predictive entropy and,
for sampled predictives, the mutual information between label and weights) and the
AUROC measures how well the scores tell the OOD set from the test part.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np
import torch
from torch import Tensor

__all__ = ["ClassifyData", "DATASETS", "HELD_OUT", "load_classify", "make_mnist1d", "median_norms"]

DATASETS = ("mnist1d", "digits", "mnist1d-8", "digits-8")
_VAL_FRACTION = {"mnist1d": 0.1, "digits": 0.2}
#: classes held out of training in the ``-8`` datasets; their test inputs form the OOD set ``"heldout"``
HELD_OUT = (8, 9)


@dataclass
class ClassifyData:
    """One dataset's splits.

    Attributes
    ----------
    name : str
    x_train, x_val, x_test : Tensors of shape (N_part, P)
        Inputs (P = 40 for MNIST-1D, 64 for digits), float32.
    y_train, y_val, y_test : Tensors of shape (N_part,)
        Class labels (int64) in ``[0, num_classes)``.
    ood : dict of str to Tensor of shape (N_test, P)
        The out-of-distribution sets, by name.
    num_classes : int
    base : str
        The underlying dataset (``"mnist1d"`` or ``"digits"``; ``name`` adds ``-8`` for held-out classes).
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    ood: Dict[str, Tensor] = field(default_factory=dict)
    num_classes: int = 10
    base: str = ""

    def __post_init__(self):
        self.base = self.base or self.name.split("-")[0]

    @property
    def in_features(self) -> int:
        return self.x_train.shape[-1]

    def to(self, device) -> "ClassifyData":
        """A copy with every tensor on ``device`` (the splits and OOD sets; labels stay int64)."""
        return ClassifyData(self.name, *(t.to(device) for t in (self.x_train, self.y_train, self.x_val, self.y_val,
                                                                self.x_test, self.y_test)),
                            {k: v.to(device) for k, v in self.ood.items()}, self.num_classes, self.base)

    def subset(self, n_train: int, n_test: int) -> "ClassifyData":
        """The first ``n_train`` training and ``n_test`` test (and OOD) points: for smoke tests."""
        return ClassifyData(self.name, self.x_train[:n_train], self.y_train[:n_train], self.x_val, self.y_val,
                            self.x_test[:n_test], self.y_test[:n_test],
                            {k: v[:n_test] for k, v in self.ood.items()}, self.num_classes, self.base)


@functools.lru_cache(maxsize=1)
def make_mnist1d():
    """MNIST-1D as the ``mnist1d`` package generates it: ``(x, y, x_test, y_test)`` NumPy arrays.

    (4000, 40), (4000,), (1000, 40), (1000,). Offline and deterministic; the global
    random states that ``make_dataset`` seeds are restored afterwards.

    Raises
    ------
    ImportError
        If ``mnist1d`` is not installed (``pip install mnist1d`` or ``pip install pyro_fa[classify]``).
    """
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("pyro-fa classify: the 'mnist1d' dataset needs the mnist1d package, got none installed. "
                          "Install it with `pip install mnist1d` (or `pip install pyro_fa[classify]`).") from err
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        d = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return d["x"], d["y"], d["x_test"], d["y_test"]


def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x, y = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.3, stratify=y, random_state=0)
    return x_tr, y_tr, x_te, y_te


def _permute_rows(x: Tensor, generator: torch.Generator) -> Tensor:
    """Each row's entries in a random order of its own."""
    idx = torch.rand(x.shape, generator=generator).argsort(-1)
    return torch.gather(x, -1, idx)


def median_norms(data: ClassifyData) -> Dict[str, float]:
    """Median Euclidean norm of the inputs of the test part and of each OOD set: ``{"test": ..., name: ...}``.

    The OOD sets are meant to sit near the data (an OOD set far from the origin is detected by any
    predictive whose variance grows with the input); the benchmark reports these beside its results.

    Examples
    --------
    >>> d = load_classify("digits")
    >>> norms = median_norms(d)
    >>> norms["rotated"] == norms["test"]  # a rotation keeps each image's norm
    True
    """
    sets = {"test": data.x_test, **data.ood}
    return {k: float(v.norm(dim=-1).median()) for k, v in sets.items()}


def load_classify(name: str, seed: int = 0, val_fraction: Optional[float] = None) -> ClassifyData:
    """Training / validation / test parts and OOD sets of a benchmark dataset (see the module docstring).

    Parameters
    ----------
    name : {"mnist1d", "digits", "mnist1d-8", "digits-8"}
        ``-8``: the classes 8 and 9 held out of training, their test inputs an OOD set.
    seed : int, default 0
        Seed of the validation cut (the test part and OOD sets do not depend on it).
    val_fraction : float, optional
        Fraction of the training part held out for validation; default 0.1 for
        MNIST-1D and 0.2 for digits.

    Returns
    -------
    ClassifyData
        Inputs of shape (N_part, 40) (MNIST-1D) or (N_part, 64) (digits), float32.

    Raises
    ------
    ValueError
        If ``name`` is unknown or ``val_fraction`` is not in (0, 1).
    """
    if name not in DATASETS:
        raise ValueError(f"load_classify: name must be one of {DATASETS}, got {name!r}.")
    base = name.split("-")[0]
    frac = _VAL_FRACTION[base] if val_fraction is None else val_fraction
    if not 0 < frac < 1:
        raise ValueError(f"load_classify: val_fraction must be in (0, 1), got {val_fraction!r}.")
    g = torch.Generator().manual_seed(1234)  # the OOD sets: fixed
    if base == "mnist1d":
        x_tr, y_tr, x_te, y_te = (torch.as_tensor(np.ascontiguousarray(a)) for a in make_mnist1d())
        x_tr, x_te = x_tr.float(), x_te.float()
    else:
        x_tr, y_tr, x_te, y_te = (torch.as_tensor(a) for a in _digits())
        x_tr, x_te = x_tr / 16.0, x_te / 16.0
    y_tr, y_te = y_tr.long(), y_te.long()
    num_classes = 10
    held = {}
    if name.endswith("-8"):
        out_te = (y_te[:, None] == torch.tensor(HELD_OUT)).any(-1)
        held = {"heldout": x_te[out_te]}
        keep = ~(y_tr[:, None] == torch.tensor(HELD_OUT)).any(-1)
        x_tr, y_tr, x_te, y_te = x_tr[keep], y_tr[keep], x_te[~out_te], y_te[~out_te]
        num_classes = 10 - len(HELD_OUT)
    if base == "mnist1d":
        ood = {"reversed": x_te.flip(-1).contiguous(), "shuffled": _permute_rows(x_te, g)}
    else:
        rotated = torch.rot90(x_te.reshape(-1, 8, 8), 1, (1, 2)).reshape(-1, 64)
        ood = {"rotated": rotated, "shuffled": _permute_rows(x_te, g)}
    ood.update(held)
    n = x_tr.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(10_000 + seed))
    n_val = int(round(frac * n))
    val, tr = perm[:n_val], perm[n_val:]
    return ClassifyData(name, x_tr[tr], y_tr[tr], x_tr[val], y_tr[val], x_te, y_te, ood, num_classes, base)
