"""FactorLaplace where it leaves the process or meets unusual layers: pickle / torch.save round trips, deep copies
that call their own network, and the GLM predictive of a recurrent network, whose CPU kernel
(``mkldnn_rnn_layer``) has no forward-mode derivative, against dense reverse-mode Jacobians."""
import copy
import io
import pickle

import torch
from torch import nn

from pyro_fa.laplace import FactorLaplace
from pyro_fa.predictive.glm import linearized_moments


def _fitted(**kw):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = torch.randint(3, (40,), generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    return net, X, FactorLaplace(net, "classification", rank=3, prior_precision=0.5, **kw).fit([(X, y)])


def _predictions(la, X):
    torch.manual_seed(1)
    return la.predict_proba(X, pred_type="glm"), la.predict_proba(X, pred_type="nn", num_samples=20), la.log_marginal_likelihood()


def test_pickle_and_torch_save_round_trips_give_the_same_posterior_and_predictions():
    net, X, la = _fitted()
    buf = io.BytesIO()
    torch.save(la, buf)
    buf.seek(0)
    for other in (pickle.loads(pickle.dumps(la)), torch.load(buf, weights_only=False)):
        post, want = other.get_posterior(), la.get_posterior()
        for name in ("loc", "cov_factor", "cov_diag"):
            torch.testing.assert_close(getattr(post, name), getattr(want, name), rtol=0, atol=0)
        for a, b in zip(_predictions(other, X), _predictions(la, X)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # the copy calls its own network, not the original's
        assert other.model is not net and other._f.model is other.model


def test_a_deep_copy_samples_networks_from_its_own_model():
    """With subset="last_layer" the sampled networks read the first layer from the model: a deep copy must read
    its own copy's, so a later change to the original network leaves the copy's predictions as they were."""
    net, X, la = _fitted(subset="last_layer")
    twin = copy.deepcopy(la)
    before = _predictions(twin, X)[1]
    with torch.no_grad():
        net[0].weight.add_(1.0)
    torch.testing.assert_close(_predictions(twin, X)[1], before, rtol=0, atol=0)
    assert not torch.allclose(_predictions(la, X)[1], before)


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(2, 3, batch_first=True)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _dense_moments(net, loc, X, cov):
    """f(x; loc) and J_x cov J_x^T with J_x from torch.autograd.functional.jacobian (reverse mode), per example."""
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]

    def f(theta, x):
        parts = dict(zip(names, (t.view(s) for t, s in zip(theta.split([s.numel() for s in shapes]), shapes))))
        return torch.func.functional_call(net, parts, (x[None],))[0]

    Js = torch.stack([torch.autograd.functional.jacobian(lambda th: f(th, x), loc) for x in X])  # (N, C, D)
    return torch.stack([f(loc, x) for x in X]).detach(), Js @ cov @ Js.transpose(-1, -2)


def test_glm_predictive_of_an_lstm_matches_dense_reverse_mode_jacobians():
    # float32: torch's LSTM under vmap fails in float64 on the CPU (a broadcast error inside aten::lstm's
    # batching fallback), in the fit as in the predictive; float32 takes the mkldnn kernel
    torch.manual_seed(0)
    net = _Recurrent().float().eval()
    X = torch.randn(30, 4, 2, dtype=torch.float32)
    y = torch.randint(2, (30,))
    la = FactorLaplace(net, "classification", rank=3, prior_precision=2.0).fit([(X, y)])
    D = la.dim
    post = la.get_posterior()
    mean, cov = la._glm_moments(X[:5])
    ref_mean, ref_cov = _dense_moments(net, la.loc, X[:5], post.covariance_matrix)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cov, ref_cov, rtol=1e-4, atol=1e-7)
    probs = la.predict_proba(X[:5], pred_type="glm")
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=torch.float32))
    # and linearized_moments with a covariance factor F F^T + diag(psi) of its own (factor_sign = +1)
    g = torch.Generator().manual_seed(3)
    F = torch.randn(D, 4, generator=g, dtype=torch.float32) * 0.1
    psi = torch.rand(D, generator=g, dtype=torch.float32) * 0.1
    mean, cov = linearized_moments(net, la.loc, X[:5], cov_diag=psi, cov_factor=F)
    ref_mean, ref_cov = _dense_moments(net, la.loc, X[:5], F @ F.T + torch.diag(psi))
    torch.testing.assert_close(cov, ref_cov, rtol=1e-4, atol=1e-7)
    var = linearized_moments(net, la.loc, X[:5], cov_diag=psi, cov_factor=F, diagonal=True)[1]
    torch.testing.assert_close(var, ref_cov.diagonal(dim1=-2, dim2=-1), rtol=1e-4, atol=1e-7)
