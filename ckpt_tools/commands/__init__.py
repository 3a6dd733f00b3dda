"""Click commands, one module per command; each is a thin wrapper over ckpt_tools.ops."""
