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


def identity_table(names=None, data_dir=None):
    """The identities on every port (or ``names``) as a Markdown table: posterior, D, max |z| of the
    score mean and of the Stein matrix, seconds; and the posteriors left out, with the reason."""
    import time

    from pyro_fa.experiments.posteriordb.loader import available_posteriors, load_posterior
    from pyro_fa.experiments.posteriordb.ports import LEFT_OUT

    names = available_posteriors(data_dir) if names is None else names
    lines = ["| posterior | D | max abs z, score | max abs z, Stein | s |", "| --- | --- | --- | --- | --- |"]
    for name in names:
        start = time.perf_counter()
        posterior = load_posterior(name, data_dir)
        r = score_stein_identities(posterior)
        lines.append(f"| {name} | {posterior.dim} | {r['max_score_z']:.2f} | {r['max_stein_z']:.2f} | "
                     f"{time.perf_counter() - start:.1f} |")
    lines += [f"| {name} | | left out: {why} | | |" for name, why in sorted(LEFT_OUT.items())]
    return "\n".join(lines)

