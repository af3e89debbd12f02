r"""The rules that choose a posterior's scale from its validation curve (:func:`~pyro_fa.predictive.select_scale`'s
``rule``), one function each, registered in :data:`SCALE_RULES`.

Each reads a :class:`Curve`: the per-point validation log-likelihoods :math:`\ell_i(s)` of every candidate
scale (the first 0, the mean), each candidate's mean :math:`\mathcal L(s)`, its gain over the mean
:math:`g(s)` and the gain's paired standard error :math:`\mathrm{se}(s)`, and returns the index chosen and why,
in words. The rules themselves are described in :func:`~pyro_fa.predictive.select_scale`; a new rule is one
function and one entry of :data:`SCALE_RULES`.
"""
from __future__ import annotations

import math
from typing import Callable, List, NamedTuple, Optional, Tuple

from torch import Tensor

__all__ = ["Curve", "Rule", "SCALE_RULES", "RULES"]


class Curve(NamedTuple):
    """The validation curve a rule reads: per-point log-likelihoods ``L`` (n, N), which rows are finite, each
    candidate's mean, its gain over the mean (scale 0) and the gain's paired standard error."""
    scales: List[float]
    L: Tensor
    N: int
    finite: Tensor
    mean: Tensor
    gain: Tensor
    se: Tensor
    fraction: float
    num_se: float


def _best_gain(c: Curve) -> int:
    """The positive scale of largest gain (0 when there is none)."""
    return int(c.gain[1:].argmax()) + 1 if len(c.scales) > 1 else 0


def _no_gain(c: Curve, best: int) -> Optional[Tuple[int, str]]:
    """The mean, when the gain at ``best`` is not beyond its paired standard error; else None."""
    g, s = float(c.gain[best]), float(c.se[best])
    if best == 0 or not g > s:
        return 0, (f"no scale beats the mean by more than its paired standard error (best gain {g:.3g} "
                   f"+- {s:.3g} per point at scale {c.scales[best]:.3g}): the mean (scale 0)")
    return None


def _argmax(c: Curve) -> Tuple[int, str]:
    i = int(c.mean.argmax())
    return i, f"the highest validation log-likelihood ({'the mean' if i == 0 else f'scale {c.scales[i]:.3g}'})"


def _one_se(c: Curve) -> Tuple[int, str]:
    scales, L, N, mean = c.scales, c.L, c.N, c.mean
    i = int(mean.argmax())
    dd = L[i] - L
    se_i = (dd.std(1, unbiased=True) / math.sqrt(N)).nan_to_num(0.0) if N > 1 else dd.new_zeros(len(scales))
    ok = [j for j in range(len(scales)) if bool(c.finite[j]) and float(mean[i] - mean[j]) <= float(se_i[j])]
    if ok[0] == 0:
        return 0, (f"no scale beats the mean by more than its paired standard error (best gain "
                   f"{float(mean[i] - mean[0]):.3g} +- {float(se_i[0]):.3g} per point at scale {scales[i]:.3g}): "
                   "the mean (scale 0)")
    if ok[0] == i:
        return i, (f"the best scale, {scales[i]:.3g}: no smaller one within a paired standard error of it (gain "
                   f"over the mean {float(mean[i] - mean[0]):.3g} +- {float(se_i[0]):.3g} per point)")
    return ok[0], (f"the smallest scale within one paired standard error ({float(se_i[ok[0]]):.3g}) of the best, "
                   f"scale {scales[i]:.3g}")


def _gated(c: Curve) -> Tuple[int, str]:
    i = int(c.mean.argmax())
    if i == 0 or not float(c.gain[i]) > 2 * float(c.se[i]):
        j = i if i > 0 else _best_gain(c)  # the best positive scale, for the record
        return 0, (f"no scale beats the mean by more than twice its paired standard error (best gain "
                   f"{float(c.gain[j]):.3g} +- {float(c.se[j]):.3g} per point at scale {c.scales[j]:.3g}): the mean "
                   "(scale 0)")
    return _one_se(c)


def _significant(c: Curve) -> Tuple[int, str]:
    best = _best_gain(c)
    none = _no_gain(c, best)
    if none is not None:
        return none
    g, s = float(c.gain[best]), float(c.se[best])
    if g > 2 * s:
        return best, f"the best scale, whose gain over the mean {g:.3g} exceeds twice its standard error {s:.3g}"
    return 0, f"the best gain over the mean {g:.3g} is within twice its standard error {s:.3g}: the mean"


def _fraction(c: Curve) -> Tuple[int, str]:
    # the best lower confidence bound on the gain
    lower = (c.gain - c.num_se * c.se).where(c.finite, c.L.new_tensor(-math.inf))
    best = int(lower[1:].argmax()) + 1 if len(c.scales) > 1 else 0
    none = _no_gain(c, best)
    if none is not None:
        return none
    g, s = float(c.gain[best]), float(c.se[best])
    i = next(j for j in range(1, len(c.scales)) if float(c.gain[j]) >= c.fraction * g)
    return i, (f"the smallest scale reaching {c.fraction:g} of the validation gain over the mean at scale "
               f"{c.scales[best]:.3g} ({g:.3g} +- {s:.3g} per point, the best lower bound)")


class Rule(NamedTuple):
    """A scale rule: its choice on a curve, and whether its choosing the mean says the curve is flat (warned of)."""
    choose: Callable[[Curve], Tuple[int, str]]
    flat_when_mean: bool = True


#: rule name -> :class:`Rule` (``select_scale``'s ``rule``); a new rule is one function and one entry
SCALE_RULES = {"gated": Rule(_gated), "one_se": Rule(_one_se), "fraction": Rule(_fraction),
          "argmax": Rule(_argmax, flat_when_mean=False), "significant": Rule(_significant)}
#: the rule names, in the order documented (the keys of :data:`SCALE_RULES`)
RULES = tuple(SCALE_RULES)
