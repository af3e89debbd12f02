"""Scale 0 (the mean, which tune_scale may choose) and the GLM predictive, kept consistent across the API."""
import math

import pytest
import torch
from torch import nn

from pyro_fa import SWAG


def _swag(T=60, seed=0):
    torch.manual_seed(seed)
    net = nn.Linear(2, 1).double()
    swag = SWAG(net, rank=1, method="em", warmup=10, seed=seed, max_deviation=None)
    g = torch.Generator().manual_seed(seed)
    for _ in range(T):
        with torch.no_grad():
            net.weight.copy_(1.0 + 0.1 * torch.randn(1, 2, generator=g, dtype=torch.float64))
            net.bias.copy_(0.1 * torch.randn(1, generator=g, dtype=torch.float64))
        swag.collect()
    return net, swag


def test_a_posterior_at_scale_0_round_trips_through_its_state_dict():
    net, swag = _swag()
    swag.scale = 0.0  # what tune_scale sets when the mean wins
    state = swag.state_dict()
    other_net = nn.Linear(2, 1).double()
    other = SWAG(other_net, rank=1, method="em", warmup=10, max_deviation=None)
    other.load_state_dict(state)
    assert other.scale == 0.0
    torch.testing.assert_close(other.sample_parameters(2), swag.loc.expand(2, -1), rtol=0, atol=0)
    state["_extra_state"] = dict(state["_extra_state"], scale=-1.0)
    with pytest.raises(ValueError, match=r"'scale' must be a finite number >= 0, got -1.0"):
        other.load_state_dict(state)
    assert other.scale == 0.0
