"""Adversarial: a library whose manifest has a mistyped ``calibration`` must be refused with a
clear error (AnchorLibraryError / ValueError, which ``POST /admin/anchors/reload`` turns into a
400 and ``serve`` into ``sfcl: error``), never an AttributeError / TypeError (a 500 with a
traceback: seen with ``"calibration": "x"``)."""

import pytest

from sfcl.library.store import AnchorLibraryError
from sfcl.library.versions import load_library
from sfcl.snapshot.triggers import TriggerConfig
from tests.test_library_store import _edit_manifest, save


@pytest.mark.parametrize("calibration", ["x", 5, [1, 2]])
def test_mistyped_calibration_is_refused_at_load(tmp_path, calibration):
    lib_dir = save(tmp_path / "lib")
    _edit_manifest(lib_dir, calibration=calibration)
    with pytest.raises(AnchorLibraryError, match="calibration"):
        load_library(lib_dir)


@pytest.mark.parametrize("calibration", [
    "x", {"thresholds": "abc"}, {"thresholds": [1, 2]}, {"thresholds": {"surprisal_z": None}},
    {"thresholds": {"surprisal_z": [1]}}, {"thresholds": {"surprisal_z": "nan"}},
])
def test_mistyped_thresholds_are_a_value_error(calibration):
    with pytest.raises(ValueError, match="thresholds|calibration"):
        TriggerConfig.from_calibration(calibration)
