r"""Closed forms :math:`\mathbb{E}_{N(m, v)}[\log p(\theta)]` registered by distribution type.

As :func:`torch.distributions.kl.register_kl` registers a KL pair: :class:`~pyro_fa.FactorELBO`
looks every latent site's prior up here (``Normal`` and ``Laplace`` are registered by
:mod:`~pyro_fa.infer.priors.gaussian` and :mod:`~pyro_fa.infer.priors.laplace`), so a model
written with plain ``pyro.distributions`` gets the closed form too; the dispatcher never
changes when a prior is added.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from torch import Tensor
from torch.distributions import Distribution, Independent

__all__ = ["register_expected_log_prob", "closed_form", "expected_log_prob", "base_of"]

ClosedForm = Callable[[Distribution, Tensor, Tensor], Tensor]

_CLOSED_FORMS: Dict[type, ClosedForm] = {}


def register_expected_log_prob(type_: type) -> Callable[[ClosedForm], ClosedForm]:
    r"""Decorator registering the closed form :math:`\mathbb{E}_{N(m, v)}[\log p(\theta)]` of a distribution type.

    The decorated function ``fn(p, loc, variance)`` receives a distribution ``p`` of
    type ``type_`` (or of a subclass that keeps its density) and the means and
    variances of the Gaussian :math:`q`'s marginals, broadcastable with ``p``'s batch
    shape, and returns the elementwise expectation (the broadcast shape).

    Parameters
    ----------
    type_ : type
        A subclass of :class:`torch.distributions.Distribution` whose ``log_prob`` is
        elementwise (empty event shape).

    Returns
    -------
    callable
        The decorator; it returns the function unchanged.

    Raises
    ------
    TypeError
        If ``type_`` is not a ``Distribution`` subclass.

    Examples
    --------
    >>> import torch.distributions as td
    >>> class Shifted(td.Normal):  # a type of one's own: the registration leaks to no other site
    ...     pass
    >>> @register_expected_log_prob(Shifted)
    ... def _shifted(p, loc, variance):
    ...     return td.Normal(p.loc, p.scale).log_prob(loc) - variance / (2 * p.scale ** 2)
    >>> closed_form(Shifted(0.0, 1.0)) is _shifted
    True
    """
    if not (isinstance(type_, type) and issubclass(type_, Distribution)):
        raise TypeError(f"register_expected_log_prob: type_ must be a torch Distribution subclass, got {type_!r}.")

    def decorator(fn: ClosedForm) -> ClosedForm:
        _CLOSED_FORMS[type_] = fn
        return fn

    return decorator


def closed_form(p: Distribution) -> Optional[ClosedForm]:
    """The registered closed form for ``p``'s type, or None.

    The lookup walks ``type(p).__mro__`` as :func:`torch.distributions.kl.kl_divergence`
    does, but stops at the first class that defines its own ``log_prob``: a subclass
    that changes the density (Pyro's ``SoftLaplace`` or a user's) is not mistaken for
    its registered parent, while Pyro's ``dist.Normal`` (torch's ``Normal`` with
    Pyro's mixin, the same density) finds torch's entry.

    Parameters
    ----------
    p : torch.distributions.Distribution

    Returns
    -------
    callable or None
    """
    for cls in type(p).__mro__:
        fn = _CLOSED_FORMS.get(cls)
        if fn is not None:
            return fn
        if "log_prob" in vars(cls):
            return None
    return None


def base_of(fn: Distribution) -> Distribution:
    """``fn`` with its ``Independent`` (``.to_event``) wrappers removed."""
    while isinstance(fn, Independent):
        fn = fn.base_dist
    return fn


def expected_log_prob(p: Distribution, loc: Tensor, variance: Tensor) -> Tensor:
    r"""Elementwise :math:`\mathbb{E}_{\theta \sim N(m, v)}[\log p(\theta)]` through the registry.

    Parameters
    ----------
    p : torch.distributions.Distribution
        A registered type (``Independent`` wrappers are looked through).
    loc, variance : Tensor
        :math:`m` and :math:`v \ge 0`, broadcastable with ``p``'s batch shape.

    Returns
    -------
    Tensor of the broadcast shape.

    Raises
    ------
    NotImplementedError
        If no closed form is registered for ``p``'s type.
    """
    base = base_of(p)
    fn = closed_form(base)
    if fn is None:
        raise NotImplementedError(
            f"expected_log_prob: no closed form registered for {type(base).__name__}; register one with "
            "@pyro_fa.infer.priors.register_expected_log_prob(<its type>)."
        )
    return fn(base, loc, variance)
