"""tests/gpu_prebuilt.prebuilt_dir, the GPU tests' lookup of what a tests.device builder made: the environment
variable's directory once it holds the marker, else a skip naming what is missing and the command that builds it."""
from __future__ import annotations

import os

import pytest

from tests.gpu_prebuilt import ROOT, prebuilt_dir


def test_the_environment_names_the_directory_once_it_holds_the_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("HELMC_PREBUILT_DIR_CHECK", str(tmp_path))
    with pytest.raises(pytest.skip.Exception) as e:
        prebuilt_dir("HELMC_PREBUILT_DIR_CHECK", "check", "b/manifest.json", "check bundle b",
                     "build_check .devrt/check", needs_gpu=False)
    assert str(e.value) == (f"no check bundle b at {tmp_path}: build on the compiler machine with "
                            "`python -m tests.device.build_check .devrt/check` and carry .devrt")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text("{}")
    assert prebuilt_dir("HELMC_PREBUILT_DIR_CHECK", "check", "b/manifest.json", "check bundle b",
                        "build_check .devrt/check", needs_gpu=False) == str(tmp_path)


def test_without_the_variable_the_folder_under_devrt(monkeypatch):
    monkeypatch.delenv("HELMC_PREBUILT_DIR_CHECK", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"at .*\.devrt.no-such-folder"):
        prebuilt_dir("HELMC_PREBUILT_DIR_CHECK", "no-such-folder", "refs.npz", "x", "y", needs_gpu=False)
    assert not os.path.exists(os.path.join(ROOT, ".devrt", "no-such-folder"))
