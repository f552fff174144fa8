"""One partition per shard: keys '{dataset}-{index:05d}', added as ingest creates shards."""

import dagster as dg

SHARDS = "shards"
shards = dg.DynamicPartitionsDefinition(name=SHARDS)
