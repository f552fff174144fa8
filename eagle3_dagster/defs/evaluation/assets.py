"""drafter_eval (measured AL and speedup of the export) and drafter_current (the promoted drafter), gated by
a blocking check: a drafter that measured worse than the promoted one stops the run before promotion."""

import dagster as dg

from eagle3_core.steps import evaluation
from eagle3_dagster.defs.automation import after_its_parent
from eagle3_dagster.defs.drafter.assets import drafter_export
from eagle3_dagster.defs.metadata import eval_metadata, gate_metadata, step_metadata
from eagle3_dagster.defs.resources import Eagle3Resource


@dg.asset(
    group_name="evaluation",
    deps=[drafter_export],
    pool="gpu",
    kinds={"pytorch"},
    automation_condition=after_its_parent(),
)
def drafter_eval(context: dg.AssetExecutionContext, eagle3: Eagle3Resource) -> dg.MaterializeResult:
    """The exported drafter run by speculative decoding on held-out prompts: AL, per position, speedup, and the
    K to draft at each batch size when served (the serving recommendation)."""
    result = evaluation.eval_step(eagle3.config(), context.log.info)
    return dg.MaterializeResult(metadata=eval_metadata(result))


@dg.asset_check(
    asset=drafter_eval,
    blocking=True,
    description="AL at gate_k, paired with the promoted drafter's on the same prompts: the lower 95% bound of "
    "the difference is at least -promotion_tolerance",
)
def not_worse_than_current(eagle3: Eagle3Resource) -> dg.AssetCheckResult:
    gate = evaluation.read_report(eagle3.config()).gate
    return dg.AssetCheckResult(
        passed=gate.passed,
        severity=dg.AssetCheckSeverity.ERROR,
        description=gate.reason,
        metadata=gate_metadata(gate),
    )


@dg.asset(
    group_name="evaluation",
    deps=[drafter_eval],
    kinds={"safetensors"},
    automation_condition=after_its_parent(),
)
def drafter_current(context: dg.AssetExecutionContext, eagle3: Eagle3Resource) -> dg.MaterializeResult:
    """The promoted drafter: `store/drafter/current` links its promotion (record and export) in one rename."""
    return dg.MaterializeResult(
        metadata=step_metadata(evaluation.promote_step(eagle3.config(), context.log.info))
    )
