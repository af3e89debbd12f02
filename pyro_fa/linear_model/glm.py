r"""``GeneralizedLinearModel``: a Bayesian GLM on a basis, fitted by SVI with a factor-analysis posterior."""
from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor, nn

from pyro_fa import AutoLowRankFactorGuide, GaussianPrior
from pyro_fa._validation import positive_float
from pyro_fa.infer.priors import FactorisedPrior
from pyro_fa.linear_model._glm_ops import LatentPredictive, _linear_predictor, progress_bar, run_svi
from pyro_fa.linear_model.likelihoods import make_likelihood
from pyro_fa.linear_model._validation import (
    as_inputs,
    as_targets,
    check_basis,
    integer,
    module_dtype_device,
)

__all__ = ["GeneralizedLinearModel"]


class GeneralizedLinearModel(nn.Module):
    r"""Bayesian generalised linear model on the features of a basis, with a factor-analysis posterior.

    .. math::

        y_n \sim p\big(y_n \mid g(\phi(x_n)^\top w), \gamma\big), \qquad w \sim p(w),
        \qquad q(w) = N(c,\; FF^\top + \Psi)

    (Steinberg et al. 2016, §1.3, eqs. 19–20), with :math:`p(w)` any
    :class:`~pyro_fa.infer.priors.FactorisedPrior` with a registered closed form and the likelihood a
    :class:`~pyro_fa.linear_model.likelihoods.Likelihood` registered by name (``"gaussian"``, with a learned
    noise scale :math:`\sigma`; ``"bernoulli"``; ``"poisson"``) or a callable ``f -> pyro distribution``.
    The weights are one latent site ``"w"`` of shape (D,); the observations sit in ``pyro.plate("data", N)``
    subsampled to ``batch_size`` rows (the batch's likelihood scaled by :math:`N/M`, §1.1 eq. 6).
    :meth:`fit` maximises the ELBO of :class:`~pyro_fa.AutoLowRankFactorGuide` (rank :math:`K`) with
    :class:`~pyro_fa.FactorELBO` in :class:`pyro.infer.SVI` (entropy and expected log prior in closed form,
    the expected log likelihood by reparameterised Monte Carlo; eqs. 11 and 25–26 with the factor-analysis
    posterior in place of their mixture of diagonal Gaussians), with the basis's learnable length scales.

    Parameters
    ----------
    basis : Basis
        Module mapping ``(N, in_features)`` to ``(N, D)`` with attributes
        ``in_features`` and ``out_features = D``.
    likelihood : str or callable, default "gaussian"
        A name registered in :data:`~pyro_fa.linear_model.likelihoods.LIKELIHOODS`
        (``"gaussian"``, ``"bernoulli"``, ``"poisson"``) or a callable.
    rank : int, default 10
        :math:`K \ge 1`; values above :math:`D` are reduced to :math:`D`.
    prior : FactorisedPrior, optional
        Prior on every weight (:class:`~pyro_fa.GaussianPrior`, :class:`~pyro_fa.LaplacePrior`, ...);
        default ``GaussianPrior(precision=1.0)``.
    noise_scale : float, default 1.0
        Initial (or, with ``learn_noise=False``, fixed) :math:`\sigma` of the Gaussian likelihood.
    learn_noise : bool, default True
        Fit :math:`\sigma` with the ELBO (Gaussian likelihood only).
    num_particles : int, default 1
        Monte Carlo draws of :math:`w` per step (vectorised when above 1).
    init_scale : float, default 0.01
        Initial posterior standard deviation of each weight (:class:`~pyro_fa.AutoLowRankFactorGuide`).

    Attributes
    ----------
    basis : Basis
    guide : AutoLowRankFactorGuide or None
        The fitted :math:`q(w)` (``None`` before :meth:`fit`).
    noise_scale : Tensor of shape ()
        :math:`\sigma` (a buffer; the fitted value after :meth:`fit`).
    losses_ : list of float
        The loss (negative ELBO estimate) at every step of the last fit.
    n_steps_ : int

    Raises
    ------
    TypeError, ValueError
        If ``basis`` is not a basis module, ``likelihood`` neither a registered name nor callable, ``prior``
        not a ``FactorisedPrior``, or a number has the wrong type or is out of range.

    Notes
    -----
    A step costs :math:`O(M D + DK^2)` for :math:`M` rows (plus the basis); no :math:`D\times D` matrix is
    formed. Predictions use the closed-form moments of :math:`f_* = \phi_*^\top w` under :math:`q` where the
    likelihood has them (:math:`O(DK)` per point), Monte Carlo over :math:`w \sim q` otherwise (eqs. 28–29).
    The dtype and device are the basis's; ``.to()`` moves a fitted model. Training runs in a private Pyro
    parameter store, so the global store is left as it was.

    References
    ----------
    Steinberg, Tiao, McCalman, Reid & O'Callaghan (2016), *revrand:
    technical report*, CSIRO Data61, §1.1 and §1.3; Ong, Nott & Smith (2018),
    *Gaussian variational approximation with a factor covariance
    structure*; Kingma & Welling (2014), *Auto-encoding variational Bayes*.

    Examples
    --------
    >>> from pyro_fa.basis import LinearBasis
    >>> _ = torch.manual_seed(0)
    >>> X = torch.randn(200, 2); y = (X[:, 0] > 0).to(X.dtype)
    >>> glm = GeneralizedLinearModel(LinearBasis(2), "bernoulli", rank=2).fit(X, y, n_steps=100, lr=0.05)
    >>> glm.predict_proba(X[:2]).shape
    torch.Size([2, 2])
    """

    def __init__(
        self,
        basis: nn.Module,
        likelihood: Union[str, Callable[[Tensor], dist.Distribution]] = "gaussian",
        rank: int = 10,
        prior: Optional[FactorisedPrior] = None,
        *,
        noise_scale: float = 1.0,
        learn_noise: bool = True,
        num_particles: int = 1,
        init_scale: float = 0.01,
    ):
        super().__init__()
        name = type(self).__name__
        self.basis = check_basis(name, basis)
        self._likelihood = make_likelihood(name, likelihood)
        self.likelihood = likelihood
        self.rank = integer(name, "rank", rank, 1)
        if prior is None:
            prior = GaussianPrior(1.0)
        if not isinstance(prior, FactorisedPrior):
            raise TypeError(f"{name}: prior must be a pyro_fa.infer.priors.FactorisedPrior (GaussianPrior, "
                            f"LaplacePrior or any subclass), got {prior!r}.")
        self.prior = prior
        if not isinstance(learn_noise, bool):
            raise TypeError(f"{name}: learn_noise must be a bool, got {learn_noise!r}.")
        self.learn_noise = learn_noise
        self.num_particles = integer(name, "num_particles", num_particles, 1)
        self.init_scale = positive_float(name, "init_scale", init_scale)
        dtype, device = module_dtype_device(basis, name)
        self.register_buffer(
            "noise_scale", torch.tensor(positive_float(name, "noise_scale", noise_scale), dtype=dtype, device=device)
        )
        self.guide: Optional[AutoLowRankFactorGuide] = None
        self.losses_: list = []
        self.n_steps_ = 0

    # ---------------------------------------------------------------- the model
    def model(self, X: Tensor, y: Optional[Tensor] = None, subsample: Optional[Tensor] = None) -> Tensor:
        r"""The Pyro model: ``w ~ prior``; ``y[i] ~ likelihood(phi(X[i]) @ w)`` in a subsampled data plate.

        ``X`` of shape (N, in_features); ``y`` of shape (N,) (sampled when omitted); ``subsample`` the row indices
        of the batch (all rows when omitted). Returns the batch's linear predictor :math:`f`, shape (M,) (or with
        leading particle dims).
        """
        if any(p.requires_grad for p in self.basis.parameters()):
            pyro.module("basis", self.basis)
        like = X.new_zeros(self.basis.out_features)
        w = pyro.sample("w", self.prior.distribution(like))
        noise = self._likelihood.noise(self.noise_scale, self.learn_noise)
        with pyro.plate("data", X.shape[0], subsample=subsample, dim=-1) as idx:
            Xb = X if subsample is None else X.index_select(0, idx)
            f = _linear_predictor(self.basis(Xb), w)
            yb = None if y is None else (y if subsample is None else y.index_select(0, idx))
            pyro.sample("y", self._likelihood.distribution(f, noise), obs=yb)
        return f

    # ---------------------------------------------------------------- data checks
    def _inputs(self, X, arg: str = "X") -> Tensor:
        b = self.noise_scale
        return as_inputs(type(self).__name__, X, self.basis.in_features, b.dtype, b.device, arg)

    def _targets(self, y, n: int) -> Tensor:
        name = type(self).__name__
        b = self.noise_scale
        y = as_targets(name, y, n, b.dtype, b.device)
        self._likelihood.check_targets(name, y)
        return y

    # ---------------------------------------------------------------- fitting
    def fit(
        self,
        X,
        y,
        n_steps: int = 2000,
        batch_size: Optional[int] = None,
        lr: float = 0.01,
        progress: bool = False,
        *,
        lr_decay: float = 0.1,
    ) -> "GeneralizedLinearModel":
        r"""Fit :math:`q(w)` (and :math:`\sigma`, the basis's length scales) by SVI on the ELBO.

        Parameters
        ----------
        X : Tensor or array of shape (N, in_features)
        y : Tensor or array of shape (N,)
            In the likelihood's support: real (Gaussian), labels in {0, 1} (Bernoulli), counts (Poisson).
        n_steps : int, default 2000
        batch_size : int, optional
            Rows per step, without replacement, reshuffled every epoch; all rows when omitted or at least ``N``.
        lr : float, default 0.01
            Initial Adam learning rate.
        progress : bool, default False
            Show a progress bar with the loss per data point.
        lr_decay : float, default 0.1
            The learning rate decays exponentially to ``lr * lr_decay`` at the last step (1: constant).

        Returns
        -------
        self

        Raises
        ------
        TypeError, ValueError
            For bad data (wrong width, non-finite values, targets outside the support) or options.

        Notes
        -----
        Each call starts a fresh guide (and noise scale, from the current ``noise_scale``) in a private Pyro
        parameter store, and draws from the global torch RNG.
        """
        name = type(self).__name__
        n_steps = integer(name, "n_steps", n_steps, 1)
        lr = positive_float(name, "lr", lr)
        lr_decay = positive_float(name, "lr_decay", lr_decay)
        if lr_decay > 1:
            raise ValueError(f"{name}: lr_decay must be in (0, 1], got {lr_decay!r}.")
        if not isinstance(progress, bool):
            raise TypeError(f"{name}: progress must be a bool, got {progress!r}.")
        X = self._inputs(X)
        N = X.shape[0]
        y = self._targets(y, N)
        if batch_size is not None:
            batch_size = integer(name, "batch_size", batch_size, 1)
            if batch_size >= N:
                batch_size = None
        bar = progress_bar(progress, n_steps, name)
        with pyro.get_param_store().scope():
            guide = AutoLowRankFactorGuide(self.model, rank=min(self.rank, self.basis.out_features),
                                           init_scale=self.init_scale)
            losses = run_svi(self.model, guide, X, y, n_steps, batch_size, lr, lr_decay, self.num_particles, bar)
            noise = self._likelihood.fitted_noise(self.learn_noise)
        if bar is not None:
            bar.close()
        if noise is not None:
            self.noise_scale = noise
        guide.requires_grad_(False)
        self.guide = guide
        self.losses_ = losses
        self.n_steps_ = n_steps
        return self

    # ---------------------------------------------------------------- posterior
    def _check_fitted(self) -> None:
        if self.guide is None:
            raise RuntimeError(f"{type(self).__name__}: call fit(X, y) before predicting.")

    def posterior(self) -> dist.LowRankMultivariateNormal:
        r""":math:`q(w) = N(c, FF^\top + \Psi)`, a ``LowRankMultivariateNormal`` with event shape (D,).

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        """
        self._check_fitted()
        return self.guide.get_posterior()

    def _latent(self) -> LatentPredictive:
        """The linear predictor under q, for the likelihood's predictions (RuntimeError before fit)."""
        return LatentPredictive(type(self).__name__, self.basis, self.posterior(), self.noise_scale)

    def _binary_latent(self, verb: str) -> LatentPredictive:
        if not self._likelihood.binary:
            raise RuntimeError(f"{type(self).__name__}: {verb} needs likelihood='bernoulli', got {self.likelihood!r}.")
        return self._latent()

    # ---------------------------------------------------------------- prediction
    def predictive_samples(self, X, n_samples: int = 100) -> Tensor:
        r"""Joint samples of the linear predictor :math:`f_* = \phi(x_*)^\top w`, :math:`w \sim q`.

        ``X`` of shape (M, in_features) gives latent values (before the inverse link) of shape (n_samples, M).
        Raises RuntimeError before :meth:`fit`, TypeError or ValueError for bad ``X`` or ``n_samples``.
        """
        latent = self._latent()
        n_samples = latent.n_samples(n_samples)
        return torch.cat(list(latent.samples(self._inputs(X), n_samples)), -1)

    @torch.no_grad()
    def predict(
        self, X, return_std: bool = False, n_samples: int = 1000
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        r"""Predictive mean (and standard deviation) of :math:`y_*`, with :math:`w` integrated out under :math:`q`.

        The likelihood's :meth:`~pyro_fa.linear_model.likelihoods.Likelihood.predictive_moments`:
        exact for the Gaussian (:math:`\mu_*`, :math:`v_* + \sigma^2`) and Poisson likelihoods, with
        :math:`\mu_*, v_*` the moments of :math:`f_*` under :math:`q`; Monte Carlo otherwise (Bernoulli:
        :math:`p_*` and :math:`\sqrt{p_*(1-p_*)}`; a callable: the law of total variance).

        Parameters
        ----------
        X : Tensor or array of shape (M, in_features)
        return_std : bool, default False
        n_samples : int, default 1000
            Weight draws where Monte Carlo is needed.

        Returns
        -------
        mean : Tensor of shape (M,)
        std : Tensor of shape (M,)
            Only with ``return_std=True``.

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        TypeError, ValueError
            For bad ``X``.
        """
        latent = self._latent()
        mean, var = self._likelihood.predictive_moments(latent, self._inputs(X), n_samples)
        return (mean, var.sqrt()) if return_std else mean

    @torch.no_grad()
    def predict_log_proba(self, X, n_samples: int = 1000) -> Tensor:
        r"""Log class probabilities :math:`[\log(1 - p_*), \log p_*]` of :meth:`predict_proba` (Bernoulli).

        Computed as :math:`\log p_* = \mathrm{logsumexp}_s \log\mathrm{sigmoid}(f_*^{(s)}) - \log S` over the
        same draws, so that a probability below the dtype's smallest number keeps a finite logarithm.

        Returns
        -------
        Tensor of shape (M, 2)
        """
        latent = self._binary_latent("predict_log_proba")
        return self._likelihood.log_probabilities(latent, self._inputs(X), latent.n_samples(n_samples))

    @torch.no_grad()
    def predict_proba(self, X, n_samples: int = 1000) -> Tensor:
        r"""Class probabilities :math:`[1 - p_*, p_*]`, :math:`p_* = \mathbb{E}_q[\mathrm{sigmoid}(f_*)]` (Bernoulli).

        A Monte Carlo average over ``n_samples`` weight draws (Steinberg et al. 2016, eq. 29).

        Returns a tensor of shape (M, 2) for ``X`` of shape (M, in_features): rows sum to 1, column 1 is
        :math:`P(y_* = 1)`. Raises RuntimeError before :meth:`fit` or when the likelihood is not binary.
        """
        latent = self._binary_latent("predict_proba")
        p = self._likelihood.probability(latent, self._inputs(X), latent.n_samples(n_samples))
        return torch.stack([1 - p, p], -1)

    @torch.no_grad()
    def log_predictive(self, X, y, n_samples: int = 1000) -> Tensor:
        r"""Per-point log predictive density :math:`\log \int p(y_* \mid f_*)\, q(w)\, dw`.

        Exact for the Gaussian likelihood, :math:`\log N(y_*; \mu_*, v_* + \sigma^2)`; otherwise
        :math:`\log \frac1S \sum_s p(y_* \mid f_*^{(s)})` over ``n_samples`` weight draws (Steinberg et al.
        2016, eq. 28), biased low by :math:`O(1/S)` (Jensen).

        Parameters
        ----------
        X : Tensor or array of shape (M, in_features)
        y : Tensor or array of shape (M,)
        n_samples : int, default 1000

        Returns
        -------
        Tensor of shape (M,)

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        TypeError, ValueError
            For bad ``X``, ``y`` (as :meth:`fit`) or ``n_samples``.
        """
        latent = self._latent()
        X = self._inputs(X)
        return self._likelihood.log_predictive(latent, X, self._targets(y, X.shape[0]), n_samples)

    def extra_repr(self) -> str:
        return f"likelihood={self._likelihood.name!r}, rank={self.rank}, prior={self.prior!r}"
