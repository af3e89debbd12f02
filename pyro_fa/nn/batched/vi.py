r"""``BatchedVI``: R independent variational fits of a Bayesian MLP regression, as one batch of tensors.

Each replica :math:`r` is the model

.. math::

    \theta_r \sim p_r(\theta),\qquad
    y_n \mid x_n, \theta_r \sim N\big(f_{\theta_r}(x_n),\ \sigma_r^2\big),

with :math:`f` a :class:`~pyro_fa.nn.BatchedMLP`, :math:`p_r` a factorised Gaussian
(precision :math:`\alpha_r`) or Laplace prior of the same variance
(:math:`b_r = 1/\sqrt{2\alpha_r}`), or any registered prior with a batched form
(:func:`~pyro_fa.infer.priors.register_prior`), and :math:`\sigma_r` learned by maximum likelihood
(a point estimate, as a ``pyro.param``) or fixed, and its guide :math:`q_r(\theta)`, one
of the registered families (:mod:`pyro_fa.nn.batched.families`, one module each;
:func:`~pyro_fa.nn.batched.families.register_family` adds one)

============ ============================================== ====================================
family       the guide it reproduces                        its parameters
============ ============================================== ====================================
``"fa"``     :class:`~pyro_fa.AutoLowRankFactorGuide`       ``loc``, ``factor`` G, ``log_scale``
``"ppca"``   the same with ``noise="isotropic"``            one ``log_scale`` per replica
``"lowrank"`` Pyro's ``AutoLowRankMultivariateNormal``      ``loc``, ``cov_factor``, ``scale_u``
``"normal"`` Pyro's ``AutoNormal``                          ``loc``, ``scale_u`` (softplus)
``"delta"``  Pyro's ``AutoDelta`` (MAP)                     ``loc``
============ ============================================== ====================================

with the same parameterisation, initialisation and ELBO estimator: ``"factor"`` is
:class:`~pyro_fa.FactorELBO` (closed-form entropy and expected log-prior, Monte Carlo
likelihood), ``"trace"`` is Pyro's ``Trace_ELBO``. The replicas share no parameter:
the summed loss :math:`\sum_r \mathcal{L}_r` has gradient :math:`\partial\mathcal{L}_r`
in replica :math:`r`'s parameters, so one optimiser step on the sum is R separate steps.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor
from torch.distributions import Normal

from pyro_fa.infer.priors import PRIORS, closed_form, get_prior
from pyro_fa.nn.batched.families import FAMILIES, get_family
from pyro_fa.nn.batched.mlp import BatchedMLP

__all__ = ["BatchedVI", "FAMILIES", "ESTIMATORS", "PRIORS"]

ESTIMATORS = ("factor", "trace")
# FAMILIES: the registry of pyro_fa.nn.batched.families (name -> GuideFamily subclass), re-exported read-only;
# PRIORS: the registry of pyro_fa.infer.priors (name -> FactorisedPrior subclass), re-exported


class BatchedVI:
    r"""``R`` independent variational fits of a Bayesian MLP regression, trained as one batch.

    Every replica is exactly one fit a Pyro user would run (see the module docstring:
    model, guide families, estimators); ``tests/nn/test_batched.py`` checks loss and
    gradients against the Pyro classes for the same parameters and the same random draws.
    Train with :func:`~pyro_fa.nn.fit_batched`, or step :meth:`optimizer` on
    ``loss(...).sum()`` yourself.

    Parameters
    ----------
    mlp : BatchedMLP
        The network :math:`f`.
    family : str, default "fa"
        A registered guide family (:data:`FAMILIES`: ``"fa"``, ``"ppca"``, ``"lowrank"``,
        ``"normal"``, ``"delta"``, or one added with
        :func:`~pyro_fa.nn.batched.families.register_family`); :class:`BatchedVI` holds one
        instance of its class, which makes the parameters, :math:`q` and the loss.
    prior : str, default "gaussian"
        A registered prior (:data:`~pyro_fa.infer.priors.PRIORS`: ``"gaussian"``,
        ``"laplace"``, or one added with :func:`~pyro_fa.infer.priors.register_prior`)
        whose class has a ``batched`` form.
    precision : float or Tensor of shape (R,), default 1.0
        Prior precision :math:`\alpha_r > 0` of each replica: the prior has variance
        :math:`1/\alpha_r` (the Laplace prior gets
        the same variance, :math:`b = 1/\sqrt{2\alpha}`).
    lr : float or Tensor of shape (R,), default 1e-3
        Adam learning rate of each replica (replicas with the same rate form one
        parameter group of :meth:`optimizer`).
    replicas : int, optional
        :math:`R`. Default: the length of the per-replica arguments (``precision``,
        ``lr``, ``noise_scale``, ``guide_noise_scale``, a 2-D ``init_loc``), scalars
        and length-1 tensors broadcasting; 1 when all are scalars.
    rank : int, default 10
        :math:`K` of the low-rank families, :math:`1 \le K \le D`.
    estimator : {"factor", "trace"}, optional
        Default: ``"factor"`` (FactorELBO) for ``"fa"`` / ``"ppca"``, ``"trace"``
        (Trace_ELBO) for Pyro's guides, as each is used in practice (the family's
        ``default_estimator``); ``"delta"`` always maximises the log joint.
    init_scale : float, default 0.01
        Initial marginal standard deviation of the guide (AutoLowRankFactorGuide's
        default; Pyro's 0.1 inflates the learned noise of such networks).
    init_loc : Tensor of shape (D,) or (R, D), optional
        Initial means (e.g. ``mlp.flatten(net)``). Default: drawn as ``nn.Linear``
        draws its weights (:meth:`BatchedMLP.init`), independently per replica.
    noise_scale : float or Tensor of shape (R,), optional
        A fixed likelihood noise :math:`\sigma_r`; learned (from
        ``init_noise_scale``) when omitted.
    init_noise_scale : float, default 1.0
        Initial learned :math:`\sigma_r`.
    guide_noise_scale : float or Tensor of shape (R,), optional
        ``"ppca"`` only: a fixed :math:`\sigma` of the guide's :math:`\Psi = \sigma^2 I`
        per replica, NaN where it is learned (AutoLowRankFactorGuide's ``noise_scale``).
    generator : torch.Generator, optional
        Draws the initial means and factors (on the generator's device, then moved).
    dtype, device : optional
        Of the parameters. Default: those of ``init_loc``, ``precision`` or ``lr`` when
        one is a floating-point tensor, else torch's default dtype and the CPU.
        :func:`~pyro_fa.nn.fit_batched` refuses data of another dtype or device.

    Attributes
    ----------
    replicas : int
    precision, lr : Tensor of shape (R,)
    prior_scale : Tensor of shape (R, 1)
        The prior's Normal standard deviation or Laplace :math:`b` (its batched
        distribution's ``scale``; None for a prior without one).

    Raises
    ------
    TypeError
        If ``mlp`` is not a BatchedMLP.
    ValueError
        For an unknown ``family``, ``prior`` or ``estimator``; a ``prior`` without a
        batched form or registered closed form; a ``rank`` outside
        :math:`[1, D]`; non-positive or non-finite ``precision``, ``lr``, scales;
        per-replica arguments of different lengths; ``guide_noise_scale`` for a family
        other than ``"ppca"``; an ``init_loc`` of another shape or not finite.

    Notes
    -----
    One step costs what one fit's step costs in tensor operations, times R, without
    Pyro's per-step tracing.
    The FactorELBO of the low-rank families never forms ``LowRankMultivariateNormal``:
    with :math:`q = N(c, S(GG^\top + I)S)` the capacitance is :math:`I + G^\top G`
    (:math:`O(DK^2)` per replica), and the gradient of :math:`G` comes from one fused
    backward (:class:`~pyro_fa.nn.batched.families.WhitenedLowRankFamily`).

    References
    ----------
    S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
    University of Edinburgh, 2021, §4.3–4.4 (VIFA). X. Jiang, *Laplace prior and
    variational inference probabilistic PCA (VIPPCA)*, report, University of Edinburgh,
    2023, §2–3. Ong, Nott & Smith (2018).

    Examples
    --------
    Three prior precisions, one fit each, in one batch:

    >>> from pyro_fa.nn import BatchedMLP, BatchedVI, fit_batched
    >>> x, y = torch.randn(64, 2), torch.randn(64)
    >>> vi = BatchedVI(BatchedMLP(2, (16,)), "fa", precision=torch.tensor([0.1, 1.0, 10.0]), lr=1e-2, rank=2,
    ...                generator=torch.Generator().manual_seed(0), dtype=x.dtype)
    >>> losses = fit_batched(vi, x, y, steps=20)
    >>> losses.shape, vi.evaluate(x, y, num_samples=8)["rmse"].shape
    (torch.Size([20, 3]), torch.Size([3]))
    """

    def __init__(self, mlp: BatchedMLP, family: str = "fa", prior: str = "gaussian", precision=1.0, lr=1e-3, *,
                 replicas: Optional[int] = None, rank: int = 10, estimator: Optional[str] = None,
                 init_scale: float = 0.01, init_loc: Optional[Tensor] = None, noise_scale=None,
                 init_noise_scale: float = 1.0, guide_noise_scale=None,
                 generator: Optional[torch.Generator] = None, dtype=None, device=None):
        if not isinstance(mlp, BatchedMLP):
            raise TypeError(f"BatchedVI: mlp must be a BatchedMLP, got {type(mlp).__name__}.")
        family_cls = get_family(family, "BatchedVI")
        prior_cls = get_prior(prior, "BatchedVI")
        if len(family_cls.estimators) == 1:  # e.g. "delta": always the log joint at the point
            estimator = family_cls.estimators[0]
        estimator = estimator or family_cls.default_estimator
        if estimator not in family_cls.estimators:
            raise ValueError(f"BatchedVI: estimator must be one of {family_cls.estimators}, got {estimator!r}.")
        if guide_noise_scale is not None and "guide_noise_scale" not in family_cls.options:
            takers = " or ".join(f"family={n!r}" for n, c in FAMILIES.items() if "guide_noise_scale" in c.options)
            raise ValueError(f"BatchedVI: guide_noise_scale must be None for family={family!r}, got "
                             f"{guide_noise_scale!r}; it fixes the isotropic noise of {takers}.")
        D = mlp.dim
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or (family_cls.uses_rank
                                                                                and not 1 <= rank <= D):
            raise ValueError(f"BatchedVI: rank must be an int in [1, D={D}], got {rank!r}.")
        for arg, value in (("init_scale", init_scale), ("init_noise_scale", init_noise_scale)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
                raise ValueError(f"BatchedVI: {arg} must be a positive finite float, got {value!r}.")
        like = next((t for t in (init_loc, precision, lr) if isinstance(t, Tensor) and t.is_floating_point()), None)
        dtype = dtype or (like.dtype if like is not None else torch.get_default_dtype())
        device = torch.device(device) if device is not None else (like.device if like is not None
                                                                  else torch.device("cpu"))
        per_replica = {"precision": precision, "lr": lr}
        if noise_scale is not None:
            per_replica["noise_scale"] = noise_scale
        if guide_noise_scale is not None:
            per_replica["guide_noise_scale"] = guide_noise_scale
        if init_loc is not None:
            if not isinstance(init_loc, Tensor) or init_loc.dim() not in (1, 2) or init_loc.shape[-1] != D:
                got = tuple(init_loc.shape) if isinstance(init_loc, Tensor) else type(init_loc).__name__
                raise ValueError(f"BatchedVI: init_loc must be a Tensor of shape ({D},) or (R, {D}), got {got}.")
            if not bool(torch.isfinite(init_loc).all()):
                raise ValueError("BatchedVI: init_loc must be finite, got NaN or inf.")
        vectors = {k: _as_vector(v, k, dtype, device) for k, v in per_replica.items()}
        R = _replica_count(vectors, init_loc, replicas)
        vectors = {k: v.expand(R).contiguous() for k, v in vectors.items()}
        for k in ("precision", "lr", "noise_scale"):
            if k in vectors and not bool(((vectors[k] > 0) & (vectors[k] < math.inf)).all()):
                raise ValueError(f"BatchedVI: {k} must be positive and finite, got {vectors[k].tolist()}.")
        fixed = vectors.get("guide_noise_scale")
        if fixed is not None and not bool(((fixed > 0) & (fixed < math.inf) | fixed.isnan()).all()):
            raise ValueError(f"BatchedVI: guide_noise_scale must be positive and finite, or NaN (learned), got "
                             f"{fixed.tolist()}.")
        precision, lr = vectors["precision"], vectors["lr"]
        self.mlp, self.family, self.prior, self.estimator = mlp, family, prior, estimator
        self._family = family_cls()
        self.replicas, self.rank = R, int(rank)
        self.precision = precision
        try:  # the registered prior of variance 1 / precision per replica, batch shape (R, 1)
            self._prior = prior_cls.batched(precision.unsqueeze(-1))
        except NotImplementedError as e:
            raise ValueError(f"BatchedVI: prior must name a prior with a batched form, got {prior!r}: {e}") from None
        self._prior_closed_form = closed_form(self._prior)
        if self._prior_closed_form is None:
            raise ValueError(f"BatchedVI: prior must have a registered closed form, got {prior!r} whose batched form "
                             f"is a {type(self._prior).__name__}; register one with register_expected_log_prob.")
        # the prior's scale per replica, shape (R, 1): Normal std or Laplace b with the same variance
        self.prior_scale = getattr(self._prior, "scale", None)
        self._fixed_noise = vectors.get("noise_scale")
        # PPCA's fixed sigma where given, shape (R, 1): those replicas' log_scale gets no gradient
        self._guide_scale = None if fixed is None else fixed.reshape(R, 1)
        if init_loc is None:
            loc = mlp.init(R, generator=generator, dtype=dtype, device=device)
        else:
            loc = init_loc.to(dtype=dtype, device=device).expand(R, D).clone()
        p: Dict[str, Tensor] = {"loc": loc, **self._family.init(self, loc, init_scale, generator)}
        if self._fixed_noise is None:
            p["log_noise"] = loc.new_full((R,), math.log(init_noise_scale))
        self._groups = self._make_groups(p, lr)
        self.lr = lr

    def __repr__(self) -> str:
        return (f"BatchedVI({self.mlp!r}, family={self.family!r}, prior={self.prior!r}, replicas={self.replicas}, "
                f"rank={self.rank}, estimator={self.estimator!r})")

    @property
    def dtype(self) -> torch.dtype:
        return self.lr.dtype

    @property
    def device(self) -> torch.device:
        return self.lr.device

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
        """``torch.optim.Adam`` (what ``pyro.optim.Adam`` wraps) with one parameter group per learning rate.

        The fused implementation (one kernel over all parameters; the same update as the
        default ``foreach`` one, to rounding) where this torch has it, unless ``kwargs`` choose
        otherwise: it steps the R × D × K factors in one pass.
        """
        groups, _ = self._groups
        # fused Adam runs on CUDA since torch 2.0 and on CPU since 2.4
        kwargs.setdefault("fused", self.device.type == "cuda"
                          or torch.torch_version.TorchVersion(torch.__version__) >= "2.4")
        return torch.optim.Adam([{"params": list(t.values()), "lr": rate} for rate, _, t in groups], **kwargs)

    def params(self) -> Dict[str, Tensor]:
        """The parameters in replica order, each of shape (R, ...) (differentiable views of the leaves)."""
        groups, inverse = self._groups
        if len(groups) == 1:
            return groups[0][2]
        return {k: torch.cat([t[k] for _, _, t in groups])[inverse] for k in groups[0][2]}

    def state(self) -> Dict[str, Tensor]:
        """Detached copies of the parameters in replica order."""
        return {k: v.detach().clone() for k, v in self.params().items()}

    # ------------------------------------------------------------- posterior
    def distribution(self, p: Optional[Dict[str, Tensor]] = None):
        r""":math:`q(\theta)` of every replica: a batch of R distributions over :math:`\mathbb{R}^D`
        (``None`` for ``"delta"``)."""
        return self._family.distribution(self, self.params() if p is None else p)

    def likelihood_scale(self, p: Optional[Dict[str, Tensor]] = None) -> Tensor:
        r"""The likelihood noise :math:`\sigma_r` per replica, fixed or learned; shape (R,)."""
        if self._fixed_noise is not None:
            return self._fixed_noise
        p = self.params() if p is None else p
        return p["log_noise"].exp()

    def _prior_log_prob(self, theta: Tensor) -> Tensor:
        """log p_r(theta) of draws of shape (S, R, D), shape (S, R)."""
        return self._prior.log_prob(theta).sum(-1)

    def _expected_prior(self, loc: Tensor, variance: Tensor) -> Tensor:
        """Closed-form E_q[log p(theta)] of a Gaussian q with these means and marginal variances, shape (R,)."""
        return self._prior_closed_form(self._prior, loc, variance).sum(-1)

    def loss(self, x: Tensor, y: Tensor, dataset_size: int, particles: int = 1) -> Tensor:
        r"""Negative ELBO of every replica, shape (R,) (sum it to train).

        .. math::

            \mathcal{L}_r = -\frac{N}{B}\sum_{b=1}^B \mathbb{E}_{q_r}\log N(y_b; f_\theta(x_b), \sigma_r^2)
            - \mathbb{E}_{q_r}\log p_r(\theta) - H[q_r],

        the expectations of the likelihood by ``particles`` reparameterised draws, those of
        the prior and the entropy in closed form (``"factor"``) or, with ``"trace"``, the
        whole :math:`\log p(y, \theta) - \log q(\theta)` at the draws.

        Parameters
        ----------
        x : Tensor of shape (R, B, p) or (B, p)
        y : Tensor of shape (R, B) or (B,)
        dataset_size : int
            :math:`N`; the likelihood of the batch is scaled by :math:`N / B`.
        particles : int, default 1
            Monte Carlo draws of :math:`\theta` (averaged), from torch's global RNG.
        """
        return self._family.loss(self, self.params(), x, y, dataset_size, particles)

    def _loglik(self, p, theta: Tensor, x: Tensor, y: Tensor, dataset_size: int) -> Tensor:
        """Log-likelihood of the batch scaled to the dataset, shape (S, R)."""
        f = self.mlp.forward(theta, x)  # (S, R, B)
        noise = self.likelihood_scale(p).unsqueeze(-1)
        return Normal(f, noise, validate_args=False).log_prob(y).sum(-1) * (dataset_size / y.shape[-1])

    # ------------------------------------------------------------ prediction
    @torch.no_grad()
    def predict(self, x: Tensor, num_samples: int = 100, generator: Optional[torch.Generator] = None):
        r"""Predictive means under ``num_samples`` posterior draws of every replica, and the noise variance.

        Parameters
        ----------
        x : Tensor of shape (R, M, p) or (M, p)
            Inputs of every replica, or of all.
        num_samples : int, default 100
            :math:`S` (1 for ``"delta"``, whatever is asked).
        generator : torch.Generator, optional
            Draws :math:`\theta`; torch's global RNG when omitted.

        Returns
        -------
        means : Tensor of shape (S, R, M)
            :math:`f_{\theta_s}(x)`, :math:`\theta_s \sim q_r`.
        noise_var : Tensor of shape (R, 1)
            :math:`\sigma_r^2`. With ``means`` the predictive mixture that
            :func:`replica_metrics` and :mod:`pyro_fa.metrics` take.
        """
        _check_inputs(self, x, "BatchedVI.predict")
        if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
            raise ValueError(f"BatchedVI.predict: num_samples must be a positive int, got {num_samples!r}.")
        p = self.params()
        theta = self._family.rsample(self, p, num_samples, generator)
        return self.mlp.forward(theta, x), self.likelihood_scale(p).pow(2).unsqueeze(-1)

    @torch.no_grad()
    def evaluate(self, x: Tensor, y: Tensor, num_samples: int = 100, *, y_std=1.0,
                 generator: Optional[torch.Generator] = None) -> Dict[str, Tensor]:
        r"""Test log-likelihood, RMSE and calibration error of every replica's model average.

        :func:`replica_metrics` of :meth:`predict`'s draws: per replica, float64,
        :func:`pyro_fa.metrics.gaussian_log_likelihood`, :func:`~pyro_fa.metrics.rmse`
        and :func:`~pyro_fa.metrics.calibration`, in the units of ``y`` times ``y_std``.

        Parameters
        ----------
        x : Tensor of shape (R, M, p) or (M, p)
        y : Tensor of shape (R, M) or (M,)
        num_samples : int, default 100
        y_std : float or Tensor of shape (R,), default 1.0
            The scale of standardised targets, to report in the original units.
        generator : torch.Generator, optional

        Returns
        -------
        dict of Tensors of shape (R,)
            ``"log_likelihood"``, ``"rmse"``, ``"calibration_error"``.
        """
        from pyro_fa.nn.batched.evaluation import replica_metrics

        means, noise_var = self.predict(x, num_samples, generator)
        return replica_metrics(means, noise_var, y, y_std=y_std)


def _as_vector(value, name: str, dtype, device) -> Tensor:
    """A per-replica argument as a 1-D tensor (length 1 for a scalar)."""
    if isinstance(value, (bool, str)) or not isinstance(value, (numbers.Real, Tensor, Sequence)):
        raise TypeError(f"BatchedVI: {name} must be a float or a Tensor of shape (R,), got {type(value).__name__}.")
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.dim() > 1:
        raise ValueError(f"BatchedVI: {name} must be a float or a Tensor of shape (R,), got shape {tuple(t.shape)}.")
    return t.reshape(-1)


def _replica_count(vectors: Dict[str, Tensor], init_loc: Optional[Tensor], replicas: Optional[int]) -> int:
    lengths = {k: v.numel() for k, v in vectors.items()}
    if init_loc is not None and init_loc.dim() == 2:
        lengths["init_loc"] = init_loc.shape[0]
    if replicas is not None:
        if isinstance(replicas, bool) or not isinstance(replicas, numbers.Integral) or replicas < 1:
            raise ValueError(f"BatchedVI: replicas must be a positive int, got {replicas!r}.")
        R, source = int(replicas), "replicas"
    else:
        longer = [(k, n) for k, n in lengths.items() if n != 1]
        source, R = longer[0] if longer else ("", 1)
    for k, n in lengths.items():
        if n not in (1, R):
            raise ValueError(f"BatchedVI: {k} must be a scalar or hold one entry per replica ({R}, from {source}), "
                             f"got {n} entries.")
    return R


def _check_inputs(model: BatchedVI, x: Tensor, fn: str) -> None:
    """``x`` of shape (R, M, p) or (M, p), on the model's dtype and device."""
    p, R = model.mlp.in_features, model.replicas
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor of shape (M, {p}) or ({R}, M, {p}), got "
                        f"{type(x).__name__}.")
    if x.dim() not in (2, 3) or x.shape[-1] != p or (x.dim() == 3 and x.shape[0] != R):
        raise ValueError(f"{fn}: x must have shape (M, {p}) or ({R}, M, {p}), got {tuple(x.shape)}.")
    if x.dtype != model.dtype or x.device != model.device:
        raise ValueError(f"{fn}: x must have the model's dtype {model.dtype} and device {model.device}, got "
                         f"{x.dtype} on {x.device}. Move it (x.to(model.device, model.dtype)), or build the "
                         "model with dtype=x.dtype, device=x.device.")
