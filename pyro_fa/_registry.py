"""One implementation of the library's registries of classes by name (fitters, priors, guide families).

A registry maps a string option (``method="em"``, ``prior="laplace"``, ``family="fa"``) to a class,
as torch's :func:`torch.distributions.kl.register_kl` maps a pair of types to a function: a new
class plugs in by registering itself, and the code that reads the option looks it up once, at the
boundary, instead of branching on the string. Layer 0: imports nothing of the library.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Dict, Mapping

__all__ = ["ClassRegistry"]


class ClassRegistry:
    """Classes registered by name, all subclasses of one base.

    Parameters
    ----------
    register_name : str
        The public decorator's name (``"register_prior"``), the start of its messages.
    base : type
        Every registered class must subclass it.
    option : str
        The argument that names a class (``"prior"``), for :meth:`get`'s message.

    Examples
    --------
    >>> class Base: pass
    >>> shapes = ClassRegistry("register_shape", Base, "shape")
    >>> @shapes.register("square")
    ... class Square(Base): pass
    >>> shapes.get("square", "Canvas") is Square, Square.name
    (True, 'square')
    >>> shapes.get("circle", "Canvas")
    Traceback (most recent call last):
    ...
    ValueError: Canvas: shape must be one of ('square',), got 'circle'.
    """

    def __init__(self, register_name: str, base: type, option: str):
        self.register_name = register_name
        self.base = base
        self.option = option
        self.classes: Dict[str, type] = {}
        #: read-only view of :attr:`classes`: name -> class
        self.view: Mapping[str, type] = MappingProxyType(self.classes)

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator registering a subclass of the base under ``name`` (sets ``cls.name``).

        Re-registering a class of the same qualified name (a module reloaded) replaces it.

        Raises
        ------
        ValueError
            If ``name`` is not a non-empty str, or already names another class.
        TypeError
            If the decorated object is not a subclass of the base.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.register_name}: name must be a non-empty str, got {name!r}.")

        def decorator(cls: type) -> type:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{self.register_name}: the decorated class must subclass {self.base.__name__}, "
                                f"got {cls!r}.")
            taken = self.classes.get(name)
            if taken is not None and taken.__qualname__ != cls.__qualname__:
                raise ValueError(f"{self.register_name}: name must be new, got {name!r}, which names "
                                 f"{taken.__qualname__}.")
            cls.name = name
            self.classes[name] = cls
            return cls

        return decorator

    def get(self, name: str, owner: str, choices=None) -> type:
        """The class registered as ``name``, checked at the boundary of ``owner`` (who asks).

        ``choices`` (optional) narrows the names ``owner`` accepts.

        Raises
        ------
        ValueError
            ``"<owner>: <option> must be one of (...), got <name>."``
        """
        allowed = tuple(self.classes) if choices is None else tuple(c for c in choices if c in self.classes)
        if not isinstance(name, str) or name not in allowed:
            raise ValueError(f"{owner}: {self.option} must be one of {allowed}, got {name!r}.")
        return self.classes[name]
