"""fix-adapter's inputs: SRC's weights file by key and, with --checkpoint, the run's DCP checkpoint whose
trained full tensors fill what prime-rl's broadcast lists but does not hold."""

from __future__ import annotations

from pathlib import Path

import torch

from ...core.errors import FormatError, UsageError
from ...formats.dcp.lora import DcpLoraSource
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.peft.config import ADAPTER_CONFIG, BIN_NAME, SAFETENSORS_NAME, parse_peft_config
from ...io.inputs import as_input, lexists, register
from ...sources.files import TensorFileSource

__all__ = ["CKPT_REF", "FixSources", "check_same_state", "open_fix_source", "weights_file"]


def weights_file(src: Path) -> Path:
    st, binf = src / SAFETENSORS_NAME, src / BIN_NAME
    if lexists(st) and lexists(binf):
        raise FormatError(
            f"has both {SAFETENSORS_NAME} and {BIN_NAME}; PEFT loads the safetensors one",
            path=src,
            hint="remove the stale one, or copy the one you mean into its own dir",
        )
    if lexists(st):
        return st
    if lexists(binf):
        return binf
    raise FormatError(f"no {SAFETENSORS_NAME} or {BIN_NAME} next to adapter_config.json", path=src)


CKPT_REF = "dcp:"  # OutTensor.source of a tensor read from --checkpoint (else: a key of SRC's weights file)


class FixSources:
    """SRC's weights file (by key) and, with --checkpoint, that checkpoint (metadata only until run)."""

    def __init__(self, weights: TensorFileSource, ckpt: DcpLoraSource | None = None):
        self.weights, self.ckpt = weights, ckpt
        self.path = weights.path

    def facts(self, key: str):
        return self.weights.facts(key)

    def names(self):
        return self.weights.names()

    def read_tensor(self, key: str) -> torch.Tensor:
        if key.startswith(CKPT_REF):
            assert self.ckpt is not None  # a checkpoint's key is planned with --checkpoint only
            return self.ckpt.read_key(key[len(CKPT_REF) :])
        return self.weights.read_tensor(key)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        self.weights.close()

    def __enter__(self) -> FixSources:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_fix_source(src: str | Path, checkpoint: str | Path | None = None) -> FixSources:
    """The export's weights file (safetensors, or a .bin loaded through the allow-list), by key; with
    `checkpoint`, the run's DCP checkpoint whose trained full tensors fill what the export lacks."""
    src = as_input(src)
    if not src.is_dir():
        raise UsageError("not an adapter directory", path=src)
    register(src)  # the whole export dir is an input: no OUT inside it
    parse_peft_config(
        src / ADAPTER_CONFIG
    )  # refuses non-LoRA peft_type, DoRA, lora_bias, ... before the weights
    weights = TensorFileSource(weights_file(src))
    if checkpoint is None:
        return FixSources(weights)
    try:  # alpha comes from the export's own resolution; the checkpoint's LoRA scale is not used
        return FixSources(weights, DcpCheckpoint.open(as_input(checkpoint)).lora(alpha=1.0))
    except BaseException:
        weights.close()
        raise


def check_same_state(sources: FixSources, modules: dict[str, tuple[str, str]], wpath: Path) -> int:
    """The checkpoint must be the state the export was written from: every LoRA factor the two share
    (dense modules) bitwise equal. Returns how many were compared."""
    ck = sources.ckpt
    assert ck is not None  # checked with --checkpoint only
    compared = 0
    for mod, keys in sorted(modules.items()):
        spec = ck.modules.get(mod)
        if spec is None or spec.expert is not None:
            continue
        for ab, key in zip("AB", keys):
            theirs = ck.read_factor(mod, ab)
            mine = sources.weights.read_tensor(key)
            if tuple(theirs.shape) != tuple(mine.shape) or not torch.equal(theirs.to(mine.dtype), mine):
                raise FormatError(
                    f"--checkpoint {ck.path} is not the state this export was written from: "
                    f"{mod} lora_{ab} differs",
                    path=wpath,
                    key=key,
                    hint="pass the checkpoint of the same step as the broadcast "
                    "(outputs/checkpoints/step_N/trainer for broadcasts/step_N)",
                )
            compared += 1
    return compared
