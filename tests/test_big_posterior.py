"""The ``big_logistic`` posterior (D = 5000 by default) and its reference draws (by pyro_fa.infer.hmc, whose
own tests are tests/test_hmc.py), checked on small instances: the log density against Pyro's trace and a dense
Gaussian, the score identity on the HMC draws, the draws against Pyro's NUTS, the reference file's round trip
and every error."""
import math

import pytest
import torch

from pyro_fa.experiments.posteriordb import big

SMALL = big.BigLogisticConfig(dim=20, num_rows=60, rank=2, factor_scale=2.0, seed=3)


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
    diag = big.make_reference(folder, SMALL, num_warmup=300, num_samples=600, thin=2, num_steps=8,
                              dtype=torch.float64, log=lambda msg: None)
    return folder, diag


@pytest.mark.slow
def test_make_reference_writes_converged_draws_and_the_score_identity_holds(small_reference):
    folder, diag = small_reference
    assert diag["converged"] and diag["rhat_max"] <= 1.01 and diag["ess_bulk_min"] > 400
    payload = torch.load(big.reference_path(folder), weights_only=True)
    assert payload["draws"].shape == (4 * 600, SMALL.dim) and payload["draws"].dtype == torch.float32
    assert diag["num_draws"] == 4 * 600 and diag["grad_evals"] > 1 + (300 + 600 * 2) * 8
    assert diag["ess_tail_min"] > 200 and diag["divergences"] == 0
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
    assert {"rhat_max", "ess_bulk_min", "ess_bulk_median", "ess_tail_min", "num_draws", "seconds", "step_size",
            "accept_rate", "grad_evals", "divergences", "score_identity"} <= set(diag)
    assert diag["num_draws"] == 4 * 8 and len(diag["step_size"]) == 4 and diag["grad_evals"] > 1 + 13 * 1
    payload = torch.load(big.reference_path(tmp_path), weights_only=True)
    assert payload["draws"].shape == (4 * 8, SMALL.dim) and payload["diagnostics"] == diag
    assert payload["sampler"]["num_samples"] == 8 and payload["sampler"]["thin"] == 1


def test_registered_as_a_standin(monkeypatch):
    from pyro_fa.experiments.posteriordb.command import load
    from pyro_fa.experiments.posteriordb.standins import STANDINS

    assert "big_logistic" in STANDINS
    monkeypatch.delenv("PYRO_FA_POSTERIORDB", raising=False)
    with pytest.raises(SystemExit, match="big_logistic_reference.pt"):
        load("big_logistic", None)
