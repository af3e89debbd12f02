"""FactorLaplace's curvature structures (pyro_fa.laplace.structures): the registry that picks one from ``rank`` or
``structure=``, and a structure defined outside the library (docs/architecture.md, "Add a curvature structure"):
its evidence, posterior variances and GLM predictive variances against dense torch linear algebra."""
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from pyro_fa.laplace import FactorLaplace, curvature_vectors, flat_network
from pyro_fa.laplace.structures import STRUCTURES, Blocks, DenseLowRank, Structure, get_structure

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def diagonal():
    """Run the docs' block (it registers "diagonal"); unregister it afterwards (the registry is global)."""
    text = ARCHITECTURE.read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index("## Add a curvature structure"):], flags=re.S).group(1)
    namespace = {"__name__": "user_structure"}
    exec(compile(block, "docs/architecture.md[Add a curvature structure]", "exec"), namespace)
    yield namespace["Diagonal"]
    STRUCTURES.classes.pop("diagonal", None)


def _problem(likelihood, C, N=30, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, C)).double()
    x = torch.randn(N, 3, dtype=torch.float64)
    y = torch.randint(C, (N,)) if likelihood == "classification" else torch.randn(N, C, dtype=torch.float64)
    return net, x, y


def _dense_ggn(la, x):
    """(1/N) sum_n J_n^T Lambda_n J_n, dense (D, D), from the per-example curvature vectors (sigma = 1)."""
    theta = torch.cat([p.detach().reshape(-1) for p in la._params])
    V = curvature_vectors(flat_network(la.model, la._named), theta, x, la.likelihood, "ggn")
    return V.T @ V / x.shape[0], theta


def test_the_structure_is_chosen_from_rank_or_by_name():
    assert get_structure("FactorLaplace", None, 3) is DenseLowRank
    assert get_structure("FactorLaplace", None, [2, 1]) is Blocks
    assert get_structure("FactorLaplace", None, {"0": 2}) is Blocks
    assert get_structure("FactorLaplace", None, "auto") is Blocks
    assert get_structure("FactorLaplace", "blocks", 3) is Blocks
    assert issubclass(DenseLowRank, Structure) and STRUCTURES.view["dense"] is DenseLowRank
    net, x, y = _problem("classification", 3)
    assert FactorLaplace(net, "classification", rank=[2, 1])._structure.layout.names == ["0", "2"]
    with pytest.raises(ValueError, match=r"FactorLaplace: structure must be one of \(.*'dense'.*\), got 'kron'\."):
        FactorLaplace(net, "classification", rank=2, structure="kron")


@pytest.mark.parametrize("likelihood,C", [("regression", 2), ("classification", 3)])
def test_a_structure_added_outside_the_library_matches_dense_linear_algebra(diagonal, likelihood, C):
    net, x, y = _problem(likelihood, C)
    sigma = 0.7 if likelihood == "regression" else 1.0
    delta = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)  # one per parameter tensor
    la = FactorLaplace(net, likelihood, structure="diagonal", prior_precision=delta, sigma_noise=sigma, chunk_size=7)
    la.fit([(x[:13], y[:13]), (x[13:], y[13:])])
    assert isinstance(la._structure, diagonal) and la.rank == 0 and la.cov_factor.shape == (la.dim, 0)
    G, theta = _dense_ggn(la, x)
    N = x.shape[0]
    torch.testing.assert_close(la.cov_diag, G.diagonal(), rtol=1e-12, atol=1e-14)
    sizes = [p.numel() for p in net.parameters()]
    d = torch.repeat_interleave(delta, torch.tensor(sizes))
    P = torch.diag(d + N / sigma ** 2 * G.diagonal())  # the structure's precision, dense
    torch.testing.assert_close(la.get_posterior().variance, torch.linalg.inv(P).diagonal(), rtol=1e-12, atol=0)
    torch.testing.assert_close(la.posterior_precision, P, rtol=1e-12, atol=0)
    # the evidence: log p(D | theta) - (log det P - sum log delta + sum delta theta^2) / 2
    out = net(x)
    if likelihood == "regression":
        loglik = -((y - out) ** 2).sum() / (2 * sigma ** 2) - 0.5 * N * C * math.log(2 * math.pi * sigma ** 2)
    else:
        loglik = -nn.functional.cross_entropy(out, y, reduction="sum")
    lml = loglik - 0.5 * (torch.logdet(P) - d.log().sum() + (d * theta ** 2).sum())
    torch.testing.assert_close(la.log_marginal_likelihood().detach(), lml.detach(), rtol=1e-12, atol=1e-10)
    # the GLM predictive's variance: diag(J_x P^{-1} J_x^T) (+ sigma^2 for a regression)
    xt = torch.randn(4, 3, dtype=torch.float64)
    J = torch.func.jacrev(lambda t: flat_network(net, list(net.named_parameters()))(t, (xt,)))(theta)  # (4, C, D)
    var = torch.einsum("ncd,de,nce->nc", J, torch.linalg.inv(P), J)
    if likelihood == "regression":
        mean, glm_var = la.predict(xt, pred_type="glm", return_var=True)
        torch.testing.assert_close(glm_var, var + sigma ** 2, rtol=1e-10, atol=1e-12)
    else:
        (m, v), = la._linearized_marginals((xt,), None)
        torch.testing.assert_close(v, var, rtol=1e-10, atol=1e-12)


def test_a_structure_added_outside_the_library_saves_its_own_buffers(diagonal):
    net, x, y = _problem("regression", 1)
    la = FactorLaplace(net, "regression", structure="diagonal").fit([(x, y)])
    state = la.state_dict()
    assert "cov_factor" not in state and "block_ranks" not in state
    fresh = FactorLaplace(net, "regression", structure="diagonal")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.log_marginal_likelihood(), la.log_marginal_likelihood())
    dense = FactorLaplace(net, "regression", rank=2)
    with pytest.raises(ValueError, match=r"missing keys \[.cov_factor.\] and unexpected keys \[\]"):
        dense.load_state_dict(state)
