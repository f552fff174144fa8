"""The project's packaging: installing it prints no setuptools deprecation warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PREPARE_METADATA = """
import sys
from setuptools import build_meta
build_meta.prepare_metadata_for_build_wheel(sys.argv[1])
"""


def test_building_the_metadata_raises_no_setuptools_deprecation(tmp_path: Path) -> None:
    # The install step builds this metadata; a deprecation turned into an error fails the build here.
    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "error::setuptools.warnings.SetuptoolsDeprecationWarning",
            "-c",
            PREPARE_METADATA,
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (dist_info,) = tmp_path.glob("eagle3-*.dist-info")
    metadata = (dist_info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata
