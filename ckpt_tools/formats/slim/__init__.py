"""Slim checkpoints: a DCP checkpoint without its frozen base weights, plus a manifest to rebuild them
(`manifest`), how a checkpoint splits into kept and dropped (`partition`), and the writer (`writer`)."""
