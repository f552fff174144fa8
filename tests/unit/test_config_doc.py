"""docs/configuration.md is what eagle3_core.config_doc generates from the configuration's models."""

import subprocess
import sys

from eagle3_core.config import TrainConfig
from eagle3_core.config_doc import configuration_doc
from tests.conftest import REPO


def test_the_configuration_document_is_the_generated_one() -> None:
    written = (REPO / "docs" / "configuration.md").read_text()
    assert written == configuration_doc(), (
        "stale: run python -m eagle3_core.config_doc > docs/configuration.md"
    )


def test_the_document_names_every_train_field_with_its_description() -> None:
    doc = configuration_doc()
    section = doc.split("## `train` (TrainConfig)", 1)[1].split("\n## ", 1)[0]
    for name, field in TrainConfig.model_fields.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| `{name}` |"))
        assert (field.description or "").split("\n")[0][:40].replace("|", "\\|") in row


def test_the_command_the_document_names_prints_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_core.config_doc"], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout == configuration_doc()
