"""`ckpt fix-adapter`: repair prime-rl's adapter exports into PEFT adapter dirs that really apply.

prime-rl writes two adapter exports that PEFT "loads" without an error and then applies nothing
(every LoRA key is reported missing, B stays zero, logits equal the base; format §5):

- the filesystem broadcast (`outputs/<run>/broadcasts/step_N/adapter_model.safetensors`) has keys
  without the `base_model.model.` prefix: `model.layers.0.mlp.up_proj.lora_A.weight`;
- the weight export (`outputs/weights/step_N/lora_adapters/adapter_model.bin`, a torch pickle)
  keeps the adapter slot: `base_model.model.model.layers.0.mlp.up_proj.lora_A.0.weight`.

The repair is a key rename (values untouched, same dtype) into safetensors -- never a pickle --
with keys sorted, plus an adapter_config.json whose lora_alpha is the training alpha (prime-rl's
exports carry the *trainer's* alpha, training used the orchestrator's: format §6.1), and
`modules_to_save` made true, under exact module names (PEFT matches entries as name suffixes): listed but
absent tensors are filled from `--checkpoint` (prime-rl HEAD trains them and its broadcast lists them
without their tensors: they are found in the checkpoint by their optimizer state), refused without it for a
HEAD run, dropped with a warning otherwise (16e747c never updates them, §6.3); present ones are dropped
when they equal the base, kept otherwise. Against the base model, every LoRA module must match a
base weight of the right shape (zero matches is an error).

Every adapter layout is read (`core.keys.LAYOUTS`: per-expert MoE modules, or PEFT's fused expert LoRA through
`target_parameters`, `formats.peft.experts`) and `--layout` says which one is written (default `peft`; a
dense adapter is the same file in every layout).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...core.dtypes import short_name
from ...core.errors import AlphaError, FormatError, UsageError
from ...core.keys import (
    DEFAULT_LAYOUT,
    LAYOUTS,
    PEFT_LORA_KEY,
    expert_parts,
    fused_param_name,
    fused_peft_modules,
)
from ...core.lora_math import check_modules_fit_base, lora_alpha_for_scale
from ...core.progress import Progress
from ...formats.hf_dir.hub import locate_model
from ...formats.hf_dir.model_dir import HFModelDir, tensor_shapes
from ...formats.peft.config import ADAPTER_CONFIG, BIN_NAME, PEFT_PREFIX, SAFETENSORS_NAME, parse_peft_config
from ...formats.peft.experts import (
    build_fused,
    fused_config,
    fused_params_of_config,
    parse_fused,
    plan_fused,
    read_view,
)
from ...formats.peft.writer import (
    AdapterDirReport,
    OutTensor,
    exact_modules_to_save,
    full_tensor_warning,
    peft_config,
    peft_key,
    safetensors_file_bytes,
    target_modules_for,
    write_adapter,
)
from ...formats.primerl.alpha import AlphaResolution, find_run_configs, resolve_alpha
from ...formats.primerl.run_dir import resolve_run
from ...io.inputs import check_input
from ...sources.files import TensorFileSource
from .sources import CKPT_REF, FixSources, check_same_state, open_fix_source

__all__ = [
    "CKPT_REF",
    "FixOptions",
    "FixPlan",
    "FixReport",
    "FixSources",
    "open_fix_source",
    "plan_fix",
    "run_fix",
]


def _belongs_to(name: str, target: str) -> bool:
    """`model.embed_tokens.weight` belongs to modules_to_save entry `embed_tokens` (PEFT matches
    the module name or its suffix)."""
    stem = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    return stem == target or stem.endswith("." + target)


# ------------------------------------------------------------------------------------ plan
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
    read_plan: dict = field(default_factory=dict, repr=False)  # source -> how to read it (fused/views)

    def to_json(self) -> dict:
        d = asdict(dataclasses.replace(self, read_plan={}))
        d.pop("read_plan")
        d["src"], d["out"] = str(self.src), str(self.out)
        d["base_checked"] = str(self.base_checked) if self.base_checked else None
        d["tensors"] = [t.to_json() for t in self.tensors]
        for k in ("fixes", "slots_present", "modules_to_save", "warnings"):
            d[k] = list(d[k])
        return d


def _resolve_alpha(
    src: Path, *, alpha, run_config, rank: int, cfg_alpha: float, cfg_scale: float, warnings: list[str]
) -> AlphaResolution:
    own = None
    if alpha is None and run_config is None and src.resolve().parent.name == "broadcasts":
        own = src.resolve().parent.parent / "configs" / "orch.toml"  # outputs/<run>/configs/orch.toml
        if os.path.lexists(own):  # the run's own config: inside the run dir, a regular file
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


@dataclass(frozen=True)
class FixOptions:
    out: str | Path
    base: str | None = None
    slot: int | None = None
    alpha: float | None = None
    run_config: str | None = None
    checkpoint: str | None = None  # the run's DCP checkpoint of the same step: fills absent modules_to_save
    layout: str = DEFAULT_LAYOUT  # how MoE expert LoRA is written (core.keys.LAYOUTS)


def plan_fix(weights: FixSources, src: str | Path, options: FixOptions) -> FixPlan:
    """Validate SRC completely (config, every key, shapes, the base) and decide the output."""
    src, out = Path(src), Path(options.out)
    base, slot, alpha, run_config = options.base, options.slot, options.alpha, options.run_config
    cfg = parse_peft_config(src / ADAPTER_CONFIG)
    if options.layout not in LAYOUTS:
        raise UsageError(f"--layout {options.layout!r}: choose one of {', '.join(LAYOUTS)}")
    params = fused_params_of_config(cfg.target_parameters)
    fused_patterns = all(k.rsplit(".", 1)[-1] in params for k in (*cfg.rank_pattern, *cfg.alpha_pattern))
    if cfg.use_rslora or ((cfg.rank_pattern or cfg.alpha_pattern) and not fused_patterns):
        raise FormatError(
            "use_rslora / rank_pattern / alpha_pattern are set: prime-rl exports have none, and "
            "fix-adapter repairs prime-rl exports",
            path=cfg.path,
            hint="a PEFT-made adapter needs no repair",
        )
    wpath = weights.path
    shapes = {k: weights.facts(k).shape for k in weights.names()}
    dtypes = {k: weights.facts(k).dtype for k in weights.names()}
    warnings: list[str] = []
    fixes: list[str] = []

    # ---- classify every key (core.keys.PEFT_LORA_KEY: every spelling we repair); the rest: modules_to_save
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
    slots = sorted({s for _, s in lora if s is not None})
    unslotted = any(s is None for _, s in lora)
    if slots and unslotted:
        raise FormatError(
            "keys mix slot-indexed (lora_A.<i>.weight) and plain lora_A.weight spellings", path=wpath
        )
    if slots:
        chosen = 0 if slot is None else slot
        if chosen not in slots:
            raise UsageError(
                f"adapter slot {chosen} is not in the export (slots present: {slots})",
                path=wpath,
                hint=f"pass --slot {slots[0]}",
            )
        fixes.append(
            f"dropped the adapter slot index from the keys (`lora_A.{chosen}.weight` -> `lora_A.weight`)"
        )
        if len(slots) > 1:
            warnings.append(
                f"the export holds slots {slots}; kept slot {chosen}. prime-rl does not record which run "
                "owns which slot (format §6.2): check it is the run you mean"
            )
    else:
        if slot not in (None, 0):
            raise UsageError(
                f"--slot {slot}: this export holds a single adapter (keys have no slot index)", path=wpath
            )
        chosen = None
    if any(not k.startswith(PEFT_PREFIX) for ab in lora.values() for k in ab.values()):
        fixes.append("added the `base_model.model.` prefix PEFT matches keys by")

    modules: dict[str, tuple[str, str]] = {}
    problems = []
    for (mod, s), ab in sorted(lora.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if s != chosen:
            continue
        if set(ab) != {"A", "B"}:
            problems.append(f"{mod}: lora_{''.join(ab)} without its partner")
            continue
        a, b = shapes[ab["A"]], shapes[ab["B"]]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            problems.append(f"{mod}: A {list(a)} and B {list(b)} do not share a rank")
            continue
        modules[mod] = (ab["A"], ab["B"])
    # a fused expert LoRA (the peft layout) is its per-expert modules, each a view into the fused tensors
    views = {}
    saved = set(modules)

    def partner_rank(experts: str, param: str) -> int | None:
        held = fused_peft_modules(experts, params).get(param) in saved
        return cfg.rank_for(fused_param_name(experts, param)) if held else None

    for mod in sorted(saved):
        a, b = modules[mod]
        expanded = parse_fused(mod, shapes[a], shapes[b], params, cfg.rank_for, partner_rank, wpath, r=cfg.r)
        if expanded is not None:
            del modules[mod]
            for name, v in expanded:
                modules[name], views[name] = (a, b), v
    if views:
        fixes.append(
            f"read the fused expert LoRA (target_parameters {list(cfg.target_parameters)}) as its "
            f"{len(views)} per-expert modules"
        )

    def fshape(mod: str, ab: str) -> tuple:
        if mod in views:
            return views[mod].a_shape if ab == "A" else views[mod].b_shape
        return shapes[modules[mod][0 if ab == "A" else 1]]

    ranks = sorted({fshape(m, "A")[0] for m in modules})
    if len(ranks) > 1:
        problems.append(f"ranks vary across modules: {ranks}")
    if problems:
        raise FormatError("adapter weights are inconsistent: " + "; ".join(problems[:8]), path=wpath)
    rank = ranks[0]
    if rank != cfg.r:
        warnings.append(f"adapter_config.json says r={cfg.r} but A has {rank} rows; writing r={rank}")
    for k in (k for ab in modules.values() for k in ab):
        if short_name(dtypes[k]) is None:
            raise FormatError(
                f"dtype torch.{dtypes[k]} is not one we write (fp32, bf16, fp16)", path=wpath, key=k
            )

    # ---- alpha: the training one, not the trainer config's
    cfg_scale = cfg.lora_alpha / cfg.r
    res = _resolve_alpha(
        src,
        alpha=alpha,
        run_config=run_config,
        rank=rank,
        cfg_alpha=cfg.lora_alpha * rank / cfg.r,
        cfg_scale=cfg_scale,
        warnings=warnings,
    )
    warnings += list(res.warnings)
    scale = res.alpha / rank
    lora_alpha = lora_alpha_for_scale(scale, rank)
    if not math.isclose(scale, cfg_scale, rel_tol=1e-9):
        fixes.append(
            f"lora_alpha {cfg.lora_alpha:g} -> {lora_alpha:g}: the export's config claims scale "
            f"{cfg_scale:g}, training used {scale:g} ({res.source})"
        )

    # ---- the base: shapes of every module, modules_to_save against it
    name_for_cfg = base if base is not None else cfg.base_model_name_or_path
    base_dir, why = (
        locate_model(base, run_root=None)
        if base is not None
        else locate_model(cfg.base_model_name_or_path, run_root=resolve_run(src).model_root)
    )
    base_shapes = None
    if base_dir is not None:
        base_shapes, _ = tensor_shapes(base_dir)
        check_modules_fit_base({m: (fshape(m, "A"), fshape(m, "B")) for m in modules}, base_shapes, base_dir)
    elif base is not None:
        raise UsageError(f"base model {base!r} not found: {why}", hint="pass an existing model directory")
    else:
        warnings.append(
            f"base model {cfg.base_model_name_or_path!r} from adapter_config.json was not found "
            f"({why}): keys were NOT checked against a model; pass --base DIR"
        )
    experts = [m for m in modules if expert_parts(m) is not None]
    fused = (
        plan_fused({m: (fshape(m, "A"), fshape(m, "B")) for m in experts}, wpath)
        if options.layout == "peft" and experts
        else []
    )
    per_module = sorted(m for m in modules if not fused or m not in set(experts))
    targets, twarn = target_modules_for(per_module, base_shapes)
    if twarn:
        warnings.append(twarn)
    if experts and bool(views) != bool(fused):
        fixes.append(
            f"MoE expert LoRA written in the {options.layout} layout ("
            + (
                "fused through target_parameters, what PEFT loads with transformers 5"
                if fused
                else "per-expert modules, what stock vLLM's Qwen3-MoE and prime-rl load"
            )
            + ")"
        )

    kept_full: list[str] = []
    filled: dict[str, str] = {}  # HF name -> checkpoint ref, for modules_to_save the export lacks
    missing = [t for t in cfg.modules_to_save if not any(_belongs_to(n, t) for n in full)]
    if weights.ckpt is not None:
        trained = weights.ckpt.full_tensors
        same = check_same_state(weights, modules, wpath)
        if not same:
            warnings.append(
                f"--checkpoint {weights.ckpt.path}: no LoRA factor in common with the export to prove it "
                "is the same step; check it is"
            )
        unlisted = sorted(
            n for n in trained if n not in full and not any(_belongs_to(n, t) for t in cfg.modules_to_save)
        )
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
            fixes.append(
                f"filled modules_to_save {sorted(filled)} from --checkpoint's trained fp32 masters "
                f"(prime-rl's "
                "broadcast lists them in adapter_config.json but holds none of their tensors)"
            )
        if unlisted:
            warnings.append(
                f"--checkpoint also trained {unlisted}, which the export's config does not list: added"
            )
        for name, ref in filled.items():
            f = weights.ckpt.key_facts(ref)
            if base_shapes is not None and tuple(base_shapes.get(name, ())) != tuple(f.shape):
                raise FormatError(
                    f"trained tensor {name} is {list(f.shape)} in --checkpoint, the base's is "
                    f"{list(base_shapes.get(name, [])) or 'absent'}",
                    path=weights.ckpt.path,
                    key=ref,
                )
    elif missing:
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
        fixes.append(
            f"modules_to_save {missing} are listed but absent from the weights (PEFT raises KeyError): "
            "dropped from the config"
        )
        warnings.append(
            f"modules_to_save {missing} are listed but the export holds none of their tensors: the output "
            "uses the base's values for them. Right for prime-rl 16e747c (its optimizer updates the LoRA "
            "only); if the run trained them (prime-rl HEAD lora.modules_to_save) pass --checkpoint CKPT "
            "of the same step to fill them"
        )
    for name in sorted(full):
        if base_dir is None:
            kept_full.append(name)
            warnings.append(
                f"kept modules_to_save tensor {name} (no base to compare with); vLLM rejects adapters "
                "with embed_tokens/lm_head modules_to_save"
            )
        elif _equals_base(weights, full[name], name, base_dir, base_shapes):
            fixes.append(
                f"dropped modules_to_save tensor {name}: identical to the base (prime-rl's LoRA optimizer "
                "never updates it), and vLLM rejects embed/lm_head modules_to_save"
            )
        else:
            kept_full.append(name)
            warnings.append(
                f"kept modules_to_save tensor {name}: it differs from the base. vLLM rejects adapters "
                "with embed_tokens/lm_head modules_to_save; PEFT loads it"
            )
    mts = exact_modules_to_save(kept_full + sorted(filled), base_shapes, path=base_dir)
    fw = full_tensor_warning(mts) if filled else None
    if fw:
        warnings.append(fw)

    read_plan: dict = {}
    tensors = []
    for m in per_module:
        for ab, k in zip("AB", modules[m]):
            source = f"view:{m}:{ab}" if m in views else k
            if m in views:
                read_plan[source] = ("view", m, ab)
            tensors.append(OutTensor(peft_key(m, ab), fshape(m, ab), short_name(dtypes[k]), source))
    for f in fused:
        for ab in "AB":
            k = modules[experts[0]][0 if ab == "A" else 1]
            read_plan[f.source(ab)] = ("fused", f, ab)
            tensors.append(
                OutTensor(
                    peft_key(f.peft_module, ab),
                    f.a_shape if ab == "A" else f.b_shape,
                    short_name(dtypes[k]),
                    f.source(ab),
                )
            )
    read_plan["_modules"], read_plan["_views"] = dict(modules), views
    for name in kept_full:
        k = full[name]
        tensors.append(OutTensor(PEFT_PREFIX + name, shapes[k], short_name(dtypes[k]), k))
    for name, ref in sorted(filled.items()):
        f = weights.ckpt.key_facts(ref)
        tensors.append(
            OutTensor(PEFT_PREFIX + name, tuple(f.shape), short_name(f.dtype) or "fp32", CKPT_REF + ref)
        )
    tensors.sort(key=lambda t: t.name)
    if wpath.name == BIN_NAME:
        fixes.append(f"{BIN_NAME} (a pickle) -> {SAFETENSORS_NAME}")
    config = peft_config(
        r=rank,
        lora_alpha=lora_alpha,
        target_modules=targets,
        base_model_name_or_path=name_for_cfg,
        modules_to_save=mts or None,
        fused=fused_config(fused, scale) if fused else None,
    )
    plan = FixPlan(
        src=src,
        out=out,
        weights_file=wpath.name,
        fixes=tuple(fixes),
        slot=chosen,
        slots_present=tuple(slots),
        modules=len(modules),
        rank=rank,
        alpha=res.alpha,
        alpha_source=res.source,
        lora_alpha=lora_alpha,
        scale=scale,
        base_model_name_or_path=name_for_cfg,
        base_checked=base_dir,
        tensors=tuple(tensors),
        modules_to_save=tuple(mts),
        config=config,
        out_file_bytes=safetensors_file_bytes(tensors),
        warnings=tuple(warnings),
        layout=options.layout,
        read_plan=read_plan,
    )
    return plan


def _equals_base(weights: TensorFileSource, key: str, name: str, base_dir: Path, base_shapes: dict) -> bool:
    if base_shapes.get(name) != weights.facts(key).shape:
        return False
    with HFModelDir.open(base_dir) as m:
        b = m.read_stored(name)
    t = weights.read_tensor(key)
    return bool(torch.equal(b.to(t.dtype), t))


@dataclass(frozen=True)
class FixReport(AdapterDirReport):
    plan: FixPlan


def run_fix(
    plan: FixPlan, weights: FixSources, progress: Progress | None = None, *, overwrite: bool = False
) -> FixReport:
    t0 = time.perf_counter()
    inputs = (
        [plan.src]
        + ([plan.base_checked] if plan.base_checked else [])
        + ([weights.ckpt.path] if weights.ckpt is not None else [])
    )  # --base and --checkpoint are read too
    rp = plan.read_plan
    modules, views = rp.get("_modules", {}), rp.get("_views", {})
    # the fused tensors the last views were cut from: one block's A and B of gate_up and down
    cache: dict = {}

    def factor(m: str, ab: str) -> torch.Tensor:
        key = modules[m][0 if ab == "A" else 1]
        if m not in views:
            return weights.read_tensor(key)
        if key not in cache:
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            cache[key] = weights.read_tensor(key)
        return read_view(views[m], ab, cache[key], key=key, path=weights.path)

    def read(t: OutTensor) -> torch.Tensor:
        how = rp.get(t.source)
        if how is None:
            return weights.read_tensor(t.source)
        if how[0] == "view":
            return factor(how[1], how[2])
        return build_fused(how[1], how[2], factor)

    size = write_adapter(
        plan.out,
        plan.tensors,
        read,
        plan.config,
        inputs=inputs,
        overwrite=overwrite,
        progress=progress,
        stage="fix",
    )
    return FixReport(plan, size, round(time.perf_counter() - t0, 3))
