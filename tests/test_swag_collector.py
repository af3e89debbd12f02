"""SWAG's collector is a part it holds: a new schedule is a subclass of IterateCollector passed as collector=
(docs/architecture.md, "Add a collector"), checked against OnlineFactorAnalysis fed the same iterates by hand."""
import re
from pathlib import Path

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from pyro_fa import OnlineFactorAnalysis
from pyro_fa.swag import SWAG, IterateCollector

ROOT = Path(__file__).resolve().parents[1]


def _example():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Add a collector", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def _run_example():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        namespace = {"__name__": "__docs__"}
        exec(compile(_example(), "docs/architecture.md (Add a collector)", "exec"), namespace)
    finally:
        torch.set_default_dtype(default)
    return namespace


def _by_hand():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    cycle = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3)
    fa = OnlineFactorAnalysis(5, 2, "em", warmup=3, seed=0, step_scale=1.0, lr=1e-3)  # SWAG's defaults
    low_steps = []
    for step in range(1, 61):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        if lr <= 0.01:
            fa.update(parameters_to_vector(net.parameters()).detach())
            low_steps.append(step)
        cycle.step()
    return net, fa, low_steps


def test_the_documented_collector_collects_exactly_the_low_points_of_the_cycle(capsys):
    ns = _run_example()
    swag = ns["swag"]
    assert capsys.readouterr().out.split() == ["60", "10"]
    assert swag.n_steps == 60 and swag.n_collected == 10 and swag.n_refused == 0
    # the same training by hand (float32, as the example): every step taken at the cycle's lowest rate goes
    # to an OnlineFactorAnalysis
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        net, fa, low_steps = _by_hand()
    finally:
        torch.set_default_dtype(default)
    assert low_steps == list(range(1, 61, 6))  # CyclicLR starts at its base rate, a cycle is 6 steps
    assert fa.n_updates == swag.n_collected
    assert torch.equal(swag.loc, fa.loc)
    assert torch.equal(swag.cov_factor, fa.cov_factor)
    assert torch.equal(swag.cov_diag, fa.cov_diag)
    assert torch.equal(ns["net"].weight, net.weight)  # the hook did not change the training


def test_the_collectors_counts_are_saved_and_loaded_with_the_posterior():
    ns = _run_example()
    swag, low = ns["swag"], ns["LowPointCollector"]
    sd = swag.state_dict()
    assert {k: sd["_extra_state"][k] for k in ("n_steps", "n", "n_window", "n_refused")} == dict(
        n_steps=60, n=10, n_window=0, n_refused=0)
    other = SWAG(ns["net"], rank=2, method="em", warmup=3, seed=1, collector=low(ns["opt"], low=0.01))
    other.load_state_dict(sd)
    assert other.n_steps == 60 and other.n_collected == 10
    assert torch.equal(other.cov_factor, swag.cov_factor)


def test_the_default_collector_is_built_from_swags_arguments():
    net = torch.nn.Linear(3, 1)
    swag = SWAG(net, rank=1, start_after=2, collect_every=3, window=2, max_deviation=None, on_nonfinite="skip")
    c = swag.collector
    assert type(c) is IterateCollector
    assert (c.start_after, c.collect_every, c.window, c.max_deviation, c.on_nonfinite) == (2, 3, 2, None, "skip")
    assert [t for t in range(1, 15) if c.due(t)] == [5, 8, 11, 14]
    assert swag.window == 2 and swag.start_after == 2


def test_collector_refusals():
    net = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match=r"SWAG: start_after, collect_every, window, on_nonfinite and "
                                         r"max_deviation must be left at their defaults with a collector"):
        SWAG(net, rank=1, collector=IterateCollector(), start_after=3)
    with pytest.raises(TypeError, match=r"SWAG: collector must be an IterateCollector, got dict"):
        SWAG(net, rank=1, collector={})
    with pytest.raises(ValueError, match=r"IterateCollector: collect_every must be an integer >= 1, got 0"):
        IterateCollector(collect_every=0)
    with pytest.raises(ValueError, match=r"IterateCollector: window must be an integer >= 1, got 0"):
        IterateCollector(window=0)
    with pytest.raises(ValueError, match=r"IterateCollector: on_nonfinite must be one of"):
        IterateCollector(on_nonfinite="ignore")
    with pytest.raises(ValueError, match=r"IterateCollector: max_deviation must be a finite number > 1 or None"):
        IterateCollector(max_deviation=1.0)
