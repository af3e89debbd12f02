r"""Prior classes registered by name, for string options such as ``BatchedVI(prior="laplace")``.

:func:`register_prior` names a :class:`~pyro_fa.infer.priors.FactorisedPrior` subclass
(``"gaussian"``, ``"laplace"``); :class:`~pyro_fa.nn.BatchedVI`'s ``prior=`` option and
:meth:`~pyro_fa.nn.BayesianNetwork.fit_many` find priors here. Their closed forms are
registered by distribution type in :mod:`~pyro_fa.infer.priors.closed_forms`. A new prior
is one file that registers itself (the architecture guide's "Add a prior").
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Type

from pyro_fa._registry import ClassRegistry
from pyro_fa.infer.priors.base import FactorisedPrior

__all__ = ["register_prior", "get_prior", "PRIORS"]

_REGISTRY = ClassRegistry("register_prior", FactorisedPrior, "prior")
_PRIORS: Dict[str, type] = _REGISTRY.classes

#: Read-only view of the registered priors: name -> :class:`FactorisedPrior` subclass.
PRIORS: Mapping[str, type] = _REGISTRY.view


def register_prior(name: str) -> Callable[[type], type]:
    """Class decorator registering a :class:`~pyro_fa.infer.priors.FactorisedPrior` subclass under ``name``.

    Sets ``cls.name = name``; :class:`~pyro_fa.nn.BatchedVI` (``prior=name``) and
    :meth:`~pyro_fa.nn.BayesianNetwork.fit_many` find the class here.

    Parameters
    ----------
    name : str
        A new, non-empty key (``"gaussian"`` and ``"laplace"`` are taken).

    Returns
    -------
    callable
        The decorator; it returns the class unchanged but for ``name``.

    Raises
    ------
    ValueError
        If ``name`` is empty or already names another class.
    TypeError
        If the decorated object is not a ``FactorisedPrior`` subclass.
    """
    return _REGISTRY.register(name)


def get_prior(name: str, owner: str = "get_prior") -> Type:
    """The prior class registered under ``name``.

    Parameters
    ----------
    name : str
    owner : str, default "get_prior"
        Who asks, for the error message (e.g. ``"BatchedVI"``).

    Raises
    ------
    ValueError
        If ``name`` is not registered; the message lists the registered names.
    """
    return _REGISTRY.get(name, owner)
