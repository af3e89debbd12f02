"""Random Fourier and other bases: exact kernels against scikit-learn, Monte Carlo rates, gradients, errors."""
import doctest
import math

import numpy as np
import pytest
import torch
from sklearn.gaussian_process.kernels import RBF, Matern, RationalQuadratic
from sklearn.metrics.pairwise import laplacian_kernel

import pyro_fa.basis
from pyro_fa.basis import KERNELS, BiasBasis, ConcatBasis, LinearBasis, RandomFourierBasis

RADIAL = [k for k in KERNELS if k != "laplace"]


def _inputs(n, d, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- exact kernels
@pytest.mark.parametrize("ard", [False, True])
@pytest.mark.parametrize("kernel", ["rbf", "matern32", "matern52"])
def test_kernel_matches_sklearn(kernel, ard):
    x1, x2 = _inputs(7, 3, 1), _inputs(5, 3, 2)
    ell = [0.7, 1.3, 2.1] if ard else 1.4
    basis = RandomFourierBasis(3, 4, kernel=kernel, lengthscale=ell, ard=ard, seed=0)
    ref = {"rbf": RBF(ell), "matern32": Matern(ell, nu=1.5), "matern52": Matern(ell, nu=2.5)}[kernel]
    expected = ref(x1.numpy(), x2.numpy())
    np.testing.assert_allclose(basis.kernel(x1, x2).detach().numpy(), expected, rtol=1e-12, atol=1e-14)


def test_laplace_kernel_is_l1_as_sklearn_laplacian():
    """The product-of-Cauchy frequencies of Table 1 estimate exp(-||x - x'||_1 / l) (scikit-learn's laplacian)."""
    x1, x2 = _inputs(6, 3, 1), _inputs(4, 3, 2)
    basis = RandomFourierBasis(3, 4, kernel="laplace", lengthscale=0.8, seed=0)
    expected = laplacian_kernel(x1.numpy(), x2.numpy(), gamma=1 / 0.8)
    np.testing.assert_allclose(basis.kernel(x1, x2).detach().numpy(), expected, rtol=1e-12)
    ell = torch.tensor([0.5, 1.0, 2.0])
    ard = RandomFourierBasis(3, 4, kernel="laplace", lengthscale=ell, ard=True, seed=0)
    closed = torch.exp(-((x1[:, None] - x2[None]).abs() / ell).sum(-1))
    torch.testing.assert_close(ard.kernel(x1, x2).detach(), closed, rtol=1e-12, atol=0)


def test_cauchy_kernel_closed_form_and_rational_quadratic():
    x1, x2 = _inputs(6, 2, 1), _inputs(4, 2, 2)
    basis = RandomFourierBasis(2, 4, kernel="cauchy", lengthscale=1.7, seed=0)
    r2 = torch.cdist(x1, x2).pow(2) / 1.7 ** 2
    torch.testing.assert_close(basis.kernel(x1, x2).detach(), 1 / (1 + r2), rtol=1e-12, atol=0)
    # 1 / (1 + r^2 / l^2) is scikit-learn's RationalQuadratic with alpha = 1 and length scale l / sqrt(2)
    expected = RationalQuadratic(length_scale=1.7 / math.sqrt(2), alpha=1.0)(x1.numpy(), x2.numpy())
    np.testing.assert_allclose(basis.kernel(x1, x2).detach().numpy(), expected, rtol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_unit_diagonal_and_default_second_argument(kernel):
    x = _inputs(5, 3)
    basis = RandomFourierBasis(3, 4, kernel=kernel, seed=0)
    K = basis.kernel(x)
    torch.testing.assert_close(torch.diagonal(K).detach(), torch.ones(5))
    torch.testing.assert_close(K, basis.kernel(x, x))


# ---------------------------------------------------------------- Monte Carlo behaviour
@pytest.mark.parametrize("kernel", KERNELS)
def test_gram_error_shrinks_like_inverse_sqrt_n(kernel):
    """Slope of log ||Phi Phi^T - K||_F against log n over n = 64 ... 4096 is -1/2 (Rahimi & Recht 2007)."""
    x = _inputs(30, 3)
    ns = [64, 256, 1024, 4096]
    errors = []
    for n in ns:
        e = 0.0
        for seed in range(6):
            basis = RandomFourierBasis(3, n, kernel=kernel, lengthscale=1.5, seed=seed)
            with torch.no_grad():
                phi = basis(x)
                e += float((phi @ phi.T - basis.kernel(x)).norm())
        errors.append(e / 6)
    lx, ly = np.log(ns), np.log(errors)
    slope = np.polyfit(lx, ly, 1)[0]
    assert -0.65 < slope < -0.35, (slope, errors)


@pytest.mark.parametrize("kernel", KERNELS)
def test_features_unbiased(kernel):
    """E[Phi Phi^T] = K: the mean Gram matrix over many bases is within 4 standard errors."""
    x = _inputs(6, 3)
    orthogonal = kernel != "laplace"
    grams = []
    for seed in range(300):
        basis = RandomFourierBasis(3, 6, kernel=kernel, orthogonal=orthogonal, seed=seed)
        with torch.no_grad():
            phi = basis(x)
        grams.append(phi @ phi.T)
    grams = torch.stack(grams)
    K = basis.kernel(x).detach()
    se = grams.std(0) / math.sqrt(len(grams)) + 1e-12
    assert ((grams.mean(0) - K).abs() / se).max() < 4.5


def test_orthogonal_rbf_features_beat_plain_ones():
    """Yu et al. (2016): orthogonal random features have a lower kernel approximation error at equal n."""
    d = 8
    x = _inputs(30, d)
    plain, orth = 0.0, 0.0
    for seed in range(20):
        for orthogonal in (False, True):
            basis = RandomFourierBasis(d, 2 * d, lengthscale=math.sqrt(d), orthogonal=orthogonal, seed=seed)
            with torch.no_grad():
                phi = basis(x)
                err = float((phi @ phi.T - basis.kernel(x)).pow(2).mean())
            if orthogonal:
                orth += err
            else:
                plain += err
    assert orth < 0.75 * plain, (orth, plain)


def test_orthogonal_blocks_have_orthogonal_directions_and_chi_norms():
    d, n = 5, 12
    basis = RandomFourierBasis(d, n, orthogonal=True, seed=3)
    W = basis.frequencies.T  # (n, d)
    block = W[:d] / W[:d].norm(dim=-1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(d), atol=1e-12, rtol=0)
    # chi_d norms: E||w||^2 = d over many draws
    norms2 = torch.cat(
        [RandomFourierBasis(d, 50, orthogonal=True, seed=s).frequencies.pow(2).sum(0) for s in range(40)]
    )
    assert abs(float(norms2.mean()) - d) < 4 * float(norms2.std()) / math.sqrt(len(norms2))


# ---------------------------------------------------------------- module behaviour
@pytest.mark.parametrize("kernel", KERNELS)
def test_shapes_and_feature_norm(kernel, device):
    basis = RandomFourierBasis(3, 10, kernel=kernel, seed=0, device=device)
    x = _inputs(4, 3).to(device)
    phi = basis(x)
    assert basis.in_features == 3 and basis.out_features == 20
    assert phi.shape == (4, 20) and phi.device.type == device.type and phi.dtype == torch.float64
    torch.testing.assert_close(phi.pow(2).sum(-1), torch.ones(4, device=device))  # cos^2 + sin^2 = 1


def test_seed_reproducible_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a = RandomFourierBasis(3, 8, kernel="matern32", seed=11)
    assert torch.equal(state, torch.get_rng_state())
    b = RandomFourierBasis(3, 8, kernel="matern32", generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(a.frequencies, b.frequencies)
    assert not torch.equal(a.frequencies, RandomFourierBasis(3, 8, kernel="matern32", seed=12).frequencies)


def test_gradient_flows_to_lengthscale_and_matches_finite_differences():
    x = _inputs(6, 2)
    for ard in (False, True):
        basis = RandomFourierBasis(2, 16, lengthscale=[0.8, 1.5] if ard else 1.2, ard=ard, seed=0)
        target = torch.randn(6, 32)

        def loss():
            return (basis(x) * target).sum() + basis.kernel(x).sum()

        loss().backward()
        grad = basis.log_lengthscale.grad.clone()
        assert torch.isfinite(grad).all() and grad.abs().min() > 0
        eps = 1e-6
        for i in range(grad.numel()):
            with torch.no_grad():
                basis.log_lengthscale.view(-1)[i] += eps
                up = float(loss())
                basis.log_lengthscale.view(-1)[i] -= 2 * eps
                down = float(loss())
                basis.log_lengthscale.view(-1)[i] += eps
            g_i = float(grad.view(-1)[i])
            assert abs((up - down) / (2 * eps) - g_i) < 1e-6 * max(1.0, abs(g_i))


def test_fixed_lengthscale_is_a_buffer():
    basis = RandomFourierBasis(2, 4, lengthscale=2.0, learn_lengthscale=False, seed=0)
    assert list(basis.parameters()) == []
    assert "log_lengthscale" in dict(basis.named_buffers())
    torch.testing.assert_close(basis.lengthscale, torch.tensor(2.0))
    ard = RandomFourierBasis(3, 4, lengthscale=2.0, ard=True, seed=0)
    assert ard.lengthscale.shape == (3,)


def test_to_dtype_and_state_dict():
    basis = RandomFourierBasis(2, 6, kernel="cauchy", seed=0).to(torch.float32)
    x = _inputs(3, 2).float()
    assert basis(x).dtype == torch.float32
    other = RandomFourierBasis(2, 6, kernel="cauchy", seed=5, dtype=torch.float32)
    other.load_state_dict(basis.state_dict())
    torch.testing.assert_close(other(x), basis(x))


def test_linear_bias_and_concat_bases():
    x = _inputs(4, 3)
    lin = LinearBasis(3)
    torch.testing.assert_close(lin(x), torch.cat([x, torch.ones(4, 1)], -1))
    assert LinearBasis(3, bias=False)(x) is x and LinearBasis(3, bias=False).out_features == 3
    rff = RandomFourierBasis(3, 5, seed=0)
    cat = rff + lin + BiasBasis(3)
    assert isinstance(cat, ConcatBasis) and len(cat.bases) == 3  # flattened
    assert cat.out_features == 10 + 4 + 1
    torch.testing.assert_close(cat(x), torch.cat([rff(x), lin(x), torch.ones(4, 1)], -1))
    assert [n for n, _ in cat.named_parameters()] == ["bases.0.log_lengthscale"]


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(in_features=0), ValueError, "in_features must be >= 1, got 0"),
        (dict(in_features=2.0), TypeError, "in_features must be an int"),
        (dict(n_components=0), ValueError, "n_components must be >= 1"),
        (dict(kernel="periodic"), ValueError, r"kernel must be one of \('rbf', 'laplace'.*got 'periodic'"),
        (dict(lengthscale=-1.0), ValueError, "lengthscale must be positive and finite"),
        (dict(lengthscale=float("nan")), ValueError, "lengthscale must be positive and finite"),
        (dict(lengthscale=True), TypeError, "lengthscale must be a positive float"),
        (dict(lengthscale="wide"), TypeError, "lengthscale must be a positive float"),
        (dict(lengthscale=[1.0, 2.0], ard=True), ValueError, r"shape \(3,\) with ard=True, got shape \(2,\)"),
        (dict(lengthscale=[1.0, 2.0, 3.0]), ValueError, "must be a scalar with ard=False.*ard=True"),
        (dict(ard=1), TypeError, "ard must be a bool"),
        (dict(orthogonal="yes"), TypeError, "orthogonal must be a bool"),
        (dict(learn_lengthscale=None), TypeError, "learn_lengthscale must be a bool"),
        (dict(kernel="laplace", orthogonal=True), ValueError, "orthogonal must be False for kernel='laplace'"),
        (dict(seed=1, generator=torch.Generator()), ValueError, "at most one of seed and generator"),
        (dict(seed=1.5), TypeError, "seed must be an int"),
        (dict(generator=3), TypeError, "generator must be a torch.Generator"),
        (dict(dtype=torch.int64), TypeError, "dtype must be a floating torch.dtype"),
    ],
)
def test_random_fourier_basis_refuses_bad_arguments(kwargs, error, match):
    args = dict(in_features=3, n_components=4)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        RandomFourierBasis(**args)


def test_forward_refuses_bad_inputs():
    basis = RandomFourierBasis(3, 4, seed=0)
    with pytest.raises(ValueError, match=r"x must have shape \(N, 3\), got \(5, 2\)"):
        basis(torch.zeros(5, 2))
    with pytest.raises(ValueError, match=r"x must have shape \(N, 3\), got \(3,\)"):
        basis(torch.zeros(3))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        basis(np.zeros((2, 3)))
    with pytest.raises(TypeError, match="x must have a floating dtype, got torch.int64"):
        basis(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"x must have the basis's dtype torch.float64, got torch.float32.*\.to\("):
        basis(torch.zeros(2, 3, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"x2 must have shape \(N, 3\)"):
        basis.kernel(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(TypeError, match="x1 must have the basis's dtype"):
        basis.kernel(torch.zeros(2, 3, dtype=torch.float32))
    with pytest.raises(TypeError, match="x2 must have the basis's dtype"):
        basis.kernel(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"LinearBasis: x must have shape \(N, 2\)"):
        LinearBasis(2)(torch.zeros(2, 3))


def test_other_bases_refuse_bad_arguments():
    with pytest.raises(TypeError, match="LinearBasis: bias must be a bool"):
        LinearBasis(2, bias=1)
    with pytest.raises(ValueError, match="BiasBasis: in_features must be >= 1"):
        BiasBasis(0)
    with pytest.raises(ValueError, match="ConcatBasis: bases must hold at least one Basis"):
        ConcatBasis()
    with pytest.raises(TypeError, match="every argument must be a pyro_fa.basis.Basis, got Linear"):
        ConcatBasis(LinearBasis(2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"same in_features, got \[2, 3\]"):
        LinearBasis(2) + LinearBasis(3)
    with pytest.raises(TypeError):
        LinearBasis(2) + 1


def test_a_registered_kernel_is_one_entry(monkeypatch):
    """A new radial kernel is one entry of KERNELS: exp(-r^2), frequencies N(0, 2I), is scikit-learn's RBF
    at length scale ell / sqrt(2); its plain and orthogonal features estimate it."""

    class Gauss2(pyro_fa.basis.RadialKernel):
        def profile(self, r):
            return torch.exp(-r * r)

        def radial_scale(self, n, generator):
            return torch.full((n,), math.sqrt(2.0), dtype=torch.float64)

    monkeypatch.setitem(KERNELS, "gauss2", Gauss2())
    x = _inputs(20, 3).double()
    K = RBF(1.5 / math.sqrt(2)).__call__(x.numpy())
    for orthogonal in (False, True):
        basis = RandomFourierBasis(3, 20000, kernel="gauss2", lengthscale=1.5, orthogonal=orthogonal, seed=0,
                                   dtype=torch.float64)
        np.testing.assert_allclose(basis.kernel(x).detach().numpy(), K, rtol=1e-12, atol=1e-14)
        with torch.no_grad():
            phi = basis(x)
        assert float((phi @ phi.T - torch.as_tensor(K)).abs().max()) < 0.05


def test_doctests():
    assert doctest.testmod(pyro_fa.basis, optionflags=doctest.ELLIPSIS).failed == 0
