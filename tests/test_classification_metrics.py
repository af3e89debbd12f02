"""Classification metrics against independent computations: torchmetrics, scikit-learn, dense NumPy loops."""
import math

import numpy as np
import pytest
import torch

from pyro_fa import metrics


def _probs(S, N, C, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(S, N, C, generator=g, dtype=dtype)
    y = torch.randint(0, C, (N,), generator=g)
    return logits.softmax(-1), y


def test_ece_matches_torchmetrics_and_a_loop():
    torchmetrics = pytest.importorskip("torchmetrics")
    p, y = _probs(1, 2000, 7)
    p = p[0]
    for n_bins in (1, 5, 15, 40):
        ours = float(metrics.expected_calibration_error(p, y, n_bins=n_bins))
        ref = torchmetrics.classification.MulticlassCalibrationError(num_classes=7, n_bins=n_bins, norm="l1")
        assert ours == pytest.approx(float(ref(p.float(), y)), abs=2e-6)
        # a plain loop over (lo, hi] bins, as Guo et al. (2017) define them
        conf, pred = p.max(-1)
        total = 0.0
        for b in range(n_bins):
            lo, hi = b / n_bins, (b + 1) / n_bins
            m = (conf > lo) & (conf <= hi)
            if m.any():
                total += float(m.sum()) / 2000 * abs(float((pred[m] == y[m]).double().mean() - conf[m].mean()))
        assert ours == pytest.approx(total, abs=1e-12)


def test_nll_brier_accuracy_of_the_model_average():
    p, y = _probs(5, 300, 4)
    bma = p.mean(0).numpy()
    yn = y.numpy()
    assert float(metrics.negative_log_likelihood(p, y)) == pytest.approx(-np.mean(np.log(bma[np.arange(300), yn])))
    onehot = np.eye(4)[yn]
    assert float(metrics.brier_score(p, y)) == pytest.approx(np.mean(np.sum((bma - onehot) ** 2, -1)))
    assert float(metrics.accuracy(p, y)) == pytest.approx(np.mean(bma.argmax(-1) == yn))
    torch.testing.assert_close(metrics.bma_probs(p), p.mean(0))
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    assert float(metrics.negative_log_likelihood(p, y)) == pytest.approx(sklearn_metrics.log_loss(yn, bma,
                                                                                                 labels=range(4)))


def test_entropy_and_mutual_information():
    p, _ = _probs(6, 50, 3)
    bma = p.mean(0).numpy()
    H = -(bma * np.log(bma)).sum(-1)
    np.testing.assert_allclose(metrics.predictive_entropy(p).numpy(), H)
    each = -(p.numpy() * np.log(p.numpy())).sum(-1).mean(0)
    np.testing.assert_allclose(metrics.mutual_information(p).numpy(), H - each)
    same = p[:1].expand(4, -1, -1)  # samples that agree carry no epistemic uncertainty
    torch.testing.assert_close(metrics.mutual_information(same), torch.zeros(50, dtype=p.dtype), atol=1e-12, rtol=0)
    uniform = torch.full((2, 3), 1 / 3, dtype=torch.float64)
    torch.testing.assert_close(metrics.predictive_entropy(uniform), torch.full((2,), math.log(3), dtype=torch.float64))


def test_ood_auroc_matches_sklearn_with_ties():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(3)
    s_in = torch.randint(0, 6, (200,), generator=g).double()  # many ties
    s_out = torch.randint(2, 9, (150,), generator=g).double()
    ref = sklearn_metrics.roc_auc_score(np.r_[np.zeros(200), np.ones(150)], np.r_[s_in.numpy(), s_out.numpy()])
    assert float(metrics.ood_auroc(s_in, s_out)) == pytest.approx(ref, abs=1e-12)
    assert float(metrics.ood_auroc(torch.zeros(3), torch.ones(2))) == 1.0
    assert float(metrics.ood_auroc(torch.ones(3), torch.ones(2))) == 0.5


def test_bad_input_is_refused_with_the_argument_named():
    p, y = _probs(1, 10, 3)
    p = p[0]
    with pytest.raises(ValueError, match=r"expected_calibration_error: n_bins must be an integer >= 1, got 0"):
        metrics.expected_calibration_error(p, y, n_bins=0)
    with pytest.raises(ValueError, match=r"negative_log_likelihood: targets must have shape \(10,\) like the "
                                         r"predictions' N, got \(10, 1\). Flatten it"):
        metrics.negative_log_likelihood(p, y.unsqueeze(-1))
    with pytest.raises(ValueError, match=r"accuracy: targets must be class labels in \[0, 3\), got values from 3 to 3"):
        metrics.accuracy(p, torch.full((10,), 3))
    with pytest.raises(TypeError, match=r"brier_score: targets must hold integer class labels, got dtype"):
        metrics.brier_score(p, y.double())
    with pytest.raises(ValueError, match=r"probs must sum to 1 over the last axis"):
        metrics.brier_score(p * 0.9, y)
    with pytest.raises(ValueError, match=r"probs must lie in \[0, 1\].*not logits"):
        metrics.negative_log_likelihood(torch.log(p), y)
    bad = p.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"predictive_entropy: probs must be finite"):
        metrics.predictive_entropy(bad)
    with pytest.raises(ValueError, match=r"mutual_information: samples must have shape \(S, N, C\)"):
        metrics.mutual_information(p)
    with pytest.raises(ValueError, match=r"ood_auroc: scores_out must have shape \(N,\) with N >= 1"):
        metrics.ood_auroc(torch.ones(3), torch.ones(0))
    with pytest.raises(TypeError, match=r"ood_auroc: scores_in must be a torch.Tensor"):
        metrics.ood_auroc([1.0], torch.ones(2))
