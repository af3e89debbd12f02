import os
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "uci"
if "PYRO_FA_DATA" not in os.environ and SHARED_DATA.is_dir():
    os.environ["PYRO_FA_DATA"] = str(SHARED_DATA)

torch.set_num_threads(1)  # the tests run many tiny kernels: one thread avoids oversubscription

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, scope="session")
def _one_blas_thread():
    """NumPy / scikit-learn BLAS on one thread too (spin-waiting threads cost 40x on a loaded 2-core machine)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        yield


@pytest.fixture(autouse=True)
def _clear_param_store():
    """Every test starts and ends with an empty Pyro param store (guides register their parameters there)."""
    import pyro

    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _float64_and_seed():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(old)
