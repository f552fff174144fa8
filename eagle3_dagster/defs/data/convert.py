"""Re-encoding the store's shards in another store dtype from Dagster (`eagle3 convert-shards`'s path), e.g. a
store of bfloat16 shards to FP8 at about half the bytes, without extracting again.

The job `eagle3_convert_shards` materializes `hidden_states` with `convert_to` set (fp8_e4m3 unless the
launchpad says otherwise), together with its blocking checks, one run per shard: launch it on one partition or
backfill it over many. Each run re-encodes the shard the store holds under its writer lock, renamed over the
old file only when whole (eagle3_core/store/convert.py): a run killed leaves the shard in its old dtype or its
new one, and a shard already in the dtype asked is left as it is, so a backfill launched again converts only
what is left. The shard's new materialization records the dtype and bytes before and after (tag
`eagle3/converted_to`), and `shard_complete` and `shard_integrity` are evaluated on the new file, so the
automation's gate on blocking checks reads the converted shard's verdicts.
"""

import dagster as dg

from eagle3_dagster.defs.data.assets import HiddenStatesConfig, StoreDtype, hidden_states

CONVERT_JOB = "eagle3_convert_shards"

# AssetSelection.assets takes hidden_states' checks with it. The run config is the launchpad's default, editable.
convert_job = dg.define_asset_job(
    CONVERT_JOB,
    selection=dg.AssetSelection.assets(hidden_states),
    config=dg.RunConfig(ops={hidden_states.op.name: HiddenStatesConfig(convert_to=StoreDtype.fp8_e4m3)}),
    description="Re-encodes each shard's hidden states in another store dtype (convert_to, default fp8_e4m3) "
    "without extracting again, then checks it; a shard already in that dtype is left as it is. Backfill it "
    "over the shards to convert a store.",
)
