r"""``AutoLowRankFactorGuide``: a factor-analysis (VIFA) or PPCA (VIPPCA) autoguide."""
from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Callable, Optional

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.initialization import init_to_median, init_to_value
from pyro.nn import PyroParam
from torch import Tensor, nn

from pyro_fa._validation import positive_float
from pyro_fa.distributions import StableLowRankMultivariateNormal
from pyro_fa.fa.linalg import orthogonal_init
from pyro_fa.infer._guide_state import _GuideStateMixin
from pyro_fa.infer._noise import NOISE_MODELS
from pyro_fa.infer.transforms import LowRankAffine

__all__ = ["AutoLowRankFactorGuide"]


class FactorLowRankMultivariateNormal(StableLowRankMultivariateNormal, TorchDistributionMixin):
    """:class:`~pyro_fa.distributions.StableLowRankMultivariateNormal` as a Pyro distribution (``pyro.sample``,
    ``to_event``, ``mask``), as :class:`pyro.distributions.LowRankMultivariateNormal` wraps torch's class: what
    :meth:`AutoLowRankFactorGuide.get_posterior` returns."""

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(FactorLowRankMultivariateNormal, _instance)
        return super().expand(batch_shape, _instance=new)


class AutoLowRankFactorGuide(_GuideStateMixin, AutoContinuous):
    r"""Factor-analysis Gaussian guide over all latent sites of a model.

    All latent sites are transformed to unconstrained space and packed into
    one vector :math:`\theta \in \mathbb{R}^D` (as every
    :class:`~pyro.infer.autoguide.AutoContinuous` guide does), with

    .. math::

        q(\theta) = N(c,\; FF^\top + \Psi),\qquad
        F = \mathrm{diag}(s)\,G,\quad \Psi = \mathrm{diag}(s)^2

    for ``noise="diagonal"`` (VIFA, Brownlie 2021, §4.3) and
    :math:`\Psi = s^2 I` with one scalar :math:`s` for ``noise="isotropic"``
    (VIPPCA, Jiang 2023, §2). The covariance is
    :math:`\mathrm{diag}(s)(GG^\top + I)\mathrm{diag}(s)`: the noise scale
    :math:`s` and the factor direction :math:`G` are separate parameters, so
    the capacitance :math:`I + F^\top\Psi^{-1}F = I + G^\top G` does not blow
    up when the noise shrinks (the parameterisation that stabilised Pyro's
    low-rank guide at :math:`D \approx 22\,000`, rank 100, pyro-ppl/pyro#2127).
    :math:`s` is kept positive through :math:`s = \exp(\gamma)` (Brownlie
    2021, eq. 4.57).

    A Pyro user swaps one line: the signature and defaults are those of
    Pyro's :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`,
    ``(model, init_loc_fn, init_scale=0.1, rank=None)``, and so is the
    parameterisation (the same ``loc``, :math:`G` and :math:`s`; only the
    names and :math:`s`'s constraint differ, see :meth:`from_pyro`)::

        guide = AutoLowRankFactorGuide(model, rank=10)
        svi = SVI(model, guide, Adam({"lr": 0.01}), FactorELBO())

    Parameters
    ----------
    model : callable
        A Pyro model with continuous latent sites.
    init_loc_fn : callable, optional
        A per-site initialisation function (see
        :mod:`pyro.infer.autoguide.initialization`). By default the mean
        starts at the values in ``model.initial_values`` when the model is a
        module made by :meth:`GaussianPrior.bayesianize
        <pyro_fa.GaussianPrior.bayesianize>` (the weights as ``nn.Linear``
        initialised them; zeros make every hidden unit identical), and at the
        prior median otherwise (Pyro's default).
    init_scale : float, default 0.1
        Initial marginal standard deviation of every unconstrained latent
        coordinate, on average. Pyro's default. The thesis's networks use
        0.01 (Brownlie 2021, §4.4; a network's weights start with little
        noise, and 0.1 inflates the learned noise of a 1×50 regression
        network on UCI data): :class:`~pyro_fa.nn.BayesianNetwork`, the
        random-feature GLM and the ``pyro-fa`` experiments pass 0.01
        explicitly. On short schedules of small hierarchical models 0.1
        converges faster.
    rank : int, optional
        :math:`K \ge 1`. Defaults to :math:`\mathrm{round}(\sqrt D)`, as
        Pyro's low-rank guide. A rank larger than the latent dimension
        :math:`D` is clipped to :math:`D` with a warning at the first call.
    noise : {"diagonal", "isotropic"}, default "diagonal"
        Keyword only. Per-coordinate noise :math:`\psi` (FA) or one shared
        :math:`\sigma^2` (probabilistic PCA).
    noise_scale : float, optional
        Keyword only, and only with ``noise="isotropic"``: a fixed :math:`\sigma` (so
        :math:`\Psi = \sigma^2 I` is a hyperparameter, as in Jiang 2023, §2);
        :math:`\sigma` is learned when omitted.
    loc_scale : {None, "prior"} or float, default None
        Keyword only. Units of the learned mean. ``None``: :math:`c` itself is the
        parameter, as in Pyro's autoguides. ``"prior"`` or a positive float
        :math:`\lambda`: the parameter is the *whitened* mean :math:`u`,
        :math:`c = \lambda \odot u`, with ``"prior"`` taking :math:`\lambda_i`
        as the prior standard deviation of coordinate :math:`i` where the
        site's support is the real line and its variance fixed and finite
        (1 elsewhere). Adam moves a parameter by about ``lr`` per step, so
        whitening makes the mean's step a fraction of the prior's spread
        (GPflow's ``whiten=True``); use a decaying learning rate with it.

    Attributes
    ----------
    loc : Parameter (or, with ``loc_scale``, tensor) of shape (D,)
        :math:`c`.
    whitened_loc : Parameter of shape (D,)
        Only with ``loc_scale``: :math:`u`, with :math:`c = \lambda \odot u`
        and :math:`\lambda` the buffer ``loc_scale`` of shape (D,).
    factor : Parameter of shape (D, K)
        :math:`G`; the covariance factor is :attr:`cov_factor`.
    scale : Parameter of shape (D,) or () (a buffer when fixed)
        :math:`s`.

    Raises
    ------
    TypeError
        If ``init_loc_fn`` is not callable (e.g. a rank passed in its
        position), ``rank`` is not an int or ``init_scale`` / ``noise_scale``
        not a number.
    ValueError
        If ``rank < 1``, ``noise`` is unknown, ``init_scale`` or ``noise_scale`` is not
        positive, ``noise_scale`` is given with ``noise="diagonal"``, the
        model has discrete latent sites, or its latent sites live on more than
        one device.

    Warns
    -----
    UserWarning
        If ``rank`` exceeds the latent dimension (it is clipped to :math:`D`).

    Notes
    -----
    The initial :math:`G` has orthogonal columns (Brownlie 2021, §4.4) of norm
    :math:`\sqrt{D/K}`, so :math:`GG^\top` has unit diagonal on average, and
    :math:`s = \texttt{init\_scale}/\sqrt2`, so each coordinate starts with
    variance :math:`\texttt{init\_scale}^2` on average, half of it from the
    factors. Sampling and :meth:`get_posterior` cost :math:`O(DK)` and
    :math:`O(DK^2)`. :meth:`get_transform` gives the affine map
    :math:`z \mapsto c + Lz` with :math:`LL^\top = FF^\top + \Psi` (a
    :class:`~pyro_fa.infer.transforms.LowRankAffine`), so the guide works with
    :class:`pyro.infer.reparam.NeuTraReparam` (NeuTra HMC, Hoffman et al.
    2019). :meth:`from_pyro` / :meth:`to_pyro` convert to and from a fitted
    :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`;
    :meth:`load_state_dict` also reads that guide's ``state_dict``.

    References
    ----------
    Ong, Nott & Smith (2018), *Gaussian variational approximation with a
    factor covariance structure*.
    S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
    University of Edinburgh, 2021, §4.3–4.4.
    X. Jiang, *Laplace prior and variational inference probabilistic PCA (VIPPCA)*,
    report, University of Edinburgh, 2023, §2.
    M. Hoffman et al. (2019), *NeuTra-lizing bad geometry in Hamiltonian Monte
    Carlo using neural transport*.

    See Also
    --------
    pyro_fa.infer.FactorELBO : the ELBO with the guide's entropy and Gaussian / Laplace priors in closed form.
    pyro_fa.infer.Pathfinder : a starting point for the guide (:meth:`Pathfinder.init_guide`).

    Examples
    --------
    >>> import pyro
    >>> def model():
    ...     pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    >>> guide = AutoLowRankFactorGuide(model, rank=2)
    >>> guide()["w"].shape
    torch.Size([3])
    >>> guide.get_posterior().cov_factor.shape
    torch.Size([3, 2])
    """

    scale_constraint = constraints.positive

    def __init__(
        self,
        model: Callable,
        init_loc_fn: Optional[Callable] = None,
        init_scale: float = 0.1,
        rank: Optional[int] = None,
        *,
        noise: str = "diagonal",
        noise_scale: Optional[float] = None,
        loc_scale=None,
    ):
        name = type(self).__name__
        if init_loc_fn is not None and not callable(init_loc_fn):
            hint = (f" The positional order is Pyro's (model, init_loc_fn, init_scale, rank): pass rank={init_loc_fn!r}."
                    if isinstance(init_loc_fn, numbers.Integral) else "")
            raise TypeError(f"{name}: init_loc_fn must be a callable or None, got {init_loc_fn!r}.{hint}")
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
                raise TypeError(f"{name}: rank must be an int or None, got {rank!r}.")
            if rank < 1:
                raise ValueError(f"{name}: rank must be >= 1, got {rank!r}.")
            rank = int(rank)
        if noise not in NOISE_MODELS:
            raise ValueError(f"{name}: noise must be one of {tuple(NOISE_MODELS)}, got {noise!r}.")
        init_scale = positive_float(name, "init_scale", init_scale)
        if isinstance(loc_scale, str) and loc_scale not in _LOC_SCALES:
            raise ValueError(f"{name}: loc_scale must be None, 'prior' or a positive float, got {loc_scale!r}.")
        if loc_scale is not None and not isinstance(loc_scale, str):
            loc_scale = positive_float(name, "loc_scale", loc_scale)
        if noise_scale is not None:
            if noise != "isotropic":
                raise ValueError(
                    f"{name}: noise_scale must be None when noise='diagonal', got {noise_scale!r}. "
                    "Pass noise='isotropic' to fix the noise."
                )
            noise_scale = positive_float(name, "noise_scale", noise_scale)
        if init_loc_fn is None:
            initial = getattr(model, "initial_values", None)
            if isinstance(initial, dict):
                init_loc_fn = init_to_value(values=initial, fallback=init_to_median)
            else:
                init_loc_fn = init_to_median
        self.rank = rank
        self.noise = noise
        self.noise_model = NOISE_MODELS[noise](noise_scale)
        self._init_scale = init_scale
        self._noise_scale = noise_scale
        self._loc_scale_option = loc_scale
        super().__init__(model, init_loc_fn=init_loc_fn)

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        name = type(self).__name__
        devices = {site["value"].device for _, site in self.prototype_trace.iter_stochastic_nodes()}
        if len(devices) > 1:
            raise ValueError(
                f"{name}: latent sites must all be on one device, got {sorted(map(str, devices))!r}. "
                "Move the model's tensors to one device."
            )
        D = self.latent_dim
        if self.rank is None:
            self.rank = max(1, int(round(D ** 0.5)))
        if self.rank > D:
            warnings.warn(f"{name}: rank {self.rank} exceeds the latent dimension D={D}; using rank={D}.",
                          UserWarning, stacklevel=3)
            self.rank = D
        self._setup_params()

    def _setup_params(self) -> None:
        """Create ``loc`` (or ``whitened_loc``), ``factor`` and ``scale`` from :attr:`prototype_trace`."""
        D = self.latent_dim
        loc = self._init_loc()
        if self._loc_scale_option is None:
            self.loc = nn.Parameter(loc)
        else:
            lam = _loc_scale_rule(self._loc_scale_option)(self, loc)
            self.register_buffer("loc_scale", lam)
            self.whitened_loc = nn.Parameter(loc / lam)
        # G with orthogonal columns of norm sqrt(D / K): unit diagonal of G G^T on average
        G = orthogonal_init(D, self.rank, scale=math.sqrt(D / self.rank), dtype=loc.dtype, device=loc.device)
        self.factor = nn.Parameter(G)
        self.noise_model.install(self, loc, self._init_scale / math.sqrt(2))
        _warn_on_stored_shapes(self)

    def __getattr__(self, name):
        derived = _DERIVED.get(name)
        if derived is not None and derived[0] in self._parameters:
            return derived[1](self)
        return super().__getattr__(name)

    def _check_setup(self, what: str) -> None:
        if self.prototype_trace is None:
            raise RuntimeError(
                f"{type(self).__name__}: {what} needs the guide's parameters, which are created from a first "
                "trace of the model; call the guide once with the model's arguments (guide(*args, **kwargs)) "
                "or run one SVI step first."
            )

    def _scale_vector(self) -> Tensor:
        scale = self.scale
        return scale if scale.dim() else scale.expand(self.loc.shape)  # fetches loc only when isotropic

    @property
    def cov_factor(self) -> Tensor:
        r""":math:`F = \mathrm{diag}(s) G`, a tensor of shape (D, K)."""
        self._check_setup("cov_factor")
        return self.factor * self._scale_vector().unsqueeze(-1)

    @property
    def cov_diag(self) -> Tensor:
        r""":math:`\psi = s^2`, a tensor of shape (D,)."""
        self._check_setup("cov_diag")
        return self._scale_vector().pow(2)

    def get_posterior(self, *args, **kwargs) -> "FactorLowRankMultivariateNormal":
        """The guide's :math:`q(\\theta)` over the packed unconstrained latent vector.

        Returns
        -------
        FactorLowRankMultivariateNormal
            The family's covariance form :math:`N(c, FF^\\top + \\psi)`
            (:class:`~pyro_fa.distributions.StableLowRankMultivariateNormal`, capacitance in float64) as a Pyro
            distribution (what the guide samples its latent vector from), ``loc`` of shape (D,),
            ``cov_factor`` (D, K), ``cov_diag`` (D,).

        Raises
        ------
        RuntimeError
            If the guide has not run yet (its parameters do not exist).
        """
        self._check_setup("get_posterior()")
        scale = self._scale_vector()
        return FactorLowRankMultivariateNormal(self.loc, self.factor * scale.unsqueeze(-1), scale * scale)

    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Draws of the packed unconstrained latent vector from :meth:`get_posterior`, without gradients.

        Parameters
        ----------
        num_samples : int, optional
            ``None``: one vector of shape (D,); else shape (num_samples, D).
        generator : torch.Generator, optional
            On any device; ``None``: the global generator.

        Raises
        ------
        ValueError
            If ``num_samples`` is not an integer >= 1 or None.
        RuntimeError
            If the guide has not run yet.
        """
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                        or num_samples < 1):
            raise ValueError(f"{type(self).__name__}: num_samples must be an integer >= 1 or None, got "
                             f"{num_samples!r}.")
        shape = () if num_samples is None else (num_samples,)
        with torch.no_grad():
            return self.get_posterior().sample(shape, generator=generator)

    def get_base_dist(self) -> dist.Distribution:
        """The standard normal :math:`N(0, I_D)` that :meth:`get_transform` maps onto :math:`q`.

        Raises
        ------
        RuntimeError
            If the guide has not run yet.
        """
        self._check_setup("get_base_dist()")
        loc = self.loc
        return dist.Normal(torch.zeros_like(loc), torch.ones_like(loc)).to_event(1)

    def get_transform(self, *args, **kwargs) -> LowRankAffine:
        r"""The affine map :math:`z \mapsto c + Lz`, :math:`LL^\top = FF^\top + \Psi`, from :meth:`get_base_dist` to :math:`q`.

        Used by :class:`pyro.infer.reparam.NeuTraReparam`: HMC then samples
        :math:`z` in a space where :math:`q` is a standard normal.

        Returns
        -------
        LowRankAffine
            Built in :math:`O(DK^2)`; each map and inverse costs :math:`O(DK)`.

        Raises
        ------
        RuntimeError
            If the guide has not run yet.
        """
        self._check_setup("get_transform()")
        scale = self._scale_vector()
        return LowRankAffine(self.loc, self.factor * scale.unsqueeze(-1), scale * scale)

    def _unpack_latent(self, latent: Tensor):
        """Pyro's unpacking, with a flat stack of draws (S, D) (MCMC draws for ``NeuTraReparam``) read as
        (S, 1, ..., 1, D), left of the model's plates; other latents are unpacked as Pyro does.

        The sites' offsets and shapes are computed once per batch shape (Pyro recomputes them, with a
        ``torch.broadcast_shapes`` per site, at every call; FactorELBO unpacks three vectors a step).
        """
        if latent.dim() == 2:
            depth = max((-f.dim for _, site in self.prototype_trace.iter_stochastic_nodes()
                         for f in site["cond_indep_stack"] if f.vectorized and f.dim is not None), default=0)
            if depth:
                latent = latent.reshape(latent.shape[:1] + (1,) * depth + latent.shape[-1:])
        cache = self.__dict__.get("_unpack_plans")
        if cache is None or cache[0] is not self.prototype_trace or cache[1] is not self._unconstrained_shapes:
            cache = self.__dict__["_unpack_plans"] = (self.prototype_trace, self._unconstrained_shapes, {})
        batch_shape = latent.shape[:-1]
        plan = cache[2].get(batch_shape)
        if plan is None:
            plan = cache[2][batch_shape] = _unpack_plan(self, batch_shape)
        if not torch._C._get_tracing_state():
            assert plan[-1] == latent.size(-1)
        return ((site, latent[..., pos:pos + size].view(shape)) for site, pos, size, shape in plan[0])

    def _loc_scale(self, *args, **kwargs):
        self._check_setup("median() / quantiles()")
        scale = self._scale_vector() * (self.factor.pow(2).sum(-1) + 1).sqrt()
        return self.loc, scale


def _warn_on_stored_shapes(guide: AutoLowRankFactorGuide) -> None:
    """Warn where Pyro's param store kept an earlier guide's parameter of another shape.

    A parameter whose name is already in the param store takes the stored value, whatever the
    guide created (Pyro's behaviour): a rank-2 guide built after a rank-1 guide of the same name
    would silently go on with the rank-1 factor.
    """
    D = guide.latent_dim
    expected = {"factor": (D, guide.rank)}
    expected["whitened_loc" if guide._loc_scale_option is not None else "loc"] = (D,)
    scale_shape = guide.noise_model.stored_shape(D)
    if scale_shape is not None:
        expected["scale"] = scale_shape
    for attr, shape in expected.items():
        try:
            got = tuple(getattr(guide, attr).shape)
        except AttributeError:
            continue
        if got != shape:
            warnings.warn(
                f"{type(guide).__name__}: param {guide._pyro_get_fullname(attr)!r} must have shape {shape} "
                f"(rank={guide.rank}, noise={guide.noise!r}, D={D}), got {got}: the param store already held "
                "that name from an earlier guide and keeps its value. Call pyro.clear_param_store() before "
                "building the new guide.",
                UserWarning, stacklevel=4)


def _prior_std(guide: AutoLowRankFactorGuide, like: Tensor) -> Tensor:
    """Per-coordinate prior standard deviation of the packed latent (1 where it is not simple)."""
    parts = []
    for name, site in guide.prototype_trace.iter_stochastic_nodes():
        shape = guide._unconstrained_shapes[name]
        std = None
        fn = site["fn"]
        if fn.support is constraints.real or getattr(fn.support, "base_constraint", None) is constraints.real:
            try:
                var = fn.variance
            except (NotImplementedError, AttributeError):
                var = None
            if torch.is_tensor(var) and not var.requires_grad:
                std = var.detach().to(like).sqrt().expand(shape)
                if not (torch.isfinite(std).all() and (std > 0).all()):
                    std = None
        parts.append((std if std is not None else like.new_ones(shape)).reshape(-1))
    return torch.cat(parts)


def _constant_loc_scale(value: float, guide: AutoLowRankFactorGuide, like: Tensor) -> Tensor:
    return like.new_full((guide.latent_dim,), value)


#: ``loc_scale`` by name -> ``(guide, loc) -> lambda`` of shape (D,); a float is a constant lambda.
_LOC_SCALES = {"prior": _prior_std}


def _loc_scale_rule(option) -> Callable:
    if isinstance(option, str):
        return _LOC_SCALES[option]
    return functools.partial(_constant_loc_scale, option)


#: attributes computed from others: name -> (the parameter that makes it derived, how to compute it)
_DERIVED = {"loc": ("whitened_loc", lambda guide: guide.whitened_loc * guide.loc_scale)}


def _unpack_plan(guide: AutoLowRankFactorGuide, batch_shape: torch.Size):
    """``([(site, offset, size, shape)], D)``: where :meth:`AutoContinuous._unpack_latent` finds each site in a
    packed latent of batch shape ``batch_shape``, with the shapes it gives them."""
    plan, pos = [], 0
    for name, site in guide.prototype_trace.iter_stochastic_nodes():
        constrained_shape = site["value"].shape
        unconstrained_shape = guide._unconstrained_shapes[name]
        size = math.prod(unconstrained_shape)
        event_dim = site["fn"].event_dim + len(unconstrained_shape) - len(constrained_shape)
        shape = torch.broadcast_shapes(unconstrained_shape, batch_shape + (1,) * event_dim)
        plan.append((site, pos, size, shape))
        pos += size
    return plan, pos
