"""ckpt-tools: LoRA merge and checkpoint surgery for prime-rl DCP checkpoints."""
__version__ = "0.1.0"
