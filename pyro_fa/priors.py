"""Deprecated: use :mod:`pyro_fa.infer.priors`."""
from pyro_fa._deprecated import alias

alias(__name__, "pyro_fa.infer.priors")
