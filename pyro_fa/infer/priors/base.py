r"""``FactorisedPrior``: the base class of every prior on a network's weights.

A factorised prior puts one density on every weight independently, so under any
Gaussian :math:`q(\theta)` only the marginals :math:`q(\theta_i) = N(m_i, v_i)` matter;
for an FA posterior :math:`N(c, FF^\top + \Psi)` they are :math:`m = c`,
:math:`v = \mathrm{rowsum}(F \odot F) + \psi` (Jiang 2023, §1.2).
"""
from __future__ import annotations

import copy as _copy
from typing import Dict

import torch
from torch import Tensor
from torch.distributions import Distribution

from pyro_fa.infer.priors.closed_forms import expected_log_prob as _registered_expected_log_prob

__all__ = ["FactorisedPrior"]


class FactorisedPrior:
    r"""Base class of an i.i.d. prior :math:`p(\theta) = \prod_i p_0(\theta_i)` on every weight.

    Subclass it, and register the subclass and its closed form, to add a prior
    (the architecture guide's "Add a prior"):

    * :meth:`base_distribution` (required): :math:`p_0`, one weight's density, a
      ``pyro.distributions`` object with empty batch and event shapes;
    * a closed form :math:`\mathbb{E}_{N(m, v)}[\log p_0(\theta)]` for
      ``type(base_distribution(...))``, registered with
      :func:`~pyro_fa.infer.priors.register_expected_log_prob`: :meth:`expected_log_prob`
      and :class:`~pyro_fa.FactorELBO` use it (or override :meth:`expected_log_prob`
      when only the prior object needs it);
    * a ``precision`` attribute or property, :math:`\alpha = 1/\mathrm{Var}[\theta_i]`,
      and the classmethod :meth:`batched` (optional): the prior of variance
      :math:`1/\alpha` for R replicas at once, what :class:`~pyro_fa.nn.BatchedVI`
      and :meth:`~pyro_fa.nn.BayesianNetwork.fit_many` train with;
    * :func:`~pyro_fa.infer.priors.register_prior` ``("name")`` on the class, so the
      batched trainer's ``prior="name"`` finds it.

    :meth:`distribution`, :meth:`log_prob` and :meth:`bayesianize` come with the base
    class; :class:`~pyro_fa.nn.BayesianNetwork` takes any instance.

    Attributes
    ----------
    name : str
        The registered name (set by ``register_prior``); ``None`` when unregistered.
    """

    name = None

    # ------------------------------------------------------------ to implement
    def base_distribution(self, like: Tensor) -> Distribution:
        """One weight's prior :math:`p_0`, with empty batch and event shapes.

        Parameters
        ----------
        like : Tensor
            Gives the dtype and device.

        Returns
        -------
        pyro.distributions.TorchDistribution
        """
        raise NotImplementedError(f"{type(self).__name__} must implement base_distribution(like).")

    @classmethod
    def batched(cls, precision: Tensor) -> Distribution:
        r"""The prior of variance :math:`1/\alpha_r` for R replicas, for the batched trainer.

        Parameters
        ----------
        precision : Tensor of shape (R, 1)
            :math:`\alpha_r > 0`.

        Returns
        -------
        torch.distributions.Distribution
            Batch shape (R, 1), elementwise ``log_prob`` over (S, R, D) draws, of a type
            with a registered closed form.
        """
        raise NotImplementedError(f"{cls.__name__} has no batched form; define the classmethod batched(precision) "
                                  "and a precision attribute to train it with BatchedVI or BayesianNetwork.fit_many.")

    # ------------------------------------------------------------- provided
    def expected_log_prob(self, loc: Tensor, variance: Tensor) -> Tensor:
        r"""Elementwise :math:`\mathbb{E}_{N(m, v)}[\log p_0(\theta)]`, the registered closed form.

        Parameters
        ----------
        loc, variance : Tensors of the same (broadcastable) shape
            Marginal means and variances of :math:`q`.

        Returns
        -------
        Tensor of the broadcast shape.
        """
        return _registered_expected_log_prob(self.base_distribution(loc), loc, variance)

    def distribution(self, like: Tensor) -> Distribution:
        """The prior of one sample site shaped like ``like``.

        Parameters
        ----------
        like : Tensor
            Gives the event shape, dtype and device of the site.

        Returns
        -------
        pyro.distributions.TorchDistribution
            Event shape ``like.shape``, empty batch shape.
        """
        return self.base_distribution(like).expand(like.shape).to_event(like.dim())

    def log_prob(self, value: Tensor) -> Tensor:
        """Elementwise log-density of ``value`` (same shape)."""
        return self.distribution(value.reshape(-1)).base_dist.log_prob(value.reshape(-1)).reshape(value.shape)

    def bayesianize(self, module: torch.nn.Module, *, copy: bool = True):
        """Turn ``module`` into a Bayesian :class:`~pyro.nn.PyroModule` with this prior on every weight.

        Every parameter of ``module`` and of its submodules becomes a
        :class:`~pyro.nn.PyroSample` site (named by its dotted parameter
        name, e.g. ``"0.weight"``) whose prior is :meth:`distribution` of
        that parameter, as TyXe does in one call.

        Parameters
        ----------
        module : torch.nn.Module
        copy : bool, default True
            Convert a deep copy and leave ``module`` untouched.

        Returns
        -------
        pyro.nn.PyroModule
            It carries ``initial_values``, a dict mapping each site name to
            the parameter's value at conversion (e.g. as ``nn.Linear``
            initialised it); :class:`~pyro_fa.AutoLowRankFactorGuide` starts
            its mean there when this module is its model, and
            :func:`pyro.infer.autoguide.init_to_value` can use it otherwise.

        Raises
        ------
        TypeError
            If ``module`` is not an ``nn.Module``.
        ValueError
            If ``module`` has no parameters.
        """
        from pyro.nn import PyroSample
        from pyro.nn.module import to_pyro_module_

        cls = type(self).__name__
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{cls}.bayesianize: module must be a torch.nn.Module, got {module!r}.")
        if next(module.parameters(), None) is None:
            raise ValueError(f"{cls}.bayesianize: module must have at least one parameter, got {module!r}.")
        if copy:
            module = _copy.deepcopy(module)
        initial_values: Dict[str, Tensor] = {
            name: value.detach().clone() for name, value in module.named_parameters()
        }
        to_pyro_module_(module)
        for _prefix, sub in module.named_modules():
            for name, value in list(sub.named_parameters(recurse=False)):
                setattr(sub, name, PyroSample(self.distribution(value.detach())))
        object.__setattr__(module, "initial_values", initial_values)
        object.__setattr__(module, "prior", self)
        return module
