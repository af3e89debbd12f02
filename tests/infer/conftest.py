import math
from types import SimpleNamespace

import pyro
import pyro.distributions as dist
import pytest
import torch


def make_linreg(N=60, D=3, alpha=0.5, beta=4.0, seed=0):
    """Bayesian linear regression with its exact posterior and log evidence (Brownlie (2021) eq. 2.13)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w_true = torch.randn(D, generator=g, dtype=torch.float64)
    y = X @ w_true + torch.randn(N, generator=g, dtype=torch.float64) / math.sqrt(beta)

    def model(X, y=None, subsample_size=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[-1], dtype=X.dtype), alpha ** -0.5).to_event(1))
        with pyro.plate("data", X.shape[0], subsample_size=subsample_size) as idx:
            obs = None if y is None else y[idx]
            return pyro.sample("y", dist.Normal((w * X[idx]).sum(-1), beta ** -0.5), obs=obs)

    A = alpha * torch.eye(D, dtype=X.dtype) + beta * X.T @ X
    S = torch.linalg.inv(A)
    m = beta * S @ X.T @ y
    evidence_cov = torch.eye(N, dtype=X.dtype) / beta + X @ X.T / alpha
    log_evidence = dist.MultivariateNormal(torch.zeros(N, dtype=X.dtype), evidence_cov).log_prob(y)

    def analytic_elbo(loc, cov):
        """E_q[log p(y, w)] + H[q] for q = N(loc, cov), dense."""
        resid = y - X @ loc
        quad = (X @ cov * X).sum(-1)
        lik = (-0.5 * math.log(2 * math.pi / beta) - 0.5 * beta * (resid.pow(2) + quad)).sum()
        prior = (0.5 * math.log(alpha / (2 * math.pi)) - 0.5 * alpha * (loc.pow(2) + cov.diagonal())).sum()
        entropy = dist.MultivariateNormal(loc, cov).entropy()
        return lik + prior + entropy

    return SimpleNamespace(
        X=X, y=y, model=model, S=S, m=m, log_evidence=log_evidence, analytic_elbo=analytic_elbo, alpha=alpha, beta=beta
    )


@pytest.fixture
def linreg():
    return make_linreg()
