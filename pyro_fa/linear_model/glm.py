r"""``GeneralizedLinearModel``: a Bayesian GLM on a basis, fitted by SVI with a factor-analysis posterior."""
from __future__ import annotations

import math
from typing import Callable, Iterator, Optional, Tuple, Union

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.infer import SVI
from torch import Tensor, nn

from pyro_fa import AutoLowRankFactorGuide, FactorELBO, GaussianPrior
from pyro_fa._validation import positive_float
from pyro_fa.infer.priors import FactorisedPrior
from pyro_fa.linear_model._glm_ops import _CHUNK_ELEMENTS, _Batches, _linear_predictor
from pyro_fa.linear_model._validation import (
    as_inputs,
    as_targets,
    check_basis,
    integer,
    module_dtype_device,
)

__all__ = ["GeneralizedLinearModel"]

LIKELIHOODS = ("gaussian", "bernoulli", "poisson")


class GeneralizedLinearModel(nn.Module):
    r"""Bayesian generalised linear model on the features of a basis, with a factor-analysis posterior.

    .. math::

        y_n \sim p\big(y_n \mid g(\phi(x_n)^\top w), \gamma\big), \qquad w \sim p(w),
        \qquad q(w) = N(c,\; FF^\top + \Psi)

    (Steinberg et al. 2016, §1.3, eqs. 19–20), with :math:`p(w)` a
    :class:`~pyro_fa.GaussianPrior` (or :class:`~pyro_fa.LaplacePrior`, or any
    :class:`~pyro_fa.infer.priors.FactorisedPrior` with a registered closed form) and
    the likelihood

    * ``"gaussian"``: :math:`N(f, \sigma^2)`, identity link, with a learned
      noise scale :math:`\sigma` (a positive ``pyro.param``);
    * ``"bernoulli"``: :math:`\mathrm{Bernoulli}(\mathrm{sigmoid}(f))`, logit link;
    * ``"poisson"``: :math:`\mathrm{Poisson}(e^f)`, log link;
    * a callable ``f -> pyro distribution`` with batch shape ``f.shape``.

    The weights are one latent site ``"w"`` of shape (D,), the observations
    sit in ``pyro.plate("data", N)`` subsampled to ``batch_size`` rows, so
    the likelihood of a batch is scaled by :math:`N/M` (Steinberg et al.
    2016, §1.1 eq. 6), and :meth:`fit` maximises the ELBO of
    :class:`~pyro_fa.AutoLowRankFactorGuide` (rank :math:`K`) with
    :class:`~pyro_fa.FactorELBO` in :class:`pyro.infer.SVI`: entropy and
    expected log prior in closed form, the expected log likelihood by
    reparameterised Monte Carlo (Steinberg et al. 2016, eqs. 11 and 25–26,
    with the factor-analysis posterior in place of their mixture of
    diagonal Gaussians). The basis's learnable length scales are fitted with
    the ELBO.

    Parameters
    ----------
    basis : Basis
        Module mapping ``(N, in_features)`` to ``(N, D)`` with attributes
        ``in_features`` and ``out_features = D``.
    likelihood : {"gaussian", "bernoulli", "poisson"} or callable, default "gaussian"
    rank : int, default 10
        :math:`K \ge 1`; values above :math:`D` are reduced to :math:`D`.
    prior : FactorisedPrior, optional
        Prior on every weight (:class:`~pyro_fa.GaussianPrior`, :class:`~pyro_fa.LaplacePrior` or
        any :class:`~pyro_fa.infer.priors.FactorisedPrior`: ``FactorELBO`` takes its registered
        closed form); default ``GaussianPrior(precision=1.0)``.
    noise_scale : float, default 1.0
        Initial (or, with ``learn_noise=False``, fixed) :math:`\sigma` of the
        Gaussian likelihood.
    learn_noise : bool, default True
        Fit :math:`\sigma` with the ELBO (Gaussian likelihood only).
    num_particles : int, default 1
        Monte Carlo draws of :math:`w` per step (vectorised when above 1).
    init_scale : float, default 0.01
        Initial posterior standard deviation of each weight (see
        :class:`~pyro_fa.AutoLowRankFactorGuide`).

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
    TypeError
        If ``basis`` is not a basis module, ``likelihood`` neither a known
        name nor callable, ``prior`` not a
        ``FactorisedPrior``, or a number has the wrong type.
    ValueError
        If ``likelihood`` is an unknown name, or ``rank``, ``noise_scale``,
        ``num_particles`` or ``init_scale`` is out of range.

    Notes
    -----
    A step costs :math:`O(M D + DK^2)` for a batch of :math:`M` rows (plus
    the basis, :math:`O(M d D)` for random Fourier features); no
    :math:`D\times D` matrix is ever formed. Predictions use the closed-form
    moments of :math:`f_* = \phi_*^\top w` under :math:`q` where they exist
    (Gaussian and Poisson means and variances, :math:`O(DK)` per point) and
    Monte Carlo over :math:`w \sim q` otherwise (Steinberg et al. 2016,
    eqs. 28–29). The module's dtype and device are those of the basis;
    ``.to()`` moves a fitted model. Training runs in a private Pyro parameter
    store (``ParamStoreDict.scope``), so several models can be fitted in one
    process without name clashes and the global store is left as it was.

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
        if isinstance(likelihood, str):
            if likelihood not in LIKELIHOODS:
                raise ValueError(f"{name}: likelihood must be one of {LIKELIHOODS} or a callable, got {likelihood!r}.")
        elif not callable(likelihood):
            raise TypeError(
                f"{name}: likelihood must be one of {LIKELIHOODS} or a callable f -> distribution, got {likelihood!r}."
            )
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
    def _distribution(self, f: Tensor, noise: Optional[Tensor]) -> dist.Distribution:
        if self.likelihood == "gaussian":
            return dist.Normal(f, noise)
        if self.likelihood == "bernoulli":
            return dist.Bernoulli(logits=f)
        if self.likelihood == "poisson":
            return dist.Poisson(f.exp())
        return self.likelihood(f)

    def model(self, X: Tensor, y: Optional[Tensor] = None, subsample: Optional[Tensor] = None) -> Tensor:
        r"""The Pyro model: ``w ~ prior``; ``y[i] ~ likelihood(phi(X[i]) @ w)`` in a subsampled data plate.

        Parameters
        ----------
        X : Tensor of shape (N, in_features)
        y : Tensor of shape (N,), optional
            Observations; sampled when omitted.
        subsample : Tensor of shape (M,), optional
            Row indices of the batch (all rows when omitted); the plate
            scales the batch's log likelihood by :math:`N/M`.

        Returns
        -------
        Tensor of shape (M,) (or with leading particle dims)
            The linear predictor :math:`f` of the batch.
        """
        if any(p.requires_grad for p in self.basis.parameters()):
            pyro.module("basis", self.basis)
        like = X.new_zeros(self.basis.out_features)
        w = pyro.sample("w", self.prior.distribution(like))
        noise = None
        if self.likelihood == "gaussian":
            noise = self.noise_scale
            if self.learn_noise:
                noise = pyro.param("noise_scale", lambda: self.noise_scale.detach().clone(),
                                   constraint=constraints.positive)
        with pyro.plate("data", X.shape[0], subsample=subsample, dim=-1) as idx:
            Xb = X if subsample is None else X.index_select(0, idx)
            f = _linear_predictor(self.basis(Xb), w)
            yb = None if y is None else (y if subsample is None else y.index_select(0, idx))
            pyro.sample("y", self._distribution(f, noise), obs=yb)
        return f

    # ---------------------------------------------------------------- data checks
    def _inputs(self, X, arg: str = "X") -> Tensor:
        b = self.noise_scale
        return as_inputs(type(self).__name__, X, self.basis.in_features, b.dtype, b.device, arg)

    def _targets(self, y, n: int) -> Tensor:
        name = type(self).__name__
        b = self.noise_scale
        y = as_targets(name, y, n, b.dtype, b.device)
        if self.likelihood == "bernoulli" and not ((y == 0) | (y == 1)).all():
            bad = y[(y != 0) & (y != 1)][:3].tolist()
            raise ValueError(f"{name}: y must hold labels in {{0, 1}} for likelihood='bernoulli', got {bad}.")
        if self.likelihood == "poisson" and not ((y >= 0) & (y == y.round())).all():
            bad = y[(y < 0) | (y != y.round())][:3].tolist()
            raise ValueError(
                f"{name}: y must hold non-negative integer counts for likelihood='poisson', got {bad}."
            )
        if callable(self.likelihood):
            d = self.likelihood(y.new_zeros(n))
            if not isinstance(d, TorchDistributionMixin):
                raise TypeError(
                    f"{name}: likelihood(f) must return a pyro.distributions distribution, got {type(d).__name__}."
                )
            if tuple(d.batch_shape) != (n,) or tuple(d.event_shape) != ():
                raise ValueError(
                    f"{name}: likelihood(f) must return a distribution with batch shape f.shape = ({n},) and "
                    f"event shape (), got batch shape {tuple(d.batch_shape)}, event shape {tuple(d.event_shape)}."
                )
            if not bool(d.support.check(y).all()):
                raise ValueError(f"{name}: y must lie in the likelihood's support {d.support}, got values outside it.")
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
            Real targets (Gaussian), labels in {0, 1} (Bernoulli) or
            non-negative integer counts (Poisson).
        n_steps : int, default 2000
            SVI steps.
        batch_size : int, optional
            Rows per step, drawn without replacement, reshuffled every epoch;
            the full data when omitted or at least ``N``.
        lr : float, default 0.01
            Initial Adam learning rate.
        progress : bool, default False
            Show a progress bar with the loss per data point.
        lr_decay : float, default 0.1
            The learning rate decays exponentially to ``lr * lr_decay`` at the
            last step (1 keeps it constant), which settles the stochastic
            optimisation.

        Returns
        -------
        self

        Raises
        ------
        TypeError, ValueError
            For bad data (wrong width, non-finite values, labels outside
            {0, 1}, negative or fractional counts) or options.

        Notes
        -----
        Each call starts a fresh guide (and, for the Gaussian likelihood, a
        fresh noise scale from the current ``noise_scale``) in a private Pyro
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
        D = self.basis.out_features
        batches = _Batches(N, batch_size, X.device)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=n_steps, desc=name)
        losses = []
        with pyro.get_param_store().scope():
            guide = AutoLowRankFactorGuide(self.model, rank=min(self.rank, D), init_scale=self.init_scale)
            optim = pyro.optim.ExponentialLR(
                {"optimizer": torch.optim.Adam, "optim_args": {"lr": lr}, "gamma": lr_decay ** (1.0 / n_steps)}
            )
            elbo = FactorELBO(
                num_particles=self.num_particles, vectorize_particles=self.num_particles > 1, max_plate_nesting=1
            )
            svi = SVI(self.model, guide, optim, elbo)
            for _ in range(n_steps):
                loss = svi.step(X, y, batches.next())
                optim.step()
                losses.append(loss)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss_per_point=loss / N)
            if self.likelihood == "gaussian" and self.learn_noise:
                noise = pyro.param("noise_scale").detach().clone()
        if bar is not None:
            bar.close()
        if self.likelihood == "gaussian" and self.learn_noise:
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

    def _feature_chunks(self, X: Tensor, per_row: int) -> Iterator[Tensor]:
        rows = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
        with torch.no_grad():
            for start in range(0, X.shape[0], rows):
                yield self.basis(X[start:start + rows])

    @torch.no_grad()
    def _f_moments(self, X: Tensor) -> Tuple[Tensor, Tensor]:
        """Mean and variance of f = phi(x)^T w under q, in O(DK) per row."""
        q = self.posterior()
        means, variances = [], []
        for Phi in self._feature_chunks(X, self.basis.out_features):
            means.append(Phi @ q.loc)
            variances.append((Phi @ q.cov_factor).pow(2).sum(-1) + Phi.pow(2) @ q.cov_diag)
        return torch.cat(means), torch.cat(variances)

    @torch.no_grad()
    def _f_samples(self, X: Tensor, n_samples: int) -> Iterator[Tensor]:
        """Blocks of joint samples of f, shape (n_samples, rows), one set of weight draws for all blocks."""
        w = self.posterior().sample((n_samples,))
        for Phi in self._feature_chunks(X, max(self.basis.out_features, n_samples)):
            yield w @ Phi.T

    def _n_samples(self, n_samples) -> int:
        return integer(type(self).__name__, "n_samples", n_samples, 1)

    # ---------------------------------------------------------------- prediction
    def predictive_samples(self, X, n_samples: int = 100) -> Tensor:
        r"""Joint samples of the linear predictor :math:`f_* = \phi(x_*)^\top w`, :math:`w \sim q`.

        Parameters
        ----------
        X : Tensor or array of shape (M, in_features)
        n_samples : int, default 100

        Returns
        -------
        Tensor of shape (n_samples, M)
            Latent values (before the inverse link).

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        TypeError, ValueError
            For bad ``X`` or ``n_samples``.
        """
        self._check_fitted()
        n_samples = self._n_samples(n_samples)
        return torch.cat(list(self._f_samples(self._inputs(X), n_samples)), -1)

    @torch.no_grad()
    def predict(
        self, X, return_std: bool = False, n_samples: int = 1000
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        r"""Predictive mean (and standard deviation) of :math:`y_*`, with :math:`w` integrated out under :math:`q`.

        * Gaussian: :math:`\mathbb{E}[y_*] = \mu_*`, :math:`\mathbb{V}[y_*] =
          v_* + \sigma^2`, with :math:`\mu_*, v_*` the mean and variance of
          :math:`f_*` under :math:`q` (exact).
        * Poisson: :math:`\mathbb{E}[y_*] = e^{\mu_* + v_*/2}` (the mean rate)
          and :math:`\mathbb{V}[y_*] = \mathbb{E}[y_*] + \mathbb{E}[y_*]^2
          (e^{v_*} - 1)` (exact).
        * Bernoulli: :math:`\mathbb{E}[y_*] = P(y_* = 1)` by Monte Carlo,
          standard deviation :math:`\sqrt{p(1-p)}`.
        * A callable likelihood: Monte Carlo of its mean and variance (law
          of total variance).

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
        self._check_fitted()
        X = self._inputs(X)
        if self.likelihood in ("gaussian", "poisson"):
            mu, v = self._f_moments(X)
            if self.likelihood == "gaussian":
                mean, var = mu, v + self.noise_scale.pow(2)
            else:
                mean = (mu + 0.5 * v).exp()
                var = mean + mean.pow(2) * torch.expm1(v)
        elif self.likelihood == "bernoulli":
            mean = self._mc_probability(X, self._n_samples(n_samples))
            var = mean * (1 - mean)
        else:
            means, variances = [], []
            for f in self._f_samples(X, self._n_samples(n_samples)):
                d = self._distribution(f, None)
                m = d.mean
                means.append(m.mean(0))
                variances.append(d.variance.mean(0) + m.var(0, unbiased=False))
            mean, var = torch.cat(means), torch.cat(variances)
        return (mean, var.sqrt()) if return_std else mean

    def _mc_probability(self, X: Tensor, n_samples: int) -> Tensor:
        return torch.cat([torch.sigmoid(f).mean(0) for f in self._f_samples(X, n_samples)])

    def _mc_log_probability(self, X: Tensor, n_samples: int) -> Tensor:
        # [log E sigmoid(-f), log E sigmoid(f)] as logsumexp of log-sigmoids over the draws minus log S:
        # finite where every draw lies far in a tail (the log of the averaged probability is -inf there)
        logsig = torch.nn.functional.logsigmoid
        out = torch.cat([torch.stack([torch.logsumexp(logsig(-f), 0), torch.logsumexp(logsig(f), 0)], -1)
                         for f in self._f_samples(X, n_samples)])
        return out - math.log(n_samples)

    @torch.no_grad()
    def predict_log_proba(self, X, n_samples: int = 1000) -> Tensor:
        r"""Log class probabilities :math:`[\log(1 - p_*), \log p_*]` of :meth:`predict_proba` (Bernoulli).

        Computed as :math:`\log p_* = \mathrm{logsumexp}_s \log\mathrm{sigmoid}(f_*^{(s)}) - \log S` over the
        same draws, so that a probability below the dtype's smallest number keeps a finite logarithm.

        Returns
        -------
        Tensor of shape (M, 2)
        """
        if self.likelihood != "bernoulli":
            raise RuntimeError(
                f"{type(self).__name__}: predict_log_proba needs likelihood='bernoulli', got {self.likelihood!r}."
            )
        self._check_fitted()
        return self._mc_log_probability(self._inputs(X), self._n_samples(n_samples))

    @torch.no_grad()
    def predict_proba(self, X, n_samples: int = 1000) -> Tensor:
        r"""Class probabilities :math:`[1 - p_*, p_*]`, :math:`p_* = \mathbb{E}_q[\mathrm{sigmoid}(f_*)]` (Bernoulli).

        A Monte Carlo average over ``n_samples`` weight draws
        (Steinberg et al. 2016, eq. 29).

        Parameters
        ----------
        X : Tensor or array of shape (M, in_features)
        n_samples : int, default 1000

        Returns
        -------
        Tensor of shape (M, 2)
            Rows sum to 1; column 1 is :math:`P(y_* = 1)`.

        Raises
        ------
        RuntimeError
            Before :meth:`fit`, or when the likelihood is not ``"bernoulli"``.
        """
        if self.likelihood != "bernoulli":
            raise RuntimeError(
                f"{type(self).__name__}: predict_proba needs likelihood='bernoulli', got {self.likelihood!r}."
            )
        self._check_fitted()
        p = self._mc_probability(self._inputs(X), self._n_samples(n_samples))
        return torch.stack([1 - p, p], -1)

    @torch.no_grad()
    def log_predictive(self, X, y, n_samples: int = 1000) -> Tensor:
        r"""Per-point log predictive density :math:`\log \int p(y_* \mid f_*)\, q(w)\, dw`.

        Exact for the Gaussian likelihood,
        :math:`\log N(y_*; \mu_*, v_* + \sigma^2)`; otherwise
        :math:`\log \frac1S \sum_s p(y_* \mid f_*^{(s)})` over ``n_samples``
        weight draws (Steinberg et al. 2016, eq. 28), which is biased low by
        :math:`O(1/S)` (Jensen).

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
        self._check_fitted()
        X = self._inputs(X)
        y = self._targets(y, X.shape[0])
        if self.likelihood == "gaussian":
            mu, v = self._f_moments(X)
            return dist.Normal(mu, (v + self.noise_scale.pow(2)).sqrt()).log_prob(y)
        n_samples = self._n_samples(n_samples)
        out, start = [], 0
        for f in self._f_samples(X, n_samples):
            yb = y[start:start + f.shape[-1]]
            start += f.shape[-1]
            out.append(torch.logsumexp(self._distribution(f, None).log_prob(yb), 0) - math.log(n_samples))
        return torch.cat(out)

    def extra_repr(self) -> str:
        lik = self.likelihood if isinstance(self.likelihood, str) else getattr(self.likelihood, "__name__", "callable")
        return f"likelihood={lik!r}, rank={self.rank}, prior={self.prior!r}"
