"""Where everything lives in a store. One place, so no other module builds a store path by hand."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

SHARD_KEY = re.compile(r"^(?P<dataset>[a-z0-9][a-z0-9_]*)-(?P<index>\d{5,})$")
VOCAB_INFO_FILE = (
    "vocab_mapping.json"  # the vocab mapping's JSON half (draft/vocab.py writes it, store checks read it)
)
PROMOTION_RECORD = "current.json"  # the DrafterCurrent record, in each promotion directory


def export_eval_dir(export_dir: Path) -> Path:
    """The eval/ directory of an export (`export/<run>`, or a version of it): its measurements."""
    return Path(export_dir) / "eval"


def shard_key(dataset: str, index: int) -> str:
    return f"{dataset}-{index:05d}"


def check_shard_key(key: str) -> str:
    if not SHARD_KEY.match(key):
        raise ValueError(
            f"{key!r} is not a shard key (expected '{{dataset}}-{{index:05d}}', e.g. 'chat-00003')"
        )
    return key


def _safe_name(name: str) -> str:
    """A host name as one path component (no separators, nothing hidden)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "host"


@dataclass(frozen=True)
class StoreLayout:
    root: Path

    @property
    def inbox_record(self) -> Path:
        """Which inbox files were ingested (size, mtime, sha256, state): eagle3_core/data/inbox.py."""
        return self.root / "inbox.json"

    @property
    def ingest_lock(self) -> Path:
        """Held while the inbox is ingested, so two callers never write the ledger at once."""
        return self.root / ".inbox.lock"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.json"

    def conversations(self, key: str) -> Path:
        return self.root / "conversations" / f"{check_shard_key(key)}.jsonl"

    def conversations_manifest(self, key: str) -> Path:
        return self.root / "conversations" / f"{check_shard_key(key)}.json"

    def rejects(self, key: str) -> Path:
        return self.root / "conversations" / f"{check_shard_key(key)}.rejects.jsonl"

    def unsharded_rejects(self, source: str, first_line: int) -> Path:
        """Rejected rows of a source that fell in no shard (its last rows, not one a new sample), by source
        and first line; a short digest of the name keeps two sources apart that _safe_name makes alike."""
        tag = hashlib.sha256(source.encode()).hexdigest()[:8]
        name = f"{_safe_name(source)}-{tag}-{first_line}.rejects.jsonl"
        return self.root / "conversations" / "unsharded" / name

    def regenerated(self, key: str) -> Path:
        return self.root / "regenerated" / f"{check_shard_key(key)}.jsonl"

    def regenerated_manifest(self, key: str) -> Path:
        return self.root / "regenerated" / f"{check_shard_key(key)}.json"

    @property
    def hidden_states_dir(self) -> Path:
        return self.root / "hidden_states"

    def hidden_states(self, key: str) -> Path:
        return self.hidden_states_dir / f"{check_shard_key(key)}.safetensors"

    def hidden_states_manifest(self, key: str) -> Path:
        return self.hidden_states_dir / f"{check_shard_key(key)}.json"

    def writer_lock(self, stage: str, key: str) -> Path:
        """Held while a stage (`hidden_states`, `regenerated`) writes shard `key`: eagle3_core/store/locks.py."""
        return self.root / ".locks" / f"{stage}-{check_shard_key(key)}.lock"

    def hidden_state_shards(self) -> list[Path]:
        """Every complete shard (a shard file that exists is complete), sorted by key."""
        if not self.hidden_states_dir.is_dir():
            return []
        return sorted(p for p in self.hidden_states_dir.glob("*.safetensors") if SHARD_KEY.match(p.stem))

    @property
    def vocab_mapping(self) -> Path:
        return self.root / "vocab_mapping"

    @property
    def drafter_runs(self) -> Path:
        return self.root / "drafter" / "runs"

    def pointer_path(self, path: Path) -> str:
        """`path` as a pointer file stores it: relative to the store, so a copied or moved store points at
        its own drafters, not the original's. The last component is kept as it is, not followed: a pointer
        to `export/<run>` names the run's export, whichever version that link gives."""
        path = Path(path)
        return (path.parent.resolve() / path.name).relative_to(self.root.resolve()).as_posix()

    def from_pointer(self, stored: str) -> Path:
        """A path a pointer file stored (relative to the store; an absolute one from before is kept as it is)."""
        return self.root / stored

    @property
    def drafter_latest(self) -> Path:
        """JSON pointer to the newest finished training run."""
        return self.root / "drafter" / "latest.json"

    @property
    def drafter_refined(self) -> Path:
        """JSON pointer to the newest on-policy refinement (DrafterRefined): what is exported while the
        offline run it started from is still the newest."""
        return self.root / "drafter" / "refined.json"

    def onpolicy_records_dir(self, drafter_run: str) -> Path:
        """The on-policy record shards of the rollouts made with run `drafter_run`'s drafter."""
        return self.root / "onpolicy" / _safe_name(drafter_run)

    def onpolicy_records(self, drafter_run: str, key: str) -> Path:
        """The record shard of conversation shard `key`'s rollouts with run `drafter_run`'s drafter."""
        return self.onpolicy_records_dir(drafter_run) / f"{check_shard_key(key)}.safetensors"

    def onpolicy_record_shards(self, drafter_run: str) -> list[Path]:
        """Every complete record shard of run `drafter_run`'s rollouts, sorted by key."""
        directory = self.onpolicy_records_dir(drafter_run)
        if not directory.is_dir():
            return []
        return sorted(p for p in directory.glob("*.safetensors") if SHARD_KEY.match(p.stem))

    @property
    def exports(self) -> Path:
        """export/<run>: each a symlink to the run's current export version (`export_versions`)."""
        return self.root / "drafter" / "export"

    def export_versions(self, run: str) -> Path:
        """The versions of a run's export, both formats each, never changed once renamed in (their eval/
        apart): `export/<run>` links the current one, so exporting again swaps a link, not a directory."""
        return self.root / "drafter" / "export-versions" / run

    def export_lock(self, run: str) -> Path:
        """Held while run `run` is exported, so one writer clears leftovers and swaps its link."""
        return self.root / ".locks" / f"export-{_safe_name(run)}.lock"

    def export_eval(self, run: str) -> Path:
        """The measured acceptance of one run's export: report-<format>.json, the serving recommendation and the
        PNGs, beside the export."""
        return export_eval_dir(self.exports / run)

    def drafter_dir_eval(self, drafter_dir: Path) -> Path:
        """Where `eagle3 eval --drafter DIR` keeps its measurement of a drafter directory from anywhere: named
        by the directory and a digest of its resolved path, so two drafters never share a report."""
        import hashlib

        resolved = Path(drafter_dir).resolve()
        digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:10]
        return self.root / "eval" / "drafters" / f"{resolved.name}-{digest}"

    @property
    def drafter_current(self) -> Path:
        """drafter/current.json: a fixed symlink to `current/current.json` (`current_record`), for people and
        tools. Before promotion directories it was a plain file, written after the link."""
        return self.root / "drafter" / "current.json"

    @property
    def drafter_current_link(self) -> Path:
        """The promotion in one symlink, to a promotion directory (`promotions`) that holds the record and
        `sglang`, `speculators` links into the run's export: serve `current/sglang` or `current/speculators`.
        Moving this link is the whole promotion, so the record and the drafter served never disagree."""
        return self.root / "drafter" / "current"

    @property
    def current_record(self) -> Path:
        """The promoted drafter's record (DrafterCurrent), read through the `current` link."""
        return self.drafter_current_link / PROMOTION_RECORD

    @property
    def promotions(self) -> Path:
        """Promotion directories, each written whole before `current` links it; only the linked one is kept."""
        return self.root / "drafter" / "promotions"

    @property
    def promotion_lock(self) -> Path:
        """Held while a drafter is promoted, so one promoter clears leftovers and moves `current`."""
        return self.root / ".locks" / "promotion.lock"

    @property
    def run_dir(self) -> Path:
        """Bookkeeping of the servers eagle3 starts: PID files and logs, so a crashed run's server is found."""
        return self.root / "run"

    def sglang_pid_file(self, hostname: str) -> Path:
        """The managed SGLang server on `hostname` (one per host: its PIDs mean nothing on another host)."""
        return self.run_dir / f"sglang-{_safe_name(hostname)}.pid"

    def sglang_log(self, hostname: str) -> Path:
        """The managed SGLang server's stdout and stderr, on `hostname`."""
        return self.run_dir / f"sglang-{_safe_name(hostname)}.log"

    @property
    def sglang_bench(self) -> Path:
        """The last `eagle3 bench-sglang` result (AL and throughput a live server reported)."""
        return self.root / "drafter" / "sglang_bench.json"
