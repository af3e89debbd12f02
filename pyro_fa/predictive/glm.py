r"""The linearised (GLM) predictive of a Gaussian posterior over a module's weights.

The network is replaced by its first-order Taylor expansion at the posterior mean :math:`c`
(Immer, Korzepa & Bauer 2021, §3),

.. math::

    f^{\rm lin}(x; \theta) = f(x; c) + J_x (\theta - c), \qquad J_x = \partial f(x; \theta) / \partial\theta
    \big|_{\theta = c} \in \mathbb{R}^{C\times D},

so that under :math:`\theta \sim N(c, s\Sigma)` the outputs are Gaussian,
:math:`f^{\rm lin}(x) \sim N\big(f(x; c),\ s J_x \Sigma J_x^\top\big)`. Every factor-analysis
posterior has :math:`\Sigma = \mathrm{diag}(\psi) \pm FF^\top`: ``+`` for a covariance fitted by
factor analysis (SWAG, the variational guide), ``-`` for the inverse of a low-rank-plus-diagonal
precision written by Woodbury (the Laplace approximation). :func:`linearized_moments` gives the
outputs' mean and covariance without forming :math:`\Sigma` or a Jacobian over all inputs;
:func:`probit_proba` turns them into class probabilities; :func:`linearized_network` is the
linearised network at one draw, for the sampled predictive (:class:`SampledPredictive`).

References
----------
A. Immer, M. Korzepa, M. Bauer, "Improving predictions of Bayesian neural nets via local
linearization", AISTATS 2021, §3. E. Daxberger, A. Kristiadi, A. Immer, R. Eschenhagen, M. Bauer,
P. Hennig, "Laplace Redux — effortless Bayesian deep learning", NeurIPS 2021, §2 (the probit
approximation as ``link_approx="probit"``). D. J. C. MacKay, "The evidence framework applied to
classification networks", Neural Computation 4(5), 1992, §2. D. J. Spiegelhalter, S. L. Lauritzen,
"Sequential updating of conditional probabilities on directed graphical structures", Networks 20, 1990.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Callable, List, Optional, Sequence, Tuple, Union

import contextlib

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp, vmap

from pyro_fa.predictive.registry import DEFAULT_LINK_APPROX, PREDICTIVES, register_predictive
from pyro_fa.predictive.sampled import SampledPredictive
from pyro_fa._validation import check_scale

__all__ = ["linearized_moments", "linearized_network", "probit_proba", "PRED_TYPES", "LINK_APPROXES",
           "DEFAULT_LINK_APPROX", "check_pred_type", "resolve_link_approx", "check_eval_mode"]

#: the predictives every posterior offers (a live view of :data:`~pyro_fa.predictive.registry.PREDICTIVES`):
#: sampled networks (``"nn"``), the network linearised at the mean (``"glm"``), and any registered since
PRED_TYPES = PREDICTIVES.keys()
#: how the predictive's outputs become class probabilities: by draws, or (Gaussian outputs) in closed form
LINK_APPROXES = ("mc", "probit")

_JACOBIAN_BUDGET = 2 ** 22  # elements of one chunk's per-example Jacobians (n, C, D) when chunk_size is None
# layers that are random or update their buffers in train mode: the linearisation is then not of one function
_RANDOM_IN_TRAINING = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
                       nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm1d,
                       nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LazyInstanceNorm1d,
                   nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d)


def check_pred_type(fn: str, pred_type, link_approx=None) -> None:
    """Refuse an unknown ``pred_type`` (one of :data:`PRED_TYPES`) or ``link_approx`` (:data:`LINK_APPROXES`).

    ``link_approx="probit"`` needs ``pred_type="glm"`` (the sampled networks' outputs are not Gaussian).

    Raises
    ------
    ValueError
        Naming ``fn``, the argument, the allowed values and the value given.
    """
    if not isinstance(pred_type, str) or pred_type not in PREDICTIVES:
        raise ValueError(f"{fn}: pred_type must be one of {tuple(PREDICTIVES)}, got {pred_type!r}.")
    if link_approx is not None:
        if link_approx not in LINK_APPROXES:
            raise ValueError(f"{fn}: link_approx must be one of {LINK_APPROXES}, got {link_approx!r}.")
        if link_approx not in PREDICTIVES[pred_type].link_approxes:
            offering = " or ".join(f"pred_type={p!r}" for p, e in PREDICTIVES.items() if link_approx in e.link_approxes)
            raise ValueError(f"{fn}: link_approx={link_approx!r} needs {offering} (Gaussian outputs), got "
                             f"pred_type={pred_type!r}. Use link_approx='mc' for sampled networks.")


def resolve_link_approx(fn: str, pred_type, link_approx=None) -> str:
    """``link_approx`` checked against ``pred_type`` (:func:`check_pred_type`), ``None`` replaced by its default.

    ``None`` is :data:`DEFAULT_LINK_APPROX`'s: ``"mc"`` for ``"nn"``, ``"probit"`` (the closed form) for ``"glm"``.

    Examples
    --------
    >>> resolve_link_approx("SWAG", "glm"), resolve_link_approx("SWAG", "nn")
    ('probit', 'mc')
    """
    check_pred_type(fn, pred_type, link_approx)
    return DEFAULT_LINK_APPROX[pred_type] if link_approx is None else link_approx


def check_eval_mode(fn: str, module: nn.Module, argument: str = "module") -> None:
    """Refuse a module with a dropout or batch-norm layer in train mode (random, or updating its buffers per call).

    Per-example Jacobians (``torch.func``) need the network to be one deterministic function of its
    weights; call this before any forward pass, so that a refusal leaves the buffers as they were.

    Raises
    ------
    ValueError
        Naming ``fn``, ``argument``, the layer and its name.
    """
    for name, sub in module.named_modules():
        if sub.training and (isinstance(sub, _RANDOM_IN_TRAINING)
                             or (isinstance(sub, _INSTANCE_NORMS) and sub.track_running_stats)):
            raise ValueError(f"{fn}: {argument} must be in eval mode where it has dropout or batch norm (the network "
                             f"is linearised as one deterministic function of its weights), got "
                             f"{type(sub).__name__} {name or '(the module)'!r} in train mode. Call "
                             f"{argument}.eval().")


def _named(fn: str, module, params) -> List[Tuple[str, Tensor]]:
    """(name, parameter) pairs of ``module`` for the flattened weights: ``params`` in its order, or all requiring grad."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{fn}: module must be a torch.nn.Module, got {type(module).__name__}.")
    check_eval_mode(fn, module)  # before any forward pass: batch-norm buffers stay as they are
    if params is None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    else:
        names = {id(p): n for n, p in module.named_parameters()}
        named = []
        for i, p in enumerate(params):
            if not torch.is_tensor(p) or id(p) not in names:
                raise ValueError(f"{fn}: params must be parameters of module (the weights the posterior is over), "
                                 f"got entry {i} of type {type(p).__name__}"
                                 + (f" and shape {tuple(p.shape)!r} that is not one of them." if torch.is_tensor(p)
                                    else "."))
            named.append((names[id(p)], p))
    if not named:
        raise ValueError(f"{fn}: module must have parameters to linearise in (params, or those requiring grad), "
                         "got none.")
    return named


def _flat_function(module: nn.Module, named) -> Callable[..., Tensor]:
    """``f(theta, *inputs)``: the module run with the flattened weights ``theta`` (D,), output as (N, C)."""
    names = [n for n, _ in named]
    shapes = [p.shape for _, p in named]
    sizes = [p.numel() for _, p in named]

    def f(theta: Tensor, *inputs: Tensor) -> Tensor:
        weights = {n: t.view(s) for n, t, s in zip(names, theta.split(sizes), shapes)}
        out = functional_call(module, weights, inputs)
        return out.unsqueeze(-1) if out.dim() == 1 else out

    return f


def _check_vector(fn: str, name: str, value, D: int, ref: Tensor) -> Tensor:
    if not torch.is_tensor(value):
        raise TypeError(f"{fn}: {name} must be a Tensor of shape ({D},), got {type(value).__name__}.")
    if value.shape != (D,):
        raise ValueError(f"{fn}: {name} must have shape ({D},) (the module's {D} weights), got {tuple(value.shape)!r}.")
    if value.dtype != ref.dtype or value.device != ref.device:
        raise ValueError(f"{fn}: {name} must be on the module's dtype and device ({ref.dtype}, {ref.device}), got "
                         f"({value.dtype}, {value.device}). Move it with .to(...).")
    return value


def _factor_blocks(fn: str, value, D: int, ref: Tensor) -> List[Tuple[int, int, Tensor]]:
    """``cov_factor`` given by blocks: a sequence of ``(lo, hi, F_b)``, ``F_b`` of shape (hi - lo, K_b), checked."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(b, (list, tuple)) and len(b) == 3 for b in value):
        raise TypeError(f"{fn}: cov_factor must be a Tensor of shape ({D}, K) or a sequence of (lo, hi, F_b) blocks, "
                        f"got {type(value).__name__}.")
    for lo, hi, F in value:
        ok = all(isinstance(i, int) and not isinstance(i, bool) for i in (lo, hi)) and 0 <= lo < hi <= D
        if not ok or not torch.is_tensor(F) or F.dim() != 2 or F.shape[0] != hi - lo:
            raise ValueError(f"{fn}: cov_factor's blocks must be (lo, hi, F_b) with 0 <= lo < hi <= {D} and F_b of "
                             f"shape (hi - lo, K_b), got ({lo!r}, {hi!r}, "
                             f"{tuple(F.shape) if torch.is_tensor(F) else type(F).__name__}).")
        if F.dtype != ref.dtype or F.device != ref.device:
            raise ValueError(f"{fn}: cov_factor's blocks must be on the module's dtype and device ({ref.dtype}, "
                             f"{ref.device}), got ({F.dtype}, {F.device}) for [{lo}, {hi}). Move them with .to(...).")
    return list(value)


def _inputs(fn: str, inputs) -> Tuple[Tensor, ...]:
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    if not inputs or not all(torch.is_tensor(x) for x in inputs):
        raise TypeError(f"{fn}: inputs must be a Tensor or a non-empty tuple of Tensors, got "
                        f"{[type(x).__name__ for x in inputs]!r}.")
    sizes = {x.shape[0] if x.dim() else None for x in inputs}
    if len(sizes) != 1 or None in sizes or 0 in sizes:
        raise ValueError(f"{fn}: inputs must share one leading (example) dimension N >= 1, got shapes "
                         f"{[tuple(x.shape) for x in inputs]!r}.")
    return inputs


def linearized_moments(module: nn.Module, loc: Tensor, inputs: Union[Tensor, Tuple[Tensor, ...]], *,
                       cov_diag: Tensor, cov_factor: Tensor, factor_sign: float = 1.0, scale: float = 1.0,
                       chunk_size: Optional[int] = None, params: Optional[Sequence[Tensor]] = None,
                       diagonal: bool = False) -> Tuple[Tensor, Tensor]:
    r"""Mean and covariance of the linearised network's outputs under a Gaussian over its weights.

    .. math::

        f^{\rm lin}(x) \sim N\big(f(x; c),\ s\,J_x \Sigma J_x^\top\big), \qquad
        J_x \Sigma J_x^\top = J_x \,\mathrm{diag}(\psi)\, J_x^\top + \sigma\, (J_x F)(J_x F)^\top,

    with :math:`\Sigma = \mathrm{diag}(\psi) + \sigma FF^\top` never formed (Immer et al. 2021, §3).
    :math:`\sigma = +1`: a factor-analysis covariance :math:`FF^\top + \Psi`. :math:`\sigma = -1`: the
    inverse of a low-rank-plus-diagonal precision :math:`A + UU^\top` by Woodbury,
    :math:`A^{-1} - A^{-1}U(I + U^\top A^{-1}U)^{-1}U^\top A^{-1}`, passed as ``cov_diag`` :math:`=
    \mathrm{diag}(A^{-1})` (:math:`A` diagonal) and ``cov_factor`` :math:`= A^{-1}UL^{-\top}` with
    :math:`LL^\top = I + U^\top A^{-1}U`.

    Parameters
    ----------
    module : nn.Module
        The network; ``module(*inputs)`` returns outputs of shape (N, C) (logits or means) or (N,)
        (read as (N, 1)). Run as it is; a dropout or batch-norm layer in train mode is refused
        (call ``module.eval()``). Its buffers are used, its parameters are replaced by ``loc``.
    loc : Tensor of shape (D,)
        The linearisation point :math:`c`: the flattened weights in the order of ``params``
        (``torch.nn.utils.parameters_to_vector`` order).
    inputs : Tensor of shape (N, ...) or tuple of such Tensors
    cov_diag : Tensor of shape (D,)
        :math:`\psi`.
    cov_factor : Tensor of shape (D, K), or sequence of (int, int, Tensor)
        :math:`F`; ``K`` may be 0 (a diagonal :math:`\Sigma`). Or by blocks, ``[(lo, hi, F_b), ...]`` with
        ``F_b`` of shape (hi - lo, K_b): :math:`F` is their columns, each zero outside its rows ``[lo, hi)``
        (e.g. :attr:`~pyro_fa.distributions.BlockLowRankPrecisionNormal.cov_factors`), never formed:
        :math:`J_xF_b` is contracted from the Jacobian's columns ``[lo, hi)`` (which the diagonal part computes
        anyway), :math:`O(C\sum_b D_bK_b)` per example instead of :math:`\sum_b K_b` forward-mode products.
    factor_sign : {1.0, -1.0}, default 1.0
        :math:`\sigma`.
    scale : float, default 1.0
        :math:`s`, the posterior scale (0: the mean's outputs, zero covariance).
    chunk_size : int, optional
        Examples per chunk: the per-example Jacobians of one chunk, shape (chunk_size, C, D), are the
        largest tensor held. Default: as many as keep that tensor below :math:`2^{22}` elements.
    params : sequence of Tensors, optional
        Parameters of ``module`` that the :math:`D` weights stand for, in flattening order; default
        every parameter requiring grad, in ``module.parameters()`` order. The others keep their values.
    diagonal : bool, default False
        Return only the variances, the diagonal of :math:`s\,J_x \Sigma J_x^\top` (what :func:`probit_proba`
        and a regression's marginal variances need): the contraction is :math:`C` times cheaper and
        :math:`C` times smaller; the Jacobians cost the same.

    Returns
    -------
    mean : Tensor of shape (N, C)
        :math:`f(x; c)`.
    cov : Tensor of shape (N, C, C), or (N, C) with ``diagonal=True``
        :math:`s\,J_x \Sigma J_x^\top` per example, or its diagonal.

    Raises
    ------
    TypeError
        ``module`` not a module, ``inputs`` not tensors, ``loc``/``cov_diag``/``cov_factor`` not tensors.
    ValueError
        Shapes that disagree with the module's :math:`D` weights, another dtype or device than the
        module's, ``factor_sign`` not :math:`\pm1`, ``scale`` negative, ``chunk_size`` not positive, inputs of
        different lengths, an output that is not (N, C) or (N,), ``params`` not the module's, a dropout or
        batch-norm layer in train mode (before any forward pass).

    Notes
    -----
    Cost per example: :math:`C` reverse-mode products for :math:`J_x` (``torch.func.vmap`` of ``jacrev``
    over a chunk of examples) and :math:`K` forward-mode products for :math:`J_x F` (``jvp``; where an
    operation has no forward-mode derivative, e.g. ``nn.LSTM`` / ``nn.GRU``'s ``mkldnn_rnn_layer`` on the CPU,
    :math:`J_xF` is contracted from the reverse-mode Jacobian instead, :math:`O(CDK)` per example), then
    :math:`O(C^2(D + K))` (:math:`O(C(D + K))` with ``diagonal=True``). Memory :math:`O(n\,C\,D)` for a chunk of :math:`n` examples; no
    :math:`D\times D` matrix and no :math:`N \times C \times D` tensor for all inputs.

    Examples
    --------
    A linear model, for which the result is exact: :math:`\mathrm{Var}[w^\top x + b] = \|x\|^2 + 1`
    under :math:`w, b \sim N(0, I)`.

    >>> net = torch.nn.Linear(3, 1)
    >>> x = torch.ones(2, 3)
    >>> mean, cov = linearized_moments(net, torch.zeros(4), x, cov_diag=torch.ones(4),
    ...                                cov_factor=torch.zeros(4, 0))
    >>> mean.shape, cov.flatten().tolist()
    (torch.Size([2, 1]), [4.0, 4.0])
    """
    fn = "linearized_moments"
    named = _named(fn, module, params)
    ref = named[0][1]
    D = sum(p.numel() for _, p in named)
    loc = _check_vector(fn, "loc", loc, D, ref)
    cov_diag = _check_vector(fn, "cov_diag", cov_diag, D, ref)
    blocks = None if torch.is_tensor(cov_factor) else _factor_blocks(fn, cov_factor, D, ref)
    if blocks is None and (cov_factor.dim() != 2 or cov_factor.shape[0] != D):
        raise ValueError(f"{fn}: cov_factor must have shape ({D}, K) (the module's {D} weights), got "
                         f"{tuple(cov_factor.shape)!r}.")
    if blocks is None and (cov_factor.dtype != ref.dtype or cov_factor.device != ref.device):
        raise ValueError(f"{fn}: cov_factor must be on the module's dtype and device ({ref.dtype}, {ref.device}), "
                         f"got ({cov_factor.dtype}, {cov_factor.device}). Move it with .to(...).")
    if factor_sign not in (1, -1) or isinstance(factor_sign, bool):
        raise ValueError(f"{fn}: factor_sign must be 1.0 (covariance F F^T + Psi) or -1.0 (Woodbury inverse of a "
                         f"low-rank-plus-diagonal precision), got {factor_sign!r}.")
    check_scale(fn, scale)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{fn}: chunk_size must be an integer >= 1 or None, got {chunk_size!r}.")
    inputs = _inputs(fn, inputs)
    f = _flat_function(module, named)
    N = inputs[0].shape[0]
    K = cov_factor.shape[1] if blocks is None else 0  # blocks: J_x F_b from the Jacobian's own coordinates
    diag = cov_diag * scale if scale != 1.0 else cov_diag
    if blocks is None:
        factor_t = (cov_factor * math.sqrt(scale) if scale != 1.0 else cov_factor).t()  # (K, D)
    else:
        blocks = [(lo, hi, F * math.sqrt(scale) if scale != 1.0 else F) for lo, hi, F in blocks]

    names, sizes = [n for n, _ in named], [p.numel() for _, p in named]

    def single(parts: Tuple[Tensor, ...], *x: Tensor) -> Tensor:  # one example's outputs, shape (C,)
        return functional_call(module, dict(zip(names, parts)), tuple(xi.unsqueeze(0) for xi in x)).reshape(-1)

    # the Jacobian by parameter tensor, never concatenated into (n, C, D): each block is squared in place and
    # contracted with its part of the diagonal (the concatenation and a squared copy took 2/3 of the time)
    per_example_jacobian = vmap(jacrev(single), in_dims=(None,) + (0,) * len(inputs))
    loc_parts = tuple(t.view(p.shape) for t, (_, p) in zip(loc.split(sizes), named))
    diag_parts = diag.split(sizes)
    means, covs = [], []
    start, n = 0, chunk_size
    forward_mode = True  # J_x F by K forward-mode products, until an operation refuses them
    while start < N:
        if n is None:  # the output size C decides the default chunk
            C = f(loc, *(x[:1] for x in inputs)).shape[-1]
            n = max(1, _JACOBIAN_BUDGET // max(1, C * D))
        chunk = tuple(x[start:start + n] for x in inputs)
        with torch.no_grad():
            mean = f(loc, *chunk)
        if mean.dim() != 2 or mean.shape[0] != chunk[0].shape[0]:
            raise ValueError(f"{fn}: the module's output must have shape (N, C) or (N,) for inputs of N="
                             f"{chunk[0].shape[0]} examples, got {tuple(mean.shape)!r}.")
        JF = None
        if K and forward_mode:
            try:
                JF = vmap(lambda v: jvp(lambda th: f(th, *chunk), (loc,), (v,))[1])(factor_t).detach()  # (K, n, C)
            except NotImplementedError as exc:  # e.g. LSTM / GRU on the CPU: mkldnn_rnn_layer has no forward AD
                if "forward AD" not in str(exc):
                    raise
                forward_mode = False  # then J_x F from the reverse-mode Jacobian below, as for blocks
        fallback = [(0, D, factor_t.t())] if K and not forward_mode else None
        cov, offset = None, 0
        block_JF = [None] * len(fallback or blocks or ())  # J_x F_b per factor block, (n, C, K_b)
        jacobians = per_example_jacobian(loc_parts, *chunk)  # blocks (n, C, *shape)
        # blocks may share memory (an LSTM's two biases get one tensor): those are squared out of place
        storages = Counter(J.untyped_storage().data_ptr() for J in jacobians)
        for J, d in zip(jacobians, diag_parts):
            shared = storages[J.untyped_storage().data_ptr()] > 1
            J = J.detach().reshape(J.shape[0], J.shape[1], -1)
            for i, (lo, hi, F) in enumerate(fallback or blocks or ()):  # the block's rows within this parameter tensor
                a, e = max(lo, offset), min(hi, offset + J.shape[-1])
                if a < e:
                    part = J[..., a - offset:e - offset] @ F[a - lo:e - lo]
                    block_JF[i] = part if block_JF[i] is None else block_JF[i] + part
            offset += J.shape[-1]
            if diagonal:
                part = (J.square() if shared else J.square_()).matmul(d)
            else:
                part = torch.matmul(J * d, J.transpose(-1, -2))
            cov = part if cov is None else cov.add_(part)
            del J
        if JF is not None:
            low_rank = JF.square().sum(0) if diagonal else torch.einsum("knc,knm->ncm", JF, JF)
            cov = cov + factor_sign * low_rank
        for JF in block_JF:  # every block meets some parameter tensor (lo < hi <= D)
            cov = cov + factor_sign * (JF.square().sum(-1) if diagonal else JF @ JF.transpose(-1, -2))
        means.append(mean.detach())
        covs.append(cov)
        start += n
    return torch.cat(means), torch.cat(covs)


def probit_proba(mean: Tensor, cov: Tensor, *, log: bool = False) -> Tensor:
    r"""Class probabilities of Gaussian logits by the multi-class probit approximation.

    .. math::

        \mathbb E\big[\mathrm{softmax}(z)\big] \approx \mathrm{softmax}\Big(\frac{\mu}{\sqrt{1 + \tfrac\pi8
        \,\mathrm{diag}\,\Sigma}}\Big), \qquad z \sim N(\mu, \Sigma),

    the logistic-sigmoid moderation of MacKay (1992, §2) and Spiegelhalter & Lauritzen (1990) applied to
    each logit, as ``link_approx="probit"`` of Daxberger et al. (2021, "Laplace Redux", §2); only the
    variances of the logits enter.

    Parameters
    ----------
    mean : Tensor of shape (N, C)
        The logits' means (e.g. from :func:`linearized_moments`).
    cov : Tensor of shape (N, C, C) or (N, C)
        Their covariances, or variances.
    log : bool, default False
        Return log-probabilities, as ``log_softmax`` of the moderated logits (finite where the
        probabilities underflow).

    Returns
    -------
    Tensor of shape (N, C)
        Probabilities (rows sum to one); ``softmax(mean)`` where the variances are zero.

    Raises
    ------
    ValueError
        Shapes that disagree, or negative variances.

    Examples
    --------
    >>> probit_proba(torch.zeros(1, 2), torch.ones(1, 2)).tolist()
    [[0.5, 0.5]]
    """
    fn = "probit_proba"
    if not torch.is_tensor(mean) or mean.dim() != 2:
        raise ValueError(f"{fn}: mean must be a Tensor of shape (N, C), got "
                         f"{tuple(mean.shape) if torch.is_tensor(mean) else type(mean).__name__!r}.")
    N, C = mean.shape
    if not torch.is_tensor(cov) or cov.shape not in ((N, C, C), (N, C)):
        raise ValueError(f"{fn}: cov must be a Tensor of shape ({N}, {C}, {C}) or ({N}, {C}) for mean of shape "
                         f"({N}, {C}), got {tuple(cov.shape) if torch.is_tensor(cov) else type(cov).__name__!r}.")
    var = cov.diagonal(dim1=-2, dim2=-1) if cov.dim() == 3 else cov
    if bool((var < 0).any()):
        raise ValueError(f"{fn}: cov must have non-negative variances, got a minimum of {float(var.min())!r}.")
    moderated = mean / torch.sqrt(1 + math.pi / 8 * var)
    return moderated.log_softmax(-1) if log else moderated.softmax(-1)


def linearized_network(module: nn.Module, loc: Tensor, theta: Tensor,
                       params: Optional[Sequence[Tensor]] = None) -> Callable[..., Tensor]:
    r"""The network linearised at ``loc``, evaluated at the weights ``theta``: :math:`f(x; c) + J_x(\theta - c)`.

    Each call is one forward-mode product (``torch.func.jvp``): no Jacobian is stored.
    For a network linear in its weights it equals ``module`` run at ``theta``.

    Parameters
    ----------
    module : nn.Module
        As in :func:`linearized_moments`.
    loc : Tensor of shape (D,)
        The linearisation point :math:`c`.
    theta : Tensor of shape (D,)
        The weights (e.g. one posterior draw).
    params : sequence of Tensors, optional
        As in :func:`linearized_moments`.

    Returns
    -------
    callable
        ``net(*inputs) -> Tensor`` of the module's output shape.

    Raises
    ------
    TypeError, ValueError
        As for :func:`linearized_moments`'s ``module``, ``loc`` and ``params``; ``theta`` likewise.

    Examples
    --------
    >>> net = torch.nn.Linear(2, 1)
    >>> theta = torch.randn(3)
    >>> x = torch.randn(4, 2)
    >>> lin = linearized_network(net, torch.zeros(3), theta)
    >>> torch.allclose(lin(x), x @ theta[:2, None] + theta[2])
    True
    """
    fn = "linearized_network"
    named = _named(fn, module, params)
    ref = named[0][1]
    D = sum(p.numel() for _, p in named)
    loc = _check_vector(fn, "loc", loc, D, ref).detach()
    delta = _check_vector(fn, "theta", theta, D, ref).detach() - loc
    names = [n for n, _ in named]
    shapes = [p.shape for _, p in named]
    sizes = [p.numel() for _, p in named]

    def net(*inputs: Tensor) -> Tensor:
        def run(th: Tensor) -> Tensor:
            return functional_call(module, {n: t.view(s) for n, t, s in zip(names, th.split(sizes), shapes)},
                                   inputs)

        out, lin = jvp(run, (loc,), (delta,))
        return out + lin

    return net


def _linearized_networks(source, loader) -> SampledPredictive:
    r"""``pred_type="glm"``: at each draw :math:`\theta`, the network linearised at the mean,
    :math:`f(x; c) + J_x(\theta - c)` (with ``loader``, the batch-norm statistics of :math:`c`)."""
    module, loc, params = source.linearization("pred_type='glm'")

    @contextlib.contextmanager
    def network(theta):
        with source.refreshed(loc, loader):
            yield source.wrap(linearized_network(module, loc, source.whole(theta), params))

    return SampledPredictive(source.draws, network, module=source.module, loc=source.loc,
                             deviations=source.deviations)


register_predictive("glm", _linearized_networks, link_approxes=("mc", "probit"), default_link_approx="probit")
