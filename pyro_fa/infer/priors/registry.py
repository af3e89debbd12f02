r"""Prior classes registered by name, for string options such as ``BatchedVI(prior="laplace")``.

:func:`register_prior` names a :class:`~pyro_fa.infer.priors.FactorisedPrior` subclass
(``"gaussian"``, ``"laplace"``); :class:`~pyro_fa.nn.BatchedVI`'s ``prior=`` option and
:meth:`~pyro_fa.nn.BayesianNetwork.fit_many` find priors here. Their closed forms are
registered by distribution type in :mod:`~pyro_fa.infer.priors.closed_forms`. A new prior
is one file that registers itself (the architecture guide's "Add a prior").
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Dict, Mapping, Type

from pyro_fa.infer.priors.base import FactorisedPrior

__all__ = ["register_prior", "get_prior", "PRIORS"]

_PRIORS: Dict[str, type] = {}

#: Read-only view of the registered priors: name -> :class:`FactorisedPrior` subclass.
PRIORS: Mapping[str, type] = MappingProxyType(_PRIORS)


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
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_prior: name must be a non-empty str, got {name!r}.")

    def decorator(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, FactorisedPrior)):
            raise TypeError(f"register_prior: the decorated class must subclass FactorisedPrior, got {cls!r}.")
        taken = _PRIORS.get(name)
        if taken is not None and taken.__qualname__ != cls.__qualname__:
            raise ValueError(f"register_prior: name must be new, got {name!r}, which names {taken.__qualname__}.")
        cls.name = name
        _PRIORS[name] = cls
        return cls

    return decorator


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
    cls = _PRIORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"{owner}: prior must be one of {tuple(_PRIORS)}, got {name!r}.")
    return cls
