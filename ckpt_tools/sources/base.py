"""The `Source` protocol, as the layers above formats/ import it: it lives in `formats.handle`, where
each format's one handle implements it."""

from __future__ import annotations

from ..formats.handle import ByteRange, Extent, Source, TensorFacts, tensor_bytes

__all__ = ["ByteRange", "Extent", "Source", "TensorFacts", "tensor_bytes"]
