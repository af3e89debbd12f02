"""Small posteriors with the fields of a posteriordb port, for the tests and ``pyro-fa posteriordb --quick``
when no port is installed: ``name``, ``model``, ``dim``, ``reference`` (N, D) and ``log_density(z)``.

* ``gaussian_linreg``: a Bayesian linear regression (known noise, Gaussian prior, two near-collinear
  features) whose posterior is Gaussian: its reference draws are exact;
* ``logistic_regression``: a Bayesian logistic regression whose reference draws come from NUTS (slow);
* ``big_logistic``: a Bayesian logistic regression with D = 5000 coefficients
  (:mod:`pyro_fa.experiments.posteriordb.big`), whose HMC reference draws are read from the data folder.
"""
from __future__ import annotations


import torch

from pyro_fa.experiments.posteriordb.standin_base import StandInPosterior

STANDINS = ("gaussian_linreg", "logistic_regression", "big_logistic")


def _linreg_data(N=40, D=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    X[:, 1] = X[:, 0] + 0.2 * X[:, 1]
    w = torch.randn(D, generator=g, dtype=torch.float64)
    return X, X @ w + 0.5 * torch.randn(N, generator=g, dtype=torch.float64)


def gaussian_linreg(num_reference: int = 10000) -> StandInPosterior:
    import pyro
    import pyro.distributions as dist

    X, y = _linreg_data()
    D, sigma = X.shape[1], 0.5

    def model():
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(X @ w, sigma).to_event(1), obs=y)

    prec = X.T @ X / sigma ** 2 + torch.eye(D, dtype=X.dtype)
    cov = torch.linalg.inv(prec)
    mean = cov @ X.T @ y / sigma ** 2
    exact = torch.distributions.MultivariateNormal(mean, covariance_matrix=cov)

    def log_density(z):
        lik = torch.distributions.Normal(z @ X.T, sigma).log_prob(y).sum(-1)
        return lik + torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)

    with torch.random.fork_rng():
        torch.manual_seed(0)
        ref = exact.sample((num_reference,))
    post = StandInPosterior("gaussian_linreg", model, D, ref, log_density)
    post.exact = exact
    return post


def logistic_regression(num_reference: int = 2000) -> StandInPosterior:
    import pyro
    import pyro.distributions as dist
    from pyro.infer import MCMC, NUTS

    g = torch.Generator().manual_seed(1)
    N, D = 100, 4
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)), generator=g)

    def model():
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
        pyro.sample("y", dist.Bernoulli(logits=X @ w).to_event(1), obs=y)

    def log_density(z):
        lik = torch.distributions.Bernoulli(logits=z @ X.T).log_prob(y).sum(-1)
        return lik + torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)

    with torch.random.fork_rng():
        pyro.set_rng_seed(0)
        mcmc = MCMC(NUTS(model), num_samples=num_reference, warmup_steps=500, disable_progbar=True)
        mcmc.run()
    return StandInPosterior("logistic_regression", model, D, mcmc.get_samples()["w"].double(), log_density)


def _load_big_logistic(data_dir=None):
    from pyro_fa.experiments.posteriordb.big import load_big_logistic

    return load_big_logistic(data_dir)


#: stand-in name -> its loader, called with the data folder (``None``: the loader's default)
_LOADERS = {"gaussian_linreg": lambda data_dir=None: gaussian_linreg(),
            "logistic_regression": lambda data_dir=None: logistic_regression(),
            "big_logistic": _load_big_logistic}


def load_standin(name: str, data_dir=None) -> StandInPosterior:
    """The stand-in posterior ``name`` (one of :data:`STANDINS`); ``data_dir`` is the folder of those whose
    reference draws are made apart (``big_logistic``).

    Raises
    ------
    KeyError
        If ``name`` is not a stand-in.
    """
    if name not in STANDINS:
        raise KeyError(f"load_standin: name must be one of {list(STANDINS)}, got {name!r}.")
    return _LOADERS[name](data_dir)
