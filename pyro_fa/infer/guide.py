r"""``AutoLowRankFactorGuide``: a factor-analysis (VIFA) or PPCA (VIPPCA) autoguide."""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Callable, Dict, Optional

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoContinuous, AutoLowRankMultivariateNormal
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median, init_to_value
from pyro.nn import PyroParam
from torch import Tensor, nn
from torch.distributions import transform_to

from pyro_fa._validation import positive_float
from pyro_fa.fa.linalg import orthogonal_init
from pyro_fa.infer.transforms import LowRankAffine

__all__ = ["AutoLowRankFactorGuide"]

_NOISE_OPTIONS = ("diagonal", "isotropic")


class AutoLowRankFactorGuide(AutoContinuous):
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
        :math:`\lambda`: the parameter is the *whitened* mean :math:`u` with
        :math:`c = \lambda \odot u`, where ``"prior"`` takes
        :math:`\lambda_i` as the prior standard deviation of coordinate
        :math:`i` (from the site's ``variance`` when its support is the real
        line, e.g. :math:`\alpha^{-1/2}` for ``GaussianPrior``,
        :math:`\sqrt2 b` for ``LaplacePrior``; 1 for constrained sites,
        infinite variances or priors whose parameters are learned). An
        optimiser such as Adam moves each parameter by about its learning
        rate per step whatever the gradient's size, so with ``None`` the mean
        travels at most ``lr`` per step and a mean many ``lr``-steps from its
        start is reached late or never; whitening makes the step a fraction
        of the prior's spread (the whitened parameterisation of sparse GPs,
        GPflow's ``whiten=True``). Use a decaying learning rate with it: a
        constant one leaves the mean jittering by about ``lr`` prior standard
        deviations.

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
    Differences from the thesis's settings, all reachable by arguments: the
    thesis (Brownlie 2021) starts at ``init_scale=0.01``; here the default is
    Pyro's 0.1, so that a Pyro user's script behaves as with Pyro's guide.
    The library's own networks and experiments pass 0.01 explicitly, so their
    recorded numbers are unchanged.

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
        if noise not in _NOISE_OPTIONS:
            raise ValueError(f"{name}: noise must be one of {_NOISE_OPTIONS}, got {noise!r}.")
        init_scale = positive_float(name, "init_scale", init_scale)
        if loc_scale is not None and not (isinstance(loc_scale, str) and loc_scale == "prior"):
            if isinstance(loc_scale, str):
                raise ValueError(f"{name}: loc_scale must be None, 'prior' or a positive float, got {loc_scale!r}.")
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
            lam = self._prior_std(loc) if self._loc_scale_option == "prior" else loc.new_full(
                (D,), self._loc_scale_option
            )
            self.register_buffer("loc_scale", lam)
            self.whitened_loc = nn.Parameter(loc / lam)
        # G with orthogonal columns of norm sqrt(D / K): unit diagonal of G G^T on average
        G = orthogonal_init(D, self.rank, scale=math.sqrt(D / self.rank), dtype=loc.dtype, device=loc.device)
        self.factor = nn.Parameter(G)
        s0 = self._init_scale / math.sqrt(2)
        if self.noise == "diagonal":
            self.scale = PyroParam(loc.new_full((D,), s0), constraint=self.scale_constraint)
        elif self._noise_scale is None:
            self.scale = PyroParam(loc.new_tensor(s0), constraint=self.scale_constraint)
        else:
            self.register_buffer("scale", loc.new_tensor(self._noise_scale))

    def __getattr__(self, name):
        if name == "loc" and "whitened_loc" in self._parameters:
            return self.whitened_loc * self.loc_scale
        return super().__getattr__(name)

    def _prior_std(self, like: Tensor) -> Tensor:
        """Per-coordinate prior standard deviation of the packed latent (1 where it is not simple)."""
        parts = []
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            shape = self._unconstrained_shapes[name]
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

    def _check_setup(self, what: str) -> None:
        if self.prototype_trace is None:
            raise RuntimeError(
                f"{type(self).__name__}: {what} needs the guide's parameters, which are created from a first "
                "trace of the model; call the guide once with the model's arguments (guide(*args, **kwargs)) "
                "or run one SVI step first."
            )

    def _scale_vector(self) -> Tensor:
        scale = self.scale
        return scale.expand(self.loc.shape) if scale.dim() == 0 else scale

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

    def get_posterior(self, *args, **kwargs) -> dist.LowRankMultivariateNormal:
        """The guide's :math:`q(\\theta)` over the packed unconstrained latent vector.

        Returns
        -------
        pyro.distributions.LowRankMultivariateNormal
            ``LowRankMultivariateNormal(loc, cov_factor, cov_diag)`` with
            ``loc`` of shape (D,), ``cov_factor`` (D, K), ``cov_diag`` (D,).

        Raises
        ------
        RuntimeError
            If the guide has not run yet (its parameters do not exist).
        """
        self._check_setup("get_posterior()")
        scale = self._scale_vector()
        return dist.LowRankMultivariateNormal(self.loc, self.factor * scale.unsqueeze(-1), scale * scale)

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

    def _loc_scale(self, *args, **kwargs):
        self._check_setup("median() / quantiles()")
        scale = self._scale_vector() * (self.factor.pow(2).sum(-1) + 1).sqrt()
        return self.loc, scale

    # ------------------------------------------------------------------ Pyro's low-rank guide
    @classmethod
    def from_pyro(cls, guide: AutoLowRankMultivariateNormal) -> "AutoLowRankFactorGuide":
        r"""The same :math:`q` as a fitted :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`.

        Pyro's guide has the same parameterisation,
        :math:`q = N(c,\, \mathrm{diag}(s)(GG^\top + I)\mathrm{diag}(s))`, with
        :math:`G` named ``cov_factor`` (ours: ``factor``; our ``cov_factor``
        is :math:`\mathrm{diag}(s)G`, as in ``get_posterior()``) and
        :math:`s` kept positive by a softplus (ours: an exponential). The
        values of :math:`c`, :math:`G`, :math:`s` are copied (detached), so
        ``get_posterior()`` of both guides agree to rounding. The new guide
        has ``noise="diagonal"``, Pyro's rank and ``init_scale``, and shares
        the Pyro guide's model trace, so it needs no call before use.

        To load a Pyro checkpoint, either restore Pyro's guide
        (``pyro.get_param_store().load(path)``, then call the new Pyro guide
        once: it takes the stored values) and convert it, or load
        the Pyro guide's ``state_dict()`` straight into a set-up
        :class:`AutoLowRankFactorGuide` with :meth:`load_state_dict`.

        Parameters
        ----------
        guide : pyro.infer.autoguide.AutoLowRankMultivariateNormal
            Run at least once (its parameters exist).

        Returns
        -------
        AutoLowRankFactorGuide

        Raises
        ------
        TypeError
            If ``guide`` is not an ``AutoLowRankMultivariateNormal``.
        RuntimeError
            If ``guide`` has not run yet.
        """
        name = cls.__name__
        if not isinstance(guide, AutoLowRankMultivariateNormal):
            raise TypeError(f"{name}.from_pyro: guide must be an AutoLowRankMultivariateNormal, got {type(guide).__name__}.")
        if guide.prototype_trace is None:
            raise RuntimeError(f"{name}.from_pyro: guide has not run yet (it has no parameters); "
                               "call it once with the model's arguments or run one SVI step first.")
        model, init_loc_fn = _unwrap_init(guide.model)
        new = cls(model, init_loc_fn=init_loc_fn, init_scale=guide._init_scale, rank=guide.rank)
        _copy_prototype(guide, new)
        new._setup_params()
        with guide._pyro_context:  # read the param store's values when it holds the guide's parameters
            loc, cov_factor, scale = guide.loc.detach(), guide.cov_factor.detach(), guide.scale.detach()
        with torch.no_grad():
            new.loc.copy_(loc)
            new.factor.copy_(cov_factor)
            new.scale_unconstrained.copy_(transform_to(new.scale_constraint).inv(scale))
        new._drop_stale_param_store_entries()
        return new

    def to_pyro(self) -> AutoLowRankMultivariateNormal:
        r"""The same :math:`q` as Pyro's :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`.

        The inverse of :meth:`from_pyro`: :math:`c`, :math:`G` and :math:`s`
        (expanded to shape (D,) for ``noise="isotropic"``) are copied
        (detached) into a new Pyro guide that shares this guide's model trace.
        Entries of the param store under that guide's names
        (``AutoLowRankMultivariateNormal.loc``, ...) left by another guide are
        dropped, so the converted values are the ones used; the same holds for
        the guide :meth:`from_pyro` returns.

        Returns
        -------
        pyro.infer.autoguide.AutoLowRankMultivariateNormal

        Raises
        ------
        RuntimeError
            If this guide has not run yet.
        """
        self._check_setup("to_pyro()")
        model, init_loc_fn = _unwrap_init(self.model)
        pyro_guide = AutoLowRankMultivariateNormal(model, init_loc_fn=init_loc_fn or init_to_median,
                                                   init_scale=self._init_scale, rank=self.rank)
        _copy_prototype(self, pyro_guide)
        with self._pyro_context:
            loc, G, scale = self.loc.detach(), self.factor.detach(), self._scale_vector().detach()
        # the three parameters AutoLowRankMultivariateNormal._setup_prototype creates
        pyro_guide.loc = nn.Parameter(loc.clone())
        pyro_guide.scale = PyroParam(scale.clone(), constraint=pyro_guide.scale_constraint)
        pyro_guide.cov_factor = nn.Parameter(G.clone())
        _drop_stale_param_store_entries(pyro_guide)  # the converted values win over a same-named guide's
        return pyro_guide

    # ------------------------------------------------------------------ serialization
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state saved by :meth:`state_dict` (or by Pyro's low-rank guide), as one transaction.

        Every entry is checked before any is written: the keys and shapes
        must match this guide's rank, latent dimension, noise kind and
        ``loc_scale``; every value must be finite and the noise scale
        positive. A refused state raises and leaves the guide as it was.

        A ``state_dict()`` of a Pyro
        :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal` (keys
        ``loc``, ``cov_factor``, ``scale_unconstrained``) over the same model
        is accepted too (with ``noise="diagonal"``) and gives the same
        :math:`q` (see :meth:`from_pyro`).

        A :class:`~pyro.nn.PyroModule` reads its parameters from the global
        param store by name; when loading replaces the Parameter objects
        (``assign=True``, or a guide whose store entries were swapped out), the
        store would keep serving the old tensors, so the loaded values would be
        ignored and SVI would update the old copies. The guide's stale store
        entries are dropped, and the loaded Parameters are registered in their
        place on next use. (Restoring the whole store with
        ``pyro.get_param_store().set_state`` / ``.load`` also works: the guide
        then reads the restored values.) The checks and the store update also
        run when the guide is loaded as part of a parent module.

        Raises
        ------
        RuntimeError
            If the guide has not run yet (call it once first), or the state was
            saved with another rank, latent dimension, noise kind or
            ``loc_scale``.
        ValueError
            If a value is not finite or a noise scale not positive.
        """
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        if own:
            self._check_setup("load_state_dict()")
            converted = self._from_pyro_state(own) if "cov_factor" in own and "factor" not in own else own
            self._validate_state(converted, strict)
            if converted is not own:
                state_dict = {k: v for k, v in state_dict.items() if not (k.startswith(prefix) and k[len(prefix):] in own)}
                state_dict.update({prefix + k: v for k, v in converted.items()})
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._drop_stale_param_store_entries()

    def _local_state(self) -> Dict[str, Tensor]:
        persistent = {k: v for k, v in self._buffers.items() if k not in self._non_persistent_buffers_set}
        return {**{k: v for k, v in self._parameters.items() if v is not None}, **persistent}

    def _describe_state(self, state: Dict[str, Tensor]) -> str:
        """The settings a state was saved with, as far as its keys and shapes tell."""
        parts = []
        if torch.is_tensor(state.get("factor")) and state["factor"].dim() == 2:
            parts.append(f"rank={state['factor'].shape[-1]}")
        loc = state.get("loc", state.get("whitened_loc"))
        if torch.is_tensor(loc):
            parts.append(f"D={loc.numel()}")
        if torch.is_tensor(state.get("scale_unconstrained")):
            parts.append("noise='isotropic'" if state["scale_unconstrained"].dim() == 0 else "noise='diagonal'")
        elif "scale" in state:
            parts.append("noise='isotropic', noise_scale fixed")
        parts.append("loc_scale set" if "whitened_loc" in state else "loc_scale=None")
        return ", ".join(parts)

    def _validate_state(self, state: Dict[str, Tensor], strict: bool) -> None:
        name = type(self).__name__
        local = self._local_state()
        mine = (f"rank={self.rank}, D={self.latent_dim}, noise={self.noise!r}"
                + (", noise_scale fixed" if self._noise_scale is not None else "")
                + (", loc_scale set" if self._loc_scale_option is not None else ", loc_scale=None"))
        mismatch = (strict and set(state) != set(local)) or any(
            k in local and (not torch.is_tensor(v) or v.shape != local[k].shape) for k, v in state.items())
        if mismatch:
            raise RuntimeError(
                f"{name}: load_state_dict got a state saved with {self._describe_state(state)} "
                f"(keys {sorted(state)!r}), but this guide has {mine} (keys {sorted(local)!r}). "
                "Build the guide with the settings the state was saved with."
            )
        for key, value in state.items():
            if key in local and not torch.isfinite(value).all():
                raise ValueError(f"{name}: load_state_dict: {key!r} must be finite, got {value!r}.")
        if "scale_unconstrained" in state:
            s = transform_to(self.scale_constraint)(state["scale_unconstrained"])
            if not (torch.isfinite(s).all() and (s > 0).all()):
                raise ValueError(f"{name}: load_state_dict: the noise scale must be positive and finite, got {s!r}.")
        for key in ("scale", "loc_scale"):
            if key in state and key in local and not (state[key] > 0).all():
                raise ValueError(f"{name}: load_state_dict: {key!r} must be positive, got {state[key]!r}.")

    def _from_pyro_state(self, state: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Translate an ``AutoLowRankMultivariateNormal`` state (softplus-constrained scale) into this guide's keys."""
        name = type(self).__name__
        if self.noise != "diagonal":
            raise RuntimeError(f"{name}: load_state_dict got an AutoLowRankMultivariateNormal state, whose noise is "
                               f"per coordinate, but this guide has noise={self.noise!r}; build it with noise='diagonal'.")
        out = {k: v for k, v in state.items() if k not in ("loc", "cov_factor", "scale_unconstrained")}
        for key in ("loc", "cov_factor", "scale_unconstrained"):
            value = state.get(key)
            if not torch.is_tensor(value):
                raise RuntimeError(f"{name}: load_state_dict: an AutoLowRankMultivariateNormal state needs {key!r}, "
                                   f"got {sorted(state)!r}.")
            if not torch.isfinite(value).all():
                raise ValueError(f"{name}: load_state_dict: {key!r} must be finite, got {value!r}.")
        like = self.factor
        scale = transform_to(AutoLowRankMultivariateNormal.scale_constraint)(state["scale_unconstrained"].to(like))
        if not (scale > 0).all():
            raise ValueError(f"{name}: load_state_dict: the noise scale must be positive, got {scale!r}.")
        out["factor"] = state["cov_factor"]
        out["scale_unconstrained"] = transform_to(self.scale_constraint).inv(scale)
        if "whitened_loc" in self._parameters:
            loc = state["loc"].to(like)
            out["whitened_loc"] = loc / self.loc_scale if loc.shape == self.loc_scale.shape else loc
            out["loc_scale"] = self.loc_scale.detach().clone()
        else:
            out["loc"] = state["loc"]
        return out

    def _drop_stale_param_store_entries(self) -> None:
        _drop_stale_param_store_entries(self)


def _drop_stale_param_store_entries(module: pyro.nn.PyroModule) -> None:
    """Drop the param store's entries under ``module``'s names that are not its own Parameters.

    A :class:`~pyro.nn.PyroModule` reads a parameter from the store when the
    store has its name, so after its Parameters were replaced or written
    outside the store the stale entries would win.
    """
    if not module._pyro_name:
        return
    store = pyro.get_param_store()
    stored = dict(store.named_parameters())
    for name, param in module.named_parameters(recurse=False):
        base = name[: -len("_unconstrained")] if name.endswith("_unconstrained") else name
        fullname = f"{module._pyro_name}.{base}"
        if fullname in stored and stored[fullname] is not param:
            del store[fullname]


def _unwrap_init(model):
    """``(model, init_loc_fn)`` from the model an ``AutoContinuous`` keeps (wrapped in an ``InitMessenger``)."""
    func = getattr(model, "func", None)
    args = getattr(func, "args", ())
    if len(args) == 2 and isinstance(args[0], InitMessenger):
        return args[1], args[0].init_fn
    return model, None


def _copy_prototype(source: AutoContinuous, target: AutoContinuous) -> None:
    """Share the model trace (and what ``AutoContinuous._setup_prototype`` derives from it) between guides."""
    for attr in ("prototype_trace", "_prototype_frames", "_unconstrained_shapes", "_cond_indep_stacks", "latent_dim"):
        setattr(target, attr, getattr(source, attr))
