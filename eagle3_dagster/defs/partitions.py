"""One partition per shard: keys '{dataset}-{index:05d}', added as ingest creates shards."""

import dagster as dg

shards = dg.DynamicPartitionsDefinition(name="shards")
