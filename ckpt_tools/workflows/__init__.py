"""Commands that compose ops: `restart_prep` (a merge, or a checkpoint rebuilt from the checkpoint's own
LoRA, plus a config edit). A workflow calls ops through their public contracts only."""
