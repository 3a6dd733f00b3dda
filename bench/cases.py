"""What the harness runs: each ckpt command beside its floors and peers (data, no execution).

A Case is one ckpt command and the contenders it is compared with in the same run. A Contender's argv
is built from a `Paths` of the size's inputs; `reads` names the input kinds it reads (warmed before it
runs, and summed for the per-byte costs), `writes` the kind its output resembles (for the disk check
and the projection). The order of CASES is the order of the run: when a time budget runs out, what
comes last is what is left out, so the issue's headline rows come first. rehydrate comes last: it
needs no DCP input, so with --free-inputs the DCP is gone before it writes one (8B on a 64 GiB disk).

Input kinds: base (bf16 HF dir), adapter (PEFT), merged (`ckpt merge` of the two), dcp (prime-rl
LoRA checkpoint), slim (`ckpt slim` of it).
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sizes import LORA_ALPHA

ALPHA = repr(LORA_ALPHA)


@dataclass(frozen=True)
class Paths:
    python: str
    bench: Path
    base: Path
    adapter: Path
    merged: Path
    dcp: Path
    slim: Path
    out: Path
    shard_bytes: int
    hf_cli: str | None = None  # huggingface_hub's `hf`, when installed
    mergekit_yaml: str | None = None  # mergekit's `mergekit-yaml`, when installed
    mergekit_config: Path | None = None


@dataclass(frozen=True)
class Contender:
    label: str
    role: str  # "ckpt", "floor" or "peer"
    argv: Callable[[Paths], list[str]]
    reads: tuple[str, ...] = ()
    writes: str | None = None  # input kind the output is the size of; None: small or nothing
    unavailable: Callable[[Paths], str | None] = lambda p: None  # a reason it cannot run here
    volume: tuple[str, ...] | None = None  # kinds whose bytes its time grows with (default: reads + writes)

    @property
    def volume_kinds(self) -> tuple[str, ...]:
        if self.volume is not None:
            return self.volume
        return self.reads + ((self.writes,) if self.writes else ())


@dataclass(frozen=True)
class Case:
    name: str
    ckpt_args: Callable[[Paths], list[str]]  # the command line after `python -m ckpt_tools`
    reads: tuple[str, ...]
    writes: str | None
    floors: tuple[Contender, ...] = ()
    peers: tuple[Contender, ...] = ()
    multi_rank: bool = False  # issue 14 lists it for torchrun
    provides: str | None = None  # the first successful output becomes this input kind, when missing
    volume: tuple[str, ...] | None = None  # see Contender.volume; () for metadata-only commands
    subcommand: str = ""  # the ckpt subcommand that must exist (`export` arrives later)

    @property
    def needs(self) -> tuple[str, ...]:
        kinds = set(self.reads)
        for c in self.floors + self.peers:
            kinds.update(c.reads)
        return tuple(sorted(kinds))


# ------------------------------------------------------------------------------------- floors


def _sh(script: str, *args) -> list[str]:
    return ["sh", "-c", script, "sh", *map(str, args)]


def cat(*kinds: str) -> Contender:
    return Contender(f"cat {' '.join(kinds)}", "floor",
                     lambda p: _sh('find "$@" -type f -exec cat {} + >/dev/null',
                                   *(getattr(p, k) for k in kinds)), reads=kinds)


def cp_sync(kind: str) -> Contender:
    return Contender(f"cp -r {kind} && sync", "floor",
                     lambda p: _sh('cp -r "$1" "$2" && sync', getattr(p, kind), p.out), reads=(kind,), writes=kind)


def cat_then_cp(read: str, write: str) -> Contender:
    """Issue 22's floor of a command that reads `read` once and writes a `write`-sized tree: both, in turn."""
    return Contender(f"cat {read} + cp -r {write} && sync", "floor",
                     lambda p: _sh('find "$1" -type f -exec cat {} + >/dev/null && cp -r "$2" "$3" && sync',
                                   getattr(p, read), getattr(p, write), p.out),
                     reads=(read, write), writes=write)


CP_LINK_DCP = Contender("cp -rl dcp (hard links)", "floor", lambda p: _sh('cp -rl "$1" "$2" && sync', p.dcp, p.out),
                        volume=())
PY_PASS = Contender("python -c pass", "floor", lambda p: [p.python, "-c", "pass"], volume=())
PY_TORCH = Contender("python -c 'import torch'", "floor", lambda p: [p.python, "-c", "import torch"], volume=())
HF_HELP = Contender("hf --help", "peer", lambda p: [p.hf_cli, "--help"], volume=(),
                    unavailable=lambda p: None if p.hf_cli else "huggingface_hub's `hf` is not installed")


def _peer(name: str, *args: str) -> Callable[[Paths], list[str]]:
    return lambda p: [p.python, str(p.bench / "peers.py"), name,
                      *(str(getattr(p, a)) if hasattr(p, a) else a for a in args)]


ST_REWRITE = Contender("safetensors load_file + save_file", "floor", _peer("st-rewrite", "base", "out"),
                       reads=("base",), writes="base")
PEFT_MERGE = Contender("PEFT merge_and_unload + save_pretrained", "peer",
                       _peer("peft-merge", "base", "adapter", "out", "shard_bytes"),
                       reads=("base", "adapter"), writes="base")
MERGEKIT = Contender(
    "mergekit-yaml (passthrough of base+adapter)", "peer",
    lambda p: _sh('"$1" "$2" "$3" --lora-merge-cache "$3.cache" --out-shard-size "$4" && rm -rf "$3.cache" && sync',
                  p.mergekit_yaml, p.mergekit_config, p.out, p.shard_bytes),
    reads=("base", "adapter"), writes="base",
    unavailable=lambda p: None if p.mergekit_yaml else "mergekit is not installed (see bench/README.md)")
DCP_TO_TORCH_SAVE = Contender("torch dcp_to_torch_save", "peer", _peer("dcp-to-torch-save", "dcp", "out"),
                              reads=("dcp",), writes="dcp")
DCP_LOAD_LORA = Contender("torch _load_state_dict_from_keys (LoRA keys)", "peer",
                          _peer("dcp-load-lora", "dcp", "out"), reads=("dcp",), writes="adapter",
                          volume=("adapter", "adapter"))

def _merge_args(p: Paths, dtype: str) -> list[str]:
    return ["merge", p.base, p.adapter, p.out, "--max-shard-size", p.shard_bytes, "--dtype", dtype, "--json"]


def _export_args(p: Paths, dtype: str) -> list[str]:
    return ["export", p.dcp, p.out, "--config-from", p.base, "--alpha", ALPHA, "--allow-zero-delta", "--dtype", dtype,
            "--json"]


# today's bf16 commands, as the floor an FP8 output is held to (issue 35: no slower than the bf16 merge)
BF16_MERGE = Contender("ckpt merge (bf16)", "floor",
                       lambda p: [p.python, "-m", "ckpt_tools", *map(str, _merge_args(p, "bf16"))],
                       reads=("base", "adapter"), writes="base")
BF16_EXPORT = Contender("ckpt export (bf16)", "floor",
                        lambda p: [p.python, "-m", "ckpt_tools", *map(str, _export_args(p, "bf16"))],
                        reads=("dcp", "base"), writes="base", volume=("dcp", "base"))


def _lora_ranges(p: Paths) -> list[str]:
    """`cat-ranges` of the DCP's LoRA items; their byte ranges are found first, untimed (a torch import)."""
    ranges, meta = Path(str(p.dcp).rstrip("/") + ".lora-ranges.json"), Path(p.dcp) / ".metadata"
    if meta.exists() and (not ranges.exists() or ranges.stat().st_mtime < meta.stat().st_mtime):
        subprocess.run([p.python, str(p.bench / "peers.py"), "lora-ranges", str(p.dcp), str(ranges)], check=True)
    return [p.python, str(p.bench / "peers.py"), "cat-ranges", str(ranges)]


# issue 22's floor of extract-adapter: exactly the bytes of the model's LoRA items, by range
CAT_LORA_ITEMS = Contender("cat LoRA items", "floor", _lora_ranges, reads=("dcp",), volume=("adapter",))

STARTUP = (PY_PASS, PY_TORCH)

# ------------------------------------------------------------------------------------- cases

CASES: tuple[Case, ...] = (
    Case("--version", lambda p: ["--version"], (), None, floors=STARTUP, peers=(HF_HELP,), volume=()),
    Case("inspect HF dir", lambda p: ["inspect", p.base, "--json"], ("base",), None, floors=STARTUP,
         peers=(HF_HELP,), volume=()),
    Case("merge", lambda p: ["merge", p.base, p.adapter, p.out, "--max-shard-size", p.shard_bytes, "--json"],
         ("base", "adapter"), "base", floors=(cat("base", "adapter"), cp_sync("base"), ST_REWRITE),
         peers=(PEFT_MERGE, MERGEKIT), multi_rank=True, provides="merged"),
    Case("diff-vs-base", lambda p: ["diff-vs-base", p.merged, p.base, "--json"], ("merged", "base"), None,
         floors=(cat("merged", "base"), PY_TORCH), multi_rank=True),   # (issue 22: the floor + one torch import)
    Case("diff-vs-base --adapter", lambda p: ["diff-vs-base", p.merged, p.base, "--adapter", p.adapter, "--json"],
         ("merged", "base", "adapter"), None, floors=(cat("merged", "base", "adapter"), PY_TORCH), multi_rank=True),
    Case("verify --deep HF dir", lambda p: ["verify", p.base, "--deep", "--json"], ("base",), None,
         floors=(cat("base"),), multi_rank=True),
    Case("adapter-to-dcp", lambda p: ["adapter-to-dcp", p.adapter, p.out, "--base", p.base, "--lr", "1e-5", "--json"],
         ("adapter", "base"), "dcp", floors=(cat("base", "adapter"), cp_sync("dcp")), multi_rank=True,
         provides="dcp"),
    Case("inspect DCP", lambda p: ["inspect", p.dcp, "--json"], ("dcp",), None, floors=STARTUP, peers=(HF_HELP,),
         volume=()),
    Case("inspect PEFT", lambda p: ["inspect", p.adapter, "--json"], ("adapter",), None, floors=STARTUP,
         peers=(HF_HELP,), volume=()),
    # metadata and zip headers only (no --deep): as instant as inspect
    Case("verify DCP", lambda p: ["verify", p.dcp, "--json"], ("dcp",), None, floors=STARTUP, peers=(HF_HELP,),
         volume=()),
    # reads only the LoRA items of the checkpoint: as many bytes as the adapter it writes
    Case("extract-adapter", lambda p: ["extract-adapter", p.dcp, p.out, "--alpha", ALPHA, "--json"], ("dcp",),
         "adapter", floors=(PY_PASS, PY_TORCH, cp_sync("adapter"), CAT_LORA_ITEMS), peers=(DCP_LOAD_LORA,), volume=("adapter", "adapter")),
    Case("merge --base-from-checkpoint",
         lambda p: ["merge", p.dcp, p.out, "--base-from-checkpoint", "--config-from", p.base, "--alpha", ALPHA,
                    "--max-shard-size", p.shard_bytes, "--allow-zero-delta", "--json"],  # (a 1-step factory run's
         # delta rounds away at small sizes; the work is the same either way)
         ("dcp", "base"), "base", floors=(cat("dcp"), cp_sync("base"), cat_then_cp("dcp", "base")),
         peers=(DCP_TO_TORCH_SAVE,), multi_rank=True, volume=("dcp", "base")),  # the base dir gives config files only: it reads the DCP, writes a base
    Case("export", lambda p: ["export", p.dcp, p.out, "--config-from", p.base, "--alpha", ALPHA, "--allow-zero-delta", "--json"], ("dcp", "base"), "base",
         floors=(cat("dcp"), cp_sync("base"), cat_then_cp("dcp", "base")), peers=(DCP_TO_TORCH_SAVE,), multi_rank=True, subcommand="export",
         volume=("dcp", "base")),
    # Issue 35: block-FP8 outputs beside today's bf16 command and `cp -r` of a bf16 tree, shuffled in one case
    Case("merge --dtype fp8", lambda p: _merge_args(p, "fp8"), ("base", "adapter"), "base",
         floors=(BF16_MERGE, cp_sync("base")), volume=("base", "adapter")),
    Case("export --dtype fp8", lambda p: _export_args(p, "fp8"), ("dcp", "base"), "base",
         floors=(BF16_EXPORT, cp_sync("base")), subcommand="export", volume=("dcp", "base")),
    Case("verify --deep DCP", lambda p: ["verify", p.dcp, "--deep", "--json"], ("dcp",), None,
         floors=(cat("dcp"),), multi_rank=True),
    Case("slim", lambda p: ["slim", p.dcp, p.out, "--json"], ("dcp",), "slim", floors=(cat("dcp"), PY_TORCH),
         multi_rank=True, provides="slim"),
    Case("slim --base", lambda p: ["slim", p.dcp, p.out, "--base", p.base, "--json"], ("dcp", "base"), "slim",
         floors=(cat("dcp", "base"),), volume=("dcp", "base", "slim")),
    Case("set-lr", lambda p: ["set-lr", p.dcp, p.out, "--scale", "0.5", "--json"], ("dcp",), None,
         floors=(PY_PASS, CP_LINK_DCP), volume=()),
    Case("rehydrate", lambda p: ["rehydrate", p.slim, p.out, "--base", p.base, "--json"], ("slim", "base"), "dcp",
         floors=(cat("slim", "base"), cp_sync("dcp")), multi_rank=True),
)


def case_by_name(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no case {name!r}: choose from {[c.name for c in CASES]}")


def ckpt_contender(case: Case, ranks: int, torchrun: bool | None = None) -> Contender:
    """The ckpt command of a case as a contender: `python -m ckpt_tools ...`, or under torchrun (always for
    N > 1; for N = 1 when `torchrun`: the rank sweep's baseline, which pays the same launcher as N > 1)."""
    torchrun = ranks > 1 if torchrun is None else torchrun

    def argv(p: Paths) -> list[str]:
        tail = [str(a) for a in case.ckpt_args(p)]
        if not torchrun:
            return [p.python, "-m", "ckpt_tools", *tail]
        return [p.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                "-m", "ckpt_tools", *tail]

    label = f"ckpt {case.name} (torchrun x{ranks})" if torchrun else f"ckpt {case.name}"
    return Contender(label, "ckpt", argv, reads=case.reads, writes=case.writes, volume=case.volume)


def is_torchrun_label(label: str) -> bool:
    """Whether a ckpt contender's label is a torchrun launch (`ckpt_contender(..., torchrun=True)`)."""
    return label.endswith(")") and "(torchrun x" in label


def mergekit_config_text(p: Paths) -> str:
    return f"merge_method: passthrough\nmodels:\n  - model: {p.base}+{p.adapter}\ndtype: bfloat16\n"


INPUT_KINDS = ("base", "adapter", "merged", "dcp", "slim")
