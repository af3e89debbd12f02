r"""``BatchedMLP``: a multilayer perceptron whose weights are one flat vector per replica.

The network

.. math::

    f_\theta(x) = w_L^\top\,\phi\big(\cdots \phi(W_1^\top x + b_1) \cdots\big) + b_L,
    \qquad \phi \in \{\mathrm{ReLU}, \tanh\},

is ``nn.Sequential(nn.Linear(p, h_1), φ, …, nn.Linear(h_{L-1}, 1))`` with all its
weights in one vector :math:`\theta \in \mathbb{R}^D`. ``R`` replicas (and ``S``
posterior draws of each) are evaluated together: every (draw, replica) pair is one
entry of a batch of plain 3-D matrix products.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = ["BatchedMLP"]

_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}
#: activation name -> its in-place tensor method, for the batched forward pass
_INPLACE_ACTIVATIONS = {"relu": Tensor.relu_, "tanh": Tensor.tanh_}


class BatchedMLP:
    r"""A scalar-output MLP evaluated for a batch of weight vectors at once.

    Layer :math:`l` stores its weight as an ``(in, out)`` block (row-major, the
    transpose of ``nn.Linear.weight``) followed by its bias; ``dim`` is the total
    count :math:`D = \sum_l (\mathrm{in}_l + 1)\,\mathrm{out}_l`.

    Parameters
    ----------
    in_features : int
        :math:`p \ge 1`.
    hidden : sequence of int
        Widths of the hidden layers, e.g. ``(50,)`` for 1×50, ``(50, 50)`` for
        2×50; ``()`` is a linear model.
    activation : {"relu", "tanh"}, default "relu"

    Attributes
    ----------
    dim : int
        :math:`D`.
    layers : list of (int, int)
        ``(in, out)`` of every linear layer, the last one ``(h_L, 1)``.

    Raises
    ------
    ValueError
        If a width is not a positive int or ``activation`` is unknown.

    Examples
    --------
    >>> mlp = BatchedMLP(3, (8,))
    >>> theta = mlp.init(4, generator=torch.Generator().manual_seed(0))  # 4 replicas
    >>> theta.shape, mlp(theta, torch.randn(4, 10, 3)).shape
    (torch.Size([4, 41]), torch.Size([4, 10]))
    >>> net = mlp.to_module(theta[1])  # replica 1 as an nn.Sequential
    >>> x = torch.randn(10, 3)
    >>> torch.allclose(net(x).squeeze(-1), mlp(theta[1], x))
    True
    """

    def __init__(self, in_features: int, hidden: Sequence[int] = (), activation: str = "relu"):
        if not _positive_int(in_features):
            raise ValueError(f"BatchedMLP: in_features must be a positive int, got {in_features!r}.")
        try:
            widths = tuple(hidden)
        except TypeError:
            raise ValueError(f"BatchedMLP: hidden must be a sequence of positive ints, got {hidden!r}.") from None
        if not all(_positive_int(h) for h in widths):
            raise ValueError(f"BatchedMLP: hidden must be a sequence of positive ints, got {hidden!r}.")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"BatchedMLP: activation must be one of {tuple(_ACTIVATIONS)}, got {activation!r}.")
        sizes = [int(in_features), *map(int, widths), 1]
        self.in_features = int(in_features)
        self.hidden = tuple(int(h) for h in widths)
        self.activation = activation
        self.layers = list(zip(sizes[:-1], sizes[1:]))
        self.dim = sum(i * o + o for i, o in self.layers)

    def __repr__(self) -> str:
        widths = "x".join(map(str, self.hidden)) or "linear"
        return f"BatchedMLP({self.in_features} -> {widths} -> 1, {self.activation}, dim={self.dim})"

    # ----------------------------------------------------------------- modules
    @classmethod
    def from_module(cls, net: nn.Module) -> "BatchedMLP":
        """The architecture of ``nn.Sequential(Linear, ReLU|Tanh, …, Linear(·, 1))`` (its weights are not read).

        Raises
        ------
        TypeError
            If ``net`` is not an ``nn.Sequential``.
        ValueError
            If its layers are not linear layers (with bias) alternating with one kind of
            activation, ``nn.ReLU`` or ``nn.Tanh``, and ending in a linear layer with one output.
        """
        return _architecture(net, "BatchedMLP.from_module")

    def flatten(self, net: nn.Module) -> Tensor:
        """The weights of a module of this architecture as one vector of shape (D,), in this layout."""
        _check_same(self, _architecture(net, "BatchedMLP.flatten"), "BatchedMLP.flatten")
        linears = [m for m in net if isinstance(m, nn.Linear)]
        return torch.cat([t for lin in linears for t in (lin.weight.detach().T.reshape(-1), lin.bias.detach())])

    def unflatten(self, theta: Tensor) -> Dict[str, Tensor]:
        """The parameters of ``theta`` (shape (..., D)) by their ``nn.Sequential`` names.

        Returns
        -------
        dict
            ``{"0.weight": (..., out, in), "0.bias": (..., out), "2.weight": …}``: the
            names and shapes of :meth:`to_module`'s ``named_parameters``.
        """
        if not isinstance(theta, Tensor) or theta.dim() < 1 or theta.shape[-1] != self.dim:
            got = tuple(theta.shape) if isinstance(theta, Tensor) else type(theta).__name__
            raise ValueError(f"BatchedMLP.unflatten: theta must be a Tensor of shape (..., {self.dim}), got {got}.")
        out, i = {}, 0
        for layer, (fan_in, fan_out) in enumerate(self.layers):
            n = fan_in * fan_out
            out[f"{2 * layer}.weight"] = theta[..., i:i + n].reshape(*theta.shape[:-1], fan_in, fan_out)\
                .transpose(-1, -2)
            out[f"{2 * layer}.bias"] = theta[..., i + n:i + n + fan_out]
            i += n + fan_out
        return out

    def to_module(self, theta: Tensor) -> nn.Sequential:
        """An ``nn.Sequential`` holding the weights ``theta`` (shape (D,)), with its dtype and device."""
        if not isinstance(theta, Tensor) or theta.shape != (self.dim,):
            got = tuple(theta.shape) if isinstance(theta, Tensor) else type(theta).__name__
            raise ValueError(f"BatchedMLP.to_module: theta must be a Tensor of shape ({self.dim},), got {got}.")
        layers = []
        for fan_in, fan_out in self.layers:
            layers += [nn.Linear(fan_in, fan_out, dtype=theta.dtype, device=theta.device),
                       _ACTIVATIONS[self.activation]()]
        net = nn.Sequential(*layers[:-1])
        with torch.no_grad():
            for name, value in self.unflatten(theta.detach()).items():
                net.get_parameter(name).copy_(value)
        return net

    # ------------------------------------------------------------------ values
    def init(self, replicas: int, *, generator: Optional[torch.Generator] = None, dtype=None, device=None) -> Tensor:
        """Weights as ``nn.Linear`` initialises them, U(-1/sqrt(fan_in), 1/sqrt(fan_in)); shape (R, D).

        Drawn on the generator's device (the CPU by default), then moved to ``device``.
        """
        parts = []
        for fan_in, fan_out in self.layers:
            bound = 1 / math.sqrt(fan_in)
            n = fan_in * fan_out + fan_out
            u = torch.rand(replicas, n, generator=generator, dtype=dtype)  # on the generator's device (CPU)
            parts.append((2 * u - 1) * bound)
        return torch.cat(parts, -1).to(device)

    def forward(self, theta: Tensor, x: Tensor) -> Tensor:
        """Network outputs.

        Parameters
        ----------
        theta : Tensor of shape (..., R, D)
        x : Tensor of shape (R, N, p) or (N, p)
            Broadcast against ``theta``'s batch shape.

        Returns
        -------
        Tensor of shape (..., R, N)
        """
        # every (draw, replica) pair is one entry of a batch of plain 3-D kernels: ``baddbmm`` adds the bias
        # inside the matrix product, the activation runs in place on its output (ReLU needs neither for its
        # backward, tanh its output only), and the scalar output layer is a multiply-and-sum, which on one CPU
        # core runs about twice as fast, forward and backward, as a batched matrix-vector product
        batch = torch.broadcast_shapes(theta.shape[:-1], x.shape[:-2])
        n, B = x.shape[-2], math.prod(batch)
        theta = theta.expand(*batch, theta.shape[-1])
        h, i = x.expand(*batch, n, x.shape[-1]).reshape(B, n, x.shape[-1]), 0
        activate = _INPLACE_ACTIVATIONS[self.activation]
        for fan_in, fan_out in self.layers[:-1]:
            W = theta[..., i:i + fan_in * fan_out].reshape(B, fan_in, fan_out)
            b = theta[..., i + fan_in * fan_out:i + fan_in * fan_out + fan_out].reshape(B, 1, fan_out)
            i += fan_in * fan_out + fan_out
            h = torch.baddbmm(b, h, W)
            h = activate(h)
        w, b = theta[..., i:i + h.shape[-1]].reshape(B, 1, -1), theta[..., i + h.shape[-1]].reshape(B, 1)
        return ((h * w).sum(-1) + b).reshape(*batch, n)

    __call__ = forward


def _positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _architecture(net, fn: str) -> BatchedMLP:
    """The BatchedMLP of ``nn.Sequential(Linear, act, …, Linear(·, 1))``, or a clear refusal naming ``fn``."""
    expected = ("an nn.Sequential of nn.Linear layers with one kind of activation, nn.ReLU or nn.Tanh, between "
                "them, ending in nn.Linear(..., 1)")
    if not isinstance(net, nn.Sequential):
        raise TypeError(f"{fn}: net must be {expected}, got {type(net).__name__}.")
    layers = list(net)
    if not layers:
        raise ValueError(f"{fn}: net must be {expected}, got an empty nn.Sequential.")
    kinds = {type(m) for m in layers[1::2]}
    for i, m in enumerate(layers):
        want = nn.Linear if i % 2 == 0 else (nn.ReLU, nn.Tanh)
        if type(m) not in (want if isinstance(want, tuple) else (want,)):
            what = "nn.Linear" if i % 2 == 0 else "nn.ReLU or nn.Tanh"
            raise ValueError(f"{fn}: layer {i} of net must be {what} ({expected}), got {m!r}. Train other "
                             "architectures one at a time with BayesianNetwork.fit.")
    if len(kinds) > 1:
        raise ValueError(f"{fn}: net's activations must all be of one kind, nn.ReLU or nn.Tanh, got "
                         f"{sorted(k.__name__ for k in kinds)}.")
    if len(layers) % 2 == 0:
        raise ValueError(f"{fn}: the last layer of net must be nn.Linear(..., 1), got {layers[-1]!r}.")
    linears: Tuple[nn.Linear, ...] = tuple(layers[0::2])
    if any(lin.bias is None for lin in linears):
        raise ValueError(f"{fn}: every nn.Linear of net must have a bias (bias=True), got "
                         f"{next(lin for lin in linears if lin.bias is None)!r}.")
    if linears[-1].out_features != 1:
        raise ValueError(f"{fn}: net must have one output (nn.Linear(..., 1) last: a Gaussian likelihood's mean), "
                         f"got {linears[-1].out_features} outputs.")
    for a, b in zip(linears[:-1], linears[1:]):
        if a.out_features != b.in_features:
            raise ValueError(f"{fn}: net's layers must chain, got {a!r} followed by {b!r}.")
    act = "relu" if not kinds or kinds == {nn.ReLU} else "tanh"
    return BatchedMLP(linears[0].in_features, tuple(lin.out_features for lin in linears[:-1]), act)


def _check_same(mlp: BatchedMLP, other: BatchedMLP, fn: str) -> None:
    if (mlp.in_features, mlp.hidden, mlp.activation) != (other.in_features, other.hidden, other.activation):
        raise ValueError(f"{fn}: net must have this architecture, {mlp!r}, got {other!r}.")
