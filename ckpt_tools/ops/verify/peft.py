"""`ckpt verify` of a PEFT adapter dir: the config, every weight key (one that maps to no LoRA module is
a problem: PEFT would silently ignore it), target_modules against the modules, `--deep` every value
finite, `--base` every target module present in the base with fitting shapes."""

from __future__ import annotations

from pathlib import Path

from ...core.errors import CkptError
from ...core.keys import PEFT_LORA_KEY
from ...core.problems import VerifyReport
from ...formats.peft.adapter import open_peft_adapter
from ...formats.peft.config import ADAPTER_CONFIG, PEFT_PREFIX, matches_target_modules, parse_peft_config
from ...sources.open import open_weights
from .digests import prove

__all__ = ["verify_peft"]


def verify_peft(
    path: Path, report: VerifyReport, *, deep: bool, base=None, trust_pickle: bool = False
) -> None:
    cfg_path = path / ADAPTER_CONFIG
    try:
        cfg = parse_peft_config(cfg_path)
    except CkptError as exc:
        report.problem(exc.path or cfg_path, exc.key, exc.message)
        return
    try:
        adapter = open_peft_adapter(path, strict=False)
    except CkptError as exc:
        report.problem(exc.path or path, exc.key, exc.message + (f" ({exc.hint})" if exc.hint else ""))
        return
    except Exception as exc:
        report.problem(path, None, f"cannot open the adapter weights: {type(exc).__name__}: {exc}")
        return
    wpath = adapter.weights_path
    _check_keys(adapter, wpath, report)
    _check_targets(adapter, cfg.target_modules, cfg_path, wpath, report)
    # the adapter's files against SHA256SUMS (extract-adapter and fix-adapter write it); PEFT's values
    # are counted below, through the adapter reader
    prove(path, report, deep=deep, weight_files={wpath.name}, tensors_by_file={}, counter_for=lambda _d: None)
    if deep:
        _check_values(adapter, wpath, report)
    if base is not None:
        _check_against_base(adapter, cfg, base, report, trust_pickle)
    report.checked.update(
        {
            "modules": len(adapter.modules),
            "modules_to_save": len(adapter.full_tensors),
            "keys": len(adapter.shapes),
        }
    )


def _check_keys(adapter, wpath: Path, report: VerifyReport) -> None:
    """Every weight key maps to a LoRA module (PEFT would silently ignore it), the adapter's own problems,
    and some weights at all."""
    for k in adapter.unrecognized:
        hint = ""
        if not k.startswith(PEFT_PREFIX) or ((m := PEFT_LORA_KEY.match(k)) and m["slot"] is not None):
            hint = " (prime-rl's export key bug: `ckpt fix-adapter` renames it)"
        report.problem(
            wpath,
            k,
            "key maps to no LoRA module: PEFT expects "
            f"{PEFT_PREFIX}<module>.lora_A.weight / lora_B.weight and would silently "
            f"ignore it{hint}",
        )
    for msg in adapter.problems:
        module = msg.split(":", 1)[0]
        report.problem(wpath, module, msg.split(": ", 1)[-1])
    if not adapter.modules and not adapter.full_tensors:
        report.problem(wpath, None, "holds no LoRA weights PEFT would load: applying it changes nothing")


def _check_targets(adapter, targets, cfg_path: Path, wpath: Path, report: VerifyReport) -> None:
    """Each module is matched by target_modules (else PEFT would not create it), and each entry of a
    target_modules list matches some module."""
    matched_targets: set[str] = set()
    for module in sorted(adapter.modules):
        if adapter.modules[module].view is not None:
            continue  # a fused expert LoRA's projection: selected by target_parameters, not target_modules
        ok = matches_target_modules(module, targets)
        if ok is False:
            report.problem(
                wpath,
                adapter.modules[module].a_key,
                f"module {module} is not matched by target_modules {targets!r}: PEFT would not "
                "create it and would silently ignore these weights",
            )
        if isinstance(targets, list):
            matched_targets.update(t for t in targets if matches_target_modules(module, [t]))
    if isinstance(targets, list) and any(m.view is None for m in adapter.modules.values()):
        for t in sorted(set(targets) - matched_targets):
            report.warn(cfg_path, None, f"target_modules entry {t!r} matches no module in the weights")


def _check_values(adapter, wpath: Path, report: VerifyReport) -> None:
    """`--deep`: every floating tensor of the adapter finite (read through the adapter reader)."""
    from ...core.tensor_math import count_nonfinite  # lazy: torch, for --deep only (2-3 s of start-up)

    for key in sorted(adapter.shapes):
        try:
            t = adapter.read(key)
        except Exception as exc:
            report.problem(wpath, key, f"cannot read: {type(exc).__name__}: {exc}")
            continue
        if t.is_floating_point() and count_nonfinite(t.reshape(-1)):
            report.problem(wpath, key, f"{count_nonfinite(t.reshape(-1))} non-finite value(s) (inf/nan)")


def _check_against_base(adapter, cfg, base, report: VerifyReport, trust_pickle: bool) -> None:
    try:
        src = open_weights(base, trust_pickle=trust_pickle)
    except CkptError as exc:
        report.problem(exc.path or base, exc.key, f"cannot open --base: {exc.message}")
        return
    wpath = adapter.weights_path
    try:
        for module, m in sorted(adapter.modules.items()):
            name = f"{module}.weight"
            if name not in src:
                report.problem(
                    wpath,
                    m.a_key,
                    f"target module {module} does not exist in the base ({src.label} has no {name})",
                )
                continue
            shape = src.facts(name).shape
            a, b = adapter.factor_shape(module, "A"), adapter.factor_shape(module, "B")
            if len(shape) != 2:
                report.problem(wpath, m.a_key, f"base {name} is {list(shape)}, not a 2-D linear weight")
                continue
            out_f, in_f = (shape[1], shape[0]) if cfg.fan_in_fan_out else shape
            if a[1] != in_f or b[0] != out_f:
                report.problem(
                    wpath,
                    m.a_key,
                    f"shapes do not fit the base: A {list(a)}, B {list(b)} but base "
                    f"{name} is {list(shape)} (expects A [r, {in_f}], B [{out_f}, r])",
                )
        for name, key in sorted(adapter.full_tensors.items()):
            if name not in src:
                report.problem(wpath, key, f"modules_to_save tensor {name} does not exist in the base")
            elif tuple(src.facts(name).shape) != tuple(adapter.shapes[key]):
                report.problem(
                    wpath,
                    key,
                    f"shape {list(adapter.shapes[key])} but the base's {name} is "
                    f"{list(src.facts(name).shape)}",
                )
        report.checked["base"] = src.describe()
    finally:
        src.close()
