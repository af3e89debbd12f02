"""`pyro-fa uci` and `pyro-fa classify` time their units after torch's one-time imports (the first optimizer)."""
import subprocess
import sys


def test_pay_lazy_imports_imports_torch_compiler_stack_before_a_unit_starts():
    code = ("import sys, torch\n"
            "from pyro_fa.experiments._io import pay_lazy_imports\n"
            "before = 'torch._dynamo' in sys.modules\n"
            "pay_lazy_imports()\n"
            "print(before, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
