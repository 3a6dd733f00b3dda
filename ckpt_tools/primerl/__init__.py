"""prime-rl run configs and run directories, as ckpt-tools reads them.

- `schema`: which keys prime-rl's config classes have, their defaults, and what happens to an unknown
  key (refused or silently dropped), per generation (`schema_16e747c`, `schema_head` hold the data);
- `config`: locate a run's config files (both generations), load them into one view with prime-rl's
  precedence and shared-key rules, and the LoRA rank/alpha the run trains and serves with;
- `files`: where a run's config files are and their load order (re-exported by `config`);
- `run_dir`: a run directory's layout (outputs, checkpoints, exports, the base model);
- `traps` (+ `traps_config`, `traps_run`, `facts`): the run-level traps `ckpt doctor` reports, one
  small function per trap, over plain facts.

No torch, no tensor bytes: config files and directory listings only. `ckpt_tools.ops.doctor` gathers
the facts (checkpoints, disk) and runs the traps.
"""
