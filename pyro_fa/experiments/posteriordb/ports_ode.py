"""Pyro ports of the posteriordb posteriors defined by ordinary differential equations: the
Lotka-Volterra predator-prey model and the one-compartment Michaelis-Menten pharmacokinetic model.

The ODEs are solved by scipy's LSODA (``scipy.integrate.odeint``, which switches between Adams and BDF
as the equations turn stiff) together with their forward sensitivities, the derivatives of the solution
in the parameters and the initial state (Hindmarsh et al., *SUNDIALS*, 2005, section 3): a torch
autograd function whose backward pass is one product with those sensitivities. Tolerances are tighter
than the Stan programs' (Stan: rk45 at relative 1e-5 and absolute 1e-3, and BDF), so that the ports'
log densities are smooth enough for the score and Stein identities.

A differentiable torch solver (torchdiffeq's dopri5, differentiated through its steps) gives the same
solutions and gradients (the tests compare them) but costs a Python call per solver stage in the
forward and the backward pass: about 0.2 s per gradient on Lotka-Volterra against 0.005 s here, which
put a 2 000-step fit at minutes rather than seconds.
"""
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from scipy.integrate import odeint as _lsoda

import pyro
import pyro.distributions as dist
from pyro.distributions import constraints

from pyro_fa.experiments.posteriordb.ports import col, flat, register_port, tensor

__all__ = ["ODESystem", "solve_ode"]

RTOL, ATOL = 1e-8, 1e-10
MAX_STEPS = 20_000
"""The solver's step budget per output interval: at extreme parameter values (an optimizer's trial point far
in the tails) a solve that would not finish raises a RuntimeError instead of hanging."""


@dataclass(frozen=True)
class ODESystem:
    """``dz/dt = rhs(t, z, p)`` for one parameter vector ``p`` (a list of floats), in numpy: ``rhs`` returns
    ``(n,)``, ``jac_z`` the ``(n, n)`` Jacobian in ``z`` and ``jac_p`` the ``(n, P)`` Jacobian in ``p``.
    ``fast``, where given, is :meth:`augmented` written out by hand (the solver calls it about a thousand times
    per solve, so its few microseconds of numpy overhead are most of a solve's time)."""

    n: int
    P: int
    rhs: Callable
    jac_z: Callable
    jac_p: Callable
    fast: Optional[Callable] = None

    def augmented(self, t, y, p):
        """The state and its sensitivities ``S = dz/d(p, z0)`` (``n x (P + n)``, row-major after the state):
        ``dS/dt = jac_z S + [jac_p, 0]``."""
        if self.fast is not None:
            return self.fast(t, y, p)
        n, P = self.n, self.P
        z, S = y[:n], y[n:].reshape(n, P + n)
        dS = self.jac_z(t, z, p) @ S
        dS[:, :P] += self.jac_p(t, z, p)
        return np.concatenate([self.rhs(t, z, p), dS.ravel()])


class _Solve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z0, params, system, times, rtol, atol):
        n, P = system.n, system.P
        z0_np, p_np = z0.detach().cpu().numpy(), params.detach().cpu().numpy()
        if not (np.isfinite(z0_np).all() and np.isfinite(p_np).all()):
            raise ValueError("solve_ode: z0 and params must be finite, got a non-finite value.")
        sensitivities = any(ctx.needs_input_grad[:2])  # without them (scoring draws) only the n states
        start = np.hstack([np.zeros((n, P)), np.eye(n)]).ravel() if sensitivities else np.zeros(0)
        fun = system.augmented if sensitivities else system.rhs
        out = np.empty((z0_np.shape[0], len(times) - 1, n + start.size))
        for b in range(z0_np.shape[0]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a failed solve is reported below, not as a warning
                y, info = _lsoda(fun, np.concatenate([z0_np[b], start]), times, args=(p_np[b].tolist(),),
                                 tfirst=True, rtol=rtol, atol=atol, mxstep=MAX_STEPS, full_output=True)
            if info["message"] != "Integration successful.":
                raise RuntimeError(f"solve_ode: LSODA failed at parameters {p_np[b].tolist()} and initial "
                                   f"state {z0_np[b].tolist()}: {info['message']}")
            out[b] = y[1:]
        out = torch.as_tensor(out, dtype=z0.dtype, device=z0.device)
        if sensitivities:
            ctx.save_for_backward(out[..., n:].reshape(out.shape[:2] + (n, P + n)))
        ctx.P = P
        return out[..., :n]

    @staticmethod
    def backward(ctx, grad):
        (sens,) = ctx.saved_tensors
        total = torch.einsum("bti,btij->bj", grad, sens)
        return total[:, ctx.P:], total[:, :ctx.P], None, None, None, None


def solve_ode(system: ODESystem, z0: torch.Tensor, params: torch.Tensor, times, rtol=RTOL, atol=ATOL):
    """The solution of ``system`` from ``z0`` at ``times[0]``, at ``times[1:]``: ``(..., N, n)`` for ``z0``
    ``(..., n)`` and ``params`` ``(..., P)`` (broadcast), differentiable in both through the forward
    sensitivities. Raises RuntimeError where LSODA does not finish, ValueError on non-finite input."""
    batch = torch.broadcast_shapes(z0.shape[:-1], params.shape[:-1])
    z0 = z0.expand(batch + z0.shape[-1:]).reshape(-1, system.n)
    params = params.expand(batch + params.shape[-1:]).reshape(-1, system.P)
    times = np.asarray(torch.as_tensor(times).detach().cpu(), dtype=np.float64)
    return _Solve.apply(z0, params, system, times, rtol, atol).reshape(batch + (len(times) - 1, system.n))


def _lv_rhs(t, z, p):
    (u, v), (alpha, beta, gamma, delta) = z.tolist(), p
    return [(alpha - beta * v) * u, (-gamma + delta * u) * v]


def _lv_jac_z(t, z, p):
    (u, v), (alpha, beta, gamma, delta) = z, p
    return np.array([[alpha - beta * v, -beta * u], [delta * v, -gamma + delta * u]])


def _lv_jac_p(t, z, p):
    u, v = z
    return np.array([[u, -u * v, 0.0, 0.0], [0.0, 0.0, -v, u * v]])


def _lv_augmented(t, y, p):
    u, v, *S = y.tolist()
    alpha, beta, gamma, delta = p
    j00, j01, j10, j11 = alpha - beta * v, -beta * u, delta * v, -gamma + delta * u
    su, sv = S[:6], S[6:]
    du = [j00 * a + j01 * b for a, b in zip(su, sv)]
    dv = [j10 * a + j11 * b for a, b in zip(su, sv)]
    du[0] += u
    du[1] -= u * v
    dv[2] -= v
    dv[3] += u * v
    return [j00 * u, j11 * v] + du + dv


LOTKA_VOLTERRA = ODESystem(2, 4, _lv_rhs, _lv_jac_z, _lv_jac_p, fast=_lv_augmented)
"""Stan's ``dz_dt``: prey ``u``, predator ``v``, ``theta = (alpha, beta, gamma, delta)``."""


def _one_comp(D, V):
    def dose(t, k_a):  # Stan's ``if (t > 0)``
        return np.exp(-k_a * t) * D * k_a / V if t > 0 else 0.0

    def rhs(t, C, p):
        k_a, K_m, V_m = p
        return np.array([dose(t, k_a) - (V_m / V) * C[0] / (K_m + C[0])])

    def jac_z(t, C, p):
        k_a, K_m, V_m = p
        return np.array([[-(V_m / V) * K_m / (K_m + C[0]) ** 2]])

    def jac_p(t, C, p):
        k_a, K_m, V_m = p
        d_dose = np.exp(-k_a * t) * D * (1 - k_a * t) / V if t > 0 else 0.0
        return np.array([[d_dose, (V_m / V) * C[0] / (K_m + C[0]) ** 2, -C[0] / (V * (K_m + C[0]))]])

    def fast(t, y, p):
        C, *S = y.tolist()
        k_a, K_m, V_m = p
        decay = math.exp(-k_a * t) * D / V if t > 0 else 0.0
        ratio = 1.0 / (K_m + C)
        j = -(V_m / V) * K_m * ratio * ratio
        return [decay * k_a - (V_m / V) * C * ratio, j * S[0] + decay * (1 - k_a * t),
                j * S[1] + (V_m / V) * C * ratio * ratio, j * S[2] - C * ratio / V, j * S[3]]

    return ODESystem(1, 3, rhs, jac_z, jac_p, fast=fast)


def _positive_normal_prior(name, value, loc, scale):
    """A normal prior on a positive parameter, unnormalised by the truncation (as Stan's ``~``)."""
    pyro.factor(f"{name}_prior", dist.Normal(loc, scale).log_prob(value).sum(-1))


@register_port("hudson_lynx_hare-lotka_volterra")
def lotka_volterra(data):
    ts, y_init, y = tensor(data["ts"]), tensor(data["y_init"]), tensor(data["y"])  # y: (N, 2)
    times = torch.cat([ts.new_zeros(1), ts])

    def model():
        theta = pyro.sample("theta", flat(constraints.positive, 4))
        z_init = pyro.sample("z_init", dist.LogNormal(torch.log(tensor(10.0)), 1.0).expand([2]).to_event(1))
        sigma = pyro.sample("sigma", dist.LogNormal(tensor(-1.0), 1.0).expand([2]).to_event(1))
        _positive_normal_prior("theta", theta, tensor([1.0, 0.05, 1.0, 0.05]), tensor([0.5, 0.05, 0.5, 0.05]))
        z = pyro.deterministic("z", solve_ode(LOTKA_VOLTERRA, z_init, theta, times), event_dim=2)
        pyro.sample("y_init", dist.LogNormal(torch.log(z_init), sigma).to_event(1), obs=y_init)
        pyro.sample("y", dist.LogNormal(torch.log(z), sigma.unsqueeze(-2)).to_event(2), obs=y)

    return model


@register_port("one_comp_mm_elim_abs-one_comp_mm_elim_abs")
def one_comp_mm_elim_abs(data):
    t0, times, C_hat = float(data["t0"]), tensor(data["times"]), tensor(data["C_hat"])
    grid = torch.cat([times.new_full((1,), t0), times])
    system = _one_comp(float(data["D"]), float(data["V"]))

    def model():
        k_a = pyro.sample("k_a", dist.HalfCauchy(tensor(1.0)))
        K_m = pyro.sample("K_m", dist.HalfCauchy(tensor(1.0)))
        V_m = pyro.sample("V_m", dist.HalfCauchy(tensor(1.0)))
        sigma = pyro.sample("sigma", dist.HalfCauchy(tensor(1.0)))
        C0 = torch.zeros(k_a.shape + (1,), dtype=torch.float64)  # Stan's C0 = {0.0}
        C = solve_ode(system, C0, torch.stack([k_a, K_m, V_m], -1), grid)[..., 0]
        C = pyro.deterministic("C", C, event_dim=1)
        pyro.sample("C_hat", dist.LogNormal(torch.log(C), col(sigma)).to_event(1), obs=C_hat)

    return model
