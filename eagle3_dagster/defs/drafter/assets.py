"""The drafter half: vocab_mapping -> drafter_checkpoint (-> drafter_refined, defs/onpolicy) -> drafter_export,
over every shard of hidden_states."""

from pathlib import Path

import dagster as dg

from eagle3_core.steps import drafter
from eagle3_core.steps.serving import serve_commands, serve_markdown
from eagle3_dagster.defs.automation import after_its_parent, when_every_shard_is_done
from eagle3_dagster.defs.data.assets import hidden_states
from eagle3_dagster.defs.drafter.pipes import train_through_pipes
from eagle3_dagster.defs.metadata import step_metadata, training_metadata
from eagle3_dagster.defs.resources import Eagle3Resource

ALL_SHARDS = dg.AssetDep(hidden_states, partition_mapping=dg.AllPartitionMapping())


@dg.asset(
    group_name="drafter",
    deps=[ALL_SHARDS],
    kinds={"safetensors"},
    automation_condition=when_every_shard_is_done(),
)
def vocab_mapping(context: dg.AssetExecutionContext, eagle3: Eagle3Resource) -> dg.MaterializeResult:
    """Top-K loss-masked target tokens over all shards (d2t, t2d), fingerprinted by tokenizer, shards and K."""
    result = drafter.vocab_step(eagle3.config(), context.log.info)
    return dg.MaterializeResult(metadata=step_metadata(result))


@dg.asset(
    group_name="drafter",
    deps=[ALL_SHARDS, vocab_mapping],
    pool="gpu",
    kinds={"pytorch"},
    automation_condition=when_every_shard_is_done(),
)
def drafter_checkpoint(context: dg.AssetExecutionContext, eagle3: Eagle3Resource) -> dg.MaterializeResult:
    """The EAGLE-3 drafter trained with training-time test on every shard; resumes a run cut short. Under
    orchestration.training pipes or k8s, as a Dagster Pipes subprocess or pod that reports the same page."""
    cfg = eagle3.config()
    if cfg.orchestration.training != "in_run":
        return train_through_pipes(context, cfg, eagle3.resolved_path())
    result = drafter.launch_training(eagle3.resolved_path(), context.log.info)
    return dg.MaterializeResult(metadata=training_metadata(result))


@dg.asset(
    group_name="drafter",
    # the drafter refined on-policy, or the offline one as it is (drafter_refined decides, onpolicy.enabled)
    deps=[dg.AssetKey("drafter_refined")],
    kinds={"safetensors"},
    automation_condition=after_its_parent(),
)
def drafter_export(context: dg.AssetExecutionContext, eagle3: Eagle3Resource) -> dg.MaterializeResult:
    """The SGLang and vLLM/speculators directories of the newest drafter, validated key by key, published
    together in one rename (a crash leaves the previous export, whole)."""
    cfg = eagle3.config()
    result = drafter.export_step(cfg, context.log.info)
    # the exact launch commands for this export, on its page (the same as `eagle3 serve-command --export`)
    serve = serve_commands(cfg, Path(result.metadata["sglang_dir"]).parent)
    return dg.MaterializeResult(
        metadata={**step_metadata(result), "serve": dg.MetadataValue.md(serve_markdown(serve))}
    )
