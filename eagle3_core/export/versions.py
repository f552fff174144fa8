"""What an export version is, apart from its two formats: the digest of what they hold, so that exporting an
unchanged drafter again publishes nothing; and the evaluation a new version carries over from the one it
replaces, marked as measured on that one.

A version (store/layout.py `export_versions`) holds:

    sglang/, speculators/   the two formats, never changed once renamed in
    digest.json             {"digest": sha256 of both formats' config.json text and tensors (name, dtype,
                            shape, bytes)}: what `publish_export` compares the next export with
    eval/                   the measurements of it (eval_step), and `carried.json` where some were carried

`eval/carried.json` lists the files copied from the version before, each with its sha256 and the version
(name and digest) it was measured on. A file is a carried measurement while its bytes are the ones listed:
`eagle3 eval` writing the report again makes it this version's own. A promotion is never made from a
carried report (steps/evaluation.py `promote_step`).
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3_core.engines.engine_config import CONFIG_FILE
from eagle3_core.errors import ExportError
from eagle3_core.export.common import WEIGHTS_FILE, ExportContents
from eagle3_core.store.atomic import json_text, read_json_object
from eagle3_core.store.digest import file_sha256

DIGEST_FILE = "digest.json"
EVAL_DIR = "eval"  # store/layout.py `export_eval`
CARRIED_FILE = "carried.json"


def _update(digest: Any, name: str, config_text: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    config = config_text.encode()
    digest.update(f"{name}\0{len(config)}\0".encode() + config)
    for key, tensor in tensors:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{key}\0{str(tensor.dtype).removeprefix('torch.')}\0{list(tensor.shape)}\0".encode())
        digest.update(flat.view(torch.uint8).numpy().data)  # the bytes as they are: no copy


def contents_digest(formats: Iterable[tuple[str, ExportContents]]) -> str:
    """The digest of what an export writes: each format's (in the order given) config.json text and tensors,
    taken one format at a time (a generator keeps one format's tensors in memory)."""
    digest = hashlib.sha256()
    for name, contents in formats:
        _update(digest, name, contents.config_text, sorted(contents.tensors.items()))
    return digest.hexdigest()


def _files_digest(export_dir: Path, names: Iterable[str]) -> str | None:
    """`contents_digest` of an export directory's files (a version from before digest.json); None where a
    format is not there as our exports write it."""
    digest = hashlib.sha256()
    for name in names:
        config, weights = export_dir / name / CONFIG_FILE, export_dir / name / WEIGHTS_FILE
        if not (config.is_file() and weights.is_file()):
            return None
        with safe_open(str(weights), framework="pt") as f:
            keys = sorted(f.keys())
            _update(digest, name, config.read_text(encoding="utf-8"), ((k, f.get_tensor(k)) for k in keys))
    return digest.hexdigest()


def version_digest(export_dir: Path, names: Iterable[str]) -> str | None:
    """The digest of what `export_dir` (a run's export, through its link) holds: its digest.json's, or from
    its files for a version written before digest.json; None when it holds no whole export of ours."""
    recorded = export_dir / DIGEST_FILE
    if recorded.is_file():
        digest = read_json_object(recorded, ExportError).get("digest")
        if isinstance(digest, str):
            return digest
    try:
        return _files_digest(export_dir, names)
    except (OSError, ValueError, RuntimeError):  # a torn or foreign file: not what would be written
        return None


def write_digest(version: Path, digest: str) -> None:
    """digest.json in a version being written (published with it: no rename of its own)."""
    (version / DIGEST_FILE).write_text(json_text({"digest": digest}), encoding="utf-8")


def carry_eval(previous: Path, version: Path, digest_before: str | None) -> list[str]:
    """The evaluation of `previous` (the export being replaced, through its link) copied into `version`'s
    eval/, each file listed in eval/carried.json as measured on `previous` (or, for one `previous` had
    carried itself and kept as it was, on the version it was measured on); the names carried."""
    source = previous / EVAL_DIR
    if not source.is_dir():
        return []
    before = carried_files(source)
    measured_on = {"version": previous.resolve().name, "digest": digest_before}
    target = version / EVAL_DIR
    shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns(CARRIED_FILE))
    files: dict[str, Any] = {}
    for path in sorted(p for p in target.rglob("*") if p.is_file() and not p.is_symlink()):
        name = path.relative_to(target).as_posix()
        sha = file_sha256(path)
        earlier = before.get(name)
        files[name] = {"sha256": sha, "measured_on": earlier if earlier is not None else measured_on}
    (target / CARRIED_FILE).write_text(
        json_text(
            {
                "about": "these files were measured on an earlier export of this run, carried here when it was "
                "exported again with other bytes; `eagle3 eval` measures this one",
                "files": files,
            }
        ),
        encoding="utf-8",
    )
    return sorted(files)


def carried_files(eval_dir: Path) -> dict[str, dict[str, Any]]:
    """{file in eval_dir: the version it was measured on ({"version", "digest"})} for each file carried from
    an earlier version and not written since (its bytes still the ones carried)."""
    marker = eval_dir / CARRIED_FILE
    if not marker.is_file():
        return {}
    listed = read_json_object(marker, ExportError).get("files")
    out: dict[str, dict[str, Any]] = {}
    for name, entry in (listed if isinstance(listed, dict) else {}).items():
        path = eval_dir / name
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("measured_on"), dict)
            and path.is_file()
            and entry.get("sha256") == file_sha256(path)
        ):
            out[name] = entry["measured_on"]
    return out


def carried_from(report: Path) -> str | None:
    """The version `report` (a file in an export's eval/) was measured on, where it was carried from an
    earlier version and not measured again since; None for this version's own measurement."""
    measured_on = carried_files(report.parent).get(report.name)
    return None if measured_on is None else str(measured_on.get("version"))
