"""Errors a user can act on. The CLI prints their message (no traceback) and exits with status 2.

They live here, free of heavy imports, so that catching them costs nothing (`eagle3 stats` never imports torch).
"""


class Eagle3Error(Exception):
    """Base of the errors whose message tells the user what to do."""


class ConfigError(Eagle3Error, ValueError):
    """A configuration value is invalid; the message names the file and the field."""


class SourceChangedError(Eagle3Error):
    """Rows that were already sharded changed; re-sharding would silently change existing shards."""


class SourceUnreadableError(Eagle3Error):
    """A source or inbox file cannot be decoded as its format (a truncated or corrupt Parquet file, a column
    Python cannot hold); the message names the file and what the decoder said."""


class DiskSpaceError(Eagle3Error, OSError):
    """Not enough free disk for a shard (with headroom), or the disk filled up under a shard or a training
    checkpoint being written."""


class ShardCorruptError(Eagle3Error):
    """A shard's bytes do not match its checksums, or its header is unreadable."""


class CheckpointCorruptError(Eagle3Error):
    """A training checkpoint is truncated, unreadable or fails the checksums it recorded; the message names the
    file and what is wrong. `reason` is a short word for it, which the checkpoint set aside is renamed with."""

    # reason has a default: unpickling an exception passes its args (the message) alone
    def __init__(self, message: str, reason: str = "damaged") -> None:
        super().__init__(message)
        self.reason = reason


class TrainingDivergedError(Eagle3Error):
    """A training run's loss or weights stopped being finite (NaN, inf): the run is stopped at that step, its
    earlier checkpoints kept; the message names the step and what to change."""


class StaleVocabMappingError(Eagle3Error):
    """A saved vocab mapping was built for other data, another tokenizer or another K than the one expected."""


class ExportError(Eagle3Error):
    """A drafter export is malformed: a missing or unexpected weight key, a wrong shape, an absent config field."""


class StoreBusyError(Eagle3Error):
    """Another process is ingesting into the same store (the inbox sensor, or a second `eagle3 ingest`)."""


class TargetError(Eagle3Error):
    """The target model directory cannot be loaded: no safetensors weights, an unreadable config.json or chat
    template. The message names the directory or file and what is wrong with it."""


class RecordError(Eagle3Error, ValueError):
    """A JSON record eagle3 wrote (a run summary, an evaluation report, a drafter pointer) is unreadable or
    lacks a field; the message names the file and the field."""
