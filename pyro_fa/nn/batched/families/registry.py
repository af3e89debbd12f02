r"""Guide families registered by name, for ``BatchedVI(family="...")``.

:func:`register_family` names a :class:`~pyro_fa.nn.batched.families.GuideFamily`
subclass (``"fa"``, ``"ppca"``, ``"lowrank"``, ``"normal"``, ``"delta"``);
:class:`~pyro_fa.nn.BatchedVI` finds its family here, once, at construction. A new family
is one file that registers itself (the architecture guide\'s "Add a guide family").
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Dict, Mapping, Type

from pyro_fa.nn.batched.families.base import GuideFamily

__all__ = ["register_family", "get_family", "FAMILIES"]

_FAMILIES: Dict[str, type] = {}

#: Read-only view of the registered guide families: name -> :class:`GuideFamily` subclass.
FAMILIES: Mapping[str, type] = MappingProxyType(_FAMILIES)


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
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_family: name must be a non-empty str, got {name!r}.")

    def decorator(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, GuideFamily)):
            raise TypeError(f"register_family: the decorated class must subclass GuideFamily, got {cls!r}.")
        taken = _FAMILIES.get(name)
        if taken is not None and taken.__qualname__ != cls.__qualname__:
            raise ValueError(f"register_family: name must be new, got {name!r}, which names {taken.__qualname__}.")
        cls.name = name
        _FAMILIES[name] = cls
        return cls

    return decorator


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
    cls = _FAMILIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"{owner}: family must be one of {tuple(_FAMILIES)}, got {name!r}.")
    return cls
