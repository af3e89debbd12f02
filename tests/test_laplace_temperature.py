"""FactorLaplace.optimize_prior_precision("gridsearch", temperature=True): the prior precision chosen by the
validation NLL after a temperature fitted at each grid value, against a brute force (one FactorLaplace per grid
value, scipy's minimize_scalar on the temperature), on an overconfident softmax regression, and its refusals."""
import doctest
import math

import pytest
import torch
from scipy.optimize import minimize_scalar
from torch import nn

import pyro_fa.laplace._prior as prior_module
from pyro_fa.laplace import FactorLaplace

GRID = [10.0 ** (k / 2) for k in range(-4, 13)]  # 1e-2 ... 1e6


def _blobs(n, seed, d=5, classes=3):
    """Overlapping Gaussian classes: a linear model fitted on few points is overconfident."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=torch.Generator().manual_seed(123)) * 1.2
    y = torch.randint(classes, (n,), generator=g)
    return (centres[y] + torch.randn(n, d, generator=g)).double(), y


@pytest.fixture(scope="module")
def problem():
    """A softmax regression trained to its MAP under a tiny weight decay (1e-3) on 30 points."""
    torch.manual_seed(0)
    x_tr, y_tr = _blobs(30, 1)
    net = nn.Linear(5, 3).double()
    opt = torch.optim.LBFGS(net.parameters(), lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-14)

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x_tr), y_tr, reduction="sum") + 0.5e-3 * sum(
            p.pow(2).sum() for p in net.parameters())
        loss.backward()
        return loss

    opt.step(closure)
    return net, (x_tr, y_tr), _blobs(120, 2), _blobs(4000, 3)


def _fitted(net, train, prior_precision=1.0):
    return FactorLaplace(net, "classification", rank=17, prior_precision=prior_precision).fit([train])


def _nll(logp, y, t=1.0):
    return float(-(logp / t).log_softmax(-1).gather(-1, y[:, None]).mean())


def _brute_force(net, train, val):
    """Per grid value a FactorLaplace fitted at that prior precision; the temperature by scipy (bounded Brent on
    log T over [0.01, 100])."""
    x_va, y_va = val
    out = []
    for v in GRID:
        la = _fitted(net, train, prior_precision=v)
        logp = la.predict_proba(x_va, pred_type="glm").detach().double().clamp_min(1e-300).log()
        res = minimize_scalar(lambda s: _nll(logp, y_va, math.exp(s)), bounds=(math.log(1e-2), math.log(1e2)),
                              method="bounded", options={"xatol": 1e-10})
        out.append((res.fun, math.exp(res.x), _nll(logp, y_va)))
    return out


def test_the_joint_choice_equals_a_brute_force(problem):
    net, train, val, _ = problem
    la = _fitted(net, train)
    chosen = float(la.optimize_prior_precision("gridsearch", val_loader=[val], grid=GRID, temperature=True))
    brute = _brute_force(net, train, val)
    k = min(range(len(GRID)), key=lambda i: brute[i][0])
    assert chosen == GRID[k]
    assert la.temperature == pytest.approx(brute[k][1], rel=1e-5)
    values, tempered, temps = la.grid_tempered_
    assert values == GRID
    assert tempered == pytest.approx([b[0] for b in brute], rel=1e-9)
    assert temps == pytest.approx([b[1] for b in brute], rel=1e-5)
    assert la.grid_scores_[1] == pytest.approx([b[2] for b in brute], rel=1e-9)
    # the tempered NLL never exceeds the raw one (T = 1 is a candidate), and the raw choice differs here
    assert all(t <= r + 1e-12 for t, r in zip(tempered, la.grid_scores_[1]))


def test_untempered_choice_is_unchanged_and_clears_the_temperature(problem):
    net, train, val, _ = problem
    la = _fitted(net, train)
    la.optimize_prior_precision("gridsearch", val_loader=[val], grid=GRID, temperature=True)
    assert la.temperature is not None
    raw = float(la.optimize_prior_precision("gridsearch", val_loader=[val], grid=GRID))
    assert la.temperature is None
    brute = _brute_force(net, train, val)
    assert raw == GRID[min(range(len(GRID)), key=lambda i: brute[i][2])]
    la.optimize_prior_precision("gridsearch", val_loader=[val], grid=GRID, temperature=True)
    la.optimize_prior_precision("marglik", n_steps=5)
    assert la.temperature is None


def test_on_an_overconfident_model_the_joint_choice_beats_raw_then_temperature(problem):
    """The fair check: on validation the joint choice can never lose to the raw choice followed by a temperature
    (the raw choice is one of its candidates), and on 4 000 held-out points it does not lose either. Here the
    raw NLL picks a wide posterior to cure the MAP's overconfidence; the tempered NLL picks a narrower one."""
    net, train, val, (x_te, y_te) = problem
    with torch.no_grad():
        logp_map = net(x_te).log_softmax(-1)
    map_nll = _nll(logp_map, y_te)
    la = _fitted(net, train)
    raw = float(la.optimize_prior_precision("gridsearch", val_loader=[val], grid=GRID))
    logp_val = la.predict_proba(val[0], pred_type="glm").double().log()
    t_raw = minimize_scalar(lambda s: _nll(logp_val, val[1], math.exp(s)), bounds=(-4.7, 4.7), method="bounded").x
    raw_then_t = _nll(la.predict_proba(x_te, pred_type="glm").double().log(), y_te, math.exp(t_raw))
    raw_val_t = _nll(logp_val, val[1], math.exp(t_raw))
    joint = float(la.optimize_prior_precision("gridsearch", val_loader=[val], grid=GRID, temperature=True))
    joint_t = _nll(la.predict_proba(x_te, pred_type="glm").double().log(), y_te, la.temperature)
    assert min(la.grid_tempered_[1]) <= raw_val_t + 1e-9
    assert _nll(la.predict_proba(x_te, pred_type="glm").double().log(), y_te) < map_nll  # the MAP is overconfident here
    assert joint != raw
    assert joint_t <= raw_then_t


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="marglik", temperature=True), r"temperature=True needs method='gridsearch'.*got method='marglik'"),
    (dict(method="gridsearch", temperature=1), r"temperature must be True or False, got 1"),
    (dict(method="gridsearch", temperature=True, grid=[1.0, -1.0]), r"grid must be a non-empty sequence"),
    (dict(method="gridsearch", temperature=True, val_loader=None), r"needs val_loader, got None"),
    (dict(method="gridsearch", temperature=True, val_loader=[]), r"val_loader must yield at least one batch"),
])
def test_bad_input_is_refused_and_nothing_is_stored(problem, kwargs, match):
    net, train, val, _ = problem
    la = _fitted(net, train, prior_precision=3.0)
    la.optimize_prior_precision("gridsearch", val_loader=[val], grid=GRID, temperature=True)
    before = (la.prior_precision.clone(), la.temperature)
    kwargs = {"val_loader": [val], **kwargs}
    with pytest.raises(ValueError, match=match):
        la.optimize_prior_precision(kwargs.pop("method"), **kwargs)
    assert torch.equal(la.prior_precision, before[0]) and la.temperature == before[1]


def test_a_non_finite_validation_point_is_refused(problem):
    net, train, val, _ = problem
    la = _fitted(net, train, prior_precision=3.0)
    x = val[0].clone()
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"validation NLL is not finite at prior precision\(s\) \[0.1, 10.0\]"):
        la.optimize_prior_precision("gridsearch", val_loader=[(x, val[1])], grid=[0.1, 10.0], temperature=True)
    assert float(la.prior_precision) == 3.0 and la.temperature is None


def test_regression_is_refused():
    net = nn.Linear(2, 1).double()
    x = torch.randn(20, 2, dtype=torch.float64)
    la = FactorLaplace(net, "regression", rank=2).fit([(x, x.sum(-1, keepdim=True))])
    with pytest.raises(ValueError, match=r"temperature=True needs likelihood='classification'.*got 'regression'"):
        la.optimize_prior_precision("gridsearch", val_loader=[(x, x.sum(-1, keepdim=True))], temperature=True)
    assert float(la.prior_precision) == 1.0 and la.temperature is None


def test_doctest():
    result = doctest.testmod(prior_module, extraglobs={"FactorLaplace": FactorLaplace, "torch": torch})
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------- laplace-torch's "+T" row in classify
def test_laplace_torch_tempered_grid_equals_a_brute_force(problem):
    # pyro_fa.experiments.classify.baselines: here beside FactorLaplace's tempered grid, which it mirrors
    """``laplace_probs(prior_method="gridsearch", tempered={})`` (pyro-fa classify's "laplace-grid+T"): the value
    of laplace-torch's 100-value grid with the least tempered validation NLL, each value predicted by a separate
    ``laplace_probs(prior_precision=value)`` and its temperature by scipy; the raw choice's probabilities are
    those of the call without ``tempered``."""
    from pyro_fa.experiments.classify import baselines as peers

    if peers.unavailable_reasons()["laplace"] is not None:
        pytest.skip("laplace-torch does not import here")
    (x_tr, y_tr), (x_va, y_va), (x_te, _) = _blobs(100, 4), problem[2], problem[3]
    train, val, x_te = (x_tr, y_tr), (x_va, y_va), x_te[:50]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for _ in range(300):  # long enough to be overconfident on 100 points
            opt.zero_grad()
            nn.functional.cross_entropy(net(train[0]), y_tr).backward()
            opt.step()
    rng = (-2.0, 4.0)
    info, tempered = {}, {}
    (p_raw,) = peers.laplace_probs(net, train, val, [x_te], prior_method="gridsearch", log_prior_prec_range=rng,
                                   info=info, tempered=tempered)
    (p_alone,) = peers.laplace_probs(net, train, val, [x_te], prior_method="gridsearch", log_prior_prec_range=rng)
    assert torch.equal(p_raw, p_alone)  # the raw row is untouched by the tempered search
    best = None
    for v in torch.logspace(*rng, 100).tolist():
        p_val, p_test = peers.laplace_probs(net, train, None, [val[0], x_te], prior_precision=v)
        logp = p_val.double().clamp_min(1e-300).log()
        res = minimize_scalar(lambda s: _nll(logp, val[1], math.exp(s)), bounds=(math.log(1e-2), math.log(1e2)),
                              method="bounded", options={"xatol": 1e-10})
        if best is None or res.fun < best[0] - 1e-9:
            best = (res.fun, v, math.exp(res.x), p_test)
    assert tempered["prior_precision"][0] == pytest.approx(best[1], rel=1e-5)
    assert tempered["temperature"] == pytest.approx(best[2], rel=1e-4)
    assert tempered["val_nll_tempered"] == pytest.approx(best[0], rel=1e-7)
    torch.testing.assert_close(tempered["probs"][0], best[3], rtol=1e-5, atol=1e-6)
    assert info["prior_precision"][0] < 1.0 < 1e3 < tempered["prior_precision"][0]  # they differ here
    with pytest.raises(ValueError, match="tempered needs prior_method='gridsearch'"):
        peers.laplace_probs(net, train, val, [x_te], tempered={})
