"""The one registry of predictives by ``pred_type`` (pyro_fa.predictive.registry), the "Add a predictive" example of
docs/architecture.md (a new ``pred_type`` in one module), and the tables that replaced string dispatch in the
Laplace approximation: every likelihood-keyed table covers every likelihood."""
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from pyro_fa.laplace import FactorLaplace
from pyro_fa.predictive import LIKELIHOODS, check_pred_type
from pyro_fa.predictive.registry import DEFAULT_LINK_APPROX, PREDICTIVES, link_choice, register_predictive
from pyro_fa.swag import SWAG, MultiSWAG

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def registry():
    """The registry as it was, restored after the test (a test's pred_type must not leak into others)."""
    saved = dict(PREDICTIVES), dict(DEFAULT_LINK_APPROX)
    yield
    PREDICTIVES.clear()
    PREDICTIVES.update(saved[0])
    DEFAULT_LINK_APPROX.clear()
    DEFAULT_LINK_APPROX.update(saved[1])


def _docs_block():
    section = (ROOT / "docs" / "architecture.md").read_text().split("## Add a predictive", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[1]


def test_the_built_in_pred_types_in_order():
    assert list(PREDICTIVES) == ["nn", "glm"]
    assert DEFAULT_LINK_APPROX == {"nn": "mc", "glm": "probit"}
    assert PREDICTIVES["glm"].link_approxes == ("mc", "probit") and PREDICTIVES["nn"].link_approxes == ("mc",)


def test_the_docs_example_adds_a_pred_type_to_every_posterior(registry):
    torch.set_default_dtype(torch.float32)
    namespace = {"__name__": "docs_add_a_predictive"}
    exec(compile(_docs_block(), "docs/architecture.md (Add a predictive, a new pred_type)", "exec"), namespace)
    assert "mean" in PREDICTIVES and DEFAULT_LINK_APPROX["mean"] == "mc"
    net, x = namespace["net"].double(), namespace["x"].double()
    la = FactorLaplace(net, "classification", rank=2).fit([(x, namespace["y"])])
    # the network at the mean, by hand: FactorLaplace's mean is the weights at fit
    torch.testing.assert_close(la.predict_proba(x, pred_type="mean", num_samples=2), net(x).softmax(-1).detach(),
                               rtol=1e-12, atol=1e-12)
    swag, twin = SWAG(net, rank=1), SWAG(net, rank=1)  # the twin collects the same iterates: the same mean
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        with torch.no_grad():
            net.weight.add_(0.1 * torch.randn(net.weight.shape, generator=g, dtype=net.weight.dtype))
        swag.collect()
        twin.collect()
    w = torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone()
    torch.nn.utils.vector_to_parameters(swag.loc, net.parameters())
    expected = net(x).detach()
    torch.nn.utils.vector_to_parameters(w, net.parameters())
    torch.testing.assert_close(swag.predict(x, pred_type="mean", num_samples=3), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.nn.utils.parameters_to_vector(net.parameters()), w)  # restored after the draws
    multi = MultiSWAG([swag, twin])
    torch.testing.assert_close(multi.predict(x, pred_type="mean", num_samples=4), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"SWAG: link_approx='probit' needs pred_type='glm' \(Gaussian outputs\), "
                                         r"got pred_type='mean'"):
        swag.predict_proba(x, pred_type="mean", link_approx="probit")


def test_the_pred_types_named_in_errors_follow_the_registry(registry):
    register_predictive("point", lambda source, loader: None)
    with pytest.raises(ValueError, match=r"f: pred_type must be one of \('nn', 'glm', 'point'\), got 'lin'"):
        check_pred_type("f", "lin")
    with pytest.raises(ValueError, match=r"f: pred_type must be one of \('nn', 'glm', 'point'\), got \['nn'\]"):
        check_pred_type("f", ["nn"])


def test_register_predictive_refuses_a_taken_name_and_a_default_it_does_not_offer(registry):
    with pytest.raises(ValueError, match=r"register_predictive: pred_type must be a new name, got 'glm', already "
                                         r"registered"):
        register_predictive("glm", lambda source, loader: None)
    with pytest.raises(ValueError, match=r"register_predictive: default_link_approx must be one of \('mc',\), got "
                                         r"'probit'"):
        register_predictive("other", lambda source, loader: None, default_link_approx="probit")
    assert "other" not in PREDICTIVES


def test_link_choice_keeps_link_approx_where_the_pred_type_offers_a_choice():
    assert link_choice("glm", "mc") == "mc" and link_choice("glm", None) is None
    assert link_choice("nn", "probit") is None  # sampled networks always average draws
    assert link_choice("unknown", "probit") == "probit"  # left for check_pred_type to refuse the pred_type


def test_every_likelihood_table_covers_every_likelihood():
    from pyro_fa.laplace import _gridsearch, _loaders, _predictive, _prior, curvature
    from pyro_fa.predictive import likelihood

    tables = [_loaders.BATCH_LOSSES, _predictive.FORWARD, _predictive.NOISE_STD, _prior._TRAIN_LOG_LIKELIHOODS,
              _prior._LOG_LIKELIHOOD_GRADIENTS, curvature._GGN_FACTORS, curvature._SAMPLED_TARGETS,
              _gridsearch._VALIDATION_NLLS, likelihood.OBSERVATION_NOISE, likelihood.LOG_LIKELIHOODS,
              likelihood.TARGET_CHECKS]
    for table in tables:
        assert tuple(table) == LIKELIHOODS


def test_the_option_tables_are_the_accepted_names():
    from pyro_fa.laplace import _laplace_torch, _prior, curvature
    from pyro_fa.predictive import scale

    assert tuple(scale.SCALE_RULES) == scale.RULES == ("gated", "one_se", "fraction", "argmax", "significant")
    assert tuple(_prior._PRIOR_SEARCHES) == _prior.PRIOR_METHODS
    assert tuple(_prior._EVIDENCE_CORRECTIONS) == _prior.EVIDENCE_MODES
    assert tuple(curvature._KINDS) == curvature.CURVATURES
    assert tuple(curvature.SUBSETS) == ("all", "last_layer")
    assert _laplace_torch.HESSIAN_STRUCTURES == ("lowrank", "full")
    assert _laplace_torch.PRIOR_STRUCTURES == ("scalar", "layerwise")


def test_a_skipped_vector_warns_at_the_callers_line():
    net = nn.Linear(2, 1)
    swag = SWAG(net, rank=1, on_nonfinite="skip")
    with torch.no_grad():
        net.weight.fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match=r"SWAG: .* It was not collected") as record:
        assert swag.collect() is False
    assert record[0].filename == __file__
