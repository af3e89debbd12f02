"""pyro_fa._validation: the argument checks every layer shares, and their messages (callers' tests match them)."""
import math

import pytest
import torch

from pyro_fa._validation import TORCH_DTYPES, check_device, positive_float


@pytest.mark.parametrize("value, expected", [(1, 1.0), (0.5, 0.5), (torch.tensor(2.0).item(), 2.0)])
def test_positive_float_returns_a_float(value, expected):
    got = positive_float("Caller", "arg", value)
    assert got == expected and type(got) is float


@pytest.mark.parametrize("value", [True, "1", None, torch.tensor(1.0)])
def test_positive_float_refuses_what_is_not_a_real_number(value):
    with pytest.raises(TypeError, match=r"^Caller: arg must be a positive float, got .*\.$"):
        positive_float("Caller", "arg", value)


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan])
def test_positive_float_refuses_what_is_not_positive_and_finite(value):
    with pytest.raises(ValueError, match=r"^Caller: arg must be a positive finite float, got .*\.$"):
        positive_float("Caller", "arg", value)


def test_check_device():
    assert check_device("Caller", None) == torch.device("cpu")
    assert check_device("Caller", torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(TypeError, match=r"Caller: device must be a str, a torch.device or None, got 0\."):
        check_device("Caller", 0)
    with pytest.raises(ValueError, match=r"Caller: where must name a torch device such as 'cpu' or 'cuda', got "):
        check_device("Caller", "no-such-device", arg="where")
    with pytest.raises(ValueError, match=r"Caller: device must hold data \('cpu' or 'cuda'\), got 'meta'"):
        check_device("Caller", "meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"Caller: device must be available, got 'cuda' but CUDA is not"):
            check_device("Caller", "cuda")


def test_dtype_names():
    assert TORCH_DTYPES[None] is torch.float64
    assert {TORCH_DTYPES[k] for k in ("float32", torch.float32)} == {torch.float32}
    assert TORCH_DTYPES["float64"] is TORCH_DTYPES[torch.float64] is torch.float64
