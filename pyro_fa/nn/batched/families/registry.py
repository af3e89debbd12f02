r"""Guide families registered by name, for ``BatchedVI(family="...")``.

:func:`register_family` names a :class:`~pyro_fa.nn.batched.families.GuideFamily`
subclass (``"fa"``, ``"ppca"``, ``"lowrank"``, ``"normal"``, ``"delta"``);
:class:`~pyro_fa.nn.BatchedVI` finds its family here, once, at construction. A new family
is one file that registers itself (the architecture guide\'s "Add a guide family").
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Type

from pyro_fa._registry import ClassRegistry
from pyro_fa.nn.batched.families.base import GuideFamily

__all__ = ["register_family", "get_family", "FAMILIES"]

_REGISTRY = ClassRegistry("register_family", GuideFamily, "family")
_FAMILIES: Dict[str, type] = _REGISTRY.classes

#: Read-only view of the registered guide families: name -> :class:`GuideFamily` subclass.
FAMILIES: Mapping[str, type] = _REGISTRY.view


def register_family(name: str) -> Callable[[type], type]:
    """Class decorator registering a :class:`GuideFamily` subclass under ``name``.

    Sets ``cls.name = name``; ``BatchedVI(mlp, family=name)`` then trains it.

    Parameters
    ----------
    name : str
        A new, non-empty key (the built-in families' names are taken).

    Returns
    -------
    callable
        The decorator; it returns the class unchanged but for ``name``.

    Raises
    ------
    ValueError
        If ``name`` is empty or already names another class.
    TypeError
        If the decorated object is not a ``GuideFamily`` subclass.
    """
    return _REGISTRY.register(name)


def get_family(name: str, owner: str = "get_family") -> Type[GuideFamily]:
    """The guide family registered under ``name``.

    Parameters
    ----------
    name : str
    owner : str, default "get_family"
        Who asks, for the error message (e.g. ``"BatchedVI"``).

    Raises
    ------
    ValueError
        If ``name`` is not registered; the message lists the registered names.
    """
    return _REGISTRY.get(name, owner)
