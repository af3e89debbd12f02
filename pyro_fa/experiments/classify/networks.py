r"""Networks of the ``pyro-fa classify`` benchmark: the MNIST-1D reference MLP and CNN, and the digits MLP.

The MNIST-1D networks are the reference ones of Greydanus (2020), "Scaling down deep
learning" (the ``mnist1d`` repository, ``notebooks/models.py``: ``MLPBase`` and
``ConvBase``), trained there by Adam at a constant rate of 1e-2 on minibatches of 100
for 6 000 steps without weight decay (``notebooks/train.py``); the paper reports about
68 % (MLP) and 94 % (CNN) test accuracy (its notebook's own run prints 65.1 % and
92.3 % for that recipe).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["CNN1d", "ResidualMLP", "make_network", "NETWORKS"]

NETWORKS = ("mlp", "cnn")


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class ResidualMLP(nn.Module):
    r"""The MNIST-1D reference MLP (Greydanus 2020, ``MLPBase``): two hidden layers of 100 with a residual.

    .. math::

        h_1 = \mathrm{relu}(W_1 x + b_1),\quad h_2 = h_1 + \mathrm{relu}(W_2 h_1 + b_2),\quad f(x) = W_3 h_2 + b_3.

    Parameters
    ----------
    in_features : int
    num_classes : int
    hidden : int, default 100
    dropout : float, default 0
        Dropout after each hidden activation (MC dropout); 0 leaves the reference network.

    Shapes: (N, in_features) -> logits (N, num_classes).
    """

    def __init__(self, in_features: int, num_classes: int, hidden: int = 100, dropout: float = 0.0):
        super().__init__()
        self.linear1 = nn.Linear(in_features, hidden)
        self.linear2 = nn.Linear(hidden, hidden)
        self.drop1, self.drop2 = _dropout(dropout), _dropout(dropout)
        self.linear3 = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop1(self.linear1(x).relu())
        h = h + self.drop2(self.linear2(h).relu())
        return self.linear3(h)


class CNN1d(nn.Module):
    """The small 1-D CNN of the MNIST-1D paper (Greydanus 2020, ``ConvBase``): three strided convolutions.

    Conv1d(1, 25, 5, stride 2, padding 1) - ReLU - Conv1d(25, 25, 3, 2, 1) - ReLU - Conv1d(25, 25, 3, 2, 1) - ReLU -
    Linear(125, C), for inputs of shape (N, 40); optional dropout after each ReLU (MC dropout).
    """

    def __init__(self, length: int = 40, num_classes: int = 10, channels: int = 25, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=1), nn.ReLU(), _dropout(dropout),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(), _dropout(dropout),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(), _dropout(dropout),
        )
        with torch.no_grad():
            n = self.features(torch.zeros(1, 1, length)).numel()
        self.head = nn.Linear(n, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x.unsqueeze(-2)).flatten(-2))


def make_network(kind: str, data, dropout: float = 0.0) -> nn.Module:
    """A fresh network for ``data`` (a :class:`~pyro_fa.experiments.classify.data.ClassifyData`).

    ``"mlp"``: :class:`ResidualMLP` on MNIST-1D (the reference MLP), a 64-100-C ReLU MLP on digits;
    ``"cnn"``: :class:`CNN1d` (MNIST-1D only). ``dropout`` > 0 adds dropout after every hidden layer. The
    weights take the inputs' dtype.

    Raises
    ------
    ValueError
        If ``kind`` is not one of :data:`NETWORKS`.
    """
    if kind not in NETWORKS:
        raise ValueError(f"make_network: kind must be one of {NETWORKS}, got {kind!r}.")
    # initialised on the CPU (the same weights on every device for a seed), then moved to the data's device
    at = {"device": data.x_train.device, "dtype": data.x_train.dtype}
    if kind == "cnn":
        return CNN1d(data.in_features, data.num_classes, dropout=dropout).to(**at)
    if data.base == "mnist1d":
        return ResidualMLP(data.in_features, data.num_classes, dropout=dropout).to(**at)
    return nn.Sequential(nn.Linear(data.in_features, 100), nn.ReLU(), _dropout(dropout),
                         nn.Linear(100, data.num_classes)).to(**at)
