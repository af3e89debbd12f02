"""Deprecated: use :mod:`pyro_fa.swag.scale`."""
from pyro_fa._deprecated import alias

alias(__name__, "pyro_fa.swag.scale")
