"""Operations: plan, then execute, one contract for all of them.

    plan_X(sources, options) -> XPlan        # frozen, from metadata alone; to_json() is --dry-run --json
    run_X(plan, sources, progress) -> XReport  # streams, writes atomically; to_json() is --json

`sources` are opened by `open_X_sources(...)` (a context manager over `ckpt_tools.sources`), so a plan
and its run read the same open inputs; `progress` receives `core.progress.ProgressEvent`s. A plan names
its independent work units (output shards, steps, tensors) so that a caller may run a subset.

One module or package per operation: `inspect`, `verify`, `merge`, `diff`, `extract_adapter`,
`fix_adapter`, `adapter_to_dcp`, `slim`, `rehydrate`, `set_lr`, `gc`, `doctor`. An op imports formats,
sources, io and core, never another op: what two ops share lives below them.
"""
