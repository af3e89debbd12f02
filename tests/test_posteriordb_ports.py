"""The posteriordb ports: each Pyro model against its Stan program's reference draws (score and Stein
identities in the unconstrained space), the loader's layout against Pyro's own (AutoContinuous's latent
order, Pyro's potential energy), and two log densities against scipy.stats at the constrained values.

Four posteriors ship with the package, so those tests always run; the rest run where the posteriordb
folder is found (``PYRO_FA_POSTERIORDB``, or ``PYRO_FA_DATA/../posteriordb``) and skip otherwise.
"""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

import pyro
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.infer.mcmc.util import initialize_model

from pyro_fa.experiments.posteriordb import (LEFT_OUT, PORTS, available_posteriors, data_folder, load_posterior,
                                             register_port, score_stein_identities)
from pyro_fa.experiments.posteriordb.loader import SHIPPED, init_to_median_or_zero, log_joint

SHIPPED_NAMES = ["eight_schools-eight_schools_noncentered", "kidiq-kidscore_momiq", "sblrc-blr",
                 "earnings-logearn_interaction"]
FAST_SHIPPED = SHIPPED_NAMES[:3]  # the identities on earnings (N = 1 192) take a few seconds
ALL = sorted(PORTS)
TOL = 5.0  # z-score bound on every entry of the identities (max of ~D^2 near-normal z-scores)


def _full_folder():
    folder = data_folder()
    return folder if folder is not None and (folder / "posteriors").is_dir() else None


def _load_full(name):
    if _full_folder() is None or name not in available_posteriors(_full_folder()):
        pytest.skip("the posteriordb folder (PYRO_FA_POSTERIORDB or PYRO_FA_DATA/../posteriordb) is not here")
    return load_posterior(name, _full_folder())


# ---- registry -----------------------------------------------------------------------------------

def test_every_posterior_of_the_database_is_ported_or_left_out_with_a_reason():
    assert not set(PORTS) & set(LEFT_OUT)
    assert all(isinstance(why, str) and why for why in LEFT_OUT.values())
    assert set(SHIPPED_NAMES) <= set(PORTS)
    folder = _full_folder()
    if folder is not None:
        database = {p.name[:-len(".json")] for p in (folder / "posteriors").glob("*.json")}
        assert database == set(PORTS) | set(LEFT_OUT)


def test_register_port_refuses_no_name():
    with pytest.raises(ValueError, match="register_port: names must be non-empty strings"):
        register_port()


def test_the_shipped_posteriors_are_found_without_a_data_folder(monkeypatch):
    monkeypatch.delenv("PYRO_FA_POSTERIORDB", raising=False)
    monkeypatch.delenv("PYRO_FA_DATA", raising=False)
    assert data_folder() is None
    assert set(SHIPPED_NAMES) <= set(available_posteriors())
    assert load_posterior("sblrc-blr").dim == 6
    assert (SHIPPED / "LICENCE.md").is_file()


def test_load_posterior_errors(monkeypatch, tmp_path):
    monkeypatch.delenv("PYRO_FA_POSTERIORDB", raising=False)
    monkeypatch.delenv("PYRO_FA_DATA", raising=False)
    with pytest.raises(KeyError, match="load_posterior: name must be a ported posterior, got 'nope'"):
        load_posterior("nope")
    with pytest.raises(FileNotFoundError, match="PYRO_FA_POSTERIORDB.*got 'arK-arK'"):
        load_posterior("arK-arK", data_dir=tmp_path)
    posterior = load_posterior("kidiq-kidscore_momiq", SHIPPED)
    with pytest.raises(ValueError, match=r"log_density: z must be of shape \(D,\) or \(n, D\) with D = 3"):
        posterior.log_density(torch.zeros(4))


# ---- layout and log density against Pyro --------------------------------------------------------

@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_shapes_and_names_in_autocontinuous_order(name):
    posterior = load_posterior(name, SHIPPED)
    D = posterior.dim
    assert posterior.reference.shape == (10_000, D) and posterior.reference.dtype == torch.float64
    assert torch.isfinite(posterior.reference).all()
    assert len(posterior.names()) == D
    guide = AutoDiagonalNormal(posterior.model, init_loc_fn=init_to_median_or_zero)
    guide()
    assert guide.latent_dim == D
    z = posterior.reference[17]
    unpacked = list(guide._unpack_latent(z))
    assert [site["name"] for site, _ in unpacked] == [s[0] for s in posterior.sites]
    values, _ = posterior.unpack(z)
    for site, u in unpacked:  # the same slice of z, mapped the same way, for every site
        torch.testing.assert_close(torch.distributions.biject_to(site["fn"].support)(u), values[site["name"]])


def test_names_follow_the_stan_program():
    assert load_posterior("eight_schools-eight_schools_noncentered", SHIPPED).names() == (
        [f"theta_trans[{j}]" for j in range(1, 9)] + ["mu", "tau"])
    assert load_posterior("sblrc-blr", SHIPPED).names() == [f"beta[{j}]" for j in range(1, 6)] + ["sigma"]


def _pyro_log_density(posterior, z):
    """Pyro's own log density in its unconstrained space (minus HMC's potential energy)."""
    # ImproperUniform cannot be sampled: Pyro traces the model under our init strategy
    model = InitMessenger(init_to_median_or_zero)(posterior.model)
    _, potential_fn, _, _ = initialize_model(model, init_strategy=init_to_median_or_zero)
    params, pos = {}, 0
    for name, _, ushape in posterior.sites:
        params[name] = z[pos:pos + ushape.numel()].reshape(ushape)
        pos += ushape.numel()
    return -potential_fn(params)


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_log_density_is_pyros_potential_and_batches(name):
    posterior = load_posterior(name, SHIPPED)
    z = posterior.reference[::2500]
    batched = posterior.log_density(z)
    assert batched.shape == (4,)
    for i in range(4):
        torch.testing.assert_close(posterior.log_density(z[i]), batched[i])
        torch.testing.assert_close(_pyro_log_density(posterior, z[i]), batched[i])


def test_kidiq_log_density_against_scipy():
    posterior = load_posterior("kidiq-kidscore_momiq", SHIPPED)
    data = posterior.data
    y, iq = torch.tensor(data["kid_score"]).numpy(), torch.tensor(data["mom_iq"]).numpy()
    for z in posterior.reference[[3, 4_000, 9_999]]:
        b0, b1, log_sigma = z.tolist()
        sigma = math.exp(log_sigma)
        expected = (stats.norm.logpdf(y, b0 + b1 * iq, sigma).sum() + stats.halfcauchy.logpdf(sigma, scale=2.5)
                    + log_sigma)  # flat beta; log-Jacobian of sigma = exp(u)
        assert posterior.log_density(z).item() == pytest.approx(expected, rel=1e-10)


def test_eight_schools_log_density_against_scipy_and_the_transformed_theta():
    posterior = load_posterior("eight_schools-eight_schools_noncentered", SHIPPED)
    y = [28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]
    sd = [15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]
    for z in posterior.reference[[0, 5_555]]:
        theta_trans, mu, log_tau = z[:8].numpy(), z[8].item(), z[9].item()
        tau = math.exp(log_tau)
        expected = (stats.norm.logpdf(theta_trans).sum() + stats.norm.logpdf(mu, 0, 5)
                    + stats.halfcauchy.logpdf(tau, scale=5) + log_tau
                    + stats.norm.logpdf(y, theta_trans * tau + mu, sd).sum())
        assert posterior.log_density(z).item() == pytest.approx(expected, rel=1e-10)
    # the reference holds Stan's transformed theta: the model's theta at a mapped draw gives it back
    stan = posterior.stan_reference
    values, _ = posterior.unpack(posterior.reference)
    trace = pyro.poutine.trace(pyro.poutine.condition(posterior.model, values)).get_trace()
    torch.testing.assert_close(trace.nodes["theta"]["value"], stan["theta"])


# ---- the identities -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAST_SHIPPED)
def test_identities_hold_on_the_shipped_posteriors(name):
    result = score_stein_identities(load_posterior(name, SHIPPED))
    assert result["finite"] and result["n"] == 10_000
    assert result["max_score_z"] < TOL and result["max_stein_z"] < TOL


def _broken(posterior, drop_jacobian=False, permute=False):
    def log_density(z):
        if permute:
            z = z.flip(-1)
        values, log_jac = posterior.unpack(z)
        return log_joint(posterior.model, values, z.shape[:-1]) + (0 if drop_jacobian else log_jac)
    return SimpleNamespace(reference=posterior.reference, log_density=log_density)


@pytest.mark.parametrize("name, how", [("eight_schools-eight_schools_noncentered", "drop_jacobian"),
                                       ("kidiq-kidscore_momiq", "permute")])
def test_identities_catch_a_missing_jacobian_and_a_permuted_order(name, how):
    # (a missing log-Jacobian of sigma on kidiq, N = 434, moves the score of log sigma by 1 against a
    # standard error of 0.3: a z-score of about 3, within the tolerance; the check has power only where
    # the prior and the Jacobian weigh against the likelihood, as for eight schools' tau)
    posterior = load_posterior(name, SHIPPED)
    result = score_stein_identities(_broken(posterior, **{how: True}))
    assert max(result["max_score_z"], result["max_stein_z"]) > 2 * TOL


def test_identities_catch_a_wrong_prior():
    # eight schools with tau ~ half-Cauchy(0, 0.5) instead of (0, 5): the posterior of tau moves
    posterior = load_posterior("eight_schools-eight_schools_noncentered", SHIPPED)
    import pyro.distributions as dist

    def log_density(z):
        good = posterior.log_density(z)
        tau = z[..., 9].exp()
        return good - dist.HalfCauchy(5.0).log_prob(tau) + dist.HalfCauchy(0.5).log_prob(tau)

    result = score_stein_identities(SimpleNamespace(reference=posterior.reference, log_density=log_density))
    assert max(result["max_score_z"], result["max_stein_z"]) > 2 * TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_identities_hold_on_every_port(name):
    posterior = load_posterior(name, SHIPPED) if name in SHIPPED_NAMES else _load_full(name)
    result = score_stein_identities(posterior)
    assert result["finite"]
    assert result["max_score_z"] < TOL and result["max_stein_z"] < TOL, (result["max_score_z"], result["max_stein_z"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_every_port_matches_pyros_potential_and_autocontinuous(name):
    posterior = load_posterior(name, SHIPPED) if name in SHIPPED_NAMES else _load_full(name)
    guide = AutoDiagonalNormal(posterior.model, init_loc_fn=init_to_median_or_zero)
    guide()
    assert guide.latent_dim == posterior.dim == len(posterior.names())
    assert [site["name"] for site, _ in guide._unpack_latent(posterior.reference[0])] == [
        s[0] for s in posterior.sites]
    z = posterior.reference[[1, 7_777]]
    batched = posterior.log_density(z)
    for i in range(2):
        torch.testing.assert_close(_pyro_log_density(posterior, z[i]), batched[i])


@pytest.mark.slow
def test_garch_beta1_is_stans():
    posterior = _load_full("garch-garch11")
    stan = posterior.stan_reference
    values, _ = posterior.unpack(posterior.reference)
    trace = pyro.poutine.trace(pyro.poutine.condition(posterior.model, values)).get_trace()
    torch.testing.assert_close(trace.nodes["beta1"]["value"], stan["beta1"])


def test_an_autoguide_starts_at_the_unconstrained_zero_of_the_flat_priors():
    posterior = load_posterior("kidiq-kidscore_momiq", SHIPPED)  # flat beta, half-Cauchy sigma
    guide = AutoNormal(posterior.model, init_loc_fn=init_to_median_or_zero)
    guide()
    torch.testing.assert_close(guide.locs.beta.detach(), torch.zeros(2))
    with pytest.raises(NotImplementedError, match="ImproperUniform does not support sampling"):
        AutoNormal(posterior.model)()  # Pyro's default init samples the prior


def test_identity_table_reports_each_posterior():
    from pyro_fa.experiments.posteriordb.identities import identity_table

    table = identity_table(["sblrc-blr"], SHIPPED).splitlines()
    assert table[0].startswith("| posterior | D |") and table[2].startswith("| sblrc-blr | 6 | ")
    assert all(float(x) < TOL for x in table[2].split("|")[3:5])


@pytest.mark.slow
def test_gauss_mix_log_density_against_scipy():
    # the ordered, positive and unit-interval maps' Jacobians written out by hand
    posterior = _load_full("low_dim_gauss_mix-low_dim_gauss_mix")
    y = np.array(posterior.data["y"])
    assert posterior.names() == ["mu[1]", "mu[2]", "sigma[1]", "sigma[2]", "theta"]
    for z in posterior.reference[[11, 8_888]]:
        u = z.tolist()
        mu = [u[0], u[0] + math.exp(u[1])]
        sigma = [math.exp(u[2]), math.exp(u[3])]
        theta = 1 / (1 + math.exp(-u[4]))
        mix = np.logaddexp(math.log(theta) + stats.norm.logpdf(y, mu[0], sigma[0]),
                           math.log1p(-theta) + stats.norm.logpdf(y, mu[1], sigma[1])).sum()
        expected = (stats.norm.logpdf(mu, 0, 2).sum() + stats.halfnorm.logpdf(sigma, scale=2).sum()
                    + stats.beta.logpdf(theta, 5, 5) + mix
                    + u[1] + u[2] + u[3] + math.log(theta) + math.log1p(-theta))
        assert posterior.log_density(z).item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("T", [1, 2, 7, 64, 200])
def test_linear_recurrence_is_the_loop(T):
    from pyro_fa.experiments.posteriordb.ports_models import linear_recurrence

    a, b = torch.randn(3, dtype=torch.float64) * 0.9, torch.randn(3, T, dtype=torch.float64)
    x, expected = b[:, 0], [b[:, 0]]
    for t in range(1, T):
        x = a * x + b[:, t]
        expected.append(x)
    torch.testing.assert_close(linear_recurrence(a, b), torch.stack(expected, -1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("N", [1, 2, 3, 8, 101])
def test_hmm_forward_is_stans_loop(N):
    from pyro_fa.experiments.posteriordb.ports_models import _forward

    log_emission = torch.randn(4, N, 3, dtype=torch.float64)
    log_transition = torch.log_softmax(torch.randn(4, 3, 3, dtype=torch.float64), -1)
    gamma = log_emission[:, 0]
    for t in range(1, N):
        gamma = torch.logsumexp(gamma.unsqueeze(-1) + log_transition, dim=-2) + log_emission[:, t]
    torch.testing.assert_close(_forward(log_emission, log_transition), torch.logsumexp(gamma, -1),
                               rtol=1e-12, atol=1e-12)


def _decay():
    from pyro_fa.experiments.posteriordb.ports_ode import ODESystem

    # dz/dt = -k z + c: z(t) = c / k + (z0 - c / k) exp(-k t)
    return ODESystem(1, 2, lambda t, z, p: np.array([-p[0] * z[0] + p[1]]),
                     lambda t, z, p: np.array([[-p[0]]]), lambda t, z, p: np.array([[-z[0], 1.0]]))


def test_solve_ode_and_its_gradient_against_the_closed_form():
    from pyro_fa.experiments.posteriordb.ports_ode import solve_ode

    times = torch.tensor([0.0, 0.5, 1.0, 3.0], dtype=torch.float64)
    z0 = torch.tensor([[2.0], [0.5], [-1.0]], dtype=torch.float64, requires_grad=True)
    p = torch.tensor([[0.7, 0.3], [2.0, 1.0], [0.1, -0.2]], dtype=torch.float64, requires_grad=True)
    z = solve_ode(_decay(), z0, p, times)
    assert z.shape == (3, 3, 1)

    def exact(z0, p):
        k, c = p[:, :1], p[:, 1:]
        return (c / k + (z0 - c / k) * torch.exp(-k * times[1:]))[..., None]

    torch.testing.assert_close(z, exact(z0, p), rtol=1e-7, atol=1e-9)
    weights = torch.randn(3, 3, 1, dtype=torch.float64)
    ours = torch.autograd.grad((z * weights).sum(), [z0, p])
    theirs = torch.autograd.grad((exact(z0, p) * weights).sum(), [z0, p])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    with torch.no_grad():  # the states alone, without the sensitivities
        torch.testing.assert_close(solve_ode(_decay(), z0, p, times), exact(z0, p), rtol=1e-7, atol=1e-9)
    # broadcasting: one initial state for a batch of parameters
    torch.testing.assert_close(solve_ode(_decay(), z0[:1, 0].detach(), p.detach(), times),
                               exact(z0[:1].detach().expand(3, 1), p.detach()), rtol=1e-7, atol=1e-9)


def test_solve_ode_refuses_non_finite_input_and_reports_a_failed_solve():
    from pyro_fa.experiments.posteriordb.ports_ode import ODESystem, solve_ode

    times = torch.tensor([0.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="solve_ode: z0 and params must be finite"):
        solve_ode(_decay(), torch.tensor([1.0], dtype=torch.float64),
                  torch.tensor([math.nan, 1.0], dtype=torch.float64), times)
    # dz/dt = z^2 from z0 = 1 blows up at t = 1
    blow_up = ODESystem(1, 1, lambda t, z, p: z ** 2, lambda t, z, p: np.array([[2 * z[0]]]),
                        lambda t, z, p: np.zeros((1, 1)))
    with pytest.raises(RuntimeError, match="solve_ode: LSODA failed"):
        solve_ode(blow_up, torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                  torch.tensor([0.0, 2.0], dtype=torch.float64))


def test_the_hand_written_sensitivity_equations_are_the_generic_ones():
    from dataclasses import replace

    from pyro_fa.experiments.posteriordb.ports_ode import LOTKA_VOLTERRA, _one_comp

    rng = np.random.default_rng(0)
    for system in (LOTKA_VOLTERRA, _one_comp(30.0, 2.0)):
        size = system.n * (1 + system.P + system.n)
        for t in (0.0, 0.7, 3.0):
            y, p = rng.uniform(0.1, 2.0, size=size), rng.uniform(0.01, 2.0, size=system.P).tolist()
            np.testing.assert_allclose(system.augmented(t, y, p), replace(system, fast=None).augmented(t, y, p),
                                       rtol=1e-13, atol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hudson_lynx_hare-lotka_volterra", "one_comp_mm_elim_abs-one_comp_mm_elim_abs"])
def test_ode_ports_against_a_differentiable_torch_solver(name):
    # torchdiffeq's dopri5, differentiated through its steps: an independent solver and an independent gradient
    torchdiffeq = pytest.importorskip("torchdiffeq")
    posterior = _load_full(name)
    z = posterior.reference[[3, 4_444]].clone().requires_grad_(True)
    values, _ = posterior.unpack(z)
    if name.startswith("hudson"):
        theta, z_init = values["theta"], values["z_init"]
        times = torch.cat([torch.zeros(1, dtype=torch.float64), torch.as_tensor(posterior.data["ts"], dtype=torch.float64)])

        def rhs(t, x):
            u, v = x[..., 0], x[..., 1]
            return torch.stack([(theta[:, 0] - theta[:, 1] * v) * u, (-theta[:, 2] + theta[:, 3] * u) * v], -1)

        expected = torchdiffeq.odeint(rhs, z_init, times, rtol=1e-10, atol=1e-12, method="dopri5")[1:].movedim(0, 1)
        site = "z"
    else:
        k_a, K_m, V_m = values["k_a"][:, None], values["K_m"][:, None], values["V_m"][:, None]
        D, V = float(posterior.data["D"]), float(posterior.data["V"])
        times = torch.as_tensor([float(posterior.data["t0"])] + list(posterior.data["times"]), dtype=torch.float64)

        def rhs(t, C):
            dose = torch.exp(-k_a * t) * D * k_a / V if t > 0 else torch.zeros_like(C)
            return dose - (V_m / V) * C / (K_m + C)

        expected = torchdiffeq.odeint(rhs, torch.zeros(2, 1, dtype=torch.float64), times, rtol=1e-10, atol=1e-12,
                                      method="dopri5")[1:, :, 0].movedim(0, 1)
        site = "C"
    trace = pyro.poutine.trace(pyro.poutine.condition(posterior.model, values)).get_trace()
    ours = trace.nodes[site]["value"]
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-8)
    weights = torch.randn_like(ours)
    torch.testing.assert_close(torch.autograd.grad((ours * weights).sum(), z, retain_graph=True)[0],
                               torch.autograd.grad((expected * weights).sum(), z)[0], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_arma11_and_garch11_log_densities_against_stans_loops():
    # Stan's programs loop over t; the ports solve the same recurrences by recursive doubling
    arma = _load_full("arma-arma11")
    y = np.array(arma.data["y"])
    for z in arma.reference[[5, 6_543]]:
        values, log_jac = arma.unpack(z)
        mu, phi, theta, sigma = (values[k].item() for k in ("mu", "phi", "theta", "sigma"))
        nu = [mu + phi * mu]
        err = y[0] - nu[0]
        for t in range(1, len(y)):
            nu.append(mu + phi * y[t - 1] + theta * err)
            err = y[t] - nu[t]
        expected = (stats.norm.logpdf([mu, phi, theta], 0, [10, 2, 2]).sum() + stats.halfcauchy.logpdf(sigma, 0, 2.5)
                    + stats.norm.logpdf(y, nu, sigma).sum() + log_jac.item())
        assert arma.log_density(z).item() == pytest.approx(expected, rel=1e-10)
    garch = _load_full("garch-garch11")
    y, sigma1 = np.array(garch.data["y"]), float(garch.data["sigma1"])
    for z in garch.reference[[5, 6_543]]:
        values, log_jac = garch.unpack(z)
        mu, alpha0, alpha1 = (values[k].item() for k in ("mu", "alpha0", "alpha1"))
        beta1 = (1 - alpha1) * values["beta1_unit"].item()
        sigma = [sigma1]
        for t in range(1, len(y)):
            sigma.append(math.sqrt(alpha0 + alpha1 * (y[t - 1] - mu) ** 2 + beta1 * sigma[-1] ** 2))
        expected = stats.norm.logpdf(y, mu, sigma).sum() + math.log1p(-alpha1) + log_jac.item()
        assert garch.log_density(z).item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.slow
def test_hmm_example_forward_algorithm_against_scipy():
    posterior = _load_full("hmm_example-hmm_example")
    from scipy.special import logsumexp
    y = np.array(posterior.data["y"])
    z = posterior.reference[4_321]
    values, log_jac = posterior.unpack(z)
    P = np.stack([values["theta1"].numpy(), values["theta2"].numpy()])
    mu = values["mu"].numpy()
    emission = stats.norm.logpdf(y[:, None], mu[None, :], 1.0)
    gamma = emission[0]
    for t in range(1, len(y)):
        gamma = np.array([logsumexp(gamma + np.log(P[:, k])) for k in range(2)]) + emission[t]
    expected = logsumexp(gamma) + stats.norm.logpdf(mu, [3.0, 10.0], 1.0).sum() + log_jac.item()
    assert posterior.log_density(z).item() == pytest.approx(expected, rel=1e-10)
