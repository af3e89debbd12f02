"""The linearised (GLM) predictive: moments against dense J Σ Jᵀ, linear models, the probit against Monte Carlo,
SWAG / MultiSWAG's pred_type="glm", dtypes and devices, errors."""
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pyro_fa import MultiSWAG, SWAG
from pyro_fa.predictive import linearized_moments, linearized_network, probit_proba

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _mlp(dtype=torch.float64, device="cpu", C=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, C)).to(dtype=dtype, device=device)


def _dense_jacobian(module, loc, x):
    """(N, C, D) by torch.autograd.functional.jacobian of the whole batch's outputs (independent of torch.func.vmap)."""
    named = [(n, p) for n, p in module.named_parameters()]
    sizes = [p.numel() for _, p in named]

    def f(theta):
        weights = {n: t.view(p.shape) for (n, p), t in zip(named, theta.split(sizes))}
        out = functional_call(module, weights, (x,))
        return out.unsqueeze(-1) if out.dim() == 1 else out

    return torch.autograd.functional.jacobian(f, loc), f(loc)


def _vector(module):
    return torch.nn.utils.parameters_to_vector(module.parameters()).detach()


def _swag(module, x, y, rank=3, method="swag", seed=0, steps=25):
    """A SWAG of ``module`` collected from SGD on a small classification / regression problem."""
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    swag = SWAG(module, rank=rank, method=method, seed=seed)
    swag.attach(opt)
    loss = nn.functional.cross_entropy if not y.is_floating_point() else (
        lambda out, t: (out.reshape(t.shape) - t).square().mean())
    for _ in range(steps):
        opt.zero_grad()
        loss(module(x), y).backward()
        opt.step()
    return swag


# -------------------------------------------------------------- (a) moments against dense J Σ Jᵀ
@pytest.mark.parametrize("chunk_size", [None, 2, 7])
@pytest.mark.parametrize("factor_sign", [1.0, -1.0])
def test_moments_equal_dense_covariance(factor_sign, chunk_size):
    net = _mlp()
    D = sum(p.numel() for p in net.parameters())
    g = torch.Generator().manual_seed(1)
    loc = _vector(net) + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(7, 4, generator=g, dtype=torch.float64)
    if factor_sign > 0:  # a factor-analysis covariance F Fᵀ + Ψ
        cov_diag = torch.rand(D, generator=g, dtype=torch.float64) + 0.1
        cov_factor = torch.randn(D, 3, generator=g, dtype=torch.float64)
        sigma = torch.diag(cov_diag) + cov_factor @ cov_factor.T
    else:  # the inverse of a precision A + U Uᵀ, by Woodbury against the dense inverse
        a = torch.rand(D, generator=g, dtype=torch.float64) + 0.5
        U = torch.randn(D, 3, generator=g, dtype=torch.float64)
        L = torch.linalg.cholesky(torch.eye(3, dtype=torch.float64) + U.T @ (U / a[:, None]))
        cov_diag = 1 / a
        cov_factor = torch.linalg.solve_triangular(L, (U / a[:, None]).T, upper=False).T  # A⁻¹ U L⁻ᵀ
        sigma = torch.linalg.inv(torch.diag(a) + U @ U.T)
    J, f_loc = _dense_jacobian(net, loc, x)
    mean, cov = linearized_moments(net, loc, x, cov_diag=cov_diag, cov_factor=cov_factor, factor_sign=factor_sign,
                                   scale=0.7, chunk_size=chunk_size)
    dense = 0.7 * torch.einsum("ncd,de,nke->nck", J, sigma, J)
    assert mean.shape == (7, 3) and cov.shape == (7, 3, 3)
    torch.testing.assert_close(mean, f_loc, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cov, dense, rtol=1e-10, atol=1e-12)
    _, var = linearized_moments(net, loc, x, cov_diag=cov_diag, cov_factor=cov_factor, factor_sign=factor_sign,
                                scale=0.7, chunk_size=chunk_size, diagonal=True)
    torch.testing.assert_close(var, dense.diagonal(dim1=-2, dim2=-1), rtol=1e-10, atol=1e-12)


def test_moments_rank_zero_params_subset_and_tuple_inputs():
    # K = 0 is J diag(ψ) Jᵀ; a subset of params is linearised while the others keep their values
    net = _mlp()
    last = list(net[2].parameters())
    loc = torch.nn.utils.parameters_to_vector(last).detach()
    x = torch.randn(5, 4, dtype=torch.float64)
    cov_diag = torch.rand(loc.numel(), dtype=torch.float64)
    mean, cov = linearized_moments(net, loc, (x,), cov_diag=cov_diag, cov_factor=loc.new_zeros(loc.numel(), 0),
                                   params=last)
    h = net[1](net[0](x)).detach()
    W_var, b_var = cov_diag[:18].view(3, 6), cov_diag[18:]
    # out_c = W_c h + b_c: outputs share no weight, so cov is diagonal with Var out_c = sum_j h_j² ψ(W_cj) + ψ(b_c)
    expected = torch.diag_embed((h.square() @ W_var.T) + b_var)
    torch.testing.assert_close(mean, net(x).detach())
    torch.testing.assert_close(cov, expected)


def test_linearized_network_equals_taylor_expansion():
    net = _mlp()
    D = sum(p.numel() for p in net.parameters())
    loc = _vector(net)
    theta = loc + 0.05 * torch.randn(D, dtype=torch.float64)
    x = torch.randn(6, 4, dtype=torch.float64)
    J, f_loc = _dense_jacobian(net, loc, x)
    torch.testing.assert_close(linearized_network(net, loc, theta)(x), f_loc + J @ (theta - loc))


# -------------------------------------------------------------- (b) a network linear in its weights
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_linear_network_glm_equals_sampled_predictive():
    torch.manual_seed(0)
    net = nn.Linear(4, 3).double()
    x = torch.randn(30, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (30,))
    swag = _swag(net, x, y)
    swag.scale = 3.0
    thetas = swag.sample(8, generator=torch.Generator().manual_seed(2))
    nn_out = swag.predictive().outputs(thetas, x)
    glm_out = swag.predictive(pred_type="glm").outputs(thetas, x)
    torch.testing.assert_close(glm_out, nn_out, rtol=1e-12, atol=1e-12)
    p_nn = swag.predict_proba(x, num_samples=8, generator=torch.Generator().manual_seed(3))
    p_glm = swag.predict_proba(x, num_samples=8, generator=torch.Generator().manual_seed(3), pred_type="glm")
    torch.testing.assert_close(p_glm, p_nn, rtol=1e-12, atol=1e-12)
    # the scale search scores both predictives alike on the same draws
    a = swag.tune_scale(x, y, scales=[0.1, 1.0, 10.0], num_samples=6, pred_type="glm")
    b = swag.tune_scale(x, y, scales=[0.1, 1.0, 10.0], num_samples=6, pred_type="nn")
    assert a.log_likelihoods == pytest.approx(b.log_likelihoods, rel=1e-12)


def test_linear_regression_predict_glm_closed_form():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)).double()  # outputs of shape (N,)
    x = torch.randn(25, 3, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1 * torch.randn(25, dtype=torch.float64)
    swag = _swag(net, x, y, rank=2)
    swag.scale = 2.0
    mean, var = swag.predict(x, pred_type="glm", noise_std=0.3)
    X1 = torch.cat([x, torch.ones(25, 1, dtype=torch.float64)], 1)
    sigma = 2.0 * (swag.cov_factor @ swag.cov_factor.T + torch.diag(swag.cov_diag))
    assert mean.shape == var.shape == (25,)
    torch.testing.assert_close(mean, X1 @ swag.loc)
    torch.testing.assert_close(var, torch.einsum("nd,de,ne->n", X1, sigma, X1) + 0.09)
    # against a large Monte Carlo of the sampled (here also linear) networks
    draws = swag.predictive_samples(x, num_samples=4000, generator=torch.Generator().manual_seed(0))
    se = draws.var(0) * math.sqrt(2 / 4000)
    assert bool(((draws.var(0) + 0.09 - var).abs() <= 4 * se + 1e-12).all())


def test_multiswag_glm_is_the_mixture_of_members():
    x = torch.randn(20, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (20,))
    nets = [_mlp(seed=s) for s in (0, 1)]
    members = [_swag(net, x, y, seed=s) for s, net in enumerate(nets)]
    ms = MultiSWAG(members)
    means, variances = [], []
    for net, m in zip(nets, members):
        J, f_loc = _dense_jacobian(net, m.loc, x)
        sigma = m.cov_factor @ m.cov_factor.T + torch.diag(m.cov_diag)
        means.append(f_loc)
        variances.append(torch.einsum("ncd,de,nce->nc", J, sigma, J))
    mean, var = ms.predict(x, pred_type="glm")
    mix = (means[0] + means[1]) / 2
    torch.testing.assert_close(mean, mix)
    torch.testing.assert_close(var, (variances[0] + means[0] ** 2 + variances[1] + means[1] ** 2) / 2 - mix ** 2)
    expected = (probit_proba(means[0], variances[0]) + probit_proba(means[1], variances[1])) / 2
    torch.testing.assert_close(ms.predict_proba(x, pred_type="glm", link_approx="probit"), expected)
    torch.testing.assert_close(ms.predict_log_proba(x, pred_type="glm", link_approx="probit"), expected.log())


def test_swag_probit_equals_dense():
    x = torch.randn(9, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (9,))
    net = _mlp()
    swag = _swag(net, x, y, method="em", rank=2)
    swag.scale = 5.0
    J, f_loc = _dense_jacobian(net, swag.loc, x)
    sigma = 5.0 * (swag.cov_factor @ swag.cov_factor.T + torch.diag(swag.cov_diag))
    expected = probit_proba(f_loc, torch.einsum("ncd,de,nke->nck", J, sigma, J))
    torch.testing.assert_close(swag.predict_proba(x, pred_type="glm", link_approx="probit", chunk_size=4), expected)
    torch.testing.assert_close(swag.predict_log_proba(x, pred_type="glm", link_approx="probit"), expected.log())


# -------------------------------------------------------------- (c) the probit approximation
def test_probit_at_zero_covariance_is_softmax():
    mean = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(probit_proba(mean, mean.new_zeros(5, 4, 4)), mean.softmax(-1), rtol=0, atol=0)


@pytest.mark.slow
def test_probit_matches_monte_carlo_for_small_variances():
    # E[softmax(z)], z ~ N(m, diag(v)), by 200 000 draws; the multi-class probit is an approximation whose error
    # grows like v (measured: about 0.055 v_max at v_max = 0.05): within 0.1 v_max + 4 standard errors, and at
    # v_max = 0.2 closer to the Monte Carlo than softmax(m) is
    g = torch.Generator().manual_seed(0)
    for vmax in (0.01, 0.05, 0.2):
        m = 1.5 * torch.randn(6, 3, generator=g, dtype=torch.float64)
        v = vmax * torch.rand(6, 3, generator=g, dtype=torch.float64)
        S = 200_000
        p = (m + v.sqrt() * torch.randn(S, 6, 3, generator=g, dtype=torch.float64)).softmax(-1)
        mc, se = p.mean(0), p.std(0) / math.sqrt(S)
        probit = probit_proba(m, torch.diag_embed(v))
        assert bool(((probit - mc).abs() <= 0.1 * vmax + 4 * se).all()), (vmax, (probit - mc).abs().max())
        if vmax == 0.2:
            assert (probit - mc).abs().sum() < 0.5 * (m.softmax(-1) - mc).abs().sum()


# -------------------------------------------------------------- (d) dtypes and devices
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_and_device_follow_the_module(dtype, device):
    net = _mlp(dtype=dtype, device=device)
    x = torch.randn(10, 4, dtype=dtype, device=device)
    y = torch.randint(0, 3, (10,), device=device)
    swag = _swag(net, x, y, rank=2)
    mean, cov = swag.linearized_moments(x)
    for out in (mean, cov, swag.predict_proba(x, pred_type="glm", link_approx="probit"),
                swag.predict_proba(x, pred_type="glm", num_samples=3),
                linearized_network(net, swag.loc, swag.sample())(x)):
        assert out.dtype == dtype and out.device.type == torch.device(device).type
    net64 = _mlp()  # the reference in float64 on the CPU
    net64.load_state_dict({k: v.double().cpu() for k, v in net.state_dict().items()})
    loc, F, psi = (t.double().cpu() for t in (swag.loc, swag.cov_factor, swag.cov_diag))
    J, _ = _dense_jacobian(net64, loc, x.double().cpu())
    dense = torch.einsum("ncd,de,nke->nck", J, F @ F.T + torch.diag(psi), J)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(cov.double().cpu(), dense, **tol)


# -------------------------------------------------------------- (e) errors
def test_bad_inputs_raise_clear_errors():
    net = _mlp()
    D = sum(p.numel() for p in net.parameters())
    loc, x = _vector(net), torch.randn(3, 4, dtype=torch.float64)
    d, F = torch.ones(D, dtype=torch.float64), torch.zeros(D, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"linearized_moments: loc must have shape \({D},\).*got \({D - 1},\)"):
        linearized_moments(net, loc[1:], x, cov_diag=d, cov_factor=F)
    with pytest.raises(ValueError, match=rf"linearized_moments: cov_diag must have shape \({D},\)"):
        linearized_moments(net, loc, x, cov_diag=d[:3], cov_factor=F)
    with pytest.raises(ValueError, match=rf"linearized_moments: cov_factor must have shape \({D}, K\).*got \(2, {D}\)"):
        linearized_moments(net, loc, x, cov_diag=d, cov_factor=F.T)
    with pytest.raises(ValueError, match=r"linearized_moments: loc must be on the module's dtype and device"):
        linearized_moments(net, loc.float(), x, cov_diag=d, cov_factor=F)
    with pytest.raises(ValueError, match=r"linearized_moments: factor_sign must be 1.0 .* or -1.0 .*got 2"):
        linearized_moments(net, loc, x, cov_diag=d, cov_factor=F, factor_sign=2)
    with pytest.raises(ValueError, match=r"linearized_moments: scale must be a finite number >= 0, got -1.0"):
        linearized_moments(net, loc, x, cov_diag=d, cov_factor=F, scale=-1.0)
    with pytest.raises(ValueError, match=r"linearized_moments: chunk_size must be an integer >= 1 or None, got 0"):
        linearized_moments(net, loc, x, cov_diag=d, cov_factor=F, chunk_size=0)
    with pytest.raises(ValueError, match=r"linearized_moments: inputs must share one leading"):
        linearized_moments(net, loc, (x, x[:2]), cov_diag=d, cov_factor=F)
    with pytest.raises(TypeError, match=r"linearized_moments: module must be a torch.nn.Module, got function"):
        linearized_moments(lambda z: z, loc, x, cov_diag=d, cov_factor=F)
    with pytest.raises(ValueError, match=r"linearized_moments: params must be parameters of module"):
        linearized_moments(net, loc, x, cov_diag=d, cov_factor=F, params=[torch.zeros(3)])
    with pytest.raises(ValueError, match=r"linearized_moments: the module's output must have shape \(N, C\)"):
        linearized_moments(nn.Sequential(net, nn.Unflatten(1, (3, 1))), loc, x, cov_diag=d, cov_factor=F)
    with pytest.raises(ValueError, match=rf"linearized_network: theta must have shape \({D},\)"):
        linearized_network(net, loc, loc[:-1])
    with pytest.raises(ValueError, match=r"probit_proba: cov must be a Tensor of shape \(3, 2, 2\) or \(3, 2\)"):
        probit_proba(torch.zeros(3, 2), torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"probit_proba: cov must have non-negative variances"):
        probit_proba(torch.zeros(3, 2), -torch.ones(3, 2))


def test_swag_rejects_unknown_pred_type_and_link_approx():
    x = torch.randn(10, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    swag = _swag(_mlp(), x, y, rank=2)
    scale = swag.scale
    with pytest.raises(ValueError, match=r"SWAG: pred_type must be one of \('nn', 'glm'\), got 'lin'"):
        swag.predict_proba(x, pred_type="lin")
    with pytest.raises(ValueError, match=r"SWAG: pred_type must be one of \('nn', 'glm'\), got 'GLM'"):
        swag.predictive(pred_type="GLM")
    with pytest.raises(ValueError, match=r"SWAG: link_approx must be one of \('mc', 'probit'\), got 'bridge'"):
        swag.predict_proba(x, pred_type="glm", link_approx="bridge")
    with pytest.raises(ValueError, match=r"SWAG: link_approx='probit' needs pred_type='glm'"):
        swag.predict_proba(x, link_approx="probit")
    with pytest.raises(ValueError, match=r"SWAG: predict\(pred_type='glm'\) gives .* fn, loader and keyword"):
        swag.predict(x, pred_type="glm", fn=torch.exp)
    with pytest.raises(ValueError, match=r"SWAG: noise_std must be positive and finite, got -1"):
        swag.predict(x, pred_type="glm", noise_std=-1)
    with pytest.raises(ValueError, match=r"MultiSWAG: pred_type must be one of"):
        MultiSWAG([swag]).predict_proba(x, pred_type="laplace")
    params_only = SWAG([torch.zeros(3, requires_grad=True)], rank=1, method="swag")
    params_only.collect()
    with pytest.raises(RuntimeError, match=r"SWAG: pred_type='glm' needs a SWAG built from an nn.Module"):
        params_only.predictive(pred_type="glm")
    assert swag.scale == scale
