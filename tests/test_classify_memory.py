"""The peak-memory meter of ``pyro-fa classify``'s Laplace rows (``fit_peak_mib``) and the rows that use it."""
import pytest
import torch

from pyro_fa.experiments.classify import posthoc, report
from pyro_fa.experiments.classify.posthoc import ResidentPeak

linux_proc = pytest.mark.skipif(not posthoc._reset_high_water_mark(), reason="/proc/self/clear_refs refused here")


@linux_proc
def test_resident_peak_sees_an_allocation_freed_before_reading():
    peak = ResidentPeak()
    block = torch.ones(200 << 18, dtype=torch.float32)  # 200 MiB of float32, written: resident
    assert block.numel() * 4 == 200 << 20
    del block  # freed before the reading: the high-water mark still holds it
    added = peak.added_mib()
    assert added is not None and 150 <= added < 400


@linux_proc
def test_resident_peak_reset_times_the_next_part_alone():
    peak = ResidentPeak()
    block = torch.ones(200 << 18, dtype=torch.float32)
    del block
    first = peak.added_mib(reset=True)
    small = torch.ones(10 << 18, dtype=torch.float32)  # 10 MiB
    second = peak.added_mib()
    assert first >= 150 and second < 100
    del small


def test_resident_peak_is_none_where_clear_refs_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(posthoc, "_CLEAR_REFS", str(tmp_path / "absent" / "clear_refs"))
    peak = ResidentPeak()
    block = torch.ones(50 << 18, dtype=torch.float32)
    assert peak.ok is False and peak.added_mib() is None and peak.added_mib(reset=True) is None
    del block


def test_resident_peak_is_none_where_status_is_unreadable(monkeypatch, tmp_path):
    monkeypatch.setattr(posthoc, "_STATUS", str(tmp_path / "status"))
    assert ResidentPeak().added_mib() is None


def test_max_or_none():
    assert posthoc._max_or_none(3.0, 5.0) == 5.0
    assert posthoc._max_or_none(3.0, None) is None


def test_chosen_cell_shows_the_mean_peak_over_the_seeds_that_measured_it():
    extra = [{"prior_precision": 10.0, "fit_peak_mib": 100.0}, {"prior_precision": 10.0, "fit_peak_mib": 140.0},
             {"prior_precision": 30.0, "fit_peak_mib": None}]
    assert report._chosen(extra) == "pp 10 ×2, 30; fit peak 120 MiB"
    assert report._chosen([{"prior_precision": 1.0}]) == "pp 1"


def test_new_laplace_rows_are_labelled_tempered_and_peers():
    for row in ("laplace-kron", "laplace-full"):
        assert row in posthoc.TEMPERED and posthoc.PEERS[row] == "laplace" and report._is_peer(row + "+T")
        assert "all" in report.label(row) and report.label(row + "+T").endswith(" + T")
    assert posthoc.LAPLACE_ROWS["laplace-full"]["hessian_structure"] == "full"
    assert posthoc.FULL_MAX_WEIGHTS == 8000
