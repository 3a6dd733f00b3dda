"""A LoRA computed in delta space: a weighted sum of other LoRAs' modules, optionally brought down to a
lower rank per module, served as a `LoraSource` so that every consumer (the PEFT writer, the merge
pipeline) reads it like a stored adapter.

`DeltaSource(inputs, terms)`: for each module, the terms (input index, coefficient); its delta is
sum_i coef_i * s_i * B_i @ A_i, with s_i the input's own LoRA scale, which is exactly the LoRA
(A stacked, B concatenated with coef_i * s_i folded in: `core.delta_math.stack_terms`) of rank
sum(r_i) and scale 1. `truncate_to(rank=K | energy=E)` decides per module the Eckart-Young rank
(`core.delta_math.truncate`: QR of A^T and B, SVD of the r x r core; this reads the factors, never a
base weight) and from then on serves the rank-k factors. One module's factors are held at a time
(A and B of a module are read one after the other by every consumer), per reading thread.

`peft_outputs(src, ...)` is what `ckpt average` and `ckpt resize-adapter` hand the one PEFT writer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..core.delta_math import Truncation, stack_terms, truncate
from ..core.errors import CkptError, FormatError
from ..core.keys import DEFAULT_LAYOUT, PROGRESS_STEP_KEY, step_of
from ..formats.handle import LoraModule, LoraSource, RawTensor, TensorFacts
from ..formats.hf_dir.hub import locate_model
from ..formats.peft.experts import build_fused
from ..formats.peft.layout import FullTensor, ModuleFactors, plan_adapter_layout
from ..formats.peft.writer import OutTensor
from ..formats.primerl.run_dir import resolve_run
from ..io.inputs import as_input

FULL_SUFFIX = "#full"  # the key a DeltaSource serves a trained full tensor under (never a real key: '#')

__all__ = [
    "FULL_SUFFIX",
    "DeltaSource",
    "Term",
    "finite",
    "lora_base",
    "lora_base_name",
    "lora_step",
    "peft_outputs",
    "shared_peft_targets",
]


@dataclass(frozen=True)
class Term:
    input: int  # index into DeltaSource.inputs
    coef: float  # the weight of this input's delta (its own LoRA scale is applied on top)


class DeltaSource(LoraSource):
    kind = "delta"

    def __init__(
        self,
        inputs: list[LoraSource],
        terms: dict[str, tuple[Term, ...]],
        *,
        path: Path,
        describe_as: str = "delta",
        full_terms: dict[str, tuple[Term, ...]] | None = None,
    ):
        self.inputs = list(inputs)
        self.terms = {m: tuple(t) for m, t in sorted(terms.items())}
        self.path = as_input(path)
        self.config_path = self.weights_path = self.path
        self.alpha, self.alpha_source = None, f"{describe_as}: the inputs' own scales folded into B (scale 1)"
        # modules_to_save (trained full tensors): sum_i coef_i * T_i, no LoRA scale; HF name -> our key
        self.full_terms = {n: tuple(t) for n, t in sorted((full_terms or {}).items())}
        self.full_tensors = {n: n + FULL_SUFFIX for n in self.full_terms}
        self.fused: dict[str, tuple] = {}  # output key -> (FusedParam, "A" | "B"), set by `peft_outputs`
        self._full_facts: dict[str, tuple[int, ...]] = {}
        for n, ts in self.full_terms.items():
            shapes = {
                tuple(self.inputs[t.input].key_facts(self.inputs[t.input].full_tensors[n]).shape) for t in ts
            }
            if len(shapes) != 1 or not ts:
                raise FormatError(
                    f"trained full tensor {n} has different shapes in the inputs ({sorted(shapes)})",
                    key=n,
                    hint="average steps of one run",
                )
            self._full_facts[n] = shapes.pop()
        self.truncations: dict[str, Truncation] = {}
        self._ranks: dict[str, int] = {}
        self._local = threading.local()  # per thread (the merge pipeline reads on threads): its last module
        self.modules = {}
        for m, ts in self.terms.items():
            if not ts:
                raise ValueError(f"module {m} has no terms")
            mods = [self.inputs[t.input].modules[m] for t in ts]
            ins, outs = {x.a_shape[1] for x in mods}, {x.b_shape[0] for x in mods}
            fan = {x.fan_in_fan_out for x in mods}
            if len(ins) != 1 or len(outs) != 1 or len(fan) != 1:
                raise FormatError(
                    f"module {m} has different shapes in the inputs (in {sorted(ins)}, out "
                    f"{sorted(outs)}, fan_in_fan_out {sorted(fan)}): they are not LoRAs of one model",
                    key=m,
                )
            r = sum(x.rank for x in mods)
            self.modules[m] = LoraModule(
                m, r, 1.0, f"{m}.lora_A", f"{m}.lora_B", (r, ins.pop()), (outs.pop(), r), fan.pop(), "float64"
            )

    # ------------------------------------------------------------------ the factors
    def stacked(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact weighted sum as one LoRA (fp64 A_cat, B_cat with scale 1). A NaN or inf in a factor
        read is refused, naming its file and key (a sum, QR or SVD would carry it into every output)."""
        parts = []
        for t in self.terms[module]:
            src = self.inputs[t.input]
            m = src.modules[module]
            a, b = (finite(src.read_factor(module, ab), src.weights_path, m.factor_ref(ab)) for ab in "AB")
            parts.append((a, b, t.coef * src.modules[module].scale))
        return stack_terms(parts)

    def truncate_to(self, *, rank: int | None = None, energy: float | None = None) -> dict[str, Truncation]:
        """Decide each module's rank (reads every module's factors once) and serve rank-k factors from
        now on. Returns the facts per module."""
        for m in self.modules:
            a, b = self.stacked(m)
            _a, _b, facts = self._truncate(m, a, b, rank=rank, energy=energy)
            self.truncations[m] = facts
            self._ranks[m] = facts.rank
            k = facts.rank
            old = self.modules[m]
            self.modules[m] = replace(old, rank=k, a_shape=(k, old.a_shape[1]), b_shape=(old.b_shape[0], k))
        self._local = threading.local()
        return dict(self.truncations)

    def pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """fp64 (A, B) served for `module` (rank-k when truncated); the last module's pair is kept."""
        cached = getattr(self._local, "pair", None)
        if cached is not None and cached[0] == module:
            return cached[1], cached[2]
        self._local.pair = None
        a, b = self.stacked(module)
        if module in self._ranks:
            a, b, _ = self._truncate(module, a, b, rank=self._ranks[module])
        for ab, x in (("A", a), ("B", b)):  # written as fp32 (or merged): past its range is inf there
            finite(x.to(torch.float32), self.path, f"{module}.lora_{ab}", what=_RESULT, hint=_RESULT_HINT)
        self._local.pair = (module, a, b)
        return a, b

    def _truncate(self, module: str, a: torch.Tensor, b: torch.Tensor, **rule):
        """`core.delta_math.truncate`, a decomposition that fails (values near fp64's range) named."""
        try:
            return truncate(a, b, **rule)
        except torch.linalg.LinAlgError as exc:
            raise FormatError(
                f"the SVD of this module's delta failed ({str(exc).split(':')[0][:60]} did not converge)",
                path=self.path,
                key=module,
                hint="its factors hold values near the float64 range: `ckpt verify --deep` the input",
            ) from None

    def full(self, name: str) -> torch.Tensor:
        """A trained full tensor: the weighted sum of the inputs' (fp64, rounded once by the writer)."""
        out = None
        for t in self.full_terms[name]:
            src = self.inputs[t.input]
            key = src.full_tensors[name]
            x = finite(src.read_key(key), src.weights_path, key).to(torch.float64) * float(t.coef)
            out = x if out is None else out.add_(x)
        assert out is not None  # every full tensor is some input's (plan_average's terms)
        finite(
            out.to(torch.float32), self.path, name, what=_RESULT, hint=_RESULT_HINT
        )  # checked, not rounded
        return out

    # ------------------------------------------------------------------ the LoraSource contract
    def read_factor(self, module: str, ab: str) -> torch.Tensor:
        a, b = self.pair(module)
        return a if ab == "A" else b

    def read_out(self, key: str) -> torch.Tensor | RawTensor:
        """A tensor of the adapter this source is written as (the writer's read): a fused expert LoRA key
        (the peft layout) placed from every expert's factors, as bytes (a `RawTensor`); else `read_key`'s."""
        if key in self.fused:
            f, ab = self.fused[key]
            return build_fused(f, ab, self.read_factor)
        return self.read_key(key)

    def read_key(self, key: str) -> torch.Tensor:
        if key.endswith(FULL_SUFFIX):
            return self.full(key[: -len(FULL_SUFFIX)]).to(torch.float32)
        module, ab = key.rsplit(".lora_", 1)
        return self.read_factor(module, ab)

    def key_facts(self, key: str) -> TensorFacts:
        if key.endswith(FULL_SUFFIX):
            return TensorFacts(key, "float32", self._full_facts[key[: -len(FULL_SUFFIX)]])
        module, ab = key.rsplit(".lora_", 1)
        m = self.modules[module]
        return TensorFacts(key, "float64", m.a_shape if ab == "A" else m.b_shape)

    def describe(self) -> dict:
        d = super().describe()
        d["inputs"] = [str(s.path) for s in self.inputs]
        return d

    def close(self) -> None:
        for s in self.inputs:
            s.close()


_RESULT = "the result (the inputs' weighted sum, at its new rank) as float32"
_RESULT_HINT = "the weights or the inputs' values take it past float32's range (3.4e38): check the weights"


def finite(
    t: torch.Tensor,
    path,
    key: str,
    *,
    what: str = "this input",
    hint: str = "a damaged or diverged input: `ckpt verify --deep` it, and average or resize without it",
) -> torch.Tensor:
    """`t`, when every value is finite; else a FormatError naming the file and the key."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int(t.numel() - int(torch.isfinite(t).sum()))
        raise FormatError(
            f"{what} holds {bad} non-finite value(s) (NaN or inf): refusing to write them",
            path=path,
            key=key,
            hint=hint,
        )
    return t


def lora_step(src: LoraSource) -> int | None:
    """The training step of an input: step_N in its path (the dir or its parent), else a checkpoint's
    progress.step; None when neither says."""
    p = as_input(src.path)
    for c in (p, p.parent):
        n = step_of(c.name)
        if n is not None:
            return n
    if src.ckpt is not None and PROGRESS_STEP_KEY in src.ckpt.entries:
        try:
            v = src.ckpt.read_object(PROGRESS_STEP_KEY)
            return v if isinstance(v, int) and not isinstance(v, bool) else None
        except CkptError:
            return None
    return None


def lora_base(src: LoraSource) -> tuple[str | None, Path | None]:
    """The base model an input names (a PEFT adapter's base_model_name_or_path, a checkpoint's run config
    model name) and the local dir it resolves to (a relative name against the run's launch dir, as
    prime-rl resolved it; None when not found here)."""
    name, root = None, None
    if src.adapter is not None:
        name = src.adapter.config.base_model_name_or_path
        root = resolve_run(src.path).model_root
    elif src.ckpt is not None:
        run = resolve_run(src.path, config=src.resolution.config_path if src.resolution is not None else None)
        name, root = run.base_name, run.launch
    if not name:
        return None, None
    found, _why = locate_model(name, run_root=root)
    return name, found.resolve() if found is not None else None


def lora_base_name(src: LoraSource) -> str | None:
    """The base model name an input names (None when it names none)."""
    return lora_base(src)[0]


def shared_peft_targets(srcs: list[LoraSource]) -> list[str] | None:
    """The inputs' own PEFT target_modules when they all name the same list, else None (the suffixes)."""
    lists = []
    for s in srcs:
        if s.adapter is None:
            return None
        t = s.adapter.config.target_modules
        lists.append(sorted(t) if isinstance(t, (list, tuple, set)) else t)
    return lists[0] if all(x == lists[0] for x in lists) and isinstance(lists[0], list) else None


def peft_outputs(
    src: DeltaSource,
    *,
    base_model_name_or_path: str | None,
    target_modules: list[str] | None = None,
    layout: str = DEFAULT_LAYOUT,
) -> tuple[tuple[OutTensor, ...], dict, tuple[str, ...]]:
    """The tensors (fp32, sorted by key), adapter_config.json and warnings of `src` as a PEFT adapter
    (`formats.peft.layout`, as every adapter writer lays one out): each module at its own rank with scale 1
    (lora_alpha = r; modules at another rank than the most common one in rank_pattern / alpha_pattern);
    trained full tensors under their exact module names in modules_to_save. `layout` (`core.keys.LAYOUTS`):
    grouped-expert modules as PEFT's fused expert LoRA (`peft`: it needs one rank across the experts of a
    projection, as an exact average or `--rank K` gives) or per expert (`vllm`, `prime-rl`); a dense LoRA
    is the same file in every layout."""
    plan = plan_adapter_layout(
        {
            m: ModuleFactors(
                spec.a_shape, spec.b_shape, "fp32", "fp32", f"{m}.lora_A", f"{m}.lora_B", spec.fan_in_fan_out
            )
            for m, spec in src.modules.items()
        },
        {n: FullTensor(tuple(src.key_facts(key).shape), "fp32", key) for n, key in src.full_tensors.items()},
        layout=layout,
        base_model_name_or_path=base_model_name_or_path,
        target_modules=target_modules,
        path=src.path,
        fuse_hint="PEFT's fused expert LoRA needs one rank across the experts: pass --rank K instead "
        "of --energy, or --layout vllm (per-expert modules)",
    )
    src.fused = {f.source(ab): (f, ab) for f in plan.fused for ab in "AB"}
    return plan.tensors, plan.config, (plan.full_warning,) if plan.full_warning else ()
