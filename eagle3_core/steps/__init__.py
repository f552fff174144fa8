"""The steps: one module per domain of the asset graph, as eagle3_dagster/defs/<domain>/ holds the assets.

- data: conversations, regenerated, hidden_states (one shard each);
- drafter: vocab_mapping, drafter_checkpoint, drafter_export (over every shard);
- evaluation: drafter_eval and the promotion to drafter_current;
- serving: the commands that serve an export.

Each step reads the store, writes atomically and returns a `StepResult` (common.py) whose flat metadata is
what the CLI prints and what Dagster shows. The CLI and the assets call the same step functions.
"""
