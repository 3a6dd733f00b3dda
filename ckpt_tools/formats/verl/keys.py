"""verl's key model: what every key of a `model_world_size_W_rank_R.pt` is (a table, pure).

The model file is `model.state_dict()` of the FSDP-wrapped actor (fsdp_checkpoint_manager.py): HF names for a
full fine-tune; for a LoRA run PEFT's names (`get_peft_model` in `FSDPEngine._build_lora_module`, adapter
"default"): `base_model.model.<HF module>.base_layer.weight` for a targeted Linear's frozen weight,
`base_model.model.<HF module>.lora_A.default.weight` / `lora_B...` for its factors, `base_model.model.<HF
name>` for everything else. The first rule that matches wins; a key no rule matches, or one a rule names as
unsupported (PEFT's modules_to_save copies, DoRA magnitudes, embedding LoRA), is an error naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...core.errors import FormatError

__all__ = ["KEY_RULES", "VerlKey", "classify", "require_known"]

PEFT = r"base_model\.model\."


@dataclass(frozen=True)
class VerlKey:
    key: str
    group: str  # base | lora | unsupported | other
    hf_name: str | None = None  # base: the HF parameter name
    module: str | None = None  # lora: the HF module FQN
    ab: str | None = None  # lora: "A" or "B"
    adapter: str | None = None  # lora: PEFT adapter name ("default")
    rule: str = ""


# (what, group, pattern, HF-name template). Order matters: the PEFT shapes before the plain HF name.
KEY_RULES: tuple[tuple[str, str, re.Pattern, str | None], ...] = (
    (
        "PEFT LoRA factor",
        "lora",
        re.compile(PEFT + r"(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$"),
        None,
    ),
    (
        "PEFT DoRA magnitude, embedding LoRA or modules_to_save copy",
        "unsupported",
        re.compile(r".*\.(lora_magnitude_vector|lora_embedding_[AB]|modules_to_save|original_module)\..*"),
        None,
    ),
    (
        "PEFT-wrapped Linear's frozen weight",
        "base",
        re.compile(PEFT + r"(?P<pre>.+)\.base_layer\.(?P<leaf>weight|bias)$"),
        "{pre}.{leaf}",
    ),
    ("PEFT-wrapped weight", "base", re.compile(PEFT + r"(?P<name>(.+\.)?(weight|bias))$"), "{name}"),
    ("HF-named weight", "base", re.compile(r"^(?P<name>(.+\.)?(weight|bias))$"), "{name}"),
)


def classify(key: str) -> VerlKey:
    for what, group, pattern, template in KEY_RULES:
        m = pattern.match(key)
        if m is None:
            continue
        g = m.groupdict()
        if group == "lora":
            return VerlKey(key, group, module=g["module"], ab=g["ab"], adapter=g["adapter"], rule=what)
        if group == "base" and template is not None:
            return VerlKey(key, group, hf_name=template.format(**g), rule=what)
        return VerlKey(key, group, rule=what)
    return VerlKey(key, "other")


def require_known(keys, path) -> list[VerlKey]:
    """Every key classified; an error naming those no rule reads (never silently dropped)."""
    infos = [classify(k) for k in keys]
    bad = [i for i in infos if i.group in ("other", "unsupported")]
    if bad:
        shown = ", ".join(i.key + (f" ({i.rule})" if i.rule else "") for i in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise FormatError(
            f"{len(bad)} key(s) of the verl model file match no supported rule of its key layout: "
            f"{shown}{more}",
            path=path,
            hint="this layout is not supported yet; `ckpt inspect --keys` lists the keys: please report it",
        )
    return infos
