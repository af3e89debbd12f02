"""The score and Stein identities: a check of a port against its reference draws without Stan.

Under the posterior p (in the unconstrained space, where it is smooth and vanishes at infinity),
``E[grad log p(z)] = 0`` and ``E[grad log p(z) (z - mu)^T] = -I``. Over near-independent reference
draws each entry's sample mean is within a few standard errors (its sample sd over sqrt(n)) of its
expectation; a wrong prior, a missing Jacobian or a permuted coordinate breaks them.
"""
import torch

__all__ = ["score_gradients", "score_stein_identities"]


def score_gradients(posterior, z=None, chunk=1000):
    """``grad log p`` at the rows of ``z`` (default the reference draws), ``(n, D)``, in chunks."""
    z = posterior.reference if z is None else z
    grads = []
    for start in range(0, z.shape[0], chunk):
        zc = z[start:start + chunk].detach().clone().requires_grad_(True)
        lp = posterior.log_density(zc)
        (g,) = torch.autograd.grad(lp.sum(), zc)
        grads.append(g)
    return torch.cat(grads)


def score_stein_identities(posterior, z=None, chunk=1000):
    """The identities' z-scores over the reference draws.

    Returns
    -------
    dict
        ``score_z`` (D,): each coordinate's mean gradient over its standard error; ``stein_z`` (D, D):
        each entry of ``mean g (z - zbar)^T + I`` over its standard error; ``max_score_z``,
        ``max_stein_z`` (floats), ``n`` the number of draws, and ``finite`` (all gradients finite).
    """
    z = posterior.reference if z is None else z
    g = score_gradients(posterior, z, chunk)
    n = z.shape[0]
    finite = bool(torch.isfinite(g).all())
    se = g.std(0) / n ** 0.5
    score_z = g.mean(0) / se
    products = g[:, :, None] * (z - z.mean(0))[:, None, :]
    eye = torch.eye(z.shape[1], dtype=z.dtype)
    stein_z = (products.mean(0) + eye) / (products.std(0) / n ** 0.5)
    return {"score_z": score_z, "stein_z": stein_z, "max_score_z": float(score_z.abs().max()),
            "max_stein_z": float(stein_z.abs().max()), "n": n, "finite": finite}
