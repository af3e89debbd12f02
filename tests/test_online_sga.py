"""Online SGA (method="sga") of OnlineFactorAnalysis: the fused Adam pass and the running scale."""
import pytest
import torch

from pyro_fa import OnlineFactorAnalysis


def _stream(D=40, K=3, T=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(D, K, generator=g, dtype=torch.float64)
    return 5.0 + torch.randn(T, K, generator=g, dtype=torch.float64) @ F.T + torch.randn(T, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_adam_matches_torch_adam(batch):
    # the default (fused, row-blocked) path against torch.optim.Adam on the same gradients
    X = _stream()
    kw = dict(method="sga", warmup=20, seed=0, dtype=torch.float64, lr=1e-2, lr_decay_after=30)
    fused = OnlineFactorAnalysis(40, 3, **kw)
    fused._work.block_rows = lambda element_size: 7  # several blocks, the last one partial
    ref = OnlineFactorAnalysis(40, 3, optimizer=torch.optim.Adam, **kw)
    assert fused.fit_state.fused and not ref.fit_state.fused
    for chunk in X.split(batch):
        fused.update(chunk)
        ref.update(chunk)
    assert torch.allclose(fused.cov_factor, ref.cov_factor, rtol=1e-10, atol=1e-12)
    assert torch.allclose(fused.cov_diag, ref.cov_diag, rtol=1e-10, atol=1e-12)
    sf, sr = fused.fit_state.optimizer.state[fused._F], ref.fit_state.optimizer.state[ref._F]
    assert float(sf["step"]) == float(sr["step"]) == len(X.split(batch)) - 20 // batch
    assert torch.allclose(sf["exp_avg_sq"], sr["exp_avg_sq"], rtol=1e-10, atol=1e-14)


def test_cached_capacitance_is_that_of_the_current_iterate():
    X = _stream()
    fa = OnlineFactorAnalysis(40, 3, method="sga", warmup=20, seed=0, dtype=torch.float64, lr=1e-2)
    fa._work.block_rows = lambda element_size: 9
    fa.update(X)
    for x in X[:30]:
        fa.update(x)
    F, psi = fa._F.detach(), fa._log_psi.detach().exp()
    dense = torch.eye(3, dtype=torch.float64) + F.T @ torch.diag(1 / psi) @ F
    assert torch.allclose(fa.fitter.step_for(fa._ctx)._sga_capacitance(fa.fit_state, fa._ctx), dense)
    # a change from outside (here load_state_dict) is noticed, not served from the cache
    other = OnlineFactorAnalysis(40, 3, method="sga", warmup=20, seed=5, dtype=torch.float64, lr=1e-2)
    other.update(X[:60])
    other.load_state_dict(fa.state_dict())
    assert torch.allclose(other.fitter.step_for(other._ctx)._sga_capacitance(other.fit_state, other._ctx), dense)


def test_standardising_scale_follows_running_variance():
    # a stream whose spread grows (like drifting SGD iterates): the scale is that of all data seen
    X = _stream(T=400) * torch.linspace(1, 5, 400, dtype=torch.float64).unsqueeze(-1)
    fa = OnlineFactorAnalysis(40, 3, method="sga", warmup=50, seed=0, dtype=torch.float64)
    for x in X:
        fa.update(x)
    ref = X.var(0, unbiased=False)
    assert torch.allclose(fa._scale.pow(2), ref, rtol=1e-10)  # set at the last step, from all vectors
    total = fa.cov_diag + fa.cov_factor.pow(2).sum(-1)
    # the fitted diagonal is at the data's scale: after 350 ascent steps (default lr 1e-2) on a stream whose spread
    # grew fivefold it is within 0.59 of it (0.13 with the thesis's lr 1e-3, which barely leaves its start)
    assert float((total / ref - 1).abs().max()) < 0.75


def test_swag_sga_warns():
    from pyro_fa import SWAG

    net = torch.nn.Linear(3, 1)
    with pytest.warns(UserWarning, match="method 'sga'"):
        SWAG(net, rank=2, method="sga")


@pytest.mark.parametrize("future_flag", ["overwrite", "swap"])
@pytest.mark.parametrize("optimizer", [None, torch.optim.Adam], ids=["fused", "torch-adam"])
def test_sga_keeps_learning_after_to_replaces_parameters(future_flag, optimizer):
    """.to() that replaces the Parameter objects re-points the optimizer: the factor keeps moving,
    exactly as after a .to() that keeps them (torch's default)."""
    X = _stream().float()
    kw = dict(method="sga", warmup=20, seed=0, lr=1e-2, optimizer=optimizer, dtype=torch.float32)
    setter = getattr(torch.__future__, f"set_{future_flag}_module_params_on_conversion")
    getter = getattr(torch.__future__, f"get_{future_flag}_module_params_on_conversion")
    moved, reference = OnlineFactorAnalysis(40, 3, **kw), OnlineFactorAnalysis(40, 3, **kw)
    for fa in (moved, reference):
        fa.update(X[:60])
    before = getter()
    setter(True)
    try:
        moved.to(torch.float64)
    finally:
        setter(before)
    reference.to(torch.float64)
    assert moved.cov_factor.dtype == torch.float64
    assert [id(p) for g in moved.fit_state.optimizer.param_groups for p in g["params"]] == [id(moved._F), id(moved._log_psi)]
    assert set(map(id, moved.fit_state.optimizer.state)) <= {id(moved._F), id(moved._log_psi)}
    F_moved = moved.cov_factor.clone()
    X64 = X.double()
    for fa in (moved, reference):
        fa.update(X64[60:120])
    assert not torch.equal(moved.cov_factor, F_moved)
    assert torch.equal(moved.cov_factor, reference.cov_factor)
    assert torch.equal(moved.cov_diag, reference.cov_diag)


def _fa_stream(D, K, T, seed):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(D, K, generator=g, dtype=torch.float64)
    psi = 0.3 + torch.rand(D, generator=g, dtype=torch.float64)
    X = -2.0 + torch.randn(T, K, generator=g, dtype=torch.float64) @ F.T
    X += torch.randn(T, D, generator=g, dtype=torch.float64) * psi.sqrt()
    return F @ F.T + torch.diag(psi), X


@pytest.mark.slow
def test_default_sga_reaches_the_truth_of_a_synthetic_fa_stream():
    # stationary FA data with known (F, Psi): the default SGA (lr 1e-2) ends within 0.05 of the true covariance
    # (relative Frobenius) and within 4 times scikit-learn's batch FactorAnalysis on the same 20 000 vectors
    # (measured: 0.029 against 0.011); the thesis's lr 1e-3 stays near its start (measured 0.58)
    from sklearn.decomposition import FactorAnalysis

    C, X = _fa_stream(D=10, K=2, T=20_000, seed=0)
    rel = lambda cov: float(torch.linalg.norm(cov - C) / torch.linalg.norm(C))  # noqa: E731
    batch = rel(torch.from_numpy(FactorAnalysis(n_components=2).fit(X.numpy()).get_covariance()))
    fa = OnlineFactorAnalysis(10, 2, method="sga", seed=0, dtype=torch.float64)
    assert fa.fitter.lr == 1e-2
    slow = OnlineFactorAnalysis(10, 2, method="sga", seed=0, dtype=torch.float64, lr=1e-3)
    for chunk in X.split(10):
        fa.update(chunk)
        slow.update(chunk)
    assert batch < 0.02
    assert rel(fa.covariance()) < min(0.05, 4 * batch)
    assert rel(slow.covariance()) > 0.3
