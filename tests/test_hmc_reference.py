"""pyro-fa hmc-reference: the network's log posterior against torch.distributions, the reference and its
diagnostics, one resumable unit file per chain (toy tasks stand in for the UCI and digits ones)."""
import json
import math

import pytest
import torch
from torch import nn
from torch.nn.utils import vector_to_parameters

from pyro_fa import cli
from pyro_fa.experiments import hmc_reference as ref
from pyro_fa.metrics import agreement, total_variation


def _regression_task(split=0):
    g = torch.Generator().manual_seed(split)
    x = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(30, generator=g, dtype=torch.float64)
    x_test = torch.randn(7, 3, generator=g, dtype=torch.float64)
    y_test = torch.sin(x_test.sum(-1))

    def make_net():
        return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)).double()

    return ref.Task("toy", split, make_net, x, y, x_test, y_test, "regression", 2.0, 0.3, {"y_std": 1.5})


def _classification_task():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 4, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    x_test = torch.randn(9, 4, generator=g, dtype=torch.float64)

    def make_net():
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()

    return ref.Task("toyc", 0, make_net, x, y, x_test, (x_test[:, 0] > 0).long(), "classification", 1.0)


def _by_hand(task, theta):
    """log p(theta) + log p(y | theta, x) by the module itself and torch.distributions."""
    net = task.make_net()
    vector_to_parameters(theta, net.parameters())
    out = net(task.x)
    prior = torch.distributions.Normal(0.0, 1 / math.sqrt(task.precision)).log_prob(theta).sum()
    if task.likelihood == "regression":
        return prior + torch.distributions.Normal(out.squeeze(-1), task.noise).log_prob(task.y).sum()
    return prior + torch.distributions.Categorical(logits=out).log_prob(task.y).sum()


@pytest.mark.parametrize("make_task", [_regression_task, _classification_task])
def test_log_posterior_matches_the_module_and_torch_distributions(make_task):
    task = make_task()
    post = ref.NetworkPosterior(task)
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(3, post.dim, generator=g, dtype=torch.float64)
    expected = torch.stack([_by_hand(task, t) for t in theta])
    assert torch.allclose(post.log_prob(theta), expected, rtol=1e-12, atol=1e-9)
    # the initialisation is the network's own (nn.Linear's bounds), one draw per generator state
    init = post.init(torch.Generator().manual_seed(5))
    assert init.shape == (post.dim,) and not torch.equal(init, post.init(torch.Generator().manual_seed(6)))


def test_classification_reference_and_chain_comparisons():
    task = _classification_task()
    settings = ref.Settings(chains=2, warmup=40, samples=20, thin=1, num_steps=4, init_steps=30)
    chains = ref.run_chains(task, [0, 1], settings, seed=0)
    reference, diag = ref.summarize(task, chains)
    probs = reference["reference"]["probs"]
    assert probs.shape == (9, 3) and torch.allclose(probs.sum(-1), torch.ones(9, dtype=probs.dtype))
    # the reference is the average of every draw of every chain; the chains' own predictives compare as stated
    pooled = torch.cat([c["draws"].double() for c in chains]).mean(0)
    assert torch.allclose(probs, pooled)
    a, b = (p["probs"] for p in reference["per_chain"])
    assert diag["between_chains"]["0-1"] == {"agreement": pytest.approx(float(agreement(a, b))),
                                             "total_variation": pytest.approx(float(total_variation(a, b)))}
    assert set(diag) >= {"rhat_max", "ess_min", "rhat_ok", "accept_rate", "step_size", "scores", "total_seconds"}
    assert 0 <= diag["scores"]["accuracy"] <= 1


def test_a_chain_does_not_depend_on_the_chains_beside_it():
    task = _regression_task()
    settings = ref.Settings(chains=3, warmup=20, samples=10, thin=1, num_steps=3, init_steps=5)
    together = ref.run_chains(task, [0, 1, 2], settings, seed=0)
    alone = ref.run_chains(task, [1], settings, seed=0)
    assert torch.allclose(together[1]["draws"], alone[0]["draws"], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(together[0]["draws"], together[1]["draws"])


@pytest.fixture
def toy_tasks(monkeypatch):
    calls = []

    def build(name, split, args, cache):
        calls.append((name, split))
        return _regression_task(split)

    monkeypatch.setitem(ref.TASKS, "yacht", build)
    return calls


def test_command_writes_the_reference_and_resumes_from_unit_files(tmp_path, toy_tasks, capsys):
    out = tmp_path / "refs"
    argv = ["hmc-reference", "--quick", "--tasks", "yacht", "--splits", "0", "--chains", "3", "--output-dir",
            str(out), "--no-progress"]
    assert cli.main(argv) == 0
    units = sorted((out / "units").glob("toy-split0__chain*.pt"))
    assert len(units) == 3
    diag = json.loads((out / "toy-split0.json").read_text())
    assert diag["chains"] == 3 and diag["draws_per_chain"] == ref.Settings.quick().samples
    assert set(diag["between_chains"]) == {"0-1", "0-2", "1-2"} and "w2" in diag["between_chains"]["0-1"]
    assert diag["rhat_ok"] == (diag["rhat_max"] < 1.05)
    saved = torch.load(out / "toy-split0.pt", weights_only=True)
    mean, var = saved["reference"]["mean"], saved["reference"]["var"]
    assert saved["f_draws"].shape == (3 * ref.Settings.quick().samples, 7)
    assert float(saved["noise"]) == pytest.approx(0.3)
    assert mean.shape == var.shape == (7,) and bool((var > 0.3 ** 2 - 1e-6).all())  # at least the noise variance
    first = capsys.readouterr().out
    assert first.count("chain") == 3 and "R-hat max" in first
    stamps = [u.stat().st_mtime_ns for u in units]
    # again: every chain is read back, none is run, the reference is the same
    assert cli.main(argv) == 0
    again = capsys.readouterr().out
    assert "chain" not in again.replace("R-hat", "") and [u.stat().st_mtime_ns for u in units] == stamps
    assert torch.equal(torch.load(out / "toy-split0.pt", weights_only=True)["reference"]["mean"], mean)
    # a damaged unit file is run again, with a warning naming it
    units[1].write_bytes(b"not a torch file")
    with pytest.warns(UserWarning, match=r"ignoring .*chain1.* which is not a readable unit file"):
        assert cli.main(argv) == 0
    assert capsys.readouterr().out.count("chain 1:") == 1


def test_command_reports_progress_in_a_log(tmp_path, toy_tasks, capsys):
    """Without --no-progress and with no terminal (pytest captures the output), one line every tenth of the
    iterations, the last one the total; with --no-progress none."""
    settings = ref.Settings.quick()
    total = settings.warmup + settings.samples * settings.thin
    argv = ["hmc-reference", "--quick", "--tasks", "yacht", "--splits", "0", "--chains", "2", "--output-dir",
            str(tmp_path / "a")]
    assert cli.main(argv) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ": iteration " in ln]
    assert len(lines) == total // max(1, total // 10) + (total % max(1, total // 10) != 0)
    assert lines[-1].startswith(f"toy-split0: iteration {total}/{total} (sampling)") and "acceptance" in lines[-1]
    assert "(warm-up)" in lines[0]
    assert cli.main(argv[:-1] + [str(tmp_path / "b"), "--no-progress"]) == 0
    assert ": iteration " not in capsys.readouterr().out


def test_command_refuses_a_bad_precision(tmp_path):
    with pytest.raises(SystemExit, match=r"pyro-fa hmc-reference: --precision must be a positive finite number, "
                                         r"got -1.0"):
        cli.main(["hmc-reference", "--quick", "--precision", "-1", "--output-dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_uci_task_is_the_benchmarks_1x50_network_at_the_map_choice(monkeypatch):
    from types import SimpleNamespace

    from pyro_fa.datasets import load_uci
    from pyro_fa.nn import BatchedMLP

    choice = {"precision": 0.1, "lr": 3e-3, "steps": 1000, "val_ll": -1.0, "tune_splits": 5}
    monkeypatch.setattr(ref, "_cached", lambda args, key, stem, compute: {"noise": 0.04} if key["kind"] ==
                        "uci-noise" else choice)
    args = SimpleNamespace(quick=True, seed=0, data_dir=None, output_dir="unused")
    task = ref.TASKS["yacht"]("yacht", 0, args, {})
    d = load_uci("yacht", 0)
    assert torch.equal(task.x, d.x_train) and torch.equal(task.y_test, d.y_test)
    assert (task.precision, task.noise, task.likelihood) == (0.1, 0.04, "regression")
    # the architecture of pyro-fa uci's BatchedMLP, 1 x 50 ReLU: the same function of the same weights
    spec = BatchedMLP(d.x_train.shape[1], (50,))
    theta = torch.randn(spec.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    net = spec.to_module(theta)
    post = ref.NetworkPosterior(task)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    assert post.dim == spec.dim
    assert torch.allclose(post.outputs(flat.unsqueeze(0), d.x_test)[0, :, 0], spec.forward(theta.unsqueeze(0),
                                                                                           d.x_test)[0])


@pytest.mark.slow
def test_quick_yacht_reference_end_to_end(tmp_path):
    """The real task: pyro-fa uci's MAP search (quick budget) for the prior precision and the noise, then HMC."""
    from pyro_fa.experiments.uci.protocol import Budget

    out = tmp_path / "refs"
    assert cli.main(["hmc-reference", "--quick", "--output-dir", str(out), "--no-progress"]) == 0
    diag = json.loads((out / "yacht-split0.json").read_text())
    (choice,) = [json.loads(p.read_text())["value"] for p in (out / "units").glob("yacht__map__*.json")]
    assert diag["precision"] == choice["precision"] and choice["precision"] in Budget.quick().precisions
    assert diag["noise"] > 0 and diag["dim"] == 6 * 50 + 50 + 50 + 1


def test_command_runs_a_dense_mass_matrix_in_units_of_its_own(tmp_path, toy_tasks, capsys):
    from pyro_fa.infer.hmc import MASS_MATRICES

    out = tmp_path / "refs"
    argv = ["hmc-reference", "--quick", "--tasks", "yacht", "--chains", "2", "--output-dir", str(out),
            "--no-progress"]
    assert cli.main(argv) == 0
    diag_units = set((out / "units").glob("toy-split0__chain*.pt"))
    keys = [torch.load(u, weights_only=True)["key"]["settings"] for u in diag_units]
    assert all("mass" not in k for k in keys)  # the default stays out of the key: earlier unit files still match
    assert json.loads((out / "toy-split0.json").read_text())["mass"] == "diag"
    assert cli.main(argv + ["--mass", "dense"]) == 0
    assert capsys.readouterr().out.count("chain") == 4  # the dense chains are run, not read from the diag ones
    dense_units = set((out / "units").glob("toy-split0__chain*.pt")) - diag_units
    assert len(dense_units) == 2
    assert all(torch.load(u, weights_only=True)["key"]["settings"]["mass"] == "dense" for u in dense_units)
    assert json.loads((out / "toy-split0.json").read_text())["mass"] == "dense"
    # the choices are the sampler's table
    parser = cli.build_parser()
    sub = parser.parse_args(["hmc-reference", "--mass", "dense"])
    assert sub.mass == "dense" and sorted(MASS_MATRICES) == ["dense", "diag"]
    with pytest.raises(SystemExit):
        cli.main(argv + ["--mass", "full"])
    assert "invalid choice: 'full'" in capsys.readouterr().err


def test_device_is_checked_and_keyed_only_when_set(tmp_path, toy_tasks):
    """``--device cpu`` is the default run (the same unit files, reused); a device torch cannot use is refused
    with the reason; the key of a unit names the device only when it is not the CPU (old units still match)."""
    out = tmp_path / "refs"
    argv = ["hmc-reference", "--quick", "--tasks", "yacht", "--splits", "0", "--chains", "2", "--output-dir",
            str(out), "--no-progress"]
    assert cli.main(argv) == 0
    stamps = sorted(u.stat().st_mtime_ns for u in (out / "units").glob("toy-split0__chain*.pt"))
    assert cli.main(argv + ["--device", "cpu"]) == 0  # reused, not run again
    assert sorted(u.stat().st_mtime_ns for u in (out / "units").glob("toy-split0__chain*.pt")) == stamps
    with pytest.raises(SystemExit, match=r"pyro-fa hmc-reference: --device must be a torch device, .* got 'gpu0'"):
        cli.main(argv + ["--device", "gpu0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"pyro-fa hmc-reference: --device 'cuda' needs CUDA, which this torch "
                                             r"does not see"):
            cli.main(argv + ["--device", "cuda"])
    assert "device" not in ref._settings_key(ref.Settings())
    assert ref._settings_key(ref.Settings(device="cuda:0"))["device"] == "cuda:0"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chains_on_cuda_start_where_the_cpu_chains_start():
    """On a GPU the chains start from the CPU run's initialisations (moved by the same Adam steps, to rounding),
    the draws come back to the CPU, and the log posterior is the CPU's."""
    task = _regression_task()
    cpu = ref.Settings.quick()
    gpu = ref.Settings.quick()
    gpu.device = "cuda"
    a = ref.run_chains(task, [0, 1], cpu, seed=0)
    b = ref.run_chains(task, [0, 1], gpu, seed=0)
    assert all(c["draws"].device.type == "cpu" and c["draws"].shape == d["draws"].shape for c, d in zip(a, b))
    post, post_gpu = ref.NetworkPosterior(task), ref.NetworkPosterior(ref.on_device(task, "cuda"))
    theta = torch.randn(3, post.dim, dtype=torch.float64)
    assert torch.allclose(post_gpu.log_prob(theta.cuda()).cpu(), post.log_prob(theta), rtol=1e-10)
    g = torch.Generator().manual_seed(5)
    assert torch.equal(post_gpu.init(g).cpu(), post.init(torch.Generator().manual_seed(5)))


def test_mnist1d_task_is_the_classify_mlp_at_a_given_precision(tmp_path):
    """``--tasks mnist1d`` is pyro-fa classify's MNIST-1D MLP on its training part (the split the validation-cut
    seed), at the precision given; its log posterior is the module's, and the reference's checks name its data."""
    import argparse

    from pyro_fa.experiments.classify.data import load_classify
    from pyro_fa.experiments.classify.networks import make_network

    args = argparse.Namespace(precision=0.5, quick=True, output_dir=str(tmp_path), seed=0, data_dir=None)
    task = ref.TASKS["mnist1d"]("mnist1d", 1, args, {})
    data = load_classify("mnist1d", seed=1)
    assert task.label == "mnist1d-split1" and task.likelihood == "classification" and task.precision == 0.5
    assert torch.equal(task.x, data.x_train.double()) and torch.equal(task.y_test, data.y_test)
    assert [p.shape for p in task.make_net().parameters()] == [p.shape for p in make_network("mlp", data).parameters()]
    post = ref.NetworkPosterior(task)
    theta = post.init(torch.Generator().manual_seed(0)).unsqueeze(0)
    small = ref.Task("m", 1, task.make_net, task.x[:50], task.y[:50], task.x_test, task.y_test, "classification", 0.5)
    assert torch.allclose(ref.NetworkPosterior(small).log_prob(theta), _by_hand(small, theta[0]).unsqueeze(0),
                          rtol=1e-12)
