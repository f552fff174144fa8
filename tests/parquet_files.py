"""Parquet files that pyarrow writes whole and cannot read back into Python rows, built by pyarrow itself, as
a reader of conversation files meets them; each fails with another exception type, none of them an OSError
with an errno (a failure of the system, not of the file)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

UNREADABLE = {
    # a duration column past what datetime.timedelta holds (about 2.7 million years): OverflowError
    "duration_out_of_range": "OverflowError",
    # a timestamp column in a time zone no machine knows: pytz's or zoneinfo's KeyError, named for the zone
    "unknown_time_zone": "Mars/Olympus",
    # the file cut in the middle, as an interrupted copy leaves it: ArrowInvalid (a ValueError)
    "truncated": "ArrowInvalid",
    # a flipped byte in a compressed page, caught by its gzip trailer: an OSError, without an errno
    "corrupt_page": "OSError: GZipCodec failed",
}


def unreadable_parquet(path: Path, kind: str) -> Path:
    """A Parquet file of one conversation that cannot be decoded, for the reason `kind` (a key of UNREADABLE)."""
    columns = {"messages": pa.array([[{"role": "user", "content": f"a question in {kind}"}]])}
    if kind == "duration_out_of_range":
        columns["took"] = pa.array([2**62], pa.duration("s"))
    elif kind == "unknown_time_zone":
        columns["at"] = pa.array([0], pa.timestamp("s", tz="Mars/Olympus"))
    pq.write_table(pa.table(columns), path, compression="gzip")
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "corrupt_page":
        chunk = pq.read_metadata(path).row_group(0).column(0)
        end = chunk.data_page_offset + chunk.total_compressed_size  # the page's gzip trailer ends there
        data = bytearray(path.read_bytes())
        data[end - 4 : end] = bytes(b ^ 0xFF for b in data[end - 4 : end])
        path.write_bytes(bytes(data))
    return path
