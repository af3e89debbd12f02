r"""Curvature vectors of a network at its trained weights, per example, by ``torch.func``.

Each example :math:`n` gives a few vectors :math:`v_{nj} \in \mathbb{R}^D` whose outer products sum to the
curvature of its negative log-likelihood, :math:`\sum_j v_{nj}v_{nj}^\top`:

* ``"ggn"``, the generalised Gauss-Newton matrix :math:`J_n^\top \Lambda_n J_n` (Schraudolph, *Fast curvature
  matrix-vector products for second-order gradient descent*, 2002; Martens, *New insights and perspectives on
  the natural gradient method*, 2020, §8), :math:`J_n` the :math:`C\times D` Jacobian of the outputs and
  :math:`\Lambda_n` the Hessian of the negative log-likelihood in the outputs, exactly as :math:`C` vectors:
  for a Gaussian likelihood the rows of :math:`J_n` (:math:`\Lambda = I/\sigma^2`; the :math:`1/\sigma^2` is
  applied later, so the noise stays a free, differentiable hyperparameter), for a categorical one the columns
  of :math:`J_n^\top L_n` with :math:`L_n = \mathrm{diag}(\sqrt{p_n}) - p_n\sqrt{p_n}^\top`, whose
  :math:`L_nL_n^\top = \mathrm{diag}(p_n) - p_np_n^\top` (using :math:`\sum_c p_{nc} = 1`), and for a
  Bernoulli one (a single logit) :math:`\sqrt{p_n(1-p_n)}\,J_n`;
* ``"mc"``, the Monte Carlo Fisher: gradients of :math:`\log p(\tilde y \mid f(x_n; \theta))` with labels
  :math:`\tilde y` drawn from the model's own predictive, divided by :math:`\sqrt{M}` for :math:`M` draws. Its
  expectation is the Fisher, equal to the GGN for these exponential-family likelihoods in their natural
  parameters; it is *not* the empirical Fisher, which uses the observed labels and is biased (Kunstner, Hennig
  & Balles, *Limitations of the empirical Fisher approximation for natural gradient descent*, 2019, §3).

Never a :math:`D\times C\times N` Jacobian: examples are processed ``chunk_size`` at a time.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vjp, vmap

__all__ = ["select_parameters", "flat_network", "curvature_vectors", "CURVATURES", "SUBSETS"]

#: the curvature kinds by name (:data:`_KINDS` holds what each computes)
CURVATURES = ("ggn", "mc")


def select_parameters(model: nn.Module, subset: Union[str, Iterable[Tensor]], owner: str) -> List[Tuple[str, Tensor]]:
    """The named parameters a Laplace approximation is over.

    Parameters
    ----------
    model : nn.Module
    subset : {"all", "last_layer"} or iterable of Tensors
        ``"all"``: every parameter that requires a gradient; ``"last_layer"``: those of the last leaf module
        (in registration order) that holds parameters; or parameters of ``model`` given one by one.
    owner : str
        The caller's name, the start of error messages.

    Returns
    -------
    list of (str, Tensor)
        In ``model.named_parameters()`` order.

    Raises
    ------
    ValueError
        Unknown string, an empty selection, or a tensor that is not a parameter of ``model``.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if isinstance(subset, str):
        if subset not in SUBSETS:
            raise ValueError(f"{owner}: subset must be 'all', 'last_layer' or an iterable of the model's "
                             f"parameters, got {subset!r}.")
        chosen = SUBSETS[subset](model, named, owner)
    else:
        try:
            wanted = list(subset)
        except TypeError:
            raise TypeError(f"{owner}: subset must be 'all', 'last_layer' or an iterable of the model's "
                            f"parameters, got {type(subset).__name__}.") from None
        by_id = {id(p): n for n, p in named}
        strangers = [i for i, p in enumerate(wanted) if not torch.is_tensor(p) or id(p) not in by_id]
        if strangers:
            raise ValueError(f"{owner}: subset must hold parameters of the model that require grad, got "
                             f"entries {strangers!r} that are not.")
        ids = {id(p) for p in wanted}
        chosen = [(n, p) for n, p in named if id(p) in ids]
    if not chosen:
        raise ValueError(f"{owner}: subset must select at least one parameter, got none.")
    return chosen


def _all_parameters(model: nn.Module, named, owner: str):
    """``subset="all"``: every parameter that requires a gradient."""
    return named


def _last_layer(model: nn.Module, named, owner: str):
    """``subset="last_layer"``: the parameters of the last leaf module (in registration order) holding some."""
    leaves = [m for m in model.modules()
              if not list(m.children()) and any(p.requires_grad for p in m.parameters(recurse=False))]
    if not leaves:
        raise ValueError(f"{owner}: subset='last_layer' needs a module with parameters, got none in "
                         f"{type(model).__name__}.")
    ids = {id(p) for p in leaves[-1].parameters(recurse=False) if p.requires_grad}
    return [(n, p) for n, p in named if id(p) in ids]


#: subset by name -> ``(model, named parameters requiring grad, owner) -> the selected (name, parameter) pairs``
SUBSETS = {"all": _all_parameters, "last_layer": _last_layer}


def flat_network(model: nn.Module, named: Sequence[Tuple[str, Tensor]]) -> Callable[[Tensor, Tensor], Tensor]:
    """``f(theta, x)``: the model's outputs at the flattened selected parameters ``theta`` (others as they are).

    Parameters
    ----------
    model : nn.Module
    named : sequence of (str, Tensor)
        The selected parameters, whose flattened concatenation ``theta`` is (shape (D,)).

    Returns
    -------
    callable
        ``f(theta, x)`` with ``theta`` of shape (D,) and ``x`` a batch, a Tensor or a tuple of Tensors (then
        ``model(*x)``); the outputs as the model returns them.
        It reads the model's other parameters and buffers at call time (by ``torch.func.functional_call``).
    """
    return _FlatNetwork(model, [n for n, _ in named], [p.shape for _, p in named])


class _FlatNetwork:
    """What :func:`flat_network` returns: a module-level callable (not a closure), so that what holds it pickles
    (``pickle``, ``torch.save``) with the model, and a deep copy calls the copied model."""

    def __init__(self, model: nn.Module, names: List[str], shapes: List[torch.Size]):
        self.model, self.names, self.shapes = model, names, shapes
        self.sizes = [s.numel() for s in shapes]

    def __call__(self, theta: Tensor, x: Tensor) -> Tensor:
        pieces = torch.split(theta, self.sizes)
        return functional_call(self.model, {n: t.view(s) for n, t, s in zip(self.names, pieces, self.shapes)},
                               x if isinstance(x, tuple) else (x,))


def _one(xi):
    """One example (a Tensor or a tuple of them, as ``vmap`` hands it) as a batch of one."""
    return tuple(t.unsqueeze(0) for t in xi) if isinstance(xi, tuple) else xi.unsqueeze(0)


def _outputs_2d(out: Tensor, owner: str) -> Tensor:
    if out.dim() == 1:
        return out.unsqueeze(-1)
    if out.dim() != 2:
        raise ValueError(f"{owner}: the model's outputs must have shape (B, C) or (B,), got {tuple(out.shape)!r}.")
    return out


def _jacobians(f: Callable, theta: Tensor, x: Tensor) -> Tuple[Tensor, Tensor]:
    """Outputs (B, C) and per-example Jacobians (B, C, D)."""
    def one(th, xi):
        out = f(th, _one(xi)).reshape(-1)
        return out, out

    J, out = vmap(jacrev(one, has_aux=True), in_dims=(None, 0))(theta, x)
    return out, J


def _softmax_factors(f: Callable, theta: Tensor, xi: Tensor) -> Tensor:
    r"""The columns of :math:`J^\top L` for one example, shape (C, D): :math:`C` vector-Jacobian products with
    the columns of :math:`L = \mathrm{diag}(\sqrt p) - p\sqrt p^\top` as cotangents (one product with
    :math:`\sqrt{p(1-p)}` for a single Bernoulli logit, shape (1, D))."""
    out, pull = vjp(lambda th: f(th, _one(xi)).reshape(-1), theta)
    out = out.detach()
    if out.shape[0] == 1:  # a Bernoulli logit: sqrt(p (1 - p)) J
        p = torch.sigmoid(out)
        return pull((p * (1 - p)).sqrt())[0].unsqueeze(0)
    p = out.softmax(-1)
    sp = p.sqrt()
    L = torch.diag(sp) - p.unsqueeze(-1) * sp.unsqueeze(-2)  # L L^T = diag(p) - p p^T
    return vmap(pull)(L.T)[0]  # row e: J^T L[:, e]


def curvature_vectors(f: Callable, theta: Tensor, x: Tensor, likelihood: str, kind: str = "ggn", *,
                      num_samples: int = 1, generator: Optional[torch.Generator] = None) -> Tensor:
    r"""The curvature vectors of a batch of examples.

    Parameters
    ----------
    f : callable
        ``f(theta, x)`` (see :func:`flat_network`), outputs of shape (B, C) or (B,).
    theta : Tensor of shape (D,)
        The weights (the MAP).
    x : Tensor of shape (B, ...), or tuple of such Tensors
        Inputs (a tuple: the network's positional arguments).
    likelihood : {"regression", "classification"}
        Gaussian (unit noise: divide the curvature by :math:`\sigma^2`) or categorical (softmax of C >= 2
        outputs; Bernoulli for a single logit).
    kind : {"ggn", "mc"}, default "ggn"
    num_samples : int, default 1
        Labels drawn per example for ``"mc"``.
    generator : torch.Generator, optional
        For the labels of ``"mc"``.

    Returns
    -------
    Tensor of shape (V, D)
        ``V = B * C`` (``"ggn"``) or ``B * num_samples`` (``"mc"``), with
        :math:`\sum_v v v^\top` the batch's curvature (exactly or in expectation).

    Notes
    -----
    ``"ggn"`` costs :math:`C` reverse-mode products per example and holds a (B, C, D) block; ``"mc"`` one
    gradient per example and draw.
    """
    theta = theta.detach()
    if kind not in _KINDS:
        raise ValueError(f"curvature_vectors: kind must be one of {CURVATURES}, got {kind!r}.")
    return _KINDS[kind](f, theta, x, likelihood, num_samples, generator)


def _ggn_classification(f: Callable, theta: Tensor, x) -> Tensor:
    """:math:`J^\\top L` straight from C vector-Jacobian products: no Jacobian formed, no (B, C, C, D) contraction."""
    V = vmap(_softmax_factors, in_dims=(None, None, 0))(f, theta, x)  # (B, C, D)
    return V.reshape(-1, theta.shape[0]).detach()


def _ggn_regression(f: Callable, theta: Tensor, x) -> Tensor:
    """The rows of :math:`J` (a Gaussian likelihood's :math:`\\Lambda = I`, the noise applied later)."""
    _, J = _jacobians(f, theta, x)  # (B, C, D)
    return J.reshape(-1, J.shape[-1]).detach()


#: likelihood -> the exact GGN factors of a batch, ``(f, theta, x) -> (B * C, D)``
_GGN_FACTORS = {"classification": _ggn_classification, "regression": _ggn_regression}


def _ggn(f, theta, x, likelihood, num_samples, generator) -> Tensor:
    return _GGN_FACTORS[likelihood](f, theta, x)


def _gaussian_labels(outs: Tensor, C: int, generator):
    """Targets drawn from a unit-noise Gaussian around the outputs, and their log-likelihood."""
    noise = torch.randn(outs.shape, dtype=outs.dtype, device=outs.device, generator=generator)

    def loglik(f, th, xi, yi):
        return -0.5 * (yi - f(th, _one(xi)).reshape(-1)).pow(2).sum()
    return outs + noise, loglik


def _categorical_labels(outs: Tensor, C: int, generator):
    """Labels drawn from the model's own categorical (Bernoulli for one logit), and their log-likelihood."""
    if C == 1:
        u = torch.rand(outs.shape, dtype=outs.dtype, device=outs.device, generator=generator)

        def loglik(f, th, xi, yi):
            z = f(th, _one(xi)).reshape(-1)
            return -nn.functional.binary_cross_entropy_with_logits(z, yi, reduction="sum")
        return (u < torch.sigmoid(outs)).to(outs.dtype), loglik
    labels = torch.multinomial(outs.softmax(-1), 1, generator=generator).squeeze(-1)

    def loglik(f, th, xi, yi):
        z = f(th, _one(xi)).reshape(-1)
        return (z.log_softmax(-1) * yi).sum()
    return nn.functional.one_hot(labels, C).to(outs.dtype), loglik


#: likelihood -> ``(outputs repeated per draw, C, generator) -> (sampled targets, log-likelihood(f, theta, x, y))``
_SAMPLED_TARGETS = {"classification": _categorical_labels, "regression": _gaussian_labels}


def _monte_carlo(f, theta, x, likelihood, num_samples, generator) -> Tensor:
    """Gradients of the log-likelihood of labels drawn from the model's predictive, over :math:`\\sqrt{M}`."""
    with torch.no_grad():
        out = _outputs_2d(f(theta, x), "curvature_vectors")
    B, C = out.shape
    M = num_samples
    xs = tuple(t.repeat_interleave(M, 0) for t in x) if isinstance(x, tuple) else x.repeat_interleave(M, 0)
    outs = out.repeat_interleave(M, 0)
    targets, loglik = _SAMPLED_TARGETS[likelihood](outs, C, generator)
    g = vmap(grad(lambda th, xi, yi: loglik(f, th, xi, yi)), in_dims=(None, 0, 0))(theta, xs, targets)
    return (g / M ** 0.5).detach()


#: curvature kind -> ``(f, theta, x, likelihood, num_samples, generator) -> the batch's curvature vectors``
_KINDS = {"ggn": _ggn, "mc": _monte_carlo}
