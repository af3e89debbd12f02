"""Deprecated: use :mod:`pyro_fa.fa.linalg`."""
from pyro_fa._deprecated import alias

alias(__name__, "pyro_fa.fa.linalg")
