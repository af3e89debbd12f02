r"""Basis functions :math:`\phi: \mathbb{R}^d \to \mathbb{R}^D` for Bayesian linear and generalised linear models.

A basis is a :class:`torch.nn.Module` mapping ``(N, in_features)`` to ``(N, out_features)``; its length scales
are ordinary parameters, fitted by autograd with the model that uses it
(:class:`~pyro_fa.linear_model.StandardLinearModel`, :class:`~pyro_fa.linear_model.GeneralizedLinearModel`).
Bases concatenate (``basis_a + basis_b``), which approximates a sum of kernels (Steinberg et al. 2016, §1.4
eqs. 36–37). :class:`RandomFourierBasis` approximates a stationary kernel of :data:`KERNELS` by Bochner's
theorem (Rahimi & Recht 2007; Steinberg et al. 2016, §1.4 eqs. 32–35 and Table 1).

References
----------
Rahimi & Recht (2007), *Random features for large-scale kernel machines*, NIPS. Steinberg, Tiao, McCalman,
Reid & O'Callaghan (2016), *revrand: technical report*, CSIRO Data61, §1.4 and Table 1. Yu, Suresh,
Choromanski, Holtmann-Rice & Kumar (2016), *Orthogonal random features*, NIPS, §3.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Optional, Sequence, Union

import torch
from torch import Tensor, nn

__all__ = [
    "KERNELS",
    "Kernel",
    "Basis",
    "RandomFourierBasis",
    "LinearBasis",
    "BiasBasis",
    "ConcatBasis",
]

def _check_int(cls: str, arg: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{cls}: {arg} must be an int, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{cls}: {arg} must be >= {minimum}, got {value!r}.")
    return int(value)


def _check_bool(cls: str, arg: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{cls}: {arg} must be a bool, got {value!r}.")
    return value


class Basis(nn.Module):
    r"""Base class of bases: a module mapping ``(N, in_features)`` to ``(N, out_features)``.

    Subclasses set ``in_features`` and ``out_features`` and implement :meth:`forward`; ``a + b``
    concatenates two bases (:class:`ConcatBasis`).

    Attributes
    ----------
    in_features : int
        :math:`d`, the width of the inputs.
    out_features : int
        :math:`D`, the number of features.
    """

    in_features: int
    out_features: int

    def __add__(self, other: "Basis") -> "ConcatBasis":
        if not isinstance(other, Basis):
            return NotImplemented
        return ConcatBasis(self, other)

    def _check_input(self, x, arg: str = "x") -> Tensor:
        name = type(self).__name__
        if not torch.is_tensor(x):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(x).__name__}.")
        if not x.is_floating_point():
            raise TypeError(f"{name}: {arg} must have a floating dtype, got {x.dtype}.")
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{name}: {arg} must have shape (N, {self.in_features}), got {tuple(x.shape)}."
            )
        return x

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class RandomFourierBasis(Basis):
    r"""Random Fourier features of a stationary kernel with learnable length scales.

    .. math::

        \phi(x) = \frac{1}{\sqrt n}\Big[\cos\big((x \oslash \ell)^\top W\big),\;
        \sin\big((x \oslash \ell)^\top W\big)\Big] \in \mathbb{R}^{2n},
        \qquad \mathbb{E}_W\big[\phi(x)^\top\phi(x')\big] = k(x, x'),

    where the :math:`n` columns :math:`\omega_i` of :math:`W` are drawn once from the kernel's spectral
    density at unit length scale and :math:`\ell` (a scalar, or one per input dimension with ``ard=True``)
    divides the inputs. The kernels, with :math:`r = \lVert (x - x') \oslash \ell \rVert_2`:

    ============  ====================================================  ==========================================
    kernel        :math:`k(x, x')`                                      :math:`\omega_i`
    ============  ====================================================  ==========================================
    ``rbf``       :math:`\exp(-r^2/2)`                                  :math:`N(0, I_d)`
    ``laplace``   :math:`\exp(-\lVert (x - x') \oslash \ell\rVert_1)`   :math:`\prod_j \mathrm{Cauchy}(0, 1)`
    ``cauchy``    :math:`1 / (1 + r^2)`                                 :math:`\sqrt{2E}\,z` (below)
    ``matern32``  :math:`(1 + \sqrt3 r)\,e^{-\sqrt3 r}`                 :math:`t_3(0, I_d)`
    ``matern52``  :math:`(1 + \sqrt5 r + 5r^2/3)\,e^{-\sqrt5 r}`        :math:`t_5(0, I_d)`
    ============  ====================================================  ==========================================

    These follow Steinberg et al. (2016, Table 1), made precise in three places (:class:`RBFKernel`,
    :class:`LaplaceKernel`, :class:`CauchyKernel`); each kernel is an entry of :data:`KERNELS`.

    Parameters
    ----------
    in_features : int
        :math:`d \ge 1`.
    n_components : int
        :math:`n \ge 1`, the number of frequencies; ``out_features = 2n``.
    kernel : {"rbf", "laplace", "cauchy", "matern32", "matern52"}, default "rbf"
    lengthscale : float or sequence of float or Tensor, default 1.0
        Initial :math:`\ell > 0`: a scalar, or (with ``ard=True``) one
        value per input dimension; a scalar with ``ard=True`` starts every
        dimension there.
    ard : bool, default False
        One length scale per input dimension (automatic relevance
        determination) instead of one shared scalar.
    orthogonal : bool, default False
        Orthogonal random features (Yu et al. 2016, §3): blocks of :math:`d` Haar-random orthonormal
        directions with independent norms from the kernel's radial distribution (:class:`RadialKernel`).
        Each frequency keeps its marginal, so the estimate stays unbiased with lower variance. Not for
        ``laplace``, whose spectral density is not rotation-invariant.
    learn_lengthscale : bool, default True
        Store :math:`\log\ell` as a parameter (fitted with the model) or as a buffer (fixed).
    seed : int, optional
        Seeds a private generator for :math:`W` (the global RNG is untouched); not with ``generator``.
    generator : torch.Generator, optional
        Draws :math:`W`; the global RNG is used when neither is given.
    dtype : torch.dtype, optional
        Of :math:`W` and :math:`\ell`; default ``torch.get_default_dtype()``.
    device : torch.device or str, optional
        Of :math:`W` and :math:`\ell`; default CPU.

    Attributes
    ----------
    frequencies : Tensor of shape (in_features, n_components)
        :math:`W` at unit length scale (a buffer).
    log_lengthscale : Parameter (or buffer) of shape () or (in_features,)
        :math:`\log\ell`.
    lengthscale : Tensor of shape () or (in_features,)
        :math:`\ell`.

    Raises
    ------
    TypeError
        If an int, bool, ``seed``, ``generator`` or ``dtype`` argument has the wrong type.
    ValueError
        If ``in_features`` / ``n_components`` are below 1, ``kernel`` is unknown, ``lengthscale`` is not
        positive and finite or has the wrong length, both ``seed`` and ``generator`` are given, or
        ``orthogonal=True`` with a kernel that is not rotation-invariant (``laplace``).

    Notes
    -----
    ``forward`` costs :math:`O(Ndn)`; the Monte Carlo error of :math:`\Phi\Phi^\top` is
    :math:`O(n^{-1/2})`. :math:`W` is drawn on the CPU in float64 and then cast, so a seed gives the same
    basis on every device.

    References
    ----------
    Rahimi & Recht (2007), *Random features for large-scale kernel machines*,
    §3; Steinberg et al. (2016), *revrand: technical report*, §1.4, eq. 35
    and Table 1; Yu et al. (2016), *Orthogonal random features*, §3 (ORF);
    Rasmussen & Williams (2006), *Gaussian processes for machine learning*,
    §4.2 (Matérn spectral densities).

    Examples
    --------
    >>> basis = RandomFourierBasis(3, 2000, kernel="matern52", seed=0)
    >>> x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    >>> phi = basis(x)
    >>> phi.shape
    torch.Size([5, 4000])
    >>> bool((phi @ phi.T - basis.kernel(x, x)).abs().max() < 0.1)
    True
    """

    def __init__(
        self,
        in_features: int,
        n_components: int,
        kernel: str = "rbf",
        lengthscale: Union[float, Sequence[float], Tensor] = 1.0,
        ard: bool = False,
        orthogonal: bool = False,
        learn_lengthscale: bool = True,
        *,
        seed: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        dtype: Optional[torch.dtype] = None,
        device=None,
    ):
        super().__init__()
        name = type(self).__name__
        self.in_features = _check_int(name, "in_features", in_features)
        self.n_components = _check_int(name, "n_components", n_components)
        self.out_features = 2 * self.n_components
        if not isinstance(kernel, str) or kernel not in KERNELS:
            raise ValueError(f"{name}: kernel must be one of {tuple(KERNELS)}, got {kernel!r}.")
        self.kernel_name = kernel
        self._kernel = KERNELS[kernel]
        self.ard = _check_bool(name, "ard", ard)
        self.orthogonal = _check_bool(name, "orthogonal", orthogonal)
        learn_lengthscale = _check_bool(name, "learn_lengthscale", learn_lengthscale)
        if orthogonal and not self._kernel.rotation_invariant:
            radial = tuple(k for k, v in KERNELS.items() if v.rotation_invariant)
            raise ValueError(
                f"{name}: orthogonal must be False for kernel={kernel!r}, got orthogonal=True: its spectral "
                "density is not rotation-invariant, so orthogonal directions would bias the kernel estimate. "
                f"Use orthogonal=False or a radial kernel {radial}."
            )
        if seed is not None and generator is not None:
            raise ValueError(f"{name}: give at most one of seed and generator, got seed={seed!r} and a generator.")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
                raise TypeError(f"{name}: seed must be an int or None, got {seed!r}.")
            generator = torch.Generator().manual_seed(int(seed))
        elif generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"{name}: generator must be a torch.Generator or None, got {generator!r}.")
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"{name}: dtype must be a floating torch.dtype or None, got {dtype!r}.")

        log_ell = self._initial_log_lengthscale(lengthscale).to(dtype=dtype, device=device)
        if learn_lengthscale:
            self.log_lengthscale = nn.Parameter(log_ell)
        else:
            self.register_buffer("log_lengthscale", log_ell)
        W = self._kernel.spectral_sample(self.in_features, self.n_components, self.orthogonal, generator)
        self.register_buffer("frequencies", W.to(dtype=dtype, device=device))

    def _initial_log_lengthscale(self, lengthscale) -> Tensor:
        name = type(self).__name__
        wrong_type = f"{name}: lengthscale must be a positive float or a sequence of them, got {lengthscale!r}."
        if isinstance(lengthscale, bool):
            raise TypeError(wrong_type)
        if isinstance(lengthscale, numbers.Real):
            value = torch.tensor(float(lengthscale), dtype=torch.float64)
        else:
            try:
                value = torch.as_tensor(lengthscale, dtype=torch.float64).detach().cpu()
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(wrong_type) from None
        if not (torch.isfinite(value).all() and (value > 0).all()):
            raise ValueError(f"{name}: lengthscale must be positive and finite, got {lengthscale!r}.")
        if value.dim() == 0:
            value = value.expand(self.in_features).clone() if self.ard else value
        elif self.ard:
            if value.shape != (self.in_features,):
                raise ValueError(
                    f"{name}: lengthscale must be a scalar or have shape ({self.in_features},) with ard=True, "
                    f"got shape {tuple(value.shape)}."
                )
        else:
            if value.numel() != 1:
                raise ValueError(
                    f"{name}: lengthscale must be a scalar with ard=False, got shape {tuple(value.shape)}. "
                    "Pass ard=True for one length scale per input dimension."
                )
            value = value.reshape(())
        return value.log()

    @property
    def lengthscale(self) -> Tensor:
        r""":math:`\ell = \exp(\log\ell)`, a tensor of shape () or (in_features,)."""
        return self.log_lengthscale.exp()

    def _check_dtype(self, x: Tensor, arg: str) -> None:
        if x.dtype != self.frequencies.dtype:
            raise TypeError(
                f"{type(self).__name__}: {arg} must have the basis's dtype {self.frequencies.dtype}, got {x.dtype}. "
                f"Convert it with {arg}.to({self.frequencies.dtype}) or the basis with .to({x.dtype})."
            )

    def forward(self, x: Tensor) -> Tensor:
        r"""The features :math:`\phi(x)`.

        Parameters
        ----------
        x : Tensor of shape (N, in_features)

        Returns
        -------
        Tensor of shape (N, 2 * n_components)
            Cosines then sines, divided by :math:`\sqrt n`.

        Raises
        ------
        TypeError, ValueError
            If ``x`` is not a floating tensor of the basis's dtype and shape (N, in_features).
        """
        x = self._check_input(x)
        self._check_dtype(x, "x")
        z = (x / self.lengthscale) @ self.frequencies
        return torch.cat([z.cos(), z.sin()], -1) / math.sqrt(self.n_components)

    def kernel(self, x1: Tensor, x2: Optional[Tensor] = None) -> Tensor:
        r"""The exact kernel :math:`k(x_1, x_2)` at the current length scale (unit amplitude).

        Parameters
        ----------
        x1 : Tensor of shape (N1, in_features)
        x2 : Tensor of shape (N2, in_features), optional
            Defaults to ``x1``.

        Returns
        -------
        Tensor of shape (N1, N2)
            The limit of ``self(x1) @ self(x2).T`` as ``n_components`` grows (raises as :meth:`forward`).

        Notes
        -----
        Distances are computed by differences, not by the expansion :math:`\lVert a\rVert^2 + \lVert
        b\rVert^2 - 2a^\top b`, so close points keep full precision; memory is :math:`O(N_1 N_2)`.
        """
        x1 = self._check_input(x1, "x1")
        self._check_dtype(x1, "x1")
        x2 = x1 if x2 is None else self._check_input(x2, "x2")
        self._check_dtype(x2, "x2")
        return self._kernel(x1 / self.lengthscale, x2 / self.lengthscale)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, n_components={self.n_components}, kernel={self.kernel_name!r}, "
            f"ard={self.ard}, orthogonal={self.orthogonal}"
        )


def _haar_directions(d: int, n: int, generator: Optional[torch.Generator]) -> Tensor:
    """``n`` unit vectors in R^d, in blocks of ``d`` orthonormal Haar-random rows; shape (n, d)."""
    blocks = -(-n // d)
    G = torch.randn(blocks, d, d, dtype=torch.float64, generator=generator)
    Q, R = torch.linalg.qr(G)
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar: fix the signs
    return Q.transpose(-1, -2).reshape(blocks * d, d)[:n]


class Kernel:
    r"""A stationary kernel of unit amplitude and unit length scale, with the sampler of its spectral density.

    Subclasses implement :meth:`__call__` (the kernel of scaled inputs) and :meth:`spectral_sample` (the
    frequencies :math:`W` of :class:`RandomFourierBasis`, Steinberg et al. 2016, Table 1); a new kernel is one
    subclass registered in :data:`KERNELS`. ``rotation_invariant``: whether the spectral density is radial,
    so that orthogonal random features keep the estimate unbiased.
    """

    rotation_invariant = True

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        """:math:`k(a, b)` for inputs already divided by the length scale, shape (N1, N2)."""
        raise NotImplementedError

    def spectral_sample(self, d: int, n: int, orthogonal: bool, generator: Optional[torch.Generator]) -> Tensor:
        """Frequencies at unit length scale, shape (d, n), float64 on the CPU."""
        raise NotImplementedError


class RadialKernel(Kernel):
    r"""A kernel of :math:`r = \lVert a - b\rVert_2` whose frequencies are Gaussian scale mixtures
    :math:`\omega = s z`, :math:`z \sim N(0, I_d)`; orthogonal features draw the directions in Haar-random
    orthonormal blocks and the norms as :math:`\chi_d\, s` (Yu et al. 2016, §3)."""

    def profile(self, r: Tensor) -> Tensor:
        """:math:`k` as a function of the Euclidean distance :math:`r`."""
        raise NotImplementedError

    def radial_scale(self, n: int, generator: Optional[torch.Generator]) -> Tensor:
        r"""The ``n`` factors :math:`s` (float64) of the frequencies :math:`\omega = s z`."""
        raise NotImplementedError

    def __call__(self, a, b):
        return self.profile(torch.cdist(a, b, p=2.0, compute_mode="donot_use_mm_for_euclid_dist"))

    def spectral_sample(self, d, n, orthogonal, generator):
        if not orthogonal:
            z = torch.randn(n, d, dtype=torch.float64, generator=generator)
            return (z * self.radial_scale(n, generator).unsqueeze(-1)).T.contiguous()
        directions = _haar_directions(d, n, generator)
        chi = torch.randn(n, d, dtype=torch.float64, generator=generator).norm(dim=-1)  # chi with d dof
        norms = chi * self.radial_scale(n, generator)
        return (directions * norms.unsqueeze(-1)).T.contiguous()


class RBFKernel(RadialKernel):
    r""":math:`\exp(-r^2/2)`; :math:`\omega \sim N(0, I_d)` (:math:`s = 1`).

    Dividing the inputs by :math:`\ell` gives frequencies of covariance :math:`\ell^{-2} I`, the kernel
    :math:`\exp(-\lVert x - x'\rVert^2/2\ell^2)` (Steinberg et al. 2016, Table 1, whose :math:`l_\phi^{-1}`
    is read as a scale, not a variance).
    """

    def profile(self, r):
        return torch.exp(-0.5 * r * r)

    def radial_scale(self, n, generator):
        return torch.ones(n, dtype=torch.float64)


class CauchyKernel(RadialKernel):
    r""":math:`1/(1 + r^2)`; :math:`s = \sqrt{2E}`, :math:`E \sim \mathrm{Exp}(1)`.

    The multivariate-Laplace (symmetric generalised asymmetric Laplace) frequencies of the table as the
    Gaussian scale mixture :math:`\sqrt{2E}\,z`, whose characteristic function is
    :math:`\mathbb{E}_E[e^{-E\lVert\tau\rVert^2}] = 1/(1 + \lVert\tau\rVert^2)`.
    """

    def profile(self, r):
        return 1 / (1 + r * r)

    def radial_scale(self, n, generator):
        u = torch.rand(n, dtype=torch.float64, generator=generator)
        return (-2 * torch.log1p(-u)).sqrt()  # -log(1 - U) ~ Exp(1), finite for U in [0, 1)


class MaternKernel(RadialKernel):
    r"""Matérn-:math:`\nu`; :math:`s = 1/\sqrt{\chi^2_{2\nu}/2\nu}` (a Student-t with ``dof`` :math:`= 2\nu`
    degrees of freedom; Rasmussen & Williams 2006, §4.2)."""

    dof: int

    def radial_scale(self, n, generator):
        chi2 = torch.randn(n, self.dof, dtype=torch.float64, generator=generator).pow(2).sum(-1)
        return (self.dof / chi2).sqrt()


class Matern32Kernel(MaternKernel):
    r""":math:`(1 + \sqrt3 r)\,e^{-\sqrt3 r}`."""

    dof = 3

    def profile(self, r):
        s = math.sqrt(3) * r
        return (1 + s) * torch.exp(-s)


class Matern52Kernel(MaternKernel):
    r""":math:`(1 + \sqrt5 r + 5r^2/3)\,e^{-\sqrt5 r}`."""

    dof = 5

    def profile(self, r):
        s = math.sqrt(5) * r
        return (1 + s + s * s / 3) * torch.exp(-s)


class LaplaceKernel(Kernel):
    r""":math:`\exp(-\lVert a - b\rVert_1)`; :math:`\omega_j \sim \mathrm{Cauchy}(0, 1)` independently.

    The kernel these frequencies estimate, with the :math:`\ell_1` norm where the table writes the norm
    without its index (Rahimi & Recht 2007, Figure 1; scikit-learn's ``laplacian_kernel`` with
    ``gamma = 1/ℓ``). Not rotation-invariant: no orthogonal features.
    """

    rotation_invariant = False

    def __call__(self, a, b):
        return torch.exp(-torch.cdist(a, b, p=1.0))

    def spectral_sample(self, d, n, orthogonal, generator):
        u = torch.rand(d, n, dtype=torch.float64, generator=generator)
        return torch.tan(math.pi * (u - 0.5))  # Cauchy(0, 1) by inversion


#: Kernels :class:`RandomFourierBasis` approximates: name -> :class:`Kernel`.
KERNELS: Dict[str, Kernel] = {"rbf": RBFKernel(), "laplace": LaplaceKernel(), "cauchy": CauchyKernel(),
                              "matern32": Matern32Kernel(), "matern52": Matern52Kernel()}


class LinearBasis(Basis):
    r"""The identity basis :math:`\phi(x) = x`, optionally with a constant feature: :math:`[x, 1]`.

    With a Gaussian prior :math:`N(0, \lambda^{-1} I)` on the weights this is
    Bayesian ridge regression (the dot-product kernel
    :math:`x^\top x' + 1` when ``bias=True``).

    Parameters
    ----------
    in_features : int
        :math:`d \ge 1`.
    bias : bool, default True
        Append a column of ones; ``out_features = in_features + bias``.

    Raises
    ------
    TypeError, ValueError
        If ``in_features`` is not an int of at least 1 or ``bias`` not a bool.

    Examples
    --------
    >>> LinearBasis(2)(torch.tensor([[3.0, 4.0]]))
    tensor([[3., 4., 1.]])
    """

    def __init__(self, in_features: int, bias: bool = True):
        super().__init__()
        name = type(self).__name__
        self.in_features = _check_int(name, "in_features", in_features)
        self.bias = _check_bool(name, "bias", bias)
        self.out_features = self.in_features + int(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        """The features; ``x`` of shape (N, in_features) gives shape (N, out_features)."""
        x = self._check_input(x)
        if not self.bias:
            return x
        return torch.cat([x, x.new_ones(x.shape[:-1] + (1,))], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, bias={self.bias}"


class BiasBasis(Basis):
    r"""A single constant feature, :math:`\phi(x) = 1`, to add an intercept to any basis.

    Parameters
    ----------
    in_features : int
        :math:`d \ge 1`, the width of the (ignored) inputs.

    Examples
    --------
    >>> basis = RandomFourierBasis(2, 10, seed=0) + BiasBasis(2)
    >>> basis.out_features
    21
    """

    def __init__(self, in_features: int):
        super().__init__()
        self.in_features = _check_int(type(self).__name__, "in_features", in_features)
        self.out_features = 1

    def forward(self, x: Tensor) -> Tensor:
        """A column of ones of shape (N, 1)."""
        x = self._check_input(x)
        return x.new_ones(x.shape[:-1] + (1,))


class ConcatBasis(Basis):
    r"""Concatenation :math:`[\phi_1(x), \ldots, \phi_P(x)]` of bases of the same input width.

    With one prior precision on all weights this approximates the sum of the
    bases' kernels (Steinberg et al. 2016, §1.4 eqs. 36–37). ``a + b`` builds
    one; nested concatenations are flattened.

    Parameters
    ----------
    *bases : Basis
        At least one, all with the same ``in_features``.

    Attributes
    ----------
    bases : torch.nn.ModuleList
    in_features : int
    out_features : int
        The sum of the bases' ``out_features``.

    Raises
    ------
    TypeError, ValueError
        If an argument is not a :class:`Basis`, no basis is given or their ``in_features`` differ.

    Examples
    --------
    >>> basis = RandomFourierBasis(3, 50, seed=0) + LinearBasis(3)
    >>> basis(torch.zeros(2, 3)).shape
    torch.Size([2, 104])
    """

    def __init__(self, *bases: Basis):
        super().__init__()
        name = type(self).__name__
        if not bases:
            raise ValueError(f"{name}: bases must hold at least one Basis, got none.")
        flat = []
        for b in bases:
            if not isinstance(b, Basis):
                raise TypeError(f"{name}: every argument must be a pyro_fa.basis.Basis, got {type(b).__name__}.")
            flat.extend(b.bases if isinstance(b, ConcatBasis) else [b])
        widths = [b.in_features for b in flat]
        if len(set(widths)) != 1:
            raise ValueError(f"{name}: all bases must have the same in_features, got {widths}.")
        self.bases = nn.ModuleList(flat)
        self.in_features = widths[0]
        self.out_features = sum(b.out_features for b in flat)

    def forward(self, x: Tensor) -> Tensor:
        """The concatenated features; ``x`` of shape (N, in_features) gives shape (N, out_features)."""
        x = self._check_input(x)
        return torch.cat([b(x) for b in self.bases], -1)
