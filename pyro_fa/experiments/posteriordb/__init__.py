"""posteriordb (Magnusson, Bürkner & Vehtari 2024) in Pyro: the posteriors as Pyro models, their
reference draws in Pyro's unconstrained space, and the checks that tie the two together.

``PORTS`` maps a posterior's name to its port (``port(data) -> model``), ``LEFT_OUT`` the posteriors
without one to the reason, and :func:`load_posterior` gives a :class:`PosteriorDBPosterior`
(the model, D, the reference draws in ``AutoContinuous``'s unconstrained order, the log density).
The ports' flat priors (``ImproperUniform``) cannot be sampled, so Pyro's default init strategies fail
on them: pass ``init_loc_fn=init_to_median_or_zero`` to an autoguide.
"""
from pyro_fa.experiments.posteriordb.ports import PORTS, LEFT_OUT, register_port
from pyro_fa.experiments.posteriordb import ports_models, ports_ode  # noqa: F401  (register their ports)
from pyro_fa.experiments.posteriordb.loader import (PosteriorDBPosterior, available_posteriors, data_folder,
                                                    init_to_median_or_zero, load_posterior)
from pyro_fa.experiments.posteriordb.identities import score_stein_identities

__all__ = ["PORTS", "LEFT_OUT", "register_port", "PosteriorDBPosterior", "load_posterior", "available_posteriors",
           "data_folder", "init_to_median_or_zero", "score_stein_identities"]
