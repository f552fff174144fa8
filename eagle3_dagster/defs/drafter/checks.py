"""Check of the draft vocabulary: how much of the training tokens it can draft. It warns, never blocks: a
low coverage caps acceptance, but a drafter trained on it still works."""

import dagster as dg

from eagle3_core.store import checks
from eagle3_dagster.defs.data.checks import check_result
from eagle3_dagster.defs.drafter.assets import vocab_mapping
from eagle3_dagster.defs.resources import Eagle3Resource


@dg.asset_check(
    asset=vocab_mapping,
    description="Share of loss tokens the draft vocabulary covers, at least checks.min_vocab_coverage",
)
def vocab_coverage(eagle3: Eagle3Resource) -> dg.AssetCheckResult:
    cfg = eagle3.config()
    verdict = checks.vocab_coverage(cfg.store_root, cfg.checks.min_vocab_coverage)
    return check_result(verdict, dg.AssetCheckSeverity.WARN)
