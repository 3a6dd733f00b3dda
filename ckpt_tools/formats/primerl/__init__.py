"""prime-rl run configs and run directories, as ckpt-tools reads them (no torch, no tensor bytes).

- `schema`: which keys prime-rl's config classes have, their defaults, and what happens to an unknown
  key (refused or silently dropped), per generation (`schema_16e747c`, `schema_head` hold the data);
- `config`: locate a run's config files (both generations), load them into one view with prime-rl's
  precedence and shared-key rules, and the LoRA rank/alpha the run trains and serves with;
- `files`: where a run's config files are and their load order (re-exported by `config`);
- `run_dir`: a run directory's layout (outputs, checkpoints, exports, the base model);
- `alpha`: the LoRA alpha a checkpoint trained with (it is not stored in the checkpoint), resolved in
  one order for every command;
- `toml_patch`: a prime-rl TOML edited in place of the user (restart-prep), comments and order kept.

The run-level traps `ckpt doctor` reports over these facts are in `ops.doctor`.
"""
