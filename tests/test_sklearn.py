"""The drop-in scikit-learn FactorAnalysis, against scikit-learn's own."""
import warnings

import numpy as np
import pytest
import torch
from sklearn.decomposition import FactorAnalysis as SKFactorAnalysis
from sklearn.decomposition._factor_analysis import _ortho_rotation
from sklearn.exceptions import ConvergenceWarning, NotFittedError
from sklearn.utils._param_validation import InvalidParameterError
from sklearn.utils.estimator_checks import parametrize_with_checks

from pyro_fa.fa import linalg
from pyro_fa.sklearn import FactorAnalysis


def fa_data(n=1000, dim=10, rank=3, seed=0):
    rng = np.random.default_rng(seed)
    F = rng.standard_normal((dim, rank))
    psi = rng.uniform(0.2, 1.2, dim)
    x = rng.standard_normal((n, rank)) @ F.T + rng.standard_normal((n, dim)) * np.sqrt(psi)
    return x + rng.standard_normal(dim)


def rel_cov_distance(a, b):
    """Relative Frobenius distance of two fitted models' covariances (through linalg)."""
    t = lambda v: torch.as_tensor(np.ascontiguousarray(v), dtype=torch.float64)  # noqa: E731
    return float(
        linalg.relative_frobenius_distance(
            t(a.components_.T), t(a.noise_variance_), t(b.components_.T), t(b.noise_variance_)
        )
    )


@parametrize_with_checks(
    [FactorAnalysis(), FactorAnalysis(algorithm="em"), FactorAnalysis(n_components=2, svd_method="lapack")]
)
def test_sklearn_compatible(estimator, check):
    check(estimator)


# ------------------------------------------------------------- against sklearn
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("svd_method", ["randomized", "lapack"])
@pytest.mark.parametrize("algorithm", ["svd", "em"])
def test_score_matches_sklearn(seed, svd_method, algorithm):
    X = fa_data(seed=seed)
    ours = FactorAnalysis(3, svd_method=svd_method, algorithm=algorithm).fit(X)
    theirs = SKFactorAnalysis(3, svd_method=svd_method).fit(X)
    assert ours.score(X) == pytest.approx(theirs.score(X), rel=1e-3)
    assert ours.score(X) >= theirs.score(X) - 1e-4 * abs(theirs.score(X))
    np.testing.assert_allclose(ours.mean_, theirs.mean_)
    assert ours.components_.shape == (3, 10) and ours.noise_variance_.shape == (10,)
    assert ours.n_features_in_ == 10 and ours.n_iter_ == len(ours.loglike_)


@pytest.mark.parametrize("algorithm", ["svd", "em"])
def test_converged_covariance_matches_sklearn(algorithm):
    X = fa_data(n=3000)
    ours = FactorAnalysis(3, tol=1e-8, max_iter=20000, algorithm=algorithm).fit(X)
    theirs = SKFactorAnalysis(3, tol=1e-8, max_iter=20000, svd_method="lapack").fit(X)
    assert rel_cov_distance(theirs, ours) < 1e-4
    np.testing.assert_allclose(ours.get_covariance(), theirs.get_covariance(), rtol=1e-4, atol=1e-4)
    assert ours.loglike_[-1] == pytest.approx(theirs.loglike_[-1], rel=1e-9)


def test_methods_match_sklearn_for_the_same_parameters():
    """transform, score_samples, get_precision: sklearn given our fitted parameters is the oracle."""
    X = fa_data()
    ours = FactorAnalysis(3).fit(X)
    oracle = SKFactorAnalysis(3).fit(X[:50])
    oracle.components_, oracle.noise_variance_, oracle.mean_ = ours.components_, ours.noise_variance_, ours.mean_
    np.testing.assert_allclose(ours.transform(X), oracle.transform(X), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(ours.score_samples(X), oracle.score_samples(X), rtol=1e-10)
    np.testing.assert_allclose(ours.get_precision(), oracle.get_precision(), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(ours.get_covariance(), oracle.get_covariance())
    np.testing.assert_allclose(ours.get_precision() @ ours.get_covariance(), np.eye(10), atol=1e-10)
    assert ours.score(X) == pytest.approx(oracle.score(X), rel=1e-12)
    np.testing.assert_allclose(ours.fit_transform(X), ours.transform(X))


@pytest.mark.parametrize("rotation", ["varimax", "quartimax"])
def test_rotation(rotation):
    X = fa_data()
    plain = FactorAnalysis(3).fit(X)
    rotated = FactorAnalysis(3, rotation=rotation).fit(X)
    expected = _ortho_rotation(plain.components_.T, method=rotation)[:3]
    np.testing.assert_allclose(rotated.components_, expected, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(rotated.get_covariance(), plain.get_covariance(), atol=1e-10)


def test_zero_and_full_components():
    X = fa_data(n=300)
    zero = FactorAnalysis(0).fit(X)
    np.testing.assert_allclose(zero.noise_variance_, X.var(0))
    assert zero.transform(X).shape == (300, 0)
    assert zero.score(X) == pytest.approx(SKFactorAnalysis(0).fit(X).score(X), rel=1e-12)
    full = FactorAnalysis(max_iter=300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        full.fit(X)
    assert full.components_.shape == (10, 10) and np.isfinite(full.score(X))


def test_noise_variance_init_and_float32():
    X = fa_data()
    psi0 = np.full(10, 0.5)
    a = FactorAnalysis(3, noise_variance_init=psi0, tol=1e-8, max_iter=20000).fit(X)
    b = FactorAnalysis(3, tol=1e-8, max_iter=20000).fit(X)
    assert rel_cov_distance(a, b) < 1e-3
    f32 = FactorAnalysis(3, dtype="float32").fit(X.astype(np.float32))
    assert f32.components_.dtype == np.float32 and f32.transform(X.astype(np.float32)).dtype == np.float32
    assert f32.score(X) == pytest.approx(b.score(X), rel=1e-4)


def test_device(device):
    X = fa_data(n=300)
    fa = FactorAnalysis(3, device=device).fit(X)
    cpu = FactorAnalysis(3).fit(X)
    assert isinstance(fa.components_, np.ndarray)
    assert fa.score(X) == pytest.approx(cpu.score(X), rel=1e-9)
    assert fa._model.loc.device.type == device.type


# ------------------------------------------------------------------ partial_fit
@pytest.mark.parametrize("algorithm", ["svd", "em"])
def test_partial_fit_batch_equals_fit(algorithm):
    X = fa_data(n=2000)
    full = FactorAnalysis(3, algorithm=algorithm).fit(X)
    streamed = FactorAnalysis(3, algorithm=algorithm)
    for part in np.array_split(X, 7):
        streamed.partial_fit(part)
    np.testing.assert_allclose(streamed.mean_, full.mean_, rtol=1e-12)
    np.testing.assert_allclose(streamed.components_, full.components_, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(streamed.noise_variance_, full.noise_variance_, rtol=1e-7)
    assert streamed.n_iter_ == full.n_iter_ and streamed.loglike_ == pytest.approx(full.loglike_, rel=1e-10)


@pytest.mark.parametrize("algorithm", ["online_em", "sga"])
def test_partial_fit_online_continues_the_stream(algorithm):
    X = fa_data(n=600)
    full = FactorAnalysis(3, algorithm=algorithm, batch_size=20, warmup=40).fit(X)
    streamed = FactorAnalysis(3, algorithm=algorithm, batch_size=20, warmup=40)
    for part in np.split(X, 3):  # batch boundaries aligned with batch_size: the same updates
        streamed.partial_fit(part)
    np.testing.assert_allclose(streamed.components_, full.components_, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(streamed.noise_variance_, full.noise_variance_, rtol=1e-9)
    np.testing.assert_allclose(streamed.mean_, X.mean(0))
    assert streamed.n_iter_ == full.n_iter_ == 30 and len(streamed.loglike_) == 3


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, bound", [("online_em", 0.45), ("sga", 0.1)])
def test_online_algorithms_approach_batch_em(algorithm, bound):
    # loose bounds: one pass over 20 000 samples, 2 000 updates of 10 rows
    X = fa_data(n=20000, dim=20, rank=3, seed=4)
    batch = FactorAnalysis(3).fit(X)
    online = FactorAnalysis(3, algorithm=algorithm, batch_size=10, learning_rate=1e-2).fit(X)
    assert rel_cov_distance(batch, online) < bound
    assert online.score(X) == pytest.approx(batch.score(X), rel=0.05)


@pytest.mark.parametrize("algorithm", ["svd", "online_em"])
def test_partial_fit_refuses_bad_batches_and_keeps_state(algorithm):
    X = fa_data(n=300)
    fa = FactorAnalysis(3, algorithm=algorithm, batch_size=10).partial_fit(X)
    state = {k: np.copy(getattr(fa, k)) for k in ("components_", "noise_variance_", "mean_")}
    n_seen = fa._model.n_updates
    bad = X[:20].copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="Input X contains NaN"):
        fa.partial_fit(bad)
    bad[3, 1] = np.inf
    with pytest.raises(ValueError, match="Input X contains infinity"):
        fa.partial_fit(bad)
    with pytest.raises(ValueError, match="X has 9 features, but FactorAnalysis is expecting 10 features"):
        fa.partial_fit(X[:, :9])
    assert fa._model.n_updates == n_seen
    for k, v in state.items():
        np.testing.assert_array_equal(getattr(fa, k), v)


# ------------------------------------------------------------------------ errors
def test_not_fitted():
    fa = FactorAnalysis(2)
    X = fa_data(n=20)
    for call in (fa.transform, fa.score, fa.score_samples):
        with pytest.raises(NotFittedError, match="This FactorAnalysis instance is not fitted yet"):
            call(X)
    for call in (fa.get_covariance, fa.get_precision):
        with pytest.raises(NotFittedError, match="not fitted yet"):
            call()


def test_convergence_warning():
    for algorithm in ("svd", "em"):
        with pytest.warns(ConvergenceWarning, match=f"FactorAnalysis: '{algorithm}' did not converge in max_iter=2"):
            fa = FactorAnalysis(3, max_iter=2, algorithm=algorithm).fit(fa_data())
        assert fa.n_iter_ == 2


def test_bad_arguments():
    X = fa_data(n=50)
    with pytest.raises(ValueError, match=r"FactorAnalysis: n_components must be <= n_features=10, got 11"):
        FactorAnalysis(11).fit(X)
    with pytest.raises(ValueError, match=r"n_components must be in \[1, n_features=10\) for algorithm='sga', got 10"):
        FactorAnalysis(algorithm="sga").fit(X)
    with pytest.raises(ValueError, match=r"noise_variance_init must have shape \(10,\), got \(3,\)"):
        FactorAnalysis(2, noise_variance_init=[1.0, 1.0, 1.0]).fit(X)
    with pytest.raises(ValueError, match="noise_variance_init must be finite and positive"):
        FactorAnalysis(2, noise_variance_init=-np.ones(10)).fit(X)
    with pytest.raises(ValueError, match="FactorAnalysis: dtype must be one of .* got 'float16'"):
        FactorAnalysis(2, dtype="float16").fit(X)
    with pytest.raises(TypeError, match="FactorAnalysis: dtype must be one of .* got 3"):
        FactorAnalysis(2, dtype=3).fit(X)
    with pytest.raises(TypeError, match="FactorAnalysis: device must be a str, a torch.device or None, got 0.5"):
        FactorAnalysis(2, device=0.5).fit(X)
    with pytest.raises(ValueError, match="FactorAnalysis: device must name a torch device .* got 'gpu0'"):
        FactorAnalysis(2, device="gpu0").fit(X)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="FactorAnalysis: device must be available, got 'cuda'"):
            FactorAnalysis(2, device="cuda").fit(X)
    with pytest.raises(InvalidParameterError, match="The 'algorithm' parameter of FactorAnalysis must be"):
        FactorAnalysis(2, algorithm="gibbs").fit(X)
    with pytest.raises(InvalidParameterError, match="The 'learning_rate' parameter of FactorAnalysis must be"):
        FactorAnalysis(2, algorithm="sga", learning_rate=0.0).fit(X)


@pytest.mark.parametrize("algorithm", ["svd", "em"])
def test_constant_columns_score_matches_sklearn_on_digits(algorithm):
    """float64: the noise floor is scikit-learn's 1e-12, so blank pixels do not cost ~20 nats per sample."""
    from sklearn.datasets import load_digits

    X = load_digits().data
    ref = SKFactorAnalysis(n_components=10, random_state=0).fit(X)
    ours = FactorAnalysis(n_components=10, random_state=0, algorithm=algorithm).fit(X)
    assert abs(ours.score(X) - ref.score(X)) < 0.5
    constant = X.std(0) == 0
    assert constant.any()
    np.testing.assert_allclose(ours.noise_variance_[constant], 1e-12)


@pytest.mark.parametrize("bad", [0.0, -1e-12, float("inf"), float("nan"), True, "1e-12"])
def test_batch_noise_floor_validated(bad):
    from pyro_fa.fa.batch import BatchFactorAnalysis

    with pytest.raises(ValueError, match="BatchFactorAnalysis: noise_floor must be a finite positive number or None"):
        BatchFactorAnalysis(4, 1, noise_floor=bad)


def test_batch_noise_floor_is_used():
    from pyro_fa.fa.batch import BatchFactorAnalysis

    x = torch.randn(200, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 3.0  # a constant column: its noise variance sits on the floor
    default = BatchFactorAnalysis(5, 2, dtype=torch.float64).fit(x)
    floored = BatchFactorAnalysis(5, 2, noise_floor=1e-12, dtype=torch.float64).fit(x)
    assert float(default.cov_diag[0]) > 1e-9
    assert float(floored.cov_diag[0]) == pytest.approx(1e-12)


def _pretend_fitted_at(fa, dim, rank=2):
    """A fitted estimator with cheap O(DK) attributes at a large D (nothing D x D)."""
    fa.components_ = np.ones((rank, dim))
    fa.noise_variance_ = np.ones(dim)
    fa.mean_ = np.zeros(dim)
    fa.n_features_in_ = dim
    return fa


@pytest.mark.parametrize("method", ["get_covariance", "get_precision"])
def test_dense_matrices_refused_at_large_n_features_before_allocating(method, monkeypatch):
    fa = _pretend_fitted_at(FactorAnalysis(2).fit(fa_data(n=50)), 200_000)

    def never(*args, **kwargs):
        raise AssertionError("a D x D matrix was being built")

    monkeypatch.setattr(linalg, "dense_covariance", never)
    monkeypatch.setattr(linalg, "solve", never)
    with pytest.raises(ValueError, match=rf"FactorAnalysis: {method}\(\) forms a dense n_features x n_features matrix "
                                         r"\(320 GB in torch.float64\) and needs n_features <= 20000, got 200000\. "
                                         r"Use components_ and noise_variance_.*max_dim=None"):
        getattr(fa, method)()
    with pytest.raises(ValueError, match="FactorAnalysis: max_dim must be a positive int or None, got 0"):
        getattr(fa, method)(max_dim=0)


def test_dense_matrices_limit_can_be_lifted_and_the_values_are_sklearns():
    X = fa_data(n=300)
    ours = FactorAnalysis(3, random_state=0).fit(X)
    with pytest.raises(ValueError, match=r"get_covariance\(\) forms a dense .* needs n_features <= 9, got 10"):
        ours.get_covariance(max_dim=9)
    cov = ours.get_covariance(max_dim=None)
    np.testing.assert_allclose(cov, ours.components_.T @ ours.components_ + np.diag(ours.noise_variance_), rtol=1e-12)
    np.testing.assert_allclose(ours.get_precision(max_dim=10), np.linalg.inv(cov), rtol=1e-8, atol=1e-10)
    ref = SKFactorAnalysis(3, random_state=0).fit(X)
    np.testing.assert_allclose(ours.get_covariance(), ref.get_covariance(), rtol=0, atol=1e-2)


def test_refused_fit_leaves_the_fitted_model_unchanged():
    """validate_data records the new feature count before later checks fail: the whole call must be undone."""
    X = fa_data(n=100)
    fa = FactorAnalysis(3, random_state=0).fit(X)
    before = fa.transform(X)
    with pytest.raises(ValueError, match=r"n_components must be <= n_features=2, got 3"):
        fa.fit(X[:, :2])
    with pytest.raises(ValueError, match=r"FactorAnalysis: device must hold data \('cpu' or 'cuda'\), got 'meta'"):
        fa.set_params(device="meta").fit(X[:, :4])
    fa.set_params(device=None)
    assert fa.n_features_in_ == 10
    np.testing.assert_array_equal(fa.transform(X), before)
    with pytest.raises(ValueError, match="Input X contains NaN"):
        fa.partial_fit(np.where(X > 2, np.nan, X))
    np.testing.assert_array_equal(fa.transform(X), before)
