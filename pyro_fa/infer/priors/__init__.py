r"""Priors over model weights with closed-form expectations under a Gaussian.

Every prior is factorised over the weights, so under any Gaussian :math:`q(\theta)` only
the marginals :math:`q(\theta_i) = N(m_i, v_i)` matter; for an FA posterior
:math:`N(c, FF^\top + \Psi)` they are :math:`m = c`,
:math:`v = \mathrm{rowsum}(F \odot F) + \psi` (Jiang 2023, §1.2).

One file per prior (:mod:`~pyro_fa.infer.priors.gaussian`,
:mod:`~pyro_fa.infer.priors.laplace`), each registering itself:

* :class:`FactorisedPrior` — the public base class a new prior subclasses;
* :func:`register_prior` — names it for the batched trainer (``PRIORS``, :func:`get_prior`);
* :func:`register_expected_log_prob` — the closed form of its distribution type, which
  :class:`~pyro_fa.FactorELBO` dispatches through (:func:`expected_log_prob`), as torch's
  ``kl_divergence`` dispatches through ``register_kl``.

References
----------
S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
University of Edinburgh, 2021, §4.3.3.
X. Jiang, *Laplace prior and variational inference probabilistic PCA (VIPPCA)*,
report, University of Edinburgh, 2023, §1.2–1.3.
"""
from pyro_fa.infer.priors.base import FactorisedPrior
from pyro_fa.infer.priors.gaussian import GaussianPrior, normal_expected_log_prob
from pyro_fa.infer.priors.laplace import LaplacePrior, expected_abs, laplace_expected_log_prob
from pyro_fa.infer.priors.closed_forms import closed_form, expected_log_prob, register_expected_log_prob
from pyro_fa.infer.priors.registry import PRIORS, get_prior, register_prior

__all__ = [
    "FactorisedPrior",
    "GaussianPrior",
    "LaplacePrior",
    "register_prior",
    "register_expected_log_prob",
    "expected_log_prob",
    "closed_form",
    "get_prior",
    "PRIORS",
    "normal_expected_log_prob",
    "laplace_expected_log_prob",
    "expected_abs",
]
