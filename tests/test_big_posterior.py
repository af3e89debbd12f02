"""The ``big_logistic`` posterior (D = 5000 by default) and the batched HMC that makes its reference draws,
checked on small instances: HMC against a Gaussian with known moments, R-hat and ESS against ArviZ's own
behaviour on independent and stuck chains, the log density against Pyro's trace and a dense Gaussian, the
score identity on HMC draws, the reference file's round trip and every error."""
import math

import numpy as np
import pytest
import torch

from pyro_fa.experiments.posteriordb import big
from pyro_fa.experiments.posteriordb.hmc import convergence, hmc, mass_windows

SMALL = big.BigLogisticConfig(dim=20, num_rows=60, rank=2, factor_scale=2.0, seed=3)


def _gaussian(dim=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(dim, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
    scales = torch.logspace(-0.5, 0.5, dim, dtype=torch.float64)  # s.d. from 0.3 to 3: needs the mass matrix
    cov = scales[:, None] * (0.7 * torch.eye(dim, dtype=torch.float64) + 0.3 * A @ A.T) * scales[None, :]
    mean = torch.linspace(-2, 2, dim, dtype=torch.float64)
    return torch.distributions.MultivariateNormal(mean, covariance_matrix=cov)


@pytest.mark.slow
def test_hmc_recovers_a_gaussians_mean_and_covariance():
    target = _gaussian()
    g = torch.Generator().manual_seed(1)
    init = target.mean + 3 * torch.randn(4, 20, generator=g, dtype=torch.float64)
    res = hmc(target.log_prob, init, num_warmup=300, num_samples=1500, num_steps=10, generator=g)
    x = res.draws.reshape(-1, 20)
    diag = convergence(res.draws)
    assert diag["rhat_max"] < 1.02 and diag["ess_bulk_min"] > 300
    assert 0.6 < res.accept_rate < 0.95
    # mean within 5 Monte Carlo standard errors (ESS-based) per coordinate
    sd = target.covariance_matrix.diagonal().sqrt()
    se = sd / math.sqrt(diag["ess_bulk_min"])
    assert ((x.mean(0) - target.mean).abs() < 5 * se).all()
    cov = torch.cov(x.T)
    # covariance in the whitened frame: close to the identity (sampling error ~ sqrt(2 / ESS))
    L = torch.linalg.cholesky(target.covariance_matrix)
    white = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L, cov, upper=False).T, upper=False)
    assert (white - torch.eye(20, dtype=torch.float64)).abs().max() < 6 * math.sqrt(2 / diag["ess_bulk_min"])
    # the mass matrix learned the marginal variances (within 30%)
    ratio = res.inv_mass / target.covariance_matrix.diagonal()
    assert ((ratio > 0.7) & (ratio < 1.3)).all()
    assert res.grad_evals >= (300 + 1500) * 10


def test_mass_windows_follow_stans_schedule():
    assert mass_windows(10) == []
    assert mass_windows(1000) == [175, 225, 325, 900]  # 150 buffer, windows 25, 50, 100 and the rest; 100 term
    w = mass_windows(200)
    assert w[0] > 30 and w[-1] == 180 and w == sorted(w)


def test_convergence_agrees_with_arviz_and_flags_stuck_chains():
    import arviz

    rng = np.random.default_rng(0)
    iid = rng.standard_normal((4, 500, 3))
    d = convergence(torch.from_numpy(iid))
    assert d["rhat_max"] < 1.01 and d["ess_bulk_min"] > 1000  # independent draws: ESS near 2000
    ess = arviz.ess(arviz.convert_to_dataset({"z": iid}), method="bulk")["z"].values
    assert d["ess_bulk_min"] == pytest.approx(float(ess.min()))
    stuck = iid.copy()
    stuck[0] += 3.0  # one chain elsewhere
    assert convergence(torch.from_numpy(stuck))["rhat_max"] > 1.1
    with pytest.raises(ValueError, match=r"convergence: draws must be of shape \(chains >= 2, draws >= 4, D\)"):
        convergence(torch.zeros(1, 10, 2))


def test_log_density_is_pyros_and_a_dense_gaussians():
    from pyro import poutine

    data = big.make_data(SMALL)
    z = torch.randn(5, SMALL.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours = big.log_density(data, z)
    model = big.make_model(data)
    for i in range(5):
        tr = poutine.trace(poutine.condition(model, data={"w": z[i]})).get_trace()
        torch.testing.assert_close(ours[i], tr.log_prob_sum())
    cov = data["cov_factor"] @ data["cov_factor"].T + torch.diag(data["cov_diag"])
    prior = torch.distributions.MultivariateNormal(torch.zeros(SMALL.dim, dtype=torch.float64), cov).log_prob(z)
    lik = torch.distributions.Bernoulli(logits=z @ data["X"].T).log_prob(data["y"]).sum(-1)
    torch.testing.assert_close(ours, prior + lik)
    torch.testing.assert_close(big.log_density(data, z[0]), ours[0])  # a single point (D,)


def test_data_are_deterministic_and_sized():
    a, b = big.make_data(SMALL), big.make_data(SMALL)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["X"].shape == (60, 20) and a["cov_factor"].shape == (20, 2) and set(a["y"].unique().tolist()) <= {0, 1}
    assert not torch.equal(big.make_data(big.BigLogisticConfig(dim=20, num_rows=60, rank=2, seed=4))["X"], a["X"])
    with pytest.raises(ValueError, match="BigLogisticConfig: dim must be a positive integer, got 0"):
        big.BigLogisticConfig(dim=0)
    with pytest.raises(ValueError, match="BigLogisticConfig: prior_scale must be a positive number, got -1.0"):
        big.BigLogisticConfig(prior_scale=-1.0)


@pytest.fixture(scope="module")
def small_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("big_ref")
    diag = big.make_reference(folder, SMALL, num_warmup=300, num_samples=1200, thin=2, num_steps=8,
                              dtype=torch.float64, log=lambda msg: None)
    return folder, diag


@pytest.mark.slow
def test_make_reference_writes_converged_draws_and_the_score_identity_holds(small_reference):
    folder, diag = small_reference
    assert diag["converged"] and diag["rhat_max"] <= 1.01 and diag["ess_bulk_min"] > 400
    payload = torch.load(big.reference_path(folder), weights_only=True)
    assert payload["draws"].shape == (4 * 600, SMALL.dim) and payload["draws"].dtype == torch.float32
    post = big.load_big_logistic(folder, SMALL)
    assert post.name == "big_logistic" and post.dim == SMALL.dim and post.reference.dtype == torch.float64
    # the score identity: E_p[grad log p] = 0, within 5 Monte Carlo standard errors per coordinate
    z = post.reference.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(post.log_density(z).sum(), z)
    se = grad.std(0) / math.sqrt(diag["ess_bulk_min"])
    assert (grad.mean(0).abs() < 5 * se).all()
    ident = big.score_identity(post.log_density, post.reference, diag["ess_bulk_min"])
    assert ident["max_abs_z"] == pytest.approx(float((grad.mean(0) / se).abs().max()))
    assert diag["score_identity"]["max_abs_z"] < 5
    # draws shifted off the posterior break the identity
    assert big.score_identity(post.log_density, post.reference + 0.5)["max_abs_z"] > 10
    # and E_p[z grad log p^T] = -I (integration by parts), loosely
    cross = z.detach().T @ grad / z.shape[0]
    assert (cross + torch.eye(SMALL.dim, dtype=torch.float64)).abs().max() < 0.35


@pytest.mark.slow
def test_reference_agrees_with_pyros_nuts(small_reference):
    """The batched HMC's posterior mean against Pyro's NUTS on the same small model."""
    import pyro
    from pyro.infer import MCMC, NUTS

    folder, diag = small_reference
    post = big.load_big_logistic(folder, SMALL)
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(post.model), num_samples=800, warmup_steps=300, disable_progbar=True)
    mcmc.run()
    w = mcmc.get_samples()["w"].double()
    sd = post.reference.std(0)
    se = sd * math.sqrt(1 / diag["ess_bulk_min"] + 1 / 400)
    assert ((w.mean(0) - post.reference.mean(0)).abs() < 5 * se).all()
    ratio = w.std(0) / sd
    assert ((ratio > 0.8) & (ratio < 1.2)).all()


def _fake_reference(folder, converged=True):
    """A reference file of SMALL's shape without running HMC (for the loader's checks)."""
    from dataclasses import asdict

    draws = torch.randn(8, SMALL.dim, generator=torch.Generator().manual_seed(0))
    torch.save({"draws": draws, "config": asdict(SMALL), "sampler": {},
                "diagnostics": {"converged": converged, "rhat_max": 1.0 if converged else 1.2}},
               big.reference_path(folder))
    return draws


def test_load_errors_name_the_command(tmp_path, monkeypatch):
    monkeypatch.delenv("PYRO_FA_POSTERIORDB", raising=False)
    with pytest.raises(FileNotFoundError, match=r"load_big_logistic: data_dir must be a folder holding "
                                                r"big_logistic_reference.pt .*--make-reference FOLDER"):
        big.load_big_logistic(tmp_path)
    with pytest.raises(FileNotFoundError, match="got None"):
        big.load_big_logistic()
    folder = tmp_path / "ok"
    folder.mkdir()
    draws = _fake_reference(folder)
    monkeypatch.setenv("PYRO_FA_POSTERIORDB", str(folder))
    post = big.load_big_logistic(config=SMALL)  # found through the environment
    assert post.dim == SMALL.dim and torch.equal(post.reference, draws.double())
    with pytest.raises(ValueError, match="load_big_logistic: the reference's config must be"):
        big.load_big_logistic(folder)  # the default (D = 5000) config
    _fake_reference(tmp_path, converged=False)
    with pytest.raises(ValueError, match=r"load_big_logistic: the reference's largest R-hat must be <= 1.01, got 1.2"):
        big.load_big_logistic(tmp_path, SMALL)


def test_make_reference_warns_when_chains_have_not_mixed(tmp_path):
    with pytest.warns(RuntimeWarning, match="make_reference: the largest split R-hat is"):
        diag = big.make_reference(tmp_path, SMALL, num_warmup=5, num_samples=8, thin=1, num_steps=1,
                                  dtype=torch.float64, log=lambda msg: None)
    assert not diag["converged"]


def test_hmc_argument_errors():
    f = lambda z: -0.5 * (z * z).sum(-1)  # noqa: E731
    with pytest.raises(ValueError, match=r"hmc: init must be of shape \(chains, D\), got \(3,\)"):
        hmc(f, torch.zeros(3), num_warmup=1, num_samples=1, num_steps=1)
    with pytest.raises(ValueError, match="hmc: num_steps must be a positive integer, got 0"):
        hmc(f, torch.zeros(2, 3), num_warmup=1, num_samples=1, num_steps=0)
    with pytest.raises(ValueError, match="hmc: target_accept must be in \\(0, 1\\), got 1.5"):
        hmc(f, torch.zeros(2, 3), num_warmup=1, num_samples=1, num_steps=1, target_accept=1.5)


def test_registered_as_a_standin(monkeypatch):
    from pyro_fa.experiments.posteriordb.command import load
    from pyro_fa.experiments.posteriordb.standins import STANDINS

    assert "big_logistic" in STANDINS
    monkeypatch.delenv("PYRO_FA_POSTERIORDB", raising=False)
    with pytest.raises(SystemExit, match="big_logistic_reference.pt"):
        load("big_logistic", None)
