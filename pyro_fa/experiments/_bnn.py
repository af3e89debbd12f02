r"""Many independent variational fits of a Bayesian MLP regression, trained as one batch of tensors.

The UCI benchmark fits the same network to 20 splits under a grid of
hyperparameters and several posterior families. One fit at a time through
``pyro.infer.SVI`` costs 4–6 ms of Python per step for a 1×50 network, most of
it tracing; here ``R`` *replicas* (split × hyperparameter × family member)
share every tensor operation, with a leading replica dimension, at about
0.15 ms per replica-step for a 1×50 network and 0.4–0.5 ms for a 2×50 one on
one CPU core (40 replicas of a 222-point full batch).

Each replica is exactly one of the fits a Pyro user would run:

========== ============================================= =====================
family     the guide it reproduces                       its parameters
========== ============================================= =====================
``"fa"``   :class:`~pyro_fa.AutoLowRankFactorGuide`        ``loc``, ``factor`` G, ``log_scale`` (s = exp)
``"ppca"`` the same with ``noise="isotropic"``            one ``log_scale`` per replica (or a fixed σ)
``"lowrank"`` Pyro's ``AutoLowRankMultivariateNormal``      ``loc``, ``cov_factor``, ``scale`` (softplus)
``"normal"`` Pyro's ``AutoNormal``                          ``loc``, ``scale`` (softplus)
``"delta"`` Pyro's ``AutoDelta`` (MAP, for SWAG)            ``loc``
========== ============================================= =====================

with the same parameterisation, initialisation rules and ELBO estimator:
``estimator="factor"`` is :class:`~pyro_fa.FactorELBO` (closed-form entropy and
expected log-prior, Monte Carlo likelihood), ``"trace"`` is Pyro's
``Trace_ELBO`` (Monte Carlo ``log p(y, θ) - log q(θ)`` with the reparameterised
draw). ``tests/test_uci.py`` checks loss and gradients against the real Pyro
classes for the same parameters and the same random draws. The model is

.. math::

    \theta \sim p(\theta),\qquad
    y_n \mid x_n, \theta \sim N\big(f_\theta(x_n),\ \sigma_y^2\big),

with :math:`p` a factorised Gaussian (precision :math:`\alpha`) or Laplace
prior of the same variance (:math:`b = 1/\sqrt{2\alpha}`), and
:math:`\sigma_y` learned by maximum likelihood (a point estimate, as a
``pyro.param``). Learning rates may differ between replicas: replicas with the
same rate form one parameter group of a plain ``torch.optim.Adam`` (what
``pyro.optim.Adam`` wraps).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F_
from torch import Tensor
from torch.distributions import Independent, LowRankMultivariateNormal, Normal

from pyro_fa.fa.linalg import orthogonal_init
from pyro_fa.infer.priors import laplace_expected_log_prob, normal_expected_log_prob

__all__ = ["MLPSpec", "ReplicaVI", "FAMILIES", "ESTIMATORS", "PRIORS"]

FAMILIES = ("fa", "ppca", "lowrank", "normal", "delta")
ESTIMATORS = ("factor", "trace")
PRIORS = ("gaussian", "laplace")


class MLPSpec:
    """A ReLU multilayer perceptron with scalar output, its weights flattened into one vector.

    Layer ``l`` stores its weight as an ``(in, out)`` block (row-major) followed
    by its bias, in order; ``dim`` is the total count :math:`D`.

    Parameters
    ----------
    in_features : int
    hidden : sequence of int
        Widths of the hidden layers, e.g. ``(50,)`` for 1×50, ``(50, 50)`` for 2×50.
    """

    def __init__(self, in_features: int, hidden: Sequence[int]):
        sizes = [int(in_features), *map(int, hidden), 1]
        self.layers = list(zip(sizes[:-1], sizes[1:]))
        self.hidden = tuple(int(h) for h in hidden)
        self.dim = sum(i * o + o for i, o in self.layers)

    def __repr__(self) -> str:
        return f"MLPSpec({self.layers[0][0]} -> {'x'.join(map(str, self.hidden))} -> 1, dim={self.dim})"

    def init(self, replicas: int, *, generator=None, dtype=None, device=None) -> Tensor:
        """Weights as ``nn.Linear`` initialises them: U(-1/sqrt(fan_in), 1/sqrt(fan_in)); shape (R, D)."""
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
        x : Tensor of shape (R, N, p)

        Returns
        -------
        Tensor of shape (..., R, N)
        """
        # every (draw, replica) pair is one entry of a batch of plain 3-D kernels: ``baddbmm`` adds the bias
        # inside the matrix product, ReLU runs in place on its output (neither needs that output for its
        # backward), and the scalar output layer is a multiply-and-sum, which on one CPU core runs about twice
        # as fast, forward and backward, as a batched matrix-vector product
        batch = torch.broadcast_shapes(theta.shape[:-1], x.shape[:-2])
        n, B = x.shape[-2], math.prod(batch)
        theta = theta.expand(*batch, theta.shape[-1])
        h, i = x.expand(*batch, n, x.shape[-1]).reshape(B, n, x.shape[-1]), 0
        for fan_in, fan_out in self.layers[:-1]:
            W = theta[..., i:i + fan_in * fan_out].reshape(B, fan_in, fan_out)
            b = theta[..., i + fan_in * fan_out:i + fan_in * fan_out + fan_out].reshape(B, 1, fan_out)
            i += fan_in * fan_out + fan_out
            h = torch.baddbmm(b, h, W).relu_()
        w, b = theta[..., i:i + h.shape[-1]].reshape(B, 1, -1), theta[..., i + h.shape[-1]].reshape(B, 1)
        return ((h * w).sum(-1) + b).reshape(*batch, n)


def _inv_softplus(x: Tensor) -> Tensor:
    return x + torch.log(-torch.expm1(-x))


class ReplicaVI:
    r"""``R`` independent variational fits of :math:`q(\theta)` for the model in the module docstring.

    Parameters
    ----------
    spec : MLPSpec
    family : {"fa", "ppca", "lowrank", "normal"}
    prior : {"gaussian", "laplace"}
    precision : Tensor of shape (R,)
        Prior precision :math:`\alpha` of each replica (the Laplace prior gets
        the same variance, :math:`b = 1/\sqrt{2\alpha}`).
    lr : Tensor of shape (R,)
        Adam learning rate of each replica.
    rank : int, default 10
        :math:`K` (unused by ``"normal"``).
    noise_scale : Tensor of shape (R,), optional
        ``"ppca"`` only: a fixed :math:`\sigma` per replica, NaN where it is
        learned (the default, all learned, when omitted).
    estimator : {"factor", "trace"}, optional
        Default: ``"factor"`` for ``"fa"`` / ``"ppca"`` (FactorELBO), ``"trace"``
        for Pyro's guides (Trace_ELBO), as each is used in practice.
    init_scale : float, default 0.01
        Initial marginal standard deviation of the guide (Pyro's default, 0.1,
        inflates the learned observation noise of such networks).
    init_noise : float, default 1.0
        Initial :math:`\sigma_y` in standardised units of y.
    generator : torch.Generator, optional
    dtype, device : optional
    """

    def __init__(self, spec: MLPSpec, family: str, prior: str, precision: Tensor, lr: Tensor, *, rank: int = 10,
                 noise_scale: Optional[Tensor] = None, estimator: Optional[str] = None, init_scale: float = 0.01,
                 init_noise: float = 1.0, generator: Optional[torch.Generator] = None, dtype=None, device=None):
        if family not in FAMILIES:
            raise ValueError(f"ReplicaVI: family must be one of {FAMILIES}, got {family!r}.")
        if prior not in PRIORS:
            raise ValueError(f"ReplicaVI: prior must be one of {PRIORS}, got {prior!r}.")
        estimator = estimator or ("factor" if family in ("fa", "ppca") else "trace")
        if family == "delta":
            estimator = "map"
        if family != "delta" and estimator not in ESTIMATORS:
            raise ValueError(f"ReplicaVI: estimator must be one of {ESTIMATORS}, got {estimator!r}.")
        if noise_scale is not None and family != "ppca":
            raise ValueError(f"ReplicaVI: noise_scale must be None for family={family!r}, got a tensor.")
        dtype = dtype or torch.get_default_dtype()
        precision = torch.as_tensor(precision, dtype=dtype, device=device).reshape(-1)
        lr = torch.as_tensor(lr, dtype=dtype, device=device).reshape(-1)
        R = precision.numel()
        if lr.numel() != R:
            raise ValueError(f"ReplicaVI: lr must have one entry per replica ({R}), got {lr.numel()}.")
        self.spec, self.family, self.prior, self.estimator = spec, family, prior, estimator
        self.replicas, self.rank = R, int(rank)
        self.precision = precision
        # the prior's scale per replica, shape (R, 1): Normal std or Laplace b with the same variance
        self.prior_scale = (precision.rsqrt() if prior == "gaussian" else (2 * precision).rsqrt()).unsqueeze(-1)
        D, K = spec.dim, self.rank
        loc = spec.init(R, generator=generator, dtype=dtype, device=device)
        p: Dict[str, Tensor] = {"loc": loc}
        if family in ("fa", "ppca"):
            # AutoLowRankFactorGuide: orthogonal G with columns of norm sqrt(D / K); s = init_scale / sqrt(2)
            p["factor"] = torch.stack([
                orthogonal_init(D, K, scale=math.sqrt(D / K), dtype=dtype, device=device, generator=generator)
                for _ in range(R)])
            width = D if family == "fa" else 1
            p["log_scale"] = loc.new_full((R, width), math.log(init_scale / math.sqrt(2)))
            if noise_scale is not None:  # fixed sigma where given: those replicas' log_scale gets no gradient
                fixed = torch.as_tensor(noise_scale, dtype=dtype, device=device).reshape(R, 1)
                if not bool(((fixed > 0) | fixed.isnan()).all()):
                    raise ValueError(f"ReplicaVI: noise_scale must be positive or NaN (learned), got {fixed.tolist()}.")
                self.fixed_scale = fixed
        elif family == "lowrank":
            # AutoLowRankMultivariateNormal: cov_factor ~ N(0, 1/K), scale = sqrt(0.5) init_scale (softplus)
            p["cov_factor"] = torch.randn(R, D, K, generator=generator, dtype=dtype).to(device) / math.sqrt(K)
            p["scale_u"] = _inv_softplus(loc.new_full((R, D), math.sqrt(0.5) * init_scale))
        elif family == "normal":
            # AutoNormal: scale = init_scale (softplus)
            p["scale_u"] = _inv_softplus(loc.new_full((R, D), init_scale))
        p["log_noise"] = loc.new_full((R,), math.log(init_noise))
        self._groups = self._make_groups(p, lr)
        self.lr = lr

    # ------------------------------------------------------------ parameters
    @staticmethod
    def _make_groups(p: Dict[str, Tensor], lr: Tensor):
        """One leaf tensor per (parameter, learning rate): a plain Adam param group per rate."""
        rates = torch.unique(lr).tolist()
        groups = []
        for rate in rates:
            idx = torch.nonzero(lr == rate).squeeze(-1)
            groups.append((rate, idx, {k: v[idx].clone().requires_grad_(True) for k, v in p.items()}))
        order = torch.cat([idx for _, idx, _ in groups])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return groups, inverse

    def optimizer(self, **kwargs) -> torch.optim.Adam:
        """``torch.optim.Adam`` with one parameter group per learning rate.

        The fused implementation (one kernel over all parameters; the same update as the
        default ``foreach`` one, to rounding) where this torch has it, unless ``kwargs`` choose
        otherwise: on one CPU core it steps the D x K factors of a 2x50 network about 8x faster.
        """
        groups, _ = self._groups
        device = self.lr.device
        # fused Adam runs on CUDA since torch 2.0 and on CPU since 2.4
        kwargs.setdefault("fused", device.type == "cuda" or torch.torch_version.TorchVersion(torch.__version__) >= "2.4")
        return torch.optim.Adam([{"params": list(t.values()), "lr": rate} for rate, _, t in groups], **kwargs)

    def params(self) -> Dict[str, Tensor]:
        """The parameters in replica order (differentiable views of the leaves)."""
        groups, inverse = self._groups
        if len(groups) == 1:
            return groups[0][2]
        return {k: torch.cat([t[k] for _, _, t in groups])[inverse] for k in groups[0][2]}

    # ------------------------------------------------------------- posterior
    def distribution(self, p: Optional[Dict[str, Tensor]] = None):
        """:math:`q(\\theta)` of every replica: a batch of R distributions over :math:`\\mathbb{R}^D`."""
        p = self.params() if p is None else p
        if self.family == "delta":
            return None
        if self.family == "normal":
            return Independent(Normal(p["loc"], F_.softplus(p["scale_u"]), validate_args=False), 1,
                               validate_args=False)
        loc, G, s = self._whitened(p)
        s = s.expand_as(loc)
        return LowRankMultivariateNormal(loc, G * s.unsqueeze(-1), s * s, validate_args=False)

    def noise_scale(self, p: Optional[Dict[str, Tensor]] = None) -> Tensor:
        """:math:`\\sigma_y` per replica, shape (R,)."""
        p = self.params() if p is None else p
        return p["log_noise"].exp()

    def _prior_log_prob(self, theta: Tensor) -> Tensor:
        if self.prior == "gaussian":
            return Normal(0.0, self.prior_scale, validate_args=False).log_prob(theta).sum(-1)
        b = self.prior_scale
        return (-(2 * b).log() - theta.abs() / b).sum(-1)

    def _expected_prior(self, loc: Tensor, variance: Tensor) -> Tensor:
        """Closed-form E_q[log p(theta)] of a Gaussian q with these means and marginal variances, shape (R,)."""
        fn = normal_expected_log_prob if self.prior == "gaussian" else laplace_expected_log_prob
        return fn(loc, variance, 0.0, self.prior_scale).sum(-1)

    def loss(self, x: Tensor, y: Tensor, dataset_size: int, particles: int = 1) -> Tensor:
        r"""Negative ELBO of every replica, shape (R,) (sum it to train).

        Parameters
        ----------
        x : Tensor of shape (R, B, p)
        y : Tensor of shape (R, B)
        dataset_size : int
            :math:`N`; the likelihood of the batch is scaled by :math:`N / B`.
        particles : int, default 1
            Monte Carlo draws of :math:`\theta` (averaged).
        """
        p = self.params()
        if self.family in ("fa", "ppca", "lowrank"):
            return self._lowrank_loss(p, x, y, dataset_size, particles)
        q = self.distribution(p)
        theta = p["loc"].unsqueeze(0) if q is None else q.rsample((particles,))  # (S, R, D)
        loglik = self._loglik(p, theta, x, y, dataset_size)
        if self.estimator == "map":  # AutoDelta: the log joint at the point
            elbo = (loglik + self._prior_log_prob(theta)).mean(0)
        elif self.estimator == "trace":
            elbo = (loglik + self._prior_log_prob(theta) - q.log_prob(theta)).mean(0)
        else:
            elbo = loglik.mean(0) + self._expected_prior(q.mean, q.variance) + q.entropy()
        return -elbo

    def _loglik(self, p, theta: Tensor, x: Tensor, y: Tensor, dataset_size: int) -> Tensor:
        """Log-likelihood of the batch scaled to the dataset, shape (S, R)."""
        f = self.spec.forward(theta, x)  # (S, R, B)
        noise = self.noise_scale(p).unsqueeze(-1)
        return Normal(f, noise, validate_args=False).log_prob(y).sum(-1) * (dataset_size / y.shape[-1])

    def _whitened(self, p):
        r"""``(loc, G, s)`` with :math:`q = N(c, S(GG^\top + I)S)`, :math:`S = \mathrm{diag}(s)`.

        Every low-rank family has this form: :class:`~pyro_fa.AutoLowRankFactorGuide` by
        construction (``factor`` G, ``s`` the fixed σ where one is given), Pyro's
        ``AutoLowRankMultivariateNormal`` with ``cov_factor`` as G and ``s`` its softplus scale.
        ``s`` has shape (R, D), or (R, 1) for one isotropic scale.
        """
        if self.family == "lowrank":
            return p["loc"], p["cov_factor"], F_.softplus(p["scale_u"])
        s = p["log_scale"].exp()
        fixed = getattr(self, "fixed_scale", None)
        return p["loc"], p["factor"], (s if fixed is None else torch.where(fixed.isnan(), s, fixed))

    def _lowrank_loss(self, p, x: Tensor, y: Tensor, dataset_size: int, particles: int) -> Tensor:
        r"""Negative ELBO of the low-rank families without forming ``LowRankMultivariateNormal``.

        With :math:`q = N(c, S(GG^\top + I)S)` the capacitance :math:`I + W^\top D^{-1} W` of
        torch's class is :math:`I + G^\top G`: the log-determinant, the marginal variances and
        :math:`\log q(\theta)` need no division by :math:`s^2` over the :math:`D \times K`
        factor. The draw is :math:`c + s \odot (G\varepsilon_K + \varepsilon_D)`, the same noise
        in the same order as ``LowRankMultivariateNormal.rsample``; ``tests/test_uci.py`` checks
        the loss and every gradient against the Pyro classes.
        """
        loc, G, s = self._whitened(p)
        R, D, K = G.shape
        eps_k = torch.randn((particles, R, K), dtype=loc.dtype, device=loc.device)
        eps_d = torch.randn((particles, R, D), dtype=loc.dtype, device=loc.device)
        if self.estimator == "trace":
            G_eps, gram, row_sq = torch.einsum("rdk,srk->srd", G, eps_k), G.transpose(-1, -2) @ G, None
        else:
            G_eps, gram, row_sq = _FactorTerms.apply(G, eps_k)
        theta = loc + s * (G_eps + eps_d)  # (S, R, D)
        loglik = self._loglik(p, theta, x, y, dataset_size)
        cap = torch.eye(K, dtype=G.dtype, device=G.device) + gram
        L = torch.linalg.cholesky(cap)
        half_logdet = L.diagonal(dim1=-2, dim2=-1).log().sum(-1) + s.log().sum(-1) * (D / s.shape[-1])
        if self.estimator == "trace":  # Trace_ELBO: log p(y, theta) - log q(theta) at the draw
            z = (theta - loc) / s  # the whitened residual, differentiable in theta as torch's log_prob is
            Gz = torch.einsum("rdk,srd->srk", G, z).unsqueeze(-1)  # (S, R, K, 1)
            Gz = torch.linalg.solve_triangular(L.expand(Gz.shape[0], -1, -1, -1), Gz, upper=False)
            maha = z.pow(2).sum(-1) - Gz.squeeze(-1).pow(2).sum(-1)  # (S, R)
            log_q = -0.5 * (maha + D * math.log(2 * math.pi)) - half_logdet
            return -(loglik + self._prior_log_prob(theta) - log_q).mean(0)
        var = s.pow(2) * (1 + row_sq)  # diag(S (GG^T + I) S)
        entropy = 0.5 * D * (1 + math.log(2 * math.pi)) + half_logdet
        return -(loglik.mean(0) + self._expected_prior(loc, var) + entropy)

    # ------------------------------------------------------------ prediction
    @torch.no_grad()
    def predict(self, x: Tensor, num_samples: int, generator: Optional[torch.Generator] = None):
        """Predictive means under ``num_samples`` posterior draws and the noise variance.

        Parameters
        ----------
        x : Tensor of shape (R, M, p)
        num_samples : int
            S (1 for ``"delta"``, whatever is asked).
        generator : torch.Generator, optional

        Returns
        -------
        means : Tensor of shape (S, R, M)
        noise_var : Tensor of shape (R, 1)
        """
        p = self.params()
        q = self.distribution(p)
        if q is None:
            theta = p["loc"].unsqueeze(0)
        else:
            theta = q.rsample((num_samples,)) if generator is None else _rsample_with(q, num_samples, generator)
        return self.spec.forward(theta, x), self.noise_scale(p).pow(2).unsqueeze(-1)

    def state(self) -> Dict[str, Tensor]:
        """Detached copies of the parameters in replica order."""
        return {k: v.detach().clone() for k, v in self.params().items()}


class _FactorTerms(torch.autograd.Function):
    r"""What the FactorELBO of :math:`q = N(c, S(GG^\top + I)S)` needs of the factor, with one fused backward.

    ``G`` (R, D, K) and the draw's noise ``eps`` (S, R, K) give :math:`G\varepsilon` (S, R, D), the Gram
    matrix :math:`G^\top G` (R, K, K) and the row sums of squares :math:`\sum_k G_{dk}^2` (R, D). Autograd
    would build the gradient of ``G`` from five passes over the D × K factor and three temporaries (one
    product per side of the Gram matrix, the outer product of the draw, the square's derivative, their
    sums); here it is one multiply-add and one ``baddbmm``:
    :math:`\bar G = \sum_s \bar g_s \varepsilon_s^\top + 2\,\bar r \odot G + G(\bar A + \bar A^\top)`.
    """

    @staticmethod
    def forward(ctx, G: Tensor, eps: Tensor):
        ctx.save_for_backward(G, eps)
        return torch.einsum("rdk,srk->srd", G, eps), G.transpose(-1, -2) @ G, G.square().sum(-1)

    @staticmethod
    def backward(ctx, g_eps: Tensor, g_gram: Tensor, g_row: Tensor):
        G, eps = ctx.saved_tensors
        grad_G = grad_eps = None
        if ctx.needs_input_grad[0]:
            if eps.shape[0] == 1:  # one particle: the outer product as a broadcast multiply (no batched k=1 bmm)
                grad_G = g_eps[0].unsqueeze(-1) * eps[0].unsqueeze(-2)
            else:
                grad_G = torch.einsum("srd,srk->rdk", g_eps, eps)
            grad_G.addcmul_(G, g_row.unsqueeze(-1), value=2)
            grad_G = torch.baddbmm(grad_G, G, g_gram + g_gram.transpose(-1, -2))
        if ctx.needs_input_grad[1]:
            grad_eps = torch.einsum("rdk,srd->srk", G, g_eps)
        return grad_G, grad_eps


def _rsample_with(q, num_samples: int, generator: torch.Generator) -> Tensor:
    """Draw from a (batched) LowRankMultivariateNormal or Independent Normal with an explicit generator."""
    loc = q.mean
    kw = {"generator": generator, "dtype": loc.dtype, "device": loc.device}
    if isinstance(q, LowRankMultivariateNormal):
        K = q.cov_factor.shape[-1]
        eps_w = torch.randn((num_samples,) + loc.shape[:-1] + (K,), **kw)
        eps_d = torch.randn((num_samples,) + loc.shape, **kw)
        return loc + (q.cov_factor @ eps_w.unsqueeze(-1)).squeeze(-1) + q.cov_diag.sqrt() * eps_d
    return loc + q.stddev * torch.randn((num_samples,) + loc.shape, **kw)
