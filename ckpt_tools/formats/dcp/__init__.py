"""torch.distributed.checkpoint (DCP) directories, read and written without torch's DCP loader.

`metadata` (allow-list unpickling into torch-free stand-ins), `model` (entries and the metadata
findings), `item` (the one decoder of a storage item), `reader` (`DcpCheckpoint`), `writer`
(`DcpWriter`), `layout` (file names, row chunks), `patch` (byte-item surgery)."""
