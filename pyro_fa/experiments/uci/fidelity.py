r"""The UCI benchmark's predictives scored against full-batch HMC (``pyro-fa uci --hmc-reference DIR``).

``pyro-fa hmc-reference`` writes, for the 1×50 network of this benchmark on split ``s`` of a dataset,
``<dataset>-split<s>.pt``: HMC's draws of the network's output at the split's test inputs (``f_draws``, S × M,
standardised units), the noise scale it was made with, and in ``meta`` the training standardisation of y and the
MAP search's choice (its prior precision). Where DIR holds such a file for a split being run, every 1×50 method's
test predictive on that split — the mixture of :math:`N(f_{\theta_s}(x), \sigma_s^2)` over its posterior draws —
is scored by the regression distance of the NeurIPS 2021 approximate-inference competition,
:func:`pyro_fa.metrics.competition_wasserstein`: per test point, the 1-Wasserstein distance between
:data:`NUM_SAMPLES` predictive samples of the method (its draws' outputs in turn, each plus its noise scale
times a standard normal) and as many of the reference (HMC's draws' outputs plus its noise), averaged over the
test points, in the reference's units: standardised y (times y_std for the original units). Both sides use the
same standard normals (common random numbers, drawn once per split from the run's seed, the same for every
method): a predictive equal to the reference's scores 0 up to its draws of f, one shifted by c scores c, and the
distance carries no Monte Carlo error of the noise's draws. The floor the methods' finite draws leave is the
reference's own row: HMC thinned to as many draws as a method has (the budget's ``test_samples``, 100) against all of
them. The 2-Wasserstein distance of the predictives' moments (:func:`pyro_fa.metrics.predictive_wasserstein2`)
is recorded beside it.

Each score records the method's cost: the seconds of its final training per split (the split's share of the
batch its replicas were trained in; the hyperparameter search, the same kind of search for every method, is left
out) and that as a multiple of the MAP fit's (the SWAG family's, which this module also scores as the
point-mass predictive :math:`N(f_{\hat\theta}(x), \hat\sigma^2)`), and the prior precision and noise the method
chose beside the reference's: HMC samples the posterior of the MAP network's prior precision and noise, a VI
method that chose another prior precision approximates another posterior.

A reference made on another test set (its number of points, or y's training mean and scale, differ), or of
another likelihood, is refused before any training; a method whose network is not the reference's (the 2×50
ones) is not scored (its entry says why).

References
----------
A. G. Wilson, P. Izmailov, M. D. Hoffman, Y. Gal, Y. Li, M. F. Pradier, S. Vikram, A. Foong, S. Lotfi &
S. Farquhar (2022), *Evaluating approximate inference in Bayesian deep learning*, NeurIPS 2021 Competitions and
Demonstrations Track, PMLR 176.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor

from pyro_fa.infer.hmc import RHAT_LIMIT
from pyro_fa.metrics import competition_wasserstein, predictive_wasserstein2

#: predictive samples per test point on each side (the competition's starter kit asks for 1 000)
NUM_SAMPLES = 1000
#: the name under which the SWAG family's MAP fit is scored
MAP_NAME = "map-1x50"
#: the name under which the reference's own scores are recorded
HMC_NAME = "hmc-reference"
#: the keys a reference file must hold
_KEYS = frozenset({"f_draws", "noise", "meta", "likelihood"})
#: relative tolerance on y's training mean and scale (a float32 load of the split against HMC's float64 one)
_RTOL = 1e-5


def _refuse(path, what: str) -> ValueError:
    return ValueError(f"pyro-fa uci: --hmc-reference file {path} {what}")


@dataclass(frozen=True)
class Reference:
    """One split's HMC reference predictive: load it with :meth:`load`, check it against the split with
    :meth:`check`, score a method's predictive with :meth:`score`.

    Attributes
    ----------
    path : str
    split : int
    f_draws : Tensor of shape (S, M)
        HMC's network outputs at the M test inputs, standardised units, float64.
    noise : float
        The noise scale HMC was run with (standardised units).
    precision : float or None
        The prior precision HMC was run with (the MAP search's choice, ``meta["map"]["precision"]``).
    y_mean, y_std : float
        The training statistics of y the reference was standardised with.
    dim : int or None
        The number of weights of its network (from ``<stem>.json``'s ``dim`` where it is there).
    rhat_max : float or None
        The largest split R-hat of its test predictive over chains (``<stem>.json``'s ``rhat_max``).
    digest : str
        The first 16 hex digits of the file's SHA-256 (part of a unit's key).
    """

    path: str
    split: int
    f_draws: Tensor
    noise: float
    precision: Optional[float]
    y_mean: float
    y_std: float
    dim: Optional[int]
    digest: str
    rhat_max: Optional[float] = None

    @classmethod
    def load(cls, path, split: int) -> "Reference":
        """Read ``path`` (written by ``pyro-fa hmc-reference``); ValueError naming the file when it is not a
        regression reference."""
        path = Path(path)
        raw = path.read_bytes()
        try:
            obj = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is refused with its reason
            raise _refuse(path, f"must be a torch file written by pyro-fa hmc-reference, got an unreadable file "
                                f"({err}).") from None
        if not isinstance(obj, dict) or not _KEYS <= set(obj):
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise _refuse(path, f"must hold the keys {sorted(_KEYS)}, got {got!r}.")
        if obj["likelihood"] != "regression":
            raise _refuse(path, f"must be a regression reference, got likelihood {obj['likelihood']!r}.")
        f = obj["f_draws"]
        if not (isinstance(f, Tensor) and f.dim() == 2 and f.is_floating_point() and bool(torch.isfinite(f).all())):
            raise _refuse(path, f"must hold f_draws, a finite (draws, test points) tensor, got "
                                f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__!r}.")
        meta = obj["meta"]
        if not isinstance(meta, dict) or not {"y_std", "y_mean"} <= set(meta):
            raise _refuse(path, f"must hold meta with y_mean and y_std, got {meta!r}.")
        diag = path.with_suffix(".json")
        diagnostics = json.loads(diag.read_text()) if diag.is_file() else {}
        choice = meta.get("map") or {}
        return cls(str(path), int(split), f.double(), float(obj["noise"]),
                   float(choice["precision"]) if "precision" in choice else None, float(meta["y_mean"]),
                   float(meta["y_std"]), diagnostics.get("dim"), hashlib.sha256(raw).hexdigest()[:16],
                   diagnostics.get("rhat_max"))

    def check(self, d) -> None:
        """Refuse (ValueError) a reference made on another test set than the split ``d``'s (a UCISplit)."""
        m = d.y_test.shape[0]
        if self.f_draws.shape[1] != m:
            raise _refuse(self.path, f"must hold the {m} test points of split {d.split} of {d.name!r}, got "
                                     f"{self.f_draws.shape[1]}: it was made on another test set.")
        for name, ours, theirs in (("y_mean", d.y_mean, self.y_mean), ("y_std", d.y_std, self.y_std)):
            if not math.isclose(float(ours), theirs, rel_tol=_RTOL, abs_tol=_RTOL):
                raise _refuse(self.path, f"must be standardised as split {d.split} of {d.name!r} is ({name} "
                                         f"{float(ours)!r}), got {name} {theirs!r}: it was made on another split.")

    def network_dim(self, d) -> int:
        """The reference's number of weights: its diagnostics', else the 1×(n_hidden or 50) network's on ``d``."""
        if self.dim is not None:
            return int(self.dim)
        width = d.n_hidden or 50
        return (d.x_train.shape[1] + 2) * width + 1

    def samples(self, seed: int, draws: Optional[int] = None) -> Tensor:
        """:data:`NUM_SAMPLES` predictive samples per test point, (M, NUM_SAMPLES): HMC's draws in turn (``draws``
        of them, evenly spaced, when given) plus noise times the normals of ``seed``."""
        f = self.f_draws if draws is None else self.thinned(draws)
        return predictive_samples(f, f.new_full((f.shape[0],), self.noise ** 2), seed)

    def thinned(self, draws: int) -> Tensor:
        """``draws`` of HMC's draws, evenly spaced over the pooled chains (all of them when there are fewer)."""
        S = self.f_draws.shape[0]
        return self.f_draws[torch.linspace(0, S - 1, min(draws, S), dtype=torch.float64).round().long()]

    def moments(self):
        """The reference predictive's mean and variance per test point, (M,) each."""
        return self.f_draws.mean(0), self.f_draws.var(0, unbiased=False) + self.noise ** 2

    def score(self, means: Tensor, noise_var: Tensor, seed: int) -> Dict[str, float]:
        """``w1``, the competition's distance, and ``w2``, the moments' 2-Wasserstein distance, of the mixture of
        N(means[s], noise_var[s]) (means (S, M), noise_var (S,)) to this reference, standardised units."""
        means = means.detach().double().cpu()
        noise_var = noise_var.detach().double().cpu().reshape(-1).expand(means.shape[0])
        ours = predictive_samples(means, noise_var, seed)
        m, v = self.moments()
        mean = means.mean(0)
        var = (means - mean).pow(2).mean(0) + noise_var.mean()
        return {"w1": float(competition_wasserstein(ours, self.samples(seed))),
                "w2": float(predictive_wasserstein2(mean, var, m, v))}


def predictive_samples(means: Tensor, noise_var: Tensor, seed: int, num: int = NUM_SAMPLES) -> Tensor:
    """Samples of the mixture of N(means[s], noise_var[s]) (means (S, M), noise_var (S,)), shape (M, num): sample
    ``i`` is draw ``i % S`` plus its noise scale times the normal ``z[i]``, z of shape (num, M) from ``seed``'s
    generator (the same normals for every predictive of the same seed and shape)."""
    S = means.shape[0]
    idx = torch.arange(num) % S
    z = torch.randn(num, means.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    z = z.to(means.dtype)
    return (means[idx] + noise_var[idx].sqrt().unsqueeze(-1) * z).T.contiguous()


def find_references(directory, dataset: str, splits: Sequence) -> Dict[int, Reference]:
    """The references in ``directory`` for the splits run (``<dataset>-split<s>.pt``), each checked against its
    split's test set; ValueError when ``directory`` is not a folder or a reference does not match. A reference
    whose diagnostics show an R-hat of ``RHAT_LIMIT`` (1.05) or more is used with a warning (its chains
    disagree)."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"pyro-fa uci: --hmc-reference must be a folder, got {str(directory)!r}.")
    out = {}
    for d in splits:
        path = folder / f"{dataset}-split{d.split}.pt"
        if path.is_file():
            ref = Reference.load(path, d.split)
            ref.check(d)
            if ref.rhat_max is not None and not ref.rhat_max < RHAT_LIMIT:
                warnings.warn(f"pyro-fa uci: the HMC reference {path} has R-hat {ref.rhat_max:.3f} (not below "
                              f"{RHAT_LIMIT}): its chains disagree, and distances to it are not a posterior's.",
                              stacklevel=2)
            out[d.split] = ref
    return out


def reference_key(references: Dict[int, Reference]) -> Dict[str, str]:
    """What a unit scored against (split -> file digest): part of its key, so a new reference retrains it."""
    return {str(s): r.digest for s, r in sorted(references.items())}


@dataclass
class Fit:
    """What a method's final fits give to be scored: predictive means (S, R, M) and noise variances ((R, 1) or
    (S, R, 1), standardised units) of replicas ``0..n-1`` = the splits run, its network's size, the prior
    precision and noise scales (R,) it chose, and its final training's seconds per split."""

    means: Tensor
    noise_var: Tensor
    dim: int
    precision: float
    noise: Tensor
    seconds: float
    map_seconds: Optional[float] = None


def score_fit(fit: Fit, data, splits: Sequence, references: Dict[int, Reference], seed: int) -> Dict[str, dict]:
    """One method's records, split (str) -> record: ``w1``, ``w2``, the split's test ``ll`` and ``rmse`` (original
    units), ``seconds`` and (where known) ``map_trainings``, its ``precision`` and ``noise`` beside the reference's;
    ``skipped`` with the reason for a network that is not the reference's."""
    from pyro_fa.experiments.uci.scores import evaluate

    out = {}
    nv = fit.noise_var if fit.noise_var.dim() == 3 else fit.noise_var.unsqueeze(0)
    for r, d in enumerate(splits):
        ref = references.get(d.split)
        if ref is None:
            continue
        if fit.dim != ref.network_dim(d):
            out[str(d.split)] = {"skipped": f"its network has {fit.dim} weights, the reference's "
                                            f"{ref.network_dim(d)}"}
            continue
        means, var = fit.means[:, r], nv[:, r].expand(fit.means.shape[0], 1)
        scores = evaluate(means.unsqueeze(1), var.unsqueeze(1), data.take(torch.tensor([r])))
        rec = {**ref.score(means, var.squeeze(-1), seed + 7919 * d.split), "ll": float(scores["ll"][0]),
               "rmse": float(scores["rmse"][0]), "seconds": fit.seconds, "precision": fit.precision,
               "noise": float(fit.noise[r]), "reference_precision": ref.precision, "reference_noise": ref.noise,
               "reference": ref.digest}
        if fit.map_seconds:
            rec["map_trainings"] = fit.seconds / fit.map_seconds
        out[str(d.split)] = rec
    return out


def score_reference(data, splits: Sequence, references: Dict[int, Reference], seed: int,
                    draws: int) -> Dict[str, dict]:
    """The reference's own records: its test ``ll`` and ``rmse`` (as the methods', its mixture over HMC's draws)
    and the floor of the distances a method of ``draws`` posterior draws can reach: ``w1`` and ``w2`` of the
    reference thinned to ``draws`` evenly spaced draws."""
    from pyro_fa.experiments.uci.scores import evaluate

    out = {}
    for r, d in enumerate(splits):
        ref = references.get(d.split)
        if ref is None:
            continue
        f = ref.f_draws.to(data.x.dtype)
        nv = f.new_full((f.shape[0], 1, 1), ref.noise ** 2)
        scores = evaluate(f.unsqueeze(1), nv, data.take(torch.tensor([r])))
        s = seed + 7919 * d.split
        thin = ref.thinned(draws)
        m, v = ref.moments()
        w2 = predictive_wasserstein2(thin.mean(0), thin.var(0, unbiased=False) + ref.noise ** 2, m, v)
        out[str(d.split)] = {"w1": float(competition_wasserstein(ref.samples(s, draws), ref.samples(s))),
                             "w2": float(w2), "draws": int(thin.shape[0]), "ll": float(scores["ll"][0]),
                             "rmse": float(scores["rmse"][0]), "rhat_max": ref.rhat_max,
                             "precision": ref.precision, "noise": ref.noise, "reference": ref.digest}
    return out


# ----------------------------------------------------------------------------- the report's section
def _cell(value: Optional[float], digits: int = 3) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def fidelity_rows(scored: Dict[str, Dict[str, dict]], split: str) -> list:
    """One split's rows ``(name, record)``: the reference first, then the MAP fit and the methods scored (a skipped
    method keeps its reason); ``map_trainings`` filled in from the MAP fit's seconds where the record lacks it."""
    map_seconds = scored.get(MAP_NAME, {}).get(split, {}).get("seconds")
    rows = []
    for name, per_split in scored.items():
        rec = dict(per_split.get(split, {}))
        if not rec:
            continue
        if "seconds" in rec and "map_trainings" not in rec and map_seconds:
            rec["map_trainings"] = rec["seconds"] / map_seconds
        rows.append((name, rec))
    first = (HMC_NAME, MAP_NAME)
    return sorted(rows, key=lambda row: first.index(row[0]) if row[0] in first else len(first))


def fidelity_tables(fidelity: Dict[str, Dict[str, Dict[str, dict]]], labels: Dict[str, str]) -> str:
    """Markdown: per dataset and scored split, every method's distance to HMC beside its test LL, RMSE and cost."""
    from pyro_fa.experiments._io import markdown_table

    names = {HMC_NAME: "HMC reference (thinned to the methods' draws: the floor)", MAP_NAME: "MAP 1×50", **labels}
    parts = [("W1 to HMC: the competition's distance (mean over test points of the 1-Wasserstein distance "
              f"between {NUM_SAMPLES} predictive samples each), W2: the 2-Wasserstein distance of the two "
              "predictives' moments, both in standardised y (lower is closer); test LL and RMSE in original units, "
              "on this split; s: the final training's seconds per split (no search); MAP ×: that over the MAP "
              "fit's; α, σ: the prior precision and noise (standardised) of the fit, the reference's in its row.")]
    for ds, scored in fidelity.items():
        splits = sorted({s for per_split in scored.values() for s in per_split}, key=int)
        for split in splits:
            rows = []
            for name, r in fidelity_rows(scored, split):
                if "skipped" in r:
                    rows.append([names.get(name, name), f"not scored: {r['skipped']}"] + [""] * 7)
                    continue
                label = names.get(name, name) + (f", R-hat {r['rhat_max']:.3f}" if r.get("rhat_max") else "")
                rows.append([label, _cell(r.get("w1")), _cell(r.get("w2")), _cell(r.get("ll")),
                             _cell(r.get("rmse")), _cell(r.get("seconds"), 1), _cell(r.get("map_trainings"), 1),
                             _cell(r.get("precision"), 2), _cell(r.get("noise"))])
            parts.append(f"**{ds}, split {split}**\n\n" + markdown_table(
                ["method", "W1 to HMC", "W2 (moments)", "test LL", "RMSE", "s", "MAP ×", "α", "σ"], rows))
    return "\n\n".join(parts)
