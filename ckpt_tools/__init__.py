"""ckpt-tools: LoRA merge and checkpoint surgery for prime-rl DCP checkpoints."""
__all__ = ["__version__"]

__version__ = "0.1.0"
