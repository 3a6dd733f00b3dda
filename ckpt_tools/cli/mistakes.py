"""Common mistakes on the command line, caught from what each path is before any work starts.

One rule, one table. `ROLES` says, for every command that takes paths of different kinds, what
each argument may be (the kinds its op really accepts); `looks_like(path)` says what a path is, from
cheap marker files only (`.metadata`, `adapter_config.json`, HF weights, the slim manifest). Two
arguments are swapped when each looks like what the other may be, and at least one of them is not
what it itself may be: the call as typed is refused by the op anyway, and the swap would pass.

    check_roles("merge", {"BASE": base, "ADAPTER": adapter, "OUT": out})
    -> UsageError: BASE looks like a DCP checkpoint and ADAPTER like an HF model dir: swapped?

A legitimate call is never refused: the rule fires only when an argument is not any kind its op
accepts (so every tuple below must list ALL the kinds the op takes for that argument). A path that
is not there, or that is none of the kinds (a hub id, a new OUT), is left to the command's own
checks, which name it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import UsageError
from ..formats.dcp.layout import METADATA_NAME
from ..formats.slim.manifest import is_slim
from ..formats.sniff import CHECKPOINTS, DCP, HF, PEFT, has_hf_weights, sniff
from ..io.inputs import as_input

__all__ = ["KIND_NAMES", "ROLES", "SLIM", "Roles", "check_roles", "looks_like"]

SLIM = "slim"  # a DCP checkpoint whose frozen base weights `ckpt slim` dropped (it is a DCP checkpoint too)

KIND_NAMES = {
    DCP: "a DCP checkpoint",
    HF: "an HF model dir",
    PEFT: "a PEFT adapter dir",
    CHECKPOINTS: "a prime-rl checkpoints dir",
    SLIM: "a slim checkpoint",
}


@dataclass(frozen=True)
class Roles:
    synopsis: str  # `ckpt <synopsis>`: the command and its arguments, as --help names them
    wants: dict[str, tuple[str, ...]]  # argument label -> every kind the op accepts there


# What each argument of each command may be, from the op's own sources (open_X_sources / plan_X). OUT
# may be what the command writes (an existing OUT is replaced under --overwrite). A key with a flag in
# it is the command run with that flag (the kinds change with it).
ROLES: dict[str, Roles] = {
    "merge": Roles("merge BASE ADAPTER OUT", {"BASE": (HF,), "ADAPTER": (PEFT, DCP), "OUT": (HF,)}),
    "merge --base-from-checkpoint": Roles(
        "merge --base-from-checkpoint [BASE] ADAPTER OUT",
        {"BASE": (DCP,), "ADAPTER": (PEFT, DCP), "OUT": (HF,), "--config-from": (HF,)},
    ),
    "export": Roles("export CKPT OUT", {"CKPT": (DCP,), "OUT": (HF,), "--config-from": (HF,)}),
    # a DCP checkpoint's base weights compare with an HF model either way round: no order to get wrong
    "diff-vs-base": Roles(
        "diff-vs-base WEIGHTS BASE", {"WEIGHTS": (HF, DCP), "BASE": (HF, DCP), "--adapter": (PEFT, DCP)}
    ),
    "slim": Roles("slim CKPT OUT", {"CKPT": (DCP,), "OUT": (DCP,), "--base": (HF,)}),
    "rehydrate": Roles("rehydrate SLIM OUT", {"SLIM": (SLIM,), "OUT": (DCP,), "--base": (HF,)}),
    "extract-adapter": Roles("extract-adapter CKPT OUT", {"CKPT": (DCP,), "OUT": (PEFT,), "--base": (HF,)}),
    "adapter-to-dcp": Roles(
        "adapter-to-dcp ADAPTER OUT",
        {"ADAPTER": (PEFT,), "OUT": (DCP,), "--base": (HF,), "--optimizer-from": (DCP,)},
    ),
    "fix-adapter": Roles(
        "fix-adapter SRC OUT", {"SRC": (PEFT,), "OUT": (PEFT,), "--base": (HF,), "--checkpoint": (DCP,)}
    ),
    # the last input against OUT and --merge (a forgotten OUT makes the last input OUT)
    "average": Roles("average CKPT_OR_ADAPTER... OUT", {"CKPT_OR_ADAPTER": (DCP, PEFT), "OUT": (PEFT,)}),
    "average --merge": Roles(
        "average CKPT_OR_ADAPTER... OUT --merge BASE",
        {"CKPT_OR_ADAPTER": (DCP, PEFT), "OUT": (HF,), "--merge": (HF,)},
    ),
    "resize-adapter": Roles("resize-adapter ADAPTER OUT", {"ADAPTER": (PEFT, DCP), "OUT": (PEFT,)}),
    "verify --base": Roles("verify PATH --base BASE", {"PATH": (PEFT,), "--base": (HF, DCP)}),
    # OUT is a model dir in merge mode, a checkpoint in adapter mode: not in the table
    "restart-prep": Roles(
        "restart-prep RUN_OR_CKPT OUT", {"RUN_OR_CKPT": (DCP, CHECKPOINTS), "--base": (HF,)}
    ),
    "gc": Roles("gc CHECKPOINTS_DIR", {"CHECKPOINTS_DIR": (CHECKPOINTS,), "--base": (HF,)}),
    "report": Roles("report PATH", {"PATH": (DCP, SLIM, CHECKPOINTS, HF), "--base": (HF,)}),
}


def looks_like(path) -> frozenset[str]:
    """Every kind `path` has the markers of (a slim checkpoint is DCP and SLIM; a dir with both an
    adapter config and HF weights is PEFT and HF); empty when it is not there or none of them."""
    if path is None:
        return frozenset()
    p = as_input(path)  # a URL's too: by its listing (io.remote)
    try:
        if not p.exists():
            return frozenset()
        kind = sniff(p)
        kinds = {kind} if kind else set()
        if has_hf_weights(p):
            kinds.add(HF)
        ckpt_dirs = (p.parent,) if p.name == METADATA_NAME else (p, p / "trainer")  # as DCP's own layout
        if kind == DCP and any(is_slim(d) for d in ckpt_dirs):
            kinds.add(SLIM)
    except OSError:  # unreadable: the command's own checks name it
        return frozenset()
    return frozenset(kinds)


def _names(kinds) -> str:
    return " or ".join(KIND_NAMES[k] for k in kinds)


def check_roles(command: str, paths: dict[str, object]) -> None:
    """Raise a UsageError when two of `paths` (argument label -> path, None when not given) are
    swapped, by the rule of the module docstring. `command` is a key of ROLES."""
    roles = ROLES[command]
    unknown = set(paths) - set(roles.wants)
    if unknown:
        raise ValueError(f"ROLES[{command!r}] has no argument {sorted(unknown)}")
    labels = [label for label in roles.wants if label in paths]
    kinds = {label: looks_like(paths[label]) for label in labels}
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            ka, kb, want_a, want_b = kinds[a], kinds[b], set(roles.wants[a]), set(roles.wants[b])
            if not ka or not kb:
                continue
            if (ka & want_b) and (kb & want_a) and not ((ka & want_a) and (kb & want_b)):
                seen_a, seen_b = sorted(ka & want_b)[0], sorted(kb & want_a)[0]
                raise UsageError(
                    f"{a} looks like {KIND_NAMES[seen_a]} and {b} like {KIND_NAMES[seen_b]}: swapped?",
                    hint=f"`ckpt {roles.synopsis}` takes {a} as {_names(roles.wants[a])}, "
                    f"{b} as {_names(roles.wants[b])}",
                )
