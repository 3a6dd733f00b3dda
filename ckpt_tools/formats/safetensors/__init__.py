"""Safetensors, read and written by us, one tensor (or one block of one tensor) in flight.

`header` (layout, validated), `read` (tensor bytes by range, verbatim block copies), `writer` (a file
whose layout is fixed up front). Package modules are imported by name: importing this package
imports no torch.
"""
