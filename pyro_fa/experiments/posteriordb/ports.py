"""Pyro ports of the posteriordb posteriors: the registry and the linear regressions.

Each port is a function ``port(data) -> model``: ``data`` is the dictionary the Stan program reads
(posteriordb's ``data/NAME.json``), and ``model`` a zero-argument Pyro model faithful to the Stan
program: the same priors (Stan's implicit improper flat prior is ``dist.ImproperUniform`` with the
parameter's constraint), the constraints as the sites' supports, the transformed parameters as
``pyro.deterministic`` sites, and the sampled parameters under the Stan program's names, vectors as
one site with ``.to_event(1)``. Normalising constants that Stan keeps or drops (a half-normal's
``log 2``, a Dirichlet's ``log Gamma(K)``) can differ; they do not move the posterior.

The models are written to broadcast over a leading batch of parameter values (a scalar parameter
is used as ``x[..., None]``), so that :func:`pyro_fa.experiments.posteriordb.loader.load_posterior`
evaluates the log density of many draws at once by conditioning the model on batched values.

A model may carry ``model.from_stan``: a function from the Stan program's parameters (a dict of
tensors with a leading batch dimension, ``"beta"`` of shape ``(n, 4)``) to the values of the
model's latent sites, used where a Pyro site is not a Stan parameter (a non-centred parameter the
reference draws hold only in its centred, transformed form).
"""
import torch

import pyro
import pyro.distributions as dist
from pyro.distributions import constraints

__all__ = ["PORTS", "LEFT_OUT", "register_port", "flat", "col"]

PORTS = {}
"""The ports by posterior name (``"eight_schools-eight_schools_noncentered"``)."""

LEFT_OUT = {}
"""Posteriors of the database that have no port, with the reason."""


def register_port(*names):
    """Register a port under one or more posterior names (a decorator).

    Parameters
    ----------
    *names : str
        posteriordb posterior names (``"MODEL_DATA-MODEL"``) that the port serves.
    """
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"register_port: names must be non-empty strings, got {names!r}.")

    def decorate(port):
        for name in names:
            PORTS[name] = port
            LEFT_OUT.pop(name, None)
        return port

    return decorate


def tensor(x):
    """The data as a float64 tensor."""
    return torch.as_tensor(x, dtype=torch.float64)


def col(x):
    """A parameter with a trailing axis, to broadcast against the data (``x[..., None]``)."""
    return x.unsqueeze(-1)


def flat(support=constraints.real, size=None):
    """Stan's implicit improper flat prior on ``support``: a scalar, or a vector of ``size``."""
    event_shape = () if size is None else (size,)
    return dist.ImproperUniform(support, (), event_shape)


def linear_regression(y, X, beta_prior=None, sigma_prior=None):
    """The Stan program ``y ~ normal(X * beta, sigma)`` (``beta[1]`` the intercept when X has a
    column of ones): ``beta`` flat or ``beta_prior``, ``sigma`` flat on (0, inf) or
    ``sigma_prior``."""
    y, X = tensor(y), tensor(X)
    K = X.shape[1]

    def model():
        beta = pyro.sample("beta", beta_prior if beta_prior is not None else flat(size=K))
        sigma = pyro.sample("sigma", sigma_prior if sigma_prior is not None else flat(constraints.positive))
        mean = beta @ X.T
        pyro.sample("y", dist.Normal(mean, col(sigma)).to_event(1), obs=y)

    return model


def design(*columns):
    """The design matrix: a column of ones and the given columns."""
    columns = [tensor(c) for c in columns]
    return torch.stack([torch.ones_like(columns[0])] + columns, dim=-1)


# ---- earnings -----------------------------------------------------------------------------------

@register_port("earnings-earn_height")
def earn_height(data):
    return linear_regression(data["earn"], design(data["height"]))


@register_port("earnings-log10earn_height")
def log10earn_height(data):
    return linear_regression(torch.log10(tensor(data["earn"])), design(data["height"]))


@register_port("earnings-logearn_height")
def logearn_height(data):
    return linear_regression(torch.log(tensor(data["earn"])), design(data["height"]))


@register_port("earnings-logearn_height_male")
def logearn_height_male(data):
    return linear_regression(torch.log(tensor(data["earn"])), design(data["height"], data["male"]))


@register_port("earnings-logearn_interaction")
def logearn_interaction(data):
    height, male = tensor(data["height"]), tensor(data["male"])
    return linear_regression(torch.log(tensor(data["earn"])), design(height, male, height * male))


@register_port("earnings-logearn_interaction_z")
def logearn_interaction_z(data):
    height, male = tensor(data["height"]), tensor(data["male"])
    z = (height - height.mean()) / height.std()  # Stan's sd: the N - 1 divisor, as torch's
    return linear_regression(torch.log(tensor(data["earn"])), design(z, male, z * male))


@register_port("earnings-logearn_logheight_male")
def logearn_logheight_male(data):
    return linear_regression(torch.log(tensor(data["earn"])),
                             design(torch.log(tensor(data["height"])), data["male"]))


# ---- kidiq --------------------------------------------------------------------------------------

def _half_cauchy_sigma():
    return dist.HalfCauchy(tensor(2.5))


@register_port("kidiq-kidscore_momiq")
def kidscore_momiq(data):
    return linear_regression(data["kid_score"], design(data["mom_iq"]), sigma_prior=_half_cauchy_sigma())


@register_port("kidiq-kidscore_momhs")
def kidscore_momhs(data):
    return linear_regression(data["kid_score"], design(data["mom_hs"]), sigma_prior=_half_cauchy_sigma())


@register_port("kidiq-kidscore_momhsiq")
def kidscore_momhsiq(data):
    return linear_regression(data["kid_score"], design(data["mom_hs"], data["mom_iq"]),
                             sigma_prior=_half_cauchy_sigma())


@register_port("kidiq-kidscore_interaction")
def kidscore_interaction(data):
    hs, iq = tensor(data["mom_hs"]), tensor(data["mom_iq"])
    return linear_regression(data["kid_score"], design(hs, iq, hs * iq), sigma_prior=_half_cauchy_sigma())


@register_port("kidiq_with_mom_work-kidscore_interaction_c")
def kidscore_interaction_c(data):
    hs, iq = tensor(data["mom_hs"]), tensor(data["mom_iq"])
    hs, iq = hs - hs.mean(), iq - iq.mean()
    return linear_regression(data["kid_score"], design(hs, iq, hs * iq))


@register_port("kidiq_with_mom_work-kidscore_interaction_c2")
def kidscore_interaction_c2(data):
    hs, iq = tensor(data["mom_hs"]) - 0.5, tensor(data["mom_iq"]) - 100
    return linear_regression(data["kid_score"], design(hs, iq, hs * iq))


@register_port("kidiq_with_mom_work-kidscore_interaction_z")
def kidscore_interaction_z(data):
    hs, iq = tensor(data["mom_hs"]), tensor(data["mom_iq"])
    hs, iq = (hs - hs.mean()) / (2 * hs.std()), (iq - iq.mean()) / (2 * iq.std())
    return linear_regression(data["kid_score"], design(hs, iq, hs * iq))


@register_port("kidiq_with_mom_work-kidscore_mom_work")
def kidscore_mom_work(data):
    work = tensor(data["mom_work"])
    return linear_regression(data["kid_score"], design(work == 2, work == 3, work == 4))


# ---- mesquite -----------------------------------------------------------------------------------

@register_port("mesquite-mesquite")
def mesquite(data):
    d = {k: tensor(v) for k, v in data.items() if k != "N"}
    return linear_regression(d["weight"], design(d["diam1"], d["diam2"], d["canopy_height"],
                                                 d["total_height"], d["density"], d["group"]))


@register_port("mesquite-logmesquite")
def logmesquite(data):
    d = {k: tensor(v) for k, v in data.items() if k != "N"}
    lg = torch.log
    return linear_regression(lg(d["weight"]), design(lg(d["diam1"]), lg(d["diam2"]), lg(d["canopy_height"]),
                                                     lg(d["total_height"]), lg(d["density"]), d["group"]))


def _canopy(d):
    lg = torch.log
    return (lg(d["diam1"] * d["diam2"] * d["canopy_height"]), lg(d["diam1"] * d["diam2"]),
            lg(d["diam1"] / d["diam2"]))


@register_port("mesquite-logmesquite_logva")
def logmesquite_logva(data):
    d = {k: tensor(v) for k, v in data.items() if k != "N"}
    volume, area, _ = _canopy(d)
    return linear_regression(torch.log(d["weight"]), design(volume, area, d["group"]))


@register_port("mesquite-logmesquite_logvas")
def logmesquite_logvas(data):
    d = {k: tensor(v) for k, v in data.items() if k != "N"}
    volume, area, shape = _canopy(d)
    return linear_regression(torch.log(d["weight"]), design(volume, area, shape, torch.log(d["total_height"]),
                                                            torch.log(d["density"]), d["group"]))


@register_port("mesquite-logmesquite_logvash")
def logmesquite_logvash(data):
    d = {k: tensor(v) for k, v in data.items() if k != "N"}
    volume, area, shape = _canopy(d)
    return linear_regression(torch.log(d["weight"]), design(volume, area, shape, torch.log(d["total_height"]),
                                                            d["group"]))


@register_port("mesquite-logmesquite_logvolume")
def logmesquite_logvolume(data):
    d = {k: tensor(v) for k, v in data.items() if k != "N"}
    volume, _, _ = _canopy(d)
    return linear_regression(torch.log(d["weight"]), design(volume))


# ---- nes ----------------------------------------------------------------------------------------

@register_port(*[f"nes{year}-nes" for year in range(1972, 2001, 4)])
def nes(data):
    d = {k: tensor(v) for k, v in data.items() if k not in ("N", "year")}
    age = d["age_discrete"]
    return linear_regression(d["partyid7"], design(d["real_ideo"], d["race_adj"], age == 2, age == 3, age == 4,
                                                   d["educ1"], d["gender"], d["income"]))


# ---- kilpisjarvi, sblr --------------------------------------------------------------------------

@register_port("kilpisjarvi_mod-kilpisjarvi")
def kilpisjarvi(data):
    x, y = tensor(data["x"]), tensor(data["y"])
    alpha_prior = dist.Normal(tensor(data["pmualpha"]), tensor(data["psalpha"]))
    beta_prior = dist.Normal(tensor(data["pmubeta"]), tensor(data["psbeta"]))

    def model():
        alpha = pyro.sample("alpha", alpha_prior)
        beta = pyro.sample("beta", beta_prior)
        sigma = pyro.sample("sigma", flat(constraints.positive))
        pyro.sample("y", dist.Normal(col(alpha) + col(beta) * x, col(sigma)).to_event(1), obs=y)

    return model


@register_port("sblrc-blr", "sblri-blr")
def blr(data):
    X = tensor(data["X"])
    # sigma ~ normal(0, 10) on (0, inf): a half-normal up to Stan's dropped log 2
    return linear_regression(data["y"], X, beta_prior=dist.Normal(tensor(0.0), 10.0).expand([X.shape[1]]).to_event(1),
                             sigma_prior=dist.HalfNormal(tensor(10.0)))
