"""`ckpt adapter-to-dcp`: a PEFT adapter + the HF base -> a prime-rl trainer checkpoint that
resumes with prime-rl's strict DCP loader.

The output is what `dcp.save({"app": AppState(model, [AdamW], scheduler, progress)})` would have
written (format §3), with our own streaming writer (`DcpWriter`: `dcp.save` keeps every tensor of
a file alive until the file closes, dcp-internals §4):

- `app.model.<hf name>`: every base tensor, as the fp32 master prime-rl holds (the bf16 hub value
  upcast, exact); tied embeddings also get `lm_head.weight`, as FSDP's state dict has it;
  `modules_to_save` tensors of the adapter replace the base's;
- `app.model.<module>.lora_A.0` [r, in] / `lora_B.0` [out, r]: the adapter's values, fp32;
- `app.optimizers.state.<module>.lora_{A,B}.0.{exp_avg,exp_avg_sq,step}`: fresh (zeros, step 0:
  see `ckpt_tools.primerl_state` for why that is exactly a never-stepped AdamW) or carried from
  another checkpoint (`--optimizer-from`);
- `app.optimizers.param_groups.0.*`: prime-rl's AdamW defaults, the requested lr, `initial_lr`,
  and the LoRA param FQNs in prime-rl's optimizer order;
- `app.scheduler.*`: the state of prime-rl's scheduler of the requested kind after
  `scheduler_step` steps; `app.progress.*`: step N.

Every tensor is written as dim-0 row chunks with `torch.chunk` boundaries for `world_size` ranks
(chunk k in `__k_0.distcp`), so each resuming FSDP2 rank reads only its rows. The base is streamed
one row chunk at a time: read those rows' bf16 bytes, upcast, append, drop -- memory is one fp32
chunk plus its bf16 source (for Qwen3-32B's embedding at world size 4: 0.78 GB + 0.39 GB).

The LoRA comes from any `LoraSource`: a PEFT adapter dir (`ckpt adapter-to-dcp`) or another prime-rl
checkpoint's own LoRA, read straight from it (`restart-prep --mode adapter`: no PEFT round trip). The
checkpoint does not store alpha (prime-rl takes it from the orchestrator config): the plan says which
`[model.lora] alpha` the resuming run must use for the adapter's scale.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.errors import FormatError, UsageError
from ..core.keys import (
    base_key,
    base_path,
    classify,
    expert_module,
    expert_module_pattern,
    expert_names,
    expert_parts,
    lora_key,
    lora_path,
    optimizer_state_key,
    optimizer_state_path,
    router_prime_name,
    stacked_base_key,
    stacked_lora_key,
    stacked_lora_path,
    step_of,
)
from ..core.lora_math import check_modules_fit_base
from ..core.primerl_state import (
    ADAMW_STATE_FIELDS,
    PRIMERL_ADAMW_DEFAULTS,
    OptimState,
    SchedulerSpec,
    adamw_param_group,
    build_optim_state,
    flat_key,
    flatten_state,
    fresh_adamw_fields,
    lora_param_order,
    progress_state,
)
from ..core.progress import Progress, report
from ..core.tied import missing_aliases
from ..dist import Group, SoloGroup
from ..formats.dcp.layout import row_chunks
from ..formats.dcp.model import BytesEntry, TensorEntry
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.dcp.writer import DcpWriter
from ..formats.handle import LoraSource
from ..formats.hf_dir.model_dir import HFModelDir
from ..formats.peft.adapter import open_peft_adapter
from ..io.inputs import as_input
from ..io.staging import SharedOutputDir
from ..sources.hashing import read_rows_as

__all__ = [
    "ToDcpJob",
    "ToDcpOptions",
    "ToDcpPlan",
    "ToDcpReport",
    "ToDcpSources",
    "open_to_dcp_sources",
    "plan_adapter_to_dcp",
    "run_adapter_to_dcp",
]

SLOT = 0  # a single-run prime-rl checkpoint holds adapter slot 0
# Per storage item: torch.save zip overhead is ~1.5 KB (format §3.2); pre-flight adds this much.
_ITEM_OVERHEAD_BYTES = 2048
_HPARAMS_FROM_SOURCE = ("betas", "eps", "weight_decay", "amsgrad", "maximize")


@dataclass(frozen=True)
class ToDcpJob:
    key: str
    path: tuple
    shape: tuple[int, ...]
    source: str  # "base:<name>", "adapter:<key>", "zeros", "ckpt:<key>"
    kind: str  # base | lora | optimizer_state

    @property
    def nbytes(self) -> int:
        return max(1, math.prod(self.shape)) * 4  # everything we write is fp32


@dataclass(frozen=True)
class ToDcpPlan:
    adapter: Path
    base: Path
    out: Path
    optimizer_from: Path | None
    world_size: int
    step: int
    lr: float
    scheduler: dict
    scheduler_step: int
    lr_now: float
    lr_next: tuple[float, ...]
    modules: int
    rank: int
    scale: float
    required_orch_alpha: float
    tensors: tuple[ToDcpJob, ...] = field(repr=False)
    objects: tuple[tuple[tuple, object], ...] = field(repr=False)  # (planner path, value) byte items
    data_bytes: int = 0
    need_bytes: int = 0
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def units(self) -> tuple[int, ...]:
        """The independent work units: the output data files (`__k_0.distcp`: rank k's rows of a tensor)."""
        return tuple(range(self.world_size))

    def to_json(self, *, full: bool = False) -> dict:
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("tensors", "objects")
        }
        for k in ("adapter", "base", "out", "optimizer_from"):
            d[k] = str(d[k]) if d[k] is not None else None
        d["lr_next"], d["notes"], d["warnings"] = list(self.lr_next), list(self.notes), list(self.warnings)
        kinds: dict[str, int] = {}
        for t in self.tensors:
            kinds[t.kind] = kinds.get(t.kind, 0) + 1
        d["tensor_keys"] = kinds
        d["byte_items"] = {
            flat_key(p): v for p, v in self.objects if p[1] != "optimizers" or p[-1] != "params"
        }
        d["keys"] = len(self.tensors) + len(self.objects)
        if full:
            d["tensors"] = [{"key": t.key, "shape": list(t.shape), "source": t.source} for t in self.tensors]
        return d


def _step_from_out(out: Path) -> int | None:
    return step_of(out.parent.name) if out.name == "trainer" else None


def _read_param_group(ckpt: DcpCheckpoint) -> dict:
    """param_groups.0 of a prime-rl checkpoint (prime-rl has one group)."""
    out = {}
    for k, e in ckpt.entries.items():
        info = classify(k, e.path)
        if info.group == "param_groups":
            if info.group_index != 0:
                raise FormatError(
                    "more than one optimizer param group: not a prime-rl LoRA checkpoint",
                    path=ckpt.dir,
                    key=k,
                )
            out[info.field] = ckpt.read_object(k)
    return out


@dataclass(frozen=True)
class ToDcpOptions:
    out: str | Path
    lr: float | None = None
    step: int | None = None
    world_size: int = 4
    scheduler: SchedulerSpec | None = None
    scheduler_step: int | None = None
    trust_pickle: bool = False


@dataclass
class ToDcpSources:
    lora: LoraSource  # a PEFT adapter, or a checkpoint's own LoRA (slot 0)
    base: HFModelDir
    optimizer_from: DcpCheckpoint | None = None

    def close(self) -> None:
        for s in (self.optimizer_from, self.base, self.lora):
            if s is not None:
                s.close()

    def __enter__(self) -> ToDcpSources:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_to_dcp_sources(
    adapter: str | Path,
    base: str | Path,
    *,
    optimizer_from: str | Path | None = None,
    trust_pickle: bool = False,
) -> ToDcpSources:
    """A PEFT adapter (refused: DoRA, bias, unknown peft_type, bad keys...), the HF base, and the
    checkpoint to carry AdamW state from (headers and metadata only)."""
    lora = open_peft_adapter(as_input(adapter), strict=True).lora()
    opened = [lora]
    try:
        hf = HFModelDir.open_ref(base)
        opened.append(hf)
        ck = (
            DcpCheckpoint.open(optimizer_from, trust_pickle=trust_pickle)
            if optimizer_from is not None
            else None
        )
    except BaseException:
        for o in reversed(opened):
            o.close()
        raise
    return ToDcpSources(lora, hf, ck)


def plan_adapter_to_dcp(sources: ToDcpSources, options: ToDcpOptions) -> ToDcpPlan:
    """Validate everything (adapter config and keys, shapes against the base, the optimizer
    source) before any tensor byte is read, and decide every key of the output."""
    ad, hf, src_ckpt = sources.lora, sources.base, sources.optimizer_from
    out, world_size = Path(options.out), options.world_size
    if world_size < 1:
        raise UsageError(f"--world-size {world_size} must be >= 1")
    rank, scale = _adapter_rank_and_scale(ad)
    base_shapes = {k: tuple(hf.facts(k).shape) for k in hf.disk_order()}
    check_modules_fit_base({m: (s.a_shape, s.b_shape) for m, s in ad.modules.items()}, base_shapes, hf.path)
    notes: list[str] = []
    warnings: list[str] = []
    # ---- model tensors: base (in file order, for sequential reads), tied aliases, LoRA
    jobs, stacks = _model_jobs(ad, hf, base_shapes, notes)
    lora_jobs, param_shape, order = _lora_jobs(ad, stacks, notes)
    jobs += lora_jobs
    # ---- optimizer: fresh, or moments carried from another checkpoint
    lr, step = options.lr, options.step
    hparams: dict = {}
    if src_ckpt is not None:
        carried, lr, step, hparams = _carried_optimizer(src_ckpt, order, param_shape, lr, step, notes)
        jobs += carried
    else:
        jobs += _fresh_optimizer(order, param_shape)
    lr, step, spec, position, ost, objects = _training_state(options, lr, step, hparams, order)
    _resume_notes(ad, out, step, rank, scale, notes, warnings)
    # every chunk is an item; byte items are small
    items = sum(max(1, len(row_chunks(j.shape[0], world_size))) if j.shape else 1 for j in jobs) + len(
        objects
    )
    data = sum(j.nbytes for j in jobs)
    return ToDcpPlan(
        adapter=ad.path,
        base=hf.path,
        out=out,
        optimizer_from=src_ckpt.dir if src_ckpt else None,
        world_size=world_size,
        step=step,
        lr=lr,
        scheduler={**dataclasses.asdict(spec), "describe": spec.describe(), "state": ost.scheduler},
        scheduler_step=position,
        lr_now=ost.lr_now,
        lr_next=ost.lr_next,
        modules=len(ad.modules),
        rank=rank,
        scale=scale,
        required_orch_alpha=scale * rank,
        tensors=tuple(jobs),
        objects=tuple(objects),
        data_bytes=data,
        need_bytes=data + items * _ITEM_OVERHEAD_BYTES + (1 << 20),
        notes=tuple(notes),
        warnings=tuple(warnings),
    )


def _adapter_rank_and_scale(ad: LoraSource) -> tuple[int, float]:
    """The adapter's one rank and one scale: prime-rl trains nn.Linear LoRA of one rank with one scale."""
    if not ad.modules:
        raise FormatError(
            "the adapter holds zero LoRA modules",
            path=ad.weights_path,
            hint="nothing to train on; check the adapter's keys",
        )
    if any(m.fan_in_fan_out for m in ad.modules.values()):
        raise FormatError(
            "fan_in_fan_out=true (Conv1D-style base layers): prime-rl's LoRA wraps nn.Linear",
            path=ad.config_path,
        )
    ranks = sorted({m.rank for m in ad.modules.values()})
    scales = sorted({m.scale for m in ad.modules.values()})
    if len(ranks) != 1 or len(scales) != 1:
        raise FormatError(
            f"ranks {ranks} / scales {scales} vary across modules (rank_pattern/alpha_pattern): "
            "prime-rl trains one rank with one scale",
            path=ad.config_path,
        )
    return ranks[0], scales[0]


def _expert_stacks(model_names: list[str], base_dir: Path) -> dict[tuple[str, str], list[int]]:
    """(experts module, projection) -> the expert indices of the base's per-expert weights: prime-rl HEAD
    trains an HF Qwen3-MoE in its own format, per-expert base weights stacked into `mlp.experts.w1/w2/w3`
    [E, out, in], the router as `mlp.router.gate.weight`, expert LoRA stacked [E, r, in] / [E, out, r]
    (`core.keys`); every other name stays. Each projection's experts must be 0..E-1."""
    stacks: dict[tuple[str, str], list[int]] = {}
    for name in model_names:
        ex = expert_parts(name[: -len(".weight")]) if name.endswith(".weight") else None
        if ex is not None:
            stacks.setdefault((ex[0], ex[2]), []).append(ex[1])
    for (experts, proj), idx in stacks.items():
        if sorted(idx) != list(range(len(idx))):
            raise FormatError(
                f"{experts}: the base's {proj} experts are {sorted(idx)[:8]}..., not 0..{len(idx) - 1}",
                path=base_dir,
            )
    return stacks


def _model_jobs(
    ad: LoraSource, hf: HFModelDir, base_shapes: dict[str, tuple[int, ...]], notes: list[str]
) -> tuple[list[ToDcpJob], dict[tuple[str, str], list[int]]]:
    """The model's tensors (the base's, in file order; tied aliases; modules_to_save from the adapter)
    under prime-rl's keys, and the base's expert stacks."""
    model_names = hf.disk_order()
    aliases = missing_aliases(hf.config, base_shapes)
    full = dict(ad.full_tensors)  # modules_to_save: HF name -> adapter key
    bad_full = [
        n for n in full if n not in base_shapes or base_shapes[n] != tuple(ad.key_facts(full[n]).shape)
    ]
    if bad_full:
        raise FormatError(
            f"modules_to_save tensors {bad_full} have no same-shaped tensor in the base",
            path=ad.weights_path,
            hint="the adapter was trained on a different base model",
        )
    stacks = _expert_stacks(model_names, hf.path)
    jobs: list[ToDcpJob] = []
    done_stacks = set()
    for name in model_names + sorted(aliases):
        src_name = aliases.get(name, name)
        ex = (
            expert_parts(name[: -len(".weight")])
            if name.endswith(".weight") and name not in aliases
            else None
        )
        if ex is not None:
            if (ex[0], ex[2]) not in done_stacks:
                done_stacks.add((ex[0], ex[2]))
                key = stacked_base_key(ex[0], ex[2])
                jobs.append(
                    ToDcpJob(
                        key,
                        ("app", "model", key.removeprefix("app.model.")),
                        (len(stacks[(ex[0], ex[2])]),) + base_shapes[src_name],
                        f"base-stack:{expert_module_pattern(ex[0], ex[2])}",
                        "base",
                    )
                )
            continue
        source = f"adapter:{full[src_name]}" if src_name in full else f"base:{src_name}"
        prime = router_prime_name(name) if stacks else None
        jobs.append(
            ToDcpJob(base_key(prime or name), base_path(prime or name), base_shapes[src_name], source, "base")
        )
    if stacks:
        notes.append(
            f"MoE: {len(stacks)} per-expert projection group(s) stacked into prime-rl's mlp.experts.w1/w2/w3 "
            "(w1 = gate, w3 = up, w2 = down) and the router written as mlp.router.gate.weight, as prime-rl "
            "HEAD's own model holds them"
        )
    if aliases:
        notes.append(
            f"tied embeddings: {', '.join(aliases)} written as a copy of "
            f"{', '.join(aliases.values())} (FSDP's state dict holds both names)"
        )
    if full:
        notes.append(f"modules_to_save {sorted(full)}: the adapter's values replace the base's")
    return jobs, stacks


def _lora_jobs(
    ad: LoraSource, stacks: dict[tuple[str, str], list[int]], notes: list[str]
) -> tuple[list[ToDcpJob], dict[str, tuple[int, ...]], list[str]]:
    """The LoRA factors under prime-rl's keys (slot 0; per-expert modules stacked, every expert present),
    each param's shape, and the params in the optimizer's order."""
    modules = sorted(ad.modules)
    dense = [m for m in modules if expert_parts(m) is None]
    lora_stacks: dict[tuple[str, str], list[int]] = {}
    for m in modules:
        ex = expert_parts(m)
        if ex is not None:
            lora_stacks.setdefault((ex[0], ex[2]), []).append(ex[1])
    jobs: list[ToDcpJob] = []
    param_shape = {}
    for m in dense:
        s_ = ad.modules[m]
        for ab, akey, shape in (("A", s_.a_key, s_.a_shape), ("B", s_.b_key, s_.b_shape)):
            jobs.append(
                ToDcpJob(
                    lora_key(m, ab, SLOT), lora_path(m, ab, SLOT), tuple(shape), f"adapter:{akey}", "lora"
                )
            )
            param_shape[lora_key(m, ab, SLOT).removeprefix("app.model.")] = tuple(shape)
    for (experts, proj), idx in sorted(lora_stacks.items()):
        n = len(stacks.get((experts, proj), ()))
        if sorted(idx) != list(range(n)):
            raise FormatError(
                f"{experts}.*.{proj}: the adapter has LoRA for experts {sorted(idx)[:8]}... of the "
                f"base's {n}; prime-rl's grouped-expert LoRA covers every expert",
                path=ad.weights_path,
            )
        first = ad.modules[expert_module(experts, 0, proj)]
        for ab, shape in (("A", first.a_shape), ("B", first.b_shape)):
            key = stacked_lora_key(experts, proj, ab, SLOT)
            jobs.append(
                ToDcpJob(
                    key,
                    stacked_lora_path(experts, proj, ab, SLOT),
                    (n,) + tuple(shape),
                    f"adapter-stack:{ab}:{expert_module_pattern(experts, proj)}",
                    "lora",
                )
            )
            param_shape[key.removeprefix("app.model.")] = (n,) + tuple(shape)
    if lora_stacks:
        notes.append(
            f"MoE LoRA: {sum(len(v) for v in lora_stacks.values())} per-expert modules stacked into "
            f"{2 * len(lora_stacks)} grouped-expert factors (w{{1,2,3}}_lora_{{A,B}}.{SLOT})"
        )
    return jobs, param_shape, lora_param_order(dense, sorted(lora_stacks), SLOT)


def _optimizer_jobs(order: list[str], param_shape: dict[str, tuple[int, ...]], source) -> list[ToDcpJob]:
    """AdamW's state of every param, each field's value from `source(key, field)`."""
    return [
        ToDcpJob(
            optimizer_state_key(fqn, fld),
            optimizer_state_path(fqn, fld),
            () if fld == "step" else param_shape[fqn],
            source(optimizer_state_key(fqn, fld), fld),
            "optimizer_state",
        )
        for fqn in order
        for fld in ADAMW_STATE_FIELDS
    ]


def _fresh_optimizer(order: list[str], param_shape: dict[str, tuple[int, ...]]) -> list[ToDcpJob]:
    fill = fresh_adamw_fields()
    return _optimizer_jobs(order, param_shape, lambda _key, fld: f"fill:{fill[fld]!r}")


def _carried_optimizer(
    src_ckpt: DcpCheckpoint,
    order: list[str],
    param_shape: dict[str, tuple[int, ...]],
    lr: float | None,
    step: int | None,
    notes: list[str],
) -> tuple[list[ToDcpJob], float | None, int | None, dict]:
    """--optimizer-from: its moments of every param (checked against the adapter's), its AdamW
    hyperparameters, and its lr and step where not given."""
    problems = []
    for fqn in order:
        for fld in ADAMW_STATE_FIELDS:
            key = optimizer_state_key(fqn, fld)
            e = src_ckpt.entries.get(key)
            want = () if fld == "step" else param_shape[fqn]
            if not isinstance(e, TensorEntry):
                problems.append(f"{key} is missing")
            elif tuple(e.shape) != want:
                problems.append(f"{key} has shape {list(e.shape)}, the adapter's param {list(want)}")
    if problems:
        raise FormatError(
            f"{len(problems)} problem(s) carrying the optimizer state: "
            + "; ".join(problems[:6])
            + (" ..." if len(problems) > 6 else ""),
            path=src_ckpt.dir,
            hint="--optimizer-from needs a checkpoint of the same LoRA (modules, rank, slot 0)",
        )
    group = _read_param_group(src_ckpt)
    hparams = {k: group[k] for k in _HPARAMS_FROM_SOURCE if k in group}
    if lr is None:
        lr = group.get("initial_lr", group.get("lr"))
        notes.append(f"lr {lr:g}: the source checkpoint's initial_lr (pass --lr to change it)")
    src_progress = {}
    for k, e in src_ckpt.entries.items():
        info = classify(k, e.path)
        if info.group == "progress" and isinstance(e, BytesEntry):
            src_progress[info.field] = src_ckpt.read_object(k)
    if step is None and isinstance(src_progress.get("step"), int):
        step = src_progress["step"]
    changed = {k: v for k, v in hparams.items() if v != PRIMERL_ADAMW_DEFAULTS.get(k)}
    if changed:
        notes.append(f"AdamW hyperparameters carried from the source: {changed}")
    return _optimizer_jobs(order, param_shape, lambda key, _fld: f"ckpt:{key}"), lr, step, hparams


def _training_state(
    options: ToDcpOptions, lr: float | None, step: int | None, hparams: dict, order: list[str]
) -> tuple[float, int, SchedulerSpec, int, OptimState, list]:
    """The lr, the step, the scheduler and its position, the optimizer and scheduler state at lr, and the byte
    items that hold them (param_groups, scheduler, progress)."""
    if lr is None:
        raise UsageError(
            "pass --lr: the base learning rate the resumed run trains with "
            "(or --optimizer-from CKPT to take that checkpoint's)"
        )
    step = 0 if step is None else int(step)
    if step < 0:
        raise UsageError(f"--step {step} must be >= 0")
    spec = options.scheduler or SchedulerSpec("constant")
    position = step if options.scheduler_step is None else int(options.scheduler_step)
    try:
        ost = build_optim_state(float(lr), spec, position, hparams=hparams)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    objects = flatten_state(
        adamw_param_group(ost.param_group, order), ("app", "optimizers", "param_groups", 0)
    )
    objects += flatten_state(ost.scheduler, ("app", "scheduler"))
    objects += flatten_state(progress_state(step), ("app", "progress"))
    return float(lr), step, spec, position, ost, objects


def _resume_notes(
    ad: LoraSource, out: Path, step: int, rank: int, scale: float, notes: list[str], warnings: list[str]
) -> None:
    """What the resuming run must match: the step dir prime-rl finds it by, the adapter's precision, the
    LoRA rank and scale it trains with."""
    n_from_dir = _step_from_out(out)
    if n_from_dir is not None and n_from_dir != step:
        warnings.append(
            f"OUT is a step_{n_from_dir}/trainer dir but progress.step will be {step}: prime-rl "
            f"finds checkpoints by directory name; use .../step_{step}/trainer or --step {n_from_dir}"
        )
    if any(s.a_dtype != "float32" for s in ad.modules.values()):
        notes.append(
            "the adapter is not fp32: its values are upcast exactly, but the rounding it went through "
            "is not undone"
        )
    notes.append(
        f"the resuming run must train with LoRA rank {rank} and scale {scale:g}: alpha = {scale * rank:g} "
        "in the trainer's model.lora at prime-rl HEAD (scale = trainer alpha / rank), in the orchestrator's "
        "[model.lora] at 16e747c (scale = orchestrator alpha / rank; its default alpha is 16)"
    )


def _write_stack(w: DcpWriter, job: ToDcpJob, read_rows) -> None:
    """A stacked [E, ...] tensor as fp32, one row chunk (a block of experts) at a time."""
    for k, (start, rows) in enumerate(row_chunks(job.shape[0], w.files)):
        if not w.owns(k):  # another rank's file (multi-rank): its experts are not read here
            w.skip(job.key)
            continue
        piece = read_rows(start, rows)
        piece = piece.to(torch.float32) if piece.is_floating_point() else piece
        w.write_chunk(
            job.key,
            job.path,
            piece,
            size=tuple(job.shape),
            offsets=(start,) + (0,) * (len(job.shape) - 1),
            file_index=k,
        )
        del piece


def _write_base_streaming(w: DcpWriter, job: ToDcpJob, hf: HFModelDir, name: str) -> None:
    """One base tensor as its fp32 master, one row chunk at a time (read those rows' bytes, upcast,
    append, drop): memory is one fp32 chunk plus its source rows."""
    shape = hf.facts(name).shape
    if not shape:
        if not w.owns(0):
            w.skip(job.key)
            return
        t = hf.read_tensor(name)
        w.write_tensor(job.key, job.path, t.float() if t.is_floating_point() else t)
        return
    for k, (start, rows) in enumerate(row_chunks(shape[0], w.files)):
        if not w.owns(k):  # another rank's file (multi-rank): its rows are not read here
            w.skip(job.key)
            continue
        piece = hf.read_rows(name, start, rows)
        piece = piece.to(torch.float32) if piece.is_floating_point() else piece
        w.write_chunk(
            job.key,
            job.path,
            piece,
            size=tuple(shape),
            offsets=(start,) + (0,) * (len(shape) - 1),
            file_index=k,
        )
        del piece


@dataclass(frozen=True)
class ToDcpReport:
    plan: ToDcpPlan
    bytes_written: int | None = None  # None: a dry run
    seconds: float = 0.0
    full: bool = False  # list every tensor (a --json dry run)

    def to_json(self) -> dict:
        rep = self.plan.to_json(full=self.full)
        if self.bytes_written is None:
            rep["dry_run"] = True
        else:
            rep.update(bytes_written=self.bytes_written, seconds=self.seconds)
        return rep


def run_adapter_to_dcp(
    plan: ToDcpPlan,
    sources: ToDcpSources,
    progress: Progress | None = None,
    *,
    overwrite: bool = False,
    group: Group | None = None,
) -> ToDcpReport:
    """Write the checkpoint (atomically); `progress`: one event per key written. Under torchrun
    (`group`), rank k of N writes its share of the rank files `__i_0.distcp` (each file holds one row
    chunk of every tensor: about equal, so by index); rank 0 writes `.metadata` and commits."""
    ad, hf, src_ckpt = sources.lora, sources.base, sources.optimizer_from
    group = group or SoloGroup()
    t0 = time.perf_counter()
    inputs = [plan.adapter, plan.base] + ([plan.optimizer_from] if plan.optimizer_from else [])
    with SharedOutputDir(
        plan.out, group, inputs=inputs, need_bytes=plan.need_bytes, overwrite=overwrite
    ) as tmp:
        split = group.part.world > 1
        w = DcpWriter(
            tmp, files=plan.world_size, owned_files=group.part.mine([1] * plan.world_size) if split else None
        )
        try:
            for i, job in enumerate(plan.tensors):
                kind, _, ref = job.source.partition(":")
                report(progress, "write", i, len(plan.tensors), unit="tensors", name=job.key)
                if kind == "base":
                    _write_base_streaming(w, job, hf, ref)
                    continue
                if kind == "base-stack":  # the base's per-expert weights, stacked by expert
                    _write_stack(
                        w, job, lambda s, n, ref=ref: read_rows_as(hf, ref + ".weight", torch.float32, s, n)
                    )
                    continue
                if kind == "adapter-stack":  # A:<pattern>: the experts' factors, stacked
                    ab, _, pattern = ref.partition(":")
                    _write_stack(
                        w,
                        job,
                        lambda s, n, ab=ab, pattern=pattern, job=job: (
                            torch.stack(
                                [ad.read_factor(m, ab).to(torch.float32) for m in expert_names(pattern, s, n)]
                            )
                            if n
                            else torch.empty((0,) + job.shape[1:])
                        ),
                    )
                    continue
                if kind == "adapter":
                    t = ad.read_key(ref).to(torch.float32)
                elif kind == "ckpt":
                    assert src_ckpt is not None  # a "ckpt:" source is planned from --optimizer-from only
                    t = src_ckpt.read_tensor(ref).to(torch.float32)
                else:  # fill:<value>
                    t = torch.full(job.shape, float(ref), dtype=torch.float32)
                if tuple(t.shape) != job.shape:
                    raise FormatError(f"read {list(t.shape)}, planned {list(job.shape)}", key=job.source)
                w.write_tensor(job.key, job.path, t, world_size=plan.world_size)
                del t
            for path, value in plan.objects:
                w.write_object(flat_key(path), path, value)
            (bytes_written,) = group.sum([w.bytes_written], "the bytes written")
            w.finish(group)
        except BaseException:
            w.abort()
            raise
    return ToDcpReport(plan, bytes_written, round(time.perf_counter() - t0, 3))
