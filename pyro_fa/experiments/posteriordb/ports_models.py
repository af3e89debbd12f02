"""Pyro ports of the posteriordb posteriors that are not plain linear regressions: the hierarchical
eight schools, brms's diamonds, the time series (AR(K), ARMA(1, 1), GARCH(1, 1)), the Gaussian
processes, the two-component mixture and the hidden Markov models (discrete states summed out by
the forward algorithm, as the Stan programs do). See :mod:`.ports` for the conventions.
"""
import torch

import pyro
import pyro.distributions as dist
from pyro.distributions import constraints

from pyro_fa.experiments.posteriordb.ports import col, flat, register_port, tensor

__all__ = []


def linear_recurrence(a, b):
    """``x[..., t] = a * x[..., t - 1] + b[..., t]`` with ``x[..., 0] = b[..., 0]``, for every ``t`` of
    ``b``'s last dimension, by recursive doubling (Hillis & Steele, *Data parallel algorithms*, 1986):
    after the step of span ``s``, ``x[t]`` holds ``sum_{k < 2s} a^k b[t - k]``. ``a`` has ``b``'s batch
    shape. The same sums as the loop, in ``ceil(log2 T)`` vector steps, so a traced model stays small.
    """
    x, power, span = b, a[..., None], 1
    while span < b.shape[-1]:
        x = torch.cat([x[..., :span], x[..., span:] + power * x[..., :-span]], -1)
        power, span = power * power, 2 * span
    return x


@register_port("eight_schools-eight_schools_noncentered")
def eight_schools_noncentered(data):
    y, sigma = tensor(data["y"]), tensor(data["sigma"])
    J = y.shape[0]

    def model():
        theta_trans = pyro.sample("theta_trans", dist.Normal(tensor(0.0), 1.0).expand([J]).to_event(1))
        mu = pyro.sample("mu", dist.Normal(tensor(0.0), 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(tensor(5.0)))
        theta = pyro.deterministic("theta", theta_trans * col(tau) + col(mu), event_dim=1)
        pyro.sample("y", dist.Normal(theta, sigma).to_event(1), obs=y)

    def from_stan(p):  # the reference holds the transformed theta, not theta_trans
        return {"theta_trans": (p["theta"] - col(p["mu"])) / col(p["tau"]), "mu": p["mu"], "tau": p["tau"]}

    model.from_stan = from_stan
    return model


@register_port("diamonds-diamonds")
def diamonds(data):
    Y, X = tensor(data["Y"]), tensor(data["X"])
    Xc = X[:, 1:] - X[:, 1:].mean(0)
    Kc = Xc.shape[1]
    # student_t(3, 0, 10) on (0, inf), normalised by Stan's lccdf(0): the folded Student t
    sigma_prior = dist.FoldedDistribution(dist.StudentT(tensor(3.0), tensor(0.0), tensor(10.0)))

    def model():
        b = pyro.sample("b", dist.Normal(tensor(0.0), 1.0).expand([Kc]).to_event(1))
        intercept = pyro.sample("Intercept", dist.StudentT(tensor(3.0), tensor(8.0), tensor(10.0)))
        sigma = pyro.sample("sigma", sigma_prior)
        pyro.sample("Y", dist.Normal(col(intercept) + b @ Xc.T, col(sigma)).to_event(1), obs=Y)

    return model


@register_port("arK-arK")
def arK(data):
    K, y = int(data["K"]), tensor(data["y"])
    T = y.shape[0]
    lags = torch.stack([y[K - k:T - k] for k in range(1, K + 1)], dim=-1)  # (T - K, K): y[t - k]

    def model():
        alpha = pyro.sample("alpha", dist.Normal(tensor(0.0), 10.0))
        beta = pyro.sample("beta", dist.Normal(tensor(0.0), 10.0).expand([K]).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfCauchy(tensor(2.5)))
        pyro.sample("y", dist.Normal(col(alpha) + beta @ lags.T, col(sigma)).to_event(1), obs=y[K:])

    return model


@register_port("arma-arma11")
def arma11(data):
    y = tensor(data["y"])
    T = y.shape[0]

    def model():
        mu = pyro.sample("mu", dist.Normal(tensor(0.0), 10.0))
        phi = pyro.sample("phi", dist.Normal(tensor(0.0), 2.0))
        theta = pyro.sample("theta", dist.Normal(tensor(0.0), 2.0))
        sigma = pyro.sample("sigma", dist.HalfCauchy(tensor(2.5)))
        # Stan's loop, err[t] = y[t] - mu - phi * y[t - 1] - theta * err[t - 1] (with mu for y[0]'s
        # predecessor), is a linear recurrence in err: solved in log2(T) vector steps rather than T
        # scalar ones (a JIT trace of the unrolled loop took minutes), then nu = y - err as Stan has it
        y_before = torch.cat([col(mu), y[:-1].expand(mu.shape + (T - 1,))], -1)
        err = linear_recurrence(-theta, y - col(mu) - col(phi) * y_before)
        nu = y - err
        pyro.sample("y", dist.Normal(nu, col(sigma)).to_event(1), obs=y)

    return model


@register_port("garch-garch11")
def garch11(data):
    y, sigma1 = tensor(data["y"]), tensor(data["sigma1"])
    T = y.shape[0]

    def model():
        mu = pyro.sample("mu", flat())
        alpha0 = pyro.sample("alpha0", flat(constraints.positive))
        alpha1 = pyro.sample("alpha1", flat(constraints.unit_interval))
        # beta1 is flat on (0, 1 - alpha1), a bound that depends on alpha1, which an AutoContinuous
        # guide's fixed supports cannot hold: sample beta1 / (1 - alpha1) on (0, 1) instead, with
        # the Jacobian of beta1 = (1 - alpha1) * beta1_unit
        beta1_unit = pyro.sample("beta1_unit", flat(constraints.unit_interval))
        pyro.factor("beta1_jacobian", torch.log1p(-alpha1))
        beta1 = pyro.deterministic("beta1", (1 - alpha1) * beta1_unit)
        # sigma[t]^2 = alpha0 + alpha1 * (y[t - 1] - mu)^2 + beta1 * sigma[t - 1]^2 is linear in sigma^2
        shocks = col(alpha0) + col(alpha1) * (y[:-1] - col(mu)) ** 2
        sigma = linear_recurrence(beta1, torch.cat([sigma1.expand(mu.shape)[..., None] ** 2, shocks], -1)).sqrt()
        pyro.sample("y", dist.Normal(col(mu), sigma).to_event(1), obs=y)

    def from_stan(p):
        return {"mu": p["mu"], "alpha0": p["alpha0"], "alpha1": p["alpha1"],
                "beta1_unit": p["beta1"] / (1 - p["alpha1"])}

    model.from_stan = from_stan
    return model


def _exp_quad(x, alpha, rho):
    """Stan's ``gp_exp_quad_cov(x, alpha, rho)`` with a batch of (alpha, rho)."""
    d2 = (x[:, None] - x[None, :]) ** 2
    return alpha[..., None, None] ** 2 * torch.exp(-d2 / (2 * rho[..., None, None] ** 2))


@register_port("gp_pois_regr-gp_regr")
def gp_regr(data):
    x, y = tensor(data["x"]), tensor(data["y"])
    N = x.shape[0]

    def model():
        rho = pyro.sample("rho", dist.Gamma(tensor(25.0), tensor(4.0)))
        alpha = pyro.sample("alpha", dist.HalfNormal(tensor(2.0)))
        sigma = pyro.sample("sigma", dist.HalfNormal(tensor(1.0)))
        # Stan's program adds sigma (not sigma^2) to the diagonal
        cov = _exp_quad(x, alpha, rho) + sigma[..., None, None] * torch.eye(N, dtype=x.dtype)
        L = torch.linalg.cholesky(cov)
        pyro.sample("y", dist.MultivariateNormal(torch.zeros_like(y), scale_tril=L), obs=y)

    return model


@register_port("gp_pois_regr-gp_pois_regr")
def gp_pois_regr(data):
    x, k = tensor(data["x"]), tensor(data["k"])
    N = x.shape[0]
    jitter = 1e-10 * torch.eye(N, dtype=x.dtype)

    def model():
        rho = pyro.sample("rho", dist.Gamma(tensor(25.0), tensor(4.0)))
        alpha = pyro.sample("alpha", dist.HalfNormal(tensor(2.0)))
        f_tilde = pyro.sample("f_tilde", dist.Normal(tensor(0.0), 1.0).expand([N]).to_event(1))
        L = torch.linalg.cholesky(_exp_quad(x, alpha, rho) + jitter)
        f = pyro.deterministic("f", (L @ f_tilde.unsqueeze(-1)).squeeze(-1), event_dim=1)
        pyro.sample("k", dist.Poisson(torch.exp(f)).to_event(1), obs=k)

    def from_stan(p):  # the reference holds f = L f_tilde
        L = torch.linalg.cholesky(_exp_quad(x, p["alpha"], p["rho"]) + jitter)
        f_tilde = torch.linalg.solve_triangular(L, p["f"].unsqueeze(-1), upper=False).squeeze(-1)
        return {"rho": p["rho"], "alpha": p["alpha"], "f_tilde": f_tilde}

    model.from_stan = from_stan
    return model


@register_port("low_dim_gauss_mix-low_dim_gauss_mix")
def low_dim_gauss_mix(data):
    y = tensor(data["y"])

    def model():
        mu = pyro.sample("mu", flat(constraints.ordered_vector, 2))
        pyro.factor("mu_prior", dist.Normal(tensor(0.0), 2.0).log_prob(mu).sum(-1))
        sigma = pyro.sample("sigma", dist.HalfNormal(tensor(2.0)).expand([2]).to_event(1))
        theta = pyro.sample("theta", dist.Beta(tensor(5.0), tensor(5.0)))
        a = torch.log(col(theta)) + dist.Normal(mu[..., :1], sigma[..., :1]).log_prob(y)
        b = torch.log1p(-col(theta)) + dist.Normal(mu[..., 1:], sigma[..., 1:]).log_prob(y)
        pyro.factor("y", torch.logaddexp(a, b).sum(-1))

    return model


def _forward(log_emission, log_transition):
    """The HMM forward algorithm as in the Stan programs (no initial distribution): ``log_emission``
    ``(..., N, K)``, ``log_transition`` ``(..., K, K)`` (row j: from state j) -> the log likelihood.

    Stan's loop ``gamma[t] = logsumexp(gamma[t - 1] + log_transition) + log_emission[t]`` is a product of
    the matrices ``log_transition + log_emission[t]`` in the (logsumexp, +) semiring, taken here by pairwise
    reduction over time (as Pyro's ``DiscreteHMM`` does) in ``ceil(log2 N)`` vector steps, not N scalar ones.
    """
    steps = log_transition.unsqueeze(-3) + log_emission[..., 1:, None, :]  # (..., N - 1, K, K)
    while steps.shape[-3] > 1:
        odd = steps[..., -1:, :, :] if steps.shape[-3] % 2 else None
        pairs = steps[..., :steps.shape[-3] // 2 * 2, :, :]
        steps = torch.logsumexp(pairs[..., 0::2, :, :, None] + pairs[..., 1::2, None, :, :], dim=-2)
        if odd is not None:
            steps = torch.cat([steps, odd], dim=-3)
    gamma = log_emission[..., 0, :]
    if steps.shape[-3]:
        gamma = torch.logsumexp(gamma.unsqueeze(-1) + steps[..., 0, :, :], dim=-2)
    return torch.logsumexp(gamma, dim=-1)


def _normal_priors(name, value, means):
    pyro.factor(f"{name}_prior", dist.Normal(tensor(means), 1.0).log_prob(value).sum(-1))


@register_port("hmm_example-hmm_example")
def hmm_example(data):
    y, K = tensor(data["y"]), int(data["K"])

    def model():
        theta1 = pyro.sample("theta1", flat(constraints.simplex, K))
        theta2 = pyro.sample("theta2", flat(constraints.simplex, K))
        mu = pyro.sample("mu", flat(constraints.positive_ordered_vector, K))
        _normal_priors("mu", mu, [3.0, 10.0])
        log_emission = dist.Normal(mu.unsqueeze(-2), 1.0).log_prob(y[:, None])
        pyro.factor("y", _forward(log_emission, torch.log(torch.stack([theta1, theta2], -2))))

    return model


def _hmm_drive(data, normal):
    u, v, K = tensor(data["u"]), tensor(data["v"]), int(data["K"])
    alpha = tensor(data["alpha"])
    support = constraints.ordered_vector if normal else constraints.positive_ordered_vector

    def model():
        theta1 = pyro.sample("theta1", dist.Dirichlet(alpha[0]))
        theta2 = pyro.sample("theta2", dist.Dirichlet(alpha[1]))
        phi = pyro.sample("phi", flat(support, K))
        lam = pyro.sample("lambda", flat(support, K))
        _normal_priors("phi", phi, [0.0, 3.0])
        _normal_priors("lambda", lam, [0.0, 3.0])
        if normal:
            log_emission = (dist.Normal(phi.unsqueeze(-2), tensor(data["tau"])).log_prob(u[:, None])
                            + dist.Normal(lam.unsqueeze(-2), tensor(data["rho"])).log_prob(v[:, None]))
        else:
            log_emission = (torch.log(phi).unsqueeze(-2) - phi.unsqueeze(-2) * u[:, None]
                            + torch.log(lam).unsqueeze(-2) - lam.unsqueeze(-2) * v[:, None])
        pyro.factor("uv", _forward(log_emission, torch.log(torch.stack([theta1, theta2], -2))))

    return model


@register_port("bball_drive_event_0-hmm_drive_0")
def hmm_drive_0(data):
    return _hmm_drive(data, normal=False)


@register_port("bball_drive_event_1-hmm_drive_1")
def hmm_drive_1(data):
    return _hmm_drive(data, normal=True)
