"""A user's CPU generator on a model that lives on another device; the CUDA checks skip without a GPU.

Every draw that takes a user's ``torch.Generator`` is drawn on the generator's device, then moved
(:mod:`pyro_fa._random`): a ``torch.Generator()`` serves a CUDA model, and one seed gives the same
draws on every device, so a posterior moved to the GPU predicts what it predicted on the CPU.
"""
import copy

import pytest
import torch
from torch import nn

from pyro_fa import SWAG, MultiSWAG, _random

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("fn, args", [(_random.randn, ((4, 3),)), (_random.rand, ((4, 3),)),
                                      (_random.randint, (7, (4, 3)))])
def test_draws_come_from_the_generators_device_then_move(fn, args):
    # "meta" holds no numbers: drawing there with a CPU generator would fail; moving there does not
    moved = fn(*args, generator=torch.Generator().manual_seed(5), device="meta")
    assert moved.device.type == "meta" and moved.shape == (4, 3)
    # the numbers are those of torch's own draw from the same CPU generator
    here = fn(*args, generator=torch.Generator().manual_seed(5), device="cpu")
    torch_fn = {_random.randn: torch.randn, _random.rand: torch.rand, _random.randint: torch.randint}[fn]
    assert torch.equal(here, torch_fn(*args, generator=torch.Generator().manual_seed(5)))
    # without a generator: torch's global RNG, on the device asked for
    torch.manual_seed(9)
    a = fn(*args, device="cpu")
    torch.manual_seed(9)
    assert torch.equal(a, torch_fn(*args))


def _swag(seed=0):
    torch.manual_seed(seed)
    x, y = torch.randn(64, 3), torch.randint(0, 3, (64,))
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    swag = SWAG(net, rank=2, method="em", warmup=3, seed=seed)
    swag.attach(opt)
    for _ in range(30):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return swag, net, x


def _to_cuda(swag, net, **kwargs):
    gpu_net = copy.deepcopy(net).cuda()
    gpu = SWAG(gpu_net, rank=2, method="em", warmup=3, **kwargs)
    gpu.load_state_dict(swag.state_dict())
    return gpu


@CUDA
def test_swag_moved_to_cuda_predicts_the_same_with_a_cpu_generator():
    swag, net, x = _swag()
    gpu = _to_cuda(swag, net)
    assert gpu.loc.is_cuda and gpu.n_collected == swag.n_collected
    for kw in ({}, {"pred_type": "glm"}):
        cpu_p = swag.predict_proba(x, num_samples=6, generator=torch.Generator().manual_seed(1), **kw)
        gpu_p = gpu.predict_proba(x.cuda(), num_samples=6, generator=torch.Generator().manual_seed(1), **kw)
        assert gpu_p.is_cuda
        torch.testing.assert_close(gpu_p.cpu(), cpu_p, rtol=1e-4, atol=1e-5)
    # a generator on the model's device is taken as well
    g = torch.Generator(device="cuda").manual_seed(1)
    assert gpu.sample(3, generator=g).is_cuda


@CUDA
def test_multiswag_on_cuda_draws_members_and_weights_with_a_cpu_generator():
    members = [_swag(s) for s in (0, 1)]
    cpu = MultiSWAG([m for m, _, _ in members])
    gpu = MultiSWAG([_to_cuda(m, net) for m, net, _ in members])
    a = cpu.sample(8, generator=torch.Generator().manual_seed(2))
    b = gpu.sample(8, generator=torch.Generator().manual_seed(2))
    assert b.is_cuda
    torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)


@CUDA
@pytest.mark.parametrize("pred_type", ["nn", "glm"])
def test_tune_scale_on_cuda_gives_the_cpus_curve_and_choice(pred_type):
    # seed= draws on a CPU generator: the GPU scores the same draws, so the curve agrees to round-off and a
    # choice between close candidates cannot flip (a CUDA generator's other stream once moved a choice 100 -> 316)
    swag, net, x = _swag()
    gpu = _to_cuda(swag, net)
    y = net(x).argmax(-1).roll(1)  # labels the mean gets partly wrong: a curve that rises before it falls
    a = swag.tune_scale(x, y, num_samples=5, seed=3, pred_type=pred_type, widen=0)
    b = gpu.tune_scale(x.cuda(), y.cuda(), num_samples=5, seed=3, pred_type=pred_type, widen=0)
    torch.testing.assert_close(torch.as_tensor(b.log_likelihoods).cpu(), torch.as_tensor(a.log_likelihoods),
                               rtol=1e-4, atol=1e-5)
    assert b.scale == a.scale and gpu.scale == swag.scale
