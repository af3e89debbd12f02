"""Pyro ports of the posteriordb posteriors defined by ordinary differential equations: the
Lotka-Volterra predator-prey model and the one-compartment Michaelis-Menten pharmacokinetic model.

The ODEs are solved with torchdiffeq's adaptive Dormand-Prince (dopri5) solver, differentiated
through the solver's steps, with tolerances tighter than the Stan programs' (Stan: rk45 at
relative 1e-5 and absolute 1e-3, and BDF): the ports' log densities are then smooth enough for the
score and Stein identities. Without torchdiffeq (the ``dev`` extra) these posteriors are left out.
"""
import torch

import pyro
import pyro.distributions as dist
from pyro.distributions import constraints

from pyro_fa.experiments.posteriordb.ports import LEFT_OUT, col, flat, register_port, tensor

__all__ = []

RTOL, ATOL = 1e-8, 1e-10
MAX_STEPS = 20_000
"""The solver's step budget: at extreme parameter values (an optimizer's trial point far in the tails)
the equations turn stiff, and the solve raises (an AssertionError from torchdiffeq) instead of hanging."""

try:
    from torchdiffeq import odeint
except ImportError:  # pragma: no cover - exercised only without the dev extra
    odeint = None
    for _name in ("hudson_lynx_hare-lotka_volterra", "one_comp_mm_elim_abs-one_comp_mm_elim_abs"):
        LEFT_OUT[_name] = "an ODE model: needs torchdiffeq (pip install torchdiffeq), which is not installed"


def _positive_normal_prior(name, value, loc, scale):
    """A normal prior on a positive parameter, unnormalised by the truncation (as Stan's ``~``)."""
    pyro.factor(f"{name}_prior", dist.Normal(loc, scale).log_prob(value).sum(-1))


if odeint is not None:

    @register_port("hudson_lynx_hare-lotka_volterra")
    def lotka_volterra(data):
        ts, y_init, y = tensor(data["ts"]), tensor(data["y_init"]), tensor(data["y"])  # y: (N, 2)
        times = torch.cat([ts.new_zeros(1), ts])

        def model():
            theta = pyro.sample("theta", flat(constraints.positive, 4))
            z_init = pyro.sample("z_init", dist.LogNormal(torch.log(tensor(10.0)), 1.0).expand([2]).to_event(1))
            sigma = pyro.sample("sigma", dist.LogNormal(tensor(-1.0), 1.0).expand([2]).to_event(1))
            _positive_normal_prior("theta", theta, tensor([1.0, 0.05, 1.0, 0.05]), tensor([0.5, 0.05, 0.5, 0.05]))
            alpha, beta, gamma, delta = (theta[..., i] for i in range(4))

            def dz_dt(t, z):
                u, v = z[..., 0], z[..., 1]
                return torch.stack([(alpha - beta * v) * u, (-gamma + delta * u) * v], -1)

            z = odeint(dz_dt, z_init, times, rtol=RTOL, atol=ATOL, method="dopri5",
                       options={"max_num_steps": MAX_STEPS})[1:]  # (N, ..., 2)
            z = pyro.deterministic("z", z.movedim(0, -2), event_dim=2)
            pyro.sample("y_init", dist.LogNormal(torch.log(z_init), sigma).to_event(1), obs=y_init)
            pyro.sample("y", dist.LogNormal(torch.log(z), sigma.unsqueeze(-2)).to_event(2), obs=y)

        return model

    @register_port("one_comp_mm_elim_abs-one_comp_mm_elim_abs")
    def one_comp_mm_elim_abs(data):
        t0, D, V = float(data["t0"]), tensor(data["D"]), tensor(data["V"])
        times, C_hat = tensor(data["times"]), tensor(data["C_hat"])
        grid = torch.cat([times.new_full((1,), t0), times])

        def model():
            k_a = pyro.sample("k_a", dist.HalfCauchy(tensor(1.0)))
            K_m = pyro.sample("K_m", dist.HalfCauchy(tensor(1.0)))
            V_m = pyro.sample("V_m", dist.HalfCauchy(tensor(1.0)))
            sigma = pyro.sample("sigma", dist.HalfCauchy(tensor(1.0)))

            def dC_dt(t, C):
                dose = torch.where(t > 0, torch.exp(-col(k_a) * t) * D * col(k_a) / V, torch.zeros_like(C))
                return dose - (col(V_m) / V) * C / (col(K_m) + C)

            C = odeint(dC_dt, torch.zeros(k_a.shape + (1,), dtype=torch.float64), grid,
                       rtol=RTOL, atol=ATOL, method="dopri5", options={"max_num_steps": MAX_STEPS})[1:, ..., 0]
            C = pyro.deterministic("C", C.movedim(0, -1), event_dim=1)
            pyro.sample("C_hat", dist.LogNormal(torch.log(C), col(sigma)).to_event(1), obs=C_hat)

        return model
