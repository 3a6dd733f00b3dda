"""Reading and writing torch.distributed.checkpoint (DCP) directories without torch's loader."""
