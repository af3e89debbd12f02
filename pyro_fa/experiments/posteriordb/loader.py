"""Load a posteriordb posterior: its Pyro port, its data, and its reference draws in Pyro's
unconstrained space.

The unconstrained vector is laid out as :class:`pyro.infer.autoguide.AutoContinuous` lays out its
latent (the latent sites in the order the model samples them, each site's unconstrained value
``biject_to(site support).inv(value)`` flattened row-major), so a guide's latent and the reference
draws are comparable coordinate by coordinate.
"""
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributions import biject_to

import pyro
from pyro import poutine
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median

from pyro_fa.experiments.posteriordb.ports import PORTS, LEFT_OUT

__all__ = ["PosteriorDBPosterior", "load_posterior", "init_to_median_or_zero", "data_folder", "available_posteriors",
           "SHIPPED"]

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "posteriordb"
"""The few posteriors that ship with the package (data, reference draws, the licence)."""

_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[([0-9,]+)\])?$")


def data_folder(data_dir=None):
    """The posteriordb folder: ``data_dir``, else ``$PYRO_FA_POSTERIORDB``, else
    ``$PYRO_FA_DATA/../posteriordb`` where it exists, else ``None``."""
    if data_dir is not None:
        return Path(data_dir)
    if os.environ.get("PYRO_FA_POSTERIORDB"):
        return Path(os.environ["PYRO_FA_POSTERIORDB"])
    if os.environ.get("PYRO_FA_DATA"):
        candidate = Path(os.environ["PYRO_FA_DATA"]).parent / "posteriordb"
        if candidate.is_dir():
            return candidate
    return None


def _find(name, data_dir):
    """(posterior json, data zip, reference zip) for ``name``: the data folder, then the shipped copy."""
    folders = [f for f in (data_folder(data_dir), SHIPPED) if f is not None]
    for folder in folders:
        posterior = folder / "posteriors" / f"{name}.json"
        reference = folder / "reference_draws" / f"{name}.json.zip"
        if posterior.is_file() and reference.is_file():
            data_name = json.loads(posterior.read_text())["data_name"]
            return posterior, folder / "data" / f"{data_name}.json.zip", reference
    raise FileNotFoundError(
        f"load_posterior: name must be a posterior in the posteriordb folder (data_dir=, else the "
        f"environment variable PYRO_FA_POSTERIORDB, else PYRO_FA_DATA/../posteriordb) or shipped with "
        f"the package, got {name!r} (looked in {[str(f) for f in folders]!r}).")


def available_posteriors(data_dir=None):
    """The names of the ported posteriors whose data are found (the data folder, or shipped)."""
    names = []
    for name in sorted(PORTS):
        try:
            _find(name, data_dir)
        except FileNotFoundError:
            continue
        names.append(name)
    return names


def _read_zip_json(path):
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read(z.namelist()[0]))


def _stan_arrays(columns):
    """Stan's columns (``"beta[1]"`` -> draws) as arrays with a leading draw axis, by base name.
    Stan's multi-index names are column-major; they are read into row-major arrays."""
    groups = {}
    for key, values in columns.items():
        match = _NAME.match(key)
        if match is None:
            continue
        base, index = match.group(1), match.group(2)
        idx = () if index is None else tuple(int(i) - 1 for i in index.split(","))
        groups.setdefault(base, {})[idx] = values
    arrays = {}
    for base, entries in groups.items():
        if () in entries:
            arrays[base] = torch.tensor(entries[()], dtype=torch.float64)
            continue
        shape = tuple(max(i[d] for i in entries) + 1 for d in range(len(next(iter(entries)))))
        n = len(next(iter(entries.values())))
        out = torch.empty((n,) + shape, dtype=torch.float64)
        for idx, values in entries.items():
            out[(slice(None),) + idx] = torch.tensor(values, dtype=torch.float64)
        arrays[base] = out
    return arrays


def _stan_name(base, shape, flat_index):
    if not shape:
        return base
    index = torch.unravel_index(torch.tensor(flat_index), shape)
    return f"{base}[{','.join(str(int(i) + 1) for i in index)}]"


@dataclass
class PosteriorDBPosterior:
    """A posteriordb posterior as a Pyro model, with its reference draws.

    Attributes
    ----------
    name : str
        the posteriordb name, ``"MODEL_DATA-MODEL"``.
    model : callable
        the zero-argument Pyro model.
    dim : int
        D, the size of the unconstrained latent vector.
    reference : Tensor
        ``(n_draws, D)`` float64: the reference draws in the unconstrained space, in
        ``AutoContinuous``'s order (10 chains of 1 000 draws, chain by chain).
    sites : list of (str, torch.Size, torch.Size)
        each latent site's name, constrained shape and unconstrained shape, in order.
    stan_reference : dict
        the reference draws as posteriordb holds them (the Stan program's constrained parameters,
        transformed parameters included), by name, each ``(n_draws, *shape)`` float64.
    data : dict
        the data the Stan program reads (posteriordb's ``data/DATA.json``).
    """

    name: str
    model: object
    dim: int
    reference: torch.Tensor
    sites: list
    stan_reference: dict = field(repr=False, default_factory=dict)
    data: dict = field(repr=False, default_factory=dict)
    _supports: dict = field(repr=False, default_factory=dict)

    def names(self):
        """The names of the D unconstrained coordinates in Stan's notation (``"beta[1]"``); a site whose
        unconstrained value has another shape than its value (a simplex) is named ``"theta1__u[1]"``."""
        out = []
        for name, shape, ushape in self.sites:
            base = name if shape == ushape else f"{name}__u"
            out.extend(_stan_name(base, tuple(ushape), i) for i in range(ushape.numel()))
        return out

    def unpack(self, z):
        """The constrained site values and the summed log-Jacobian of ``z`` of shape ``(..., D)``."""
        batch = z.shape[:-1]
        values, log_jac, pos = {}, z.new_zeros(batch), 0
        for name, shape, ushape in self.sites:
            u = z[..., pos:pos + ushape.numel()].reshape(batch + ushape)
            pos += ushape.numel()
            transform = biject_to(self._supports[name])
            x = transform(u)
            ladj = transform.log_abs_det_jacobian(u, x)
            log_jac = log_jac + sum_rightmost(ladj, ladj.dim() - len(batch))
            values[name] = x
        return values, log_jac

    def log_density(self, z):
        """log p(z) in the unconstrained space (the model's log joint at the constrained values plus
        the log-Jacobian of the map), differentiable; ``z`` of shape ``(D,)`` or ``(n, D)``."""
        if z.shape[-1] != self.dim or z.dim() not in (1, 2):
            raise ValueError(f"PosteriorDBPosterior.log_density: z must be of shape (D,) or (n, D) with "
                             f"D = {self.dim}, got {tuple(z.shape)!r}.")
        values, log_jac = self.unpack(z)
        return log_jac + log_joint(self.model, values, z.shape[:-1])


def log_joint(model, values, batch=()):
    """The model's log joint at the latent ``values`` (with a leading ``batch``): every sample and
    factor site's log density, summed over everything but the batch."""
    trace = poutine.trace(poutine.condition(model, data=values)).get_trace()
    total = torch.zeros(batch, dtype=torch.float64)
    for site in trace.nodes.values():
        if site["type"] != "sample" or site["infer"].get("_deterministic"):
            continue
        lp = site["fn"].log_prob(site["value"])
        extra = lp.dim() - len(batch)
        if extra < 0:
            lp = lp.expand(batch)
        total = total + sum_rightmost(lp, max(extra, 0))
    return total


def _unconstrained_zero(site):
    transform = biject_to(site["fn"].support)
    shape = site["fn"].batch_shape + site["fn"].event_shape
    value = transform(torch.zeros(transform.inverse_shape(shape), dtype=torch.float64))
    value._pyro_custom_init = False
    return value


def init_to_median_or_zero(site=None):
    """Pyro's ``init_to_median`` for the ports' proper priors, and the point whose unconstrained value
    is zero for their improper flat priors (``ImproperUniform``, which Pyro's init strategies sample
    and so cannot start from): pass it as an autoguide's ``init_loc_fn``."""
    if site is None:
        return init_to_median_or_zero
    if isinstance(site["fn"], pyro.distributions.ImproperUniform):
        return _unconstrained_zero(site)
    return init_to_median(site, fallback=_unconstrained_zero)


def _prototype(model):
    with poutine.block():
        trace = poutine.trace(InitMessenger(init_to_median_or_zero)(model)).get_trace()
    sites, supports = [], {}
    for name, site in trace.iter_stochastic_nodes():
        support = site["fn"].support
        u = biject_to(support).inv(site["value"])
        sites.append((name, site["value"].shape, u.shape))
        supports[name] = support
    return sites, supports


def load_posterior(name, data_dir=None):
    """Load a ported posteriordb posterior.

    Parameters
    ----------
    name : str
        a posterior with a port (``pyro_fa.experiments.posteriordb.PORTS``), e.g.
        ``"eight_schools-eight_schools_noncentered"``.
    data_dir : str or Path, optional
        the posteriordb folder (``posteriors/``, ``data/``, ``reference_draws/``); default
        ``$PYRO_FA_POSTERIORDB``, else ``$PYRO_FA_DATA/../posteriordb``, else the few shipped.

    Returns
    -------
    PosteriorDBPosterior
    """
    if name not in PORTS:
        why = f" ({LEFT_OUT[name]})" if name in LEFT_OUT else ""
        raise KeyError(f"load_posterior: name must be a ported posterior, got {name!r}{why}.")
    _, data_path, reference_path = _find(name, data_dir)
    data = _read_zip_json(data_path)
    model = PORTS[name](data)
    sites, supports = _prototype(model)
    chains = _read_zip_json(reference_path)
    stan = [_stan_arrays(chain) for chain in chains]
    stan = {k: torch.cat([c[k] for c in stan]) for k in stan[0]}
    from_stan = getattr(model, "from_stan", None)
    latent = from_stan(stan) if from_stan is not None else stan
    n = next(iter(stan.values())).shape[0]
    parts = []
    for site, shape, ushape in sites:
        x = latent[site].reshape((n,) + tuple(shape))
        parts.append(biject_to(supports[site]).inv(x).reshape(n, -1))
    reference = torch.cat(parts, dim=-1)
    return PosteriorDBPosterior(name=name, model=model, dim=reference.shape[-1], reference=reference,
                                sites=sites, stan_reference=stan, data=data, _supports=supports)
