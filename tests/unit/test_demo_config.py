"""`eagle3 demo --target toy|smollm2`: each target's config is a valid eagle3.yaml for that target, written in
its own default directory, and a directory holding the other target's demo is refused in one line."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from eagle3_cli.main import DEMOS, demo_config, main
from eagle3_core.config import load_config
from eagle3_core.errors import ConfigError


def args(target: str, workdir: Path | None) -> argparse.Namespace:
    return argparse.Namespace(
        target=target, workdir=str(workdir) if workdir else None, conversations=None, shard_size=None
    )


@pytest.mark.parametrize("target", sorted(DEMOS))
def test_each_demo_writes_a_config_for_its_own_target(
    target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = demo_config(args(target, None), DEMOS[target])
    assert path == tmp_path / DEMOS[target].workdir / "eagle3.yaml"
    cfg = load_config(path)
    assert cfg.target.path == target
    assert cfg.data.shard_size == DEMOS[target].shard_size
    assert cfg.cache_root == (tmp_path / ".cache" / "eagle3").resolve()  # the repository's cache, shared
    assert demo_config(args(target, None), DEMOS[target]) == path  # found again, kept as it is


def test_a_workdir_holding_the_other_demo_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo_config(args("toy", tmp_path), DEMOS["toy"])
    with pytest.raises(ConfigError, match=r"target.path is 'toy', not 'smollm2': .* give --workdir another"):
        demo_config(args("smollm2", tmp_path), DEMOS["smollm2"])
    assert main(["demo", "--target", "smollm2", "--workdir", str(tmp_path)]) == 2
    [line] = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("error: ") and "give --workdir another directory for --target smollm2" in line
