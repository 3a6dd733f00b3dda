"""fix-adapter's plan: SRC validated completely (config, every key, shapes, the base), in named steps, then
the adapter dir it becomes, laid out by `formats.peft.layout` (as every adapter writer's is)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...core.dtypes import short_name
from ...core.errors import AlphaError, FormatError, UsageError
from ...core.keys import DEFAULT_LAYOUT, PEFT_LORA_KEY, fused_param_name, fused_peft_modules
from ...core.lora_math import check_modules_fit_base, lora_alpha_for_scale
from ...formats.hf_dir.hub import locate_model
from ...formats.hf_dir.model_dir import HFModelDir, tensor_shapes
from ...formats.peft.config import (
    ADAPTER_CONFIG,
    BIN_NAME,
    PEFT_PREFIX,
    SAFETENSORS_NAME,
    PeftConfig,
    parse_peft_config,
)
from ...formats.peft.experts import ExpertView, FusedParam, fused_params_of_config, parse_fused
from ...formats.peft.layout import AdapterLayout, FullTensor, ModuleFactors, check_layout, plan_adapter_layout
from ...formats.peft.writer import OutTensor, safetensors_file_bytes
from ...formats.primerl.alpha import AlphaResolution, find_run_configs, resolve_alpha
from ...formats.primerl.run_dir import resolve_run
from ...io.inputs import as_input, check_input, lexists
from .sources import CKPT_REF, FixSources, check_same_state

__all__ = ["FixOptions", "FixPlan", "FixReads", "plan_fix"]


@dataclass(frozen=True)
class FixOptions:
    out: str | Path
    base: str | None = None
    slot: int | None = None
    alpha: float | None = None
    run_config: str | None = None
    checkpoint: str | None = None  # the run's DCP checkpoint of the same step: fills absent modules_to_save
    layout: str = DEFAULT_LAYOUT  # how MoE expert LoRA is written (core.keys.LAYOUTS)


@dataclass(frozen=True)
class FixReads:
    """How `run_fix` reads the planned tensors that SRC does not hold as they are written."""

    factor_keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # module -> its (A, B) keys in SRC
    views: dict[str, ExpertView] = field(default_factory=dict)  # a per-expert module inside SRC's fused LoRA
    view_sources: dict[str, tuple[str, str]] = field(default_factory=dict)  # source -> (module, A | B)
    fused_sources: dict[str, tuple[FusedParam, str]] = field(default_factory=dict)  # source -> (fused, A | B)


@dataclass(frozen=True)
class FixPlan:
    src: Path
    out: Path
    weights_file: str
    fixes: tuple[str, ...]  # what was wrong with the keys/config
    slot: int | None
    slots_present: tuple[int, ...]
    modules: int
    rank: int
    alpha: float
    alpha_source: str
    lora_alpha: float
    scale: float
    base_model_name_or_path: str | None
    base_checked: Path | None
    tensors: tuple[OutTensor, ...]
    modules_to_save: tuple[str, ...]
    config: dict = field(repr=False)
    out_file_bytes: int = 0
    warnings: tuple[str, ...] = ()
    layout: str = DEFAULT_LAYOUT
    reads: FixReads = field(default_factory=FixReads, repr=False)

    def to_json(self) -> dict:
        d = asdict(dataclasses.replace(self, reads=FixReads()))
        d.pop("reads")
        d["src"], d["out"] = str(self.src), str(self.out)
        d["base_checked"] = str(self.base_checked) if self.base_checked else None
        d["tensors"] = [t.to_json() for t in self.tensors]
        for k in ("fixes", "slots_present", "modules_to_save", "warnings"):
            d[k] = list(d[k])
        return d


@dataclass
class _Notes:
    """What the plan says as it goes: each group of fixes in the order the report lists them."""

    keys: list[str] = field(default_factory=list)  # the slot, the prefix, a fused export read per expert
    alpha: list[str] = field(default_factory=list)
    layout: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)  # modules_to_save filled or dropped
    warnings: list[str] = field(default_factory=list)  # the keys, alpha and base's
    layout_warnings: list[str] = field(default_factory=list)  # target_modules'
    full_warnings: list[str] = field(default_factory=list)  # modules_to_save's

    def fixes(self, weights_name: str) -> tuple[str, ...]:
        pickle = [f"{BIN_NAME} (a pickle) -> {SAFETENSORS_NAME}"] if weights_name == BIN_NAME else []
        return tuple(self.keys + self.alpha + self.layout + self.full + pickle)

    def all_warnings(self) -> tuple[str, ...]:
        return tuple(self.warnings + self.layout_warnings + self.full_warnings)


@dataclass(frozen=True)
class _Factors:
    """SRC's LoRA as read: each module's (A, B) keys, the per-expert views of a fused export, shapes."""

    keys: dict[str, tuple[str, str]]
    views: dict[str, ExpertView]
    shapes: dict[str, tuple[int, ...]]

    def shape(self, module: str, ab: str) -> tuple[int, ...]:
        if module in self.views:
            v = self.views[module]
            return v.a_shape if ab == "A" else v.b_shape
        return tuple(self.shapes[self.keys[module][0 if ab == "A" else 1]])

    def source(self, module: str, ab: str) -> str:
        return f"view:{module}:{ab}" if module in self.views else self.keys[module][0 if ab == "A" else 1]


def _belongs_to(name: str, target: str) -> bool:
    """`model.embed_tokens.weight` belongs to modules_to_save entry `embed_tokens` (PEFT matches
    the module name or its suffix)."""
    stem = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    return stem == target or stem.endswith("." + target)


def plan_fix(weights: FixSources, src: str | Path, options: FixOptions) -> FixPlan:
    """Validate SRC completely (config, every key, shapes, the base) and decide the output."""
    src = as_input(src)
    cfg = parse_peft_config(src / ADAPTER_CONFIG)
    check_layout(options.layout)
    params = _check_config(cfg)
    wpath = weights.path
    shapes = {k: weights.facts(k).shape for k in weights.names()}
    dtypes = {k: weights.facts(k).dtype for k in weights.names()}
    notes = _Notes()
    lora, full = _classify_keys(shapes, cfg, wpath)
    chosen, slots = _choose_slot(lora, options.slot, wpath, notes)
    factors = _pair_factors(lora, chosen, shapes, cfg, params, wpath, notes)
    rank = _rank(factors, dtypes, cfg, wpath, notes)
    res, scale = _alpha(src, options, cfg, rank, notes)
    name_for_cfg, base_dir, base_shapes = _base(src, options.base, cfg, factors, notes)
    kept_full, filled = _modules_to_save(weights, src, cfg, factors, full, base_dir, base_shapes, notes)
    layout = plan_adapter_layout(
        {m: _module_factors(factors, m, dtypes) for m in sorted(factors.keys)},
        _full_tensors(weights, full, kept_full, filled, shapes, dtypes),
        layout=options.layout,
        base_model_name_or_path=name_for_cfg,
        rank=rank,
        scale=scale,
        base_shapes=base_shapes,
        base_dir=base_dir,
        path=wpath,
    )
    _layout_notes(layout, factors, options.layout, filled, notes)
    return FixPlan(
        src=src,
        out=Path(options.out),
        weights_file=wpath.name,
        fixes=notes.fixes(wpath.name),
        slot=chosen,
        slots_present=tuple(slots),
        modules=len(factors.keys),
        rank=rank,
        alpha=res.alpha,
        alpha_source=res.source,
        lora_alpha=layout.lora_alpha,
        scale=scale,
        base_model_name_or_path=name_for_cfg,
        base_checked=base_dir,
        tensors=layout.tensors,
        modules_to_save=layout.modules_to_save,
        config=layout.config,
        out_file_bytes=safetensors_file_bytes(list(layout.tensors)),
        warnings=notes.all_warnings(),
        layout=options.layout,
        reads=_reads(factors, layout),
    )


def _check_config(cfg: PeftConfig) -> set[str]:
    """A prime-rl export's config (no rsLoRA, no patterns but a fused expert LoRA's); its fused params."""
    params = fused_params_of_config(cfg.target_parameters)
    fused_patterns = all(k.rsplit(".", 1)[-1] in params for k in (*cfg.rank_pattern, *cfg.alpha_pattern))
    if cfg.use_rslora or ((cfg.rank_pattern or cfg.alpha_pattern) and not fused_patterns):
        raise FormatError(
            "use_rslora / rank_pattern / alpha_pattern are set: prime-rl exports have none, and "
            "fix-adapter repairs prime-rl exports",
            path=cfg.path,
            hint="a PEFT-made adapter needs no repair",
        )
    return params


def _classify_keys(
    shapes: dict[str, tuple[int, ...]], cfg: PeftConfig, wpath: Path
) -> tuple[dict[tuple[str, int | None], dict[str, str]], dict[str, str]]:
    """Every key a LoRA factor ((module, slot) -> {A | B: key}; core.keys.PEFT_LORA_KEY, every spelling we
    repair) or a listed modules_to_save tensor (HF name -> key); anything else is refused."""
    lora: dict[tuple[str, int | None], dict[str, str]] = {}
    full: dict[str, str] = {}
    unknown: list[str] = []
    for k in shapes:
        m = PEFT_LORA_KEY.match(k)
        if m:
            s = int(m["slot"]) if m["slot"] is not None else None
            lora.setdefault((m["module"], s), {})[m["ab"]] = k
            continue
        name = k[len(PEFT_PREFIX) :] if k.startswith(PEFT_PREFIX) else k
        if any(_belongs_to(name, t) for t in cfg.modules_to_save):
            full[name] = k
        else:
            unknown.append(k)
    if unknown:
        raise FormatError(
            f"{len(unknown)} key(s) are neither LoRA A/B nor modules_to_save: "
            + ", ".join(repr(k) for k in unknown[:8])
            + (" ..." if len(unknown) > 8 else ""),
            path=wpath,
            hint="fix-adapter repairs prime-rl adapter exports; this is something else",
        )
    if not lora:
        raise FormatError("zero LoRA A/B tensors: there is no adapter to repair", path=wpath)
    return lora, full


def _choose_slot(
    lora: dict[tuple[str, int | None], dict[str, str]], slot: int | None, wpath: Path, notes: _Notes
) -> tuple[int | None, list[int]]:
    """The adapter slot kept (None: the keys have none) and the slots present."""
    slots = sorted({s for _, s in lora if s is not None})
    if slots and any(s is None for _, s in lora):
        raise FormatError(
            "keys mix slot-indexed (lora_A.<i>.weight) and plain lora_A.weight spellings", path=wpath
        )
    chosen = None
    if slots:
        chosen = 0 if slot is None else slot
        if chosen not in slots:
            raise UsageError(
                f"adapter slot {chosen} is not in the export (slots present: {slots})",
                path=wpath,
                hint=f"pass --slot {slots[0]}",
            )
        notes.keys.append(
            f"dropped the adapter slot index from the keys (`lora_A.{chosen}.weight` -> `lora_A.weight`)"
        )
        if len(slots) > 1:
            notes.warnings.append(
                f"the export holds slots {slots}; kept slot {chosen}. prime-rl does not record which run "
                "owns which slot (format §6.2): check it is the run you mean"
            )
    elif slot not in (None, 0):
        raise UsageError(
            f"--slot {slot}: this export holds a single adapter (keys have no slot index)", path=wpath
        )
    if any(not k.startswith(PEFT_PREFIX) for ab in lora.values() for k in ab.values()):
        notes.keys.append("added the `base_model.model.` prefix PEFT matches keys by")
    return chosen, slots


def _pair_factors(
    lora: dict[tuple[str, int | None], dict[str, str]],
    chosen: int | None,
    shapes: dict[str, tuple[int, ...]],
    cfg: PeftConfig,
    params: set[str],
    wpath: Path,
    notes: _Notes,
) -> _Factors:
    """Each module of the kept slot with both factors of one rank; a fused expert LoRA (the peft layout)
    read as its per-expert modules, each a view into the fused tensors."""
    keys: dict[str, tuple[str, str]] = {}
    problems = []
    for (mod, s), ab in sorted(lora.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if s != chosen:
            continue
        if set(ab) != {"A", "B"}:
            problems.append(f"{mod}: lora_{''.join(ab)} without its partner")
            continue
        sa, sb = shapes[ab["A"]], shapes[ab["B"]]
        if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[1]:
            problems.append(f"{mod}: A {list(sa)} and B {list(sb)} do not share a rank")
            continue
        keys[mod] = (ab["A"], ab["B"])
    views = {}
    saved = set(keys)

    def partner_rank(experts: str, param: str) -> int | None:
        held = fused_peft_modules(experts, params).get(param) in saved
        return cfg.rank_for(fused_param_name(experts, param)) if held else None

    for mod in sorted(saved):
        a, b = keys[mod]
        expanded = parse_fused(mod, shapes[a], shapes[b], params, cfg.rank_for, partner_rank, wpath, r=cfg.r)
        if expanded is not None:
            del keys[mod]
            for name, v in expanded:
                keys[name], views[name] = (a, b), v
    if views:
        notes.keys.append(
            f"read the fused expert LoRA (target_parameters {list(cfg.target_parameters)}) as its "
            f"{len(views)} per-expert modules"
        )
    factors = _Factors(keys, views, shapes)
    ranks = sorted({factors.shape(m, "A")[0] for m in keys})
    if len(ranks) > 1:
        problems.append(f"ranks vary across modules: {ranks}")
    if problems:
        raise FormatError("adapter weights are inconsistent: " + "; ".join(problems[:8]), path=wpath)
    return factors


def _rank(
    factors: _Factors, dtypes: dict[str, torch.dtype], cfg: PeftConfig, wpath: Path, notes: _Notes
) -> int:
    """The one rank (A's rows), every factor in a dtype we write."""
    rank = factors.shape(next(iter(factors.keys)), "A")[0]
    if rank != cfg.r:
        notes.warnings.append(f"adapter_config.json says r={cfg.r} but A has {rank} rows; writing r={rank}")
    for k in (k for ab in factors.keys.values() for k in ab):
        if short_name(dtypes[k]) is None:
            raise FormatError(
                f"dtype torch.{dtypes[k]} is not one we write (fp32, bf16, fp16)", path=wpath, key=k
            )
    return rank


def _alpha(
    src: Path, options: FixOptions, cfg: PeftConfig, rank: int, notes: _Notes
) -> tuple[AlphaResolution, float]:
    """The training alpha, not the trainer config's (format §6.1), and its scale."""
    cfg_scale = cfg.lora_alpha / cfg.r
    res = _resolve_alpha(
        src,
        alpha=options.alpha,
        run_config=options.run_config,
        rank=rank,
        cfg_alpha=cfg.lora_alpha * rank / cfg.r,
        cfg_scale=cfg_scale,
        warnings=notes.warnings,
    )
    notes.warnings += list(res.warnings)
    scale = res.alpha / rank
    if not math.isclose(scale, cfg_scale, rel_tol=1e-9):
        notes.alpha.append(
            f"lora_alpha {cfg.lora_alpha:g} -> {lora_alpha_for_scale(scale, rank):g}: the export's config "
            f"claims scale {cfg_scale:g}, training used {scale:g} ({res.source})"
        )
    return res, scale


def _resolve_alpha(
    src: Path, *, alpha, run_config, rank: int, cfg_alpha: float, cfg_scale: float, warnings: list[str]
) -> AlphaResolution:
    own = None
    if alpha is None and run_config is None and src.resolve().parent.name == "broadcasts":
        own = src.resolve().parent.parent / "configs" / "orch.toml"  # outputs/<run>/configs/orch.toml
        if lexists(own):  # the run's own config: inside the run dir, a regular file
            check_input(own, root=src.resolve().parents[1], what="the broadcast's run config")
        else:
            own = None
    try:
        res = resolve_alpha(alpha=alpha, run_config=run_config or own, ckpt_dir=src, rank=rank)
        return dataclasses.replace(res, source=f"the broadcast's run config {own}") if own else res
    except AlphaError:
        if alpha is not None or run_config is not None or len(find_run_configs(src)) > 1:
            raise
    warnings.append(
        f"no run config (outputs/run_*/configs/orch.toml) found above {src}: keeping the export's own "
        f"lora_alpha {cfg_alpha:g} (scale {cfg_scale:g}), which prime-rl copies from the TRAINER config "
        "while training used the orchestrator's [model.lora] alpha; pass --run-config or --alpha "
        "to be sure"
    )
    return AlphaResolution(cfg_alpha, f"{src / ADAPTER_CONFIG} (unverified)")


def _base(
    src: Path, base: str | None, cfg: PeftConfig, factors: _Factors, notes: _Notes
) -> tuple[str | None, Path | None, dict[str, tuple[int, ...]] | None]:
    """The base model (--base, else the export's config's): the name the output's config gives, the dir
    it resolves to and its tensor shapes, which every module must fit (None: not found, unchecked)."""
    name_for_cfg = base if base is not None else cfg.base_model_name_or_path
    base_dir, why = (
        locate_model(base, run_root=None)
        if base is not None
        else locate_model(cfg.base_model_name_or_path, run_root=resolve_run(src).model_root)
    )
    if base_dir is not None:
        base_shapes, _ = tensor_shapes(base_dir)
        check_modules_fit_base(
            {m: (factors.shape(m, "A"), factors.shape(m, "B")) for m in factors.keys}, base_shapes, base_dir
        )
        return name_for_cfg, base_dir, base_shapes
    if base is not None:
        raise UsageError(f"base model {base!r} not found: {why}", hint="pass an existing model directory")
    notes.warnings.append(
        f"base model {cfg.base_model_name_or_path!r} from adapter_config.json was not found "
        f"({why}): keys were NOT checked against a model; pass --base DIR"
    )
    return name_for_cfg, None, None


def _modules_to_save(
    weights: FixSources,
    src: Path,
    cfg: PeftConfig,
    factors: _Factors,
    full: dict[str, str],
    base_dir: Path | None,
    base_shapes: dict[str, tuple[int, ...]] | None,
    notes: _Notes,
) -> tuple[list[str], dict[str, str]]:
    """modules_to_save made true: (the export's full tensors kept, HF name -> --checkpoint ref of those
    filled from the checkpoint). Listed but absent ones are filled from --checkpoint, refused without it
    for a prime-rl HEAD run, dropped otherwise; present ones equal to the base are dropped."""
    missing = [t for t in cfg.modules_to_save if not any(_belongs_to(n, t) for n in full)]
    filled: dict[str, str] = {}
    if weights.ckpt is not None:
        filled = _fill_from_checkpoint(weights, cfg, factors, full, missing, base_shapes, notes)
    elif missing:
        _drop_missing(src, cfg, missing, notes)
    kept_full: list[str] = []
    for name in sorted(full):
        if base_dir is None:
            kept_full.append(name)
            notes.full_warnings.append(
                f"kept modules_to_save tensor {name} (no base to compare with); vLLM rejects adapters "
                "with embed_tokens/lm_head modules_to_save"
            )
        elif _equals_base(weights, full[name], name, base_dir, base_shapes or {}):
            notes.full.append(
                f"dropped modules_to_save tensor {name}: identical to the base (prime-rl's LoRA optimizer "
                "never updates it), and vLLM rejects embed/lm_head modules_to_save"
            )
        else:
            kept_full.append(name)
            notes.full_warnings.append(
                f"kept modules_to_save tensor {name}: it differs from the base. vLLM rejects adapters "
                "with embed_tokens/lm_head modules_to_save; PEFT loads it"
            )
    return kept_full, filled


def _fill_from_checkpoint(
    weights: FixSources,
    cfg: PeftConfig,
    factors: _Factors,
    full: dict[str, str],
    missing: list[str],
    base_shapes: dict[str, tuple[int, ...]] | None,
    notes: _Notes,
) -> dict[str, str]:
    """HF name -> --checkpoint ref of each trained full tensor the export lacks (listed or not)."""
    ckpt = weights.ckpt
    assert ckpt is not None
    trained = ckpt.full_tensors
    if not check_same_state(weights, factors.keys, weights.path):
        notes.full_warnings.append(
            f"--checkpoint {ckpt.path}: no LoRA factor in common with the export to prove it "
            "is the same step; check it is"
        )
    unlisted = sorted(
        n for n in trained if n not in full and not any(_belongs_to(n, t) for t in cfg.modules_to_save)
    )
    filled: dict[str, str] = {}
    for t in missing:
        hits = sorted(n for n in trained if _belongs_to(n, t))
        if not hits:
            raise FormatError(
                f"modules_to_save {t!r} is listed but --checkpoint trained no such tensor "
                f"(its trained full tensors: {sorted(trained) or 'none'})",
                path=cfg.path,
                hint="pass the run's own checkpoint of the same step",
            )
        filled.update((n, trained[n]) for n in hits)
    filled.update((n, trained[n]) for n in unlisted)
    if filled:
        notes.full.append(
            f"filled modules_to_save {sorted(filled)} from --checkpoint's trained fp32 masters (prime-rl's "
            "broadcast lists them in adapter_config.json but holds none of their tensors)"
        )
    if unlisted:
        notes.full_warnings.append(
            f"--checkpoint also trained {unlisted}, which the export's config does not list: added"
        )
    for name, ref in filled.items():
        f = ckpt.key_facts(ref)
        if base_shapes is not None and tuple(base_shapes.get(name, ())) != tuple(f.shape):
            raise FormatError(
                f"trained tensor {name} is {list(f.shape)} in --checkpoint, the base's is "
                f"{list(base_shapes.get(name, [])) or 'absent'}",
                path=ckpt.path,
                key=ref,
            )
    return filled


def _drop_missing(src: Path, cfg: PeftConfig, missing: list[str], notes: _Notes) -> None:
    """Listed modules_to_save the export holds no tensor of, without --checkpoint: refused for a prime-rl
    HEAD run (it trained them), else dropped from the config (16e747c never updates them)."""
    configs = find_run_configs(src)
    if configs and configs[0].suffix == ".json":  # a prime-rl HEAD run: they were trained
        raise FormatError(
            f"modules_to_save {missing} are listed but the export holds none of their tensors: "
            "prime-rl HEAD trains them (lora.modules_to_save) and its broadcast does not save them, "
            "so an adapter without them would load with the base's UNTRAINED modules",
            path=cfg.path,
            hint="pass --checkpoint outputs/checkpoints/step_N/trainer (the same step) to fill them, "
            "or merge the checkpoint instead (`ckpt merge BASE CKPT`)",
        )
    notes.full.append(
        f"modules_to_save {missing} are listed but absent from the weights (PEFT raises KeyError): "
        "dropped from the config"
    )
    notes.full_warnings.append(
        f"modules_to_save {missing} are listed but the export holds none of their tensors: the output "
        "uses the base's values for them. Right for prime-rl 16e747c (its optimizer updates the LoRA "
        "only); if the run trained them (prime-rl HEAD lora.modules_to_save) pass --checkpoint CKPT "
        "of the same step to fill them"
    )


def _equals_base(weights: FixSources, key: str, name: str, base_dir: Path, base_shapes: dict) -> bool:
    if base_shapes.get(name) != weights.facts(key).shape:
        return False
    with HFModelDir.open(base_dir) as m:
        b = m.read_stored(name)
    t = weights.read_tensor(key)
    return bool(torch.equal(b.to(t.dtype), t))


def _module_factors(factors: _Factors, m: str, dtypes: dict[str, torch.dtype]) -> ModuleFactors:
    """A module as the repaired adapter writes it: each factor in its own dtype, read by key (or view)."""
    a, b = factors.keys[m]
    return ModuleFactors(
        factors.shape(m, "A"),
        factors.shape(m, "B"),
        short_name(dtypes[a]) or "",
        short_name(dtypes[b]) or "",
        factors.source(m, "A"),
        factors.source(m, "B"),
    )


def _full_tensors(
    weights: FixSources,
    full: dict[str, str],
    kept_full: list[str],
    filled: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
) -> dict[str, FullTensor]:
    """The kept full tensors (SRC's), then those filled from --checkpoint (its trained fp32 masters)."""
    out = {}
    for name in kept_full:
        key = full[name]
        dtype = short_name(dtypes[key])
        if dtype is None:
            raise FormatError(
                f"dtype torch.{dtypes[key]} is not one we write (fp32, bf16, fp16)",
                path=weights.path,
                key=key,
            )
        out[name] = FullTensor(tuple(shapes[key]), dtype, key)
    for name, ref in sorted(filled.items()):
        assert weights.ckpt is not None  # filled only from --checkpoint
        f = weights.ckpt.key_facts(ref)
        out[name] = FullTensor(tuple(f.shape), short_name(f.dtype) or "fp32", CKPT_REF + ref)
    return out


def _layout_notes(
    layout: AdapterLayout, factors: _Factors, written: str, filled: dict[str, str], notes: _Notes
) -> None:
    """What the layout planner decided that the report says: target_modules that had to name the
    modules, an expert LoRA written in another layout than read, what consumers do with filled
    modules_to_save."""
    if layout.target_warning:
        notes.layout_warnings.append(layout.target_warning)
    if layout.experts and bool(factors.views) != bool(layout.fused):
        notes.layout.append(
            f"MoE expert LoRA written in the {written} layout ("
            + (
                "fused through target_parameters, what PEFT loads with transformers 5"
                if layout.fused
                else "per-expert modules, what stock vLLM's Qwen3-MoE and prime-rl load"
            )
            + ")"
        )
    if filled and layout.full_warning:
        notes.full_warnings.append(layout.full_warning)


def _reads(factors: _Factors, layout: AdapterLayout) -> FixReads:
    view_sources = {
        factors.source(m, ab): (m, ab) for m in layout.per_module if m in factors.views for ab in "AB"
    }
    fused_sources = {f.source(ab): (f, ab) for f in layout.fused for ab in "AB"}
    return FixReads(dict(factors.keys), dict(factors.views), view_sources, fused_sources)
