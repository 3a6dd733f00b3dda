"""Hostile FILES (issue 10): crafted checkpoints, models, adapters and configs that a user downloads
with a checkpoint must never write outside, destroy an input, hang, blow up memory, give a silent
wrong result, or end in anything but one clean line.

Every attack is built with the real libraries (torch's DCP metadata classes and torch.save,
safetensors, zipfile, os.mkfifo, sparse truncate) on a copy of the genuine prime-rl fixture, and
run through the real CLI (`python -m ckpt_tools`, a subprocess) with a timeout and wait4's peak
RSS: the safe behaviour is asserted (victim files outside unchanged by sha256, inputs unchanged,
peak RSS < 1 GiB, wall < 30 s, a refusal naming the file). Independent runs go two at a time
(`hardening_util.run_measured_many`), through a warm runner that imported torch once and forks a
child per run executing `ckpt_tools.entry.main` (what the `ckpt` executable runs after its imports;
it saves ~2 s of torch import per run); start-up signals and a few others use fresh interpreters.
Figures for docs/reliability.md: `hu.record("hostile_files")`.
"""
from __future__ import annotations

import collections
import io
import json
import os
import pickle
import re
import shutil
import signal
import struct
import time
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)

from . import hardening_util as hu
from .conftest import FIXTURE, json_payload

BASE_KEY = "app.model.model.layers.1.mlp.down_proj.weight"
STEP_KEY = "app.progress.step"
LR_KEY = "app.optimizers.param_groups.0.lr"
TRAINER_REL = Path("outputs/checkpoints/step_3/trainer")
ORCH_REL = Path("outputs/run_default/configs/orch.toml")
BROADCAST_REL = Path("outputs/run_default/broadcasts/step_3")
BIN_ADAPTER_REL = Path("outputs/weights/step_3/lora_adapters")
VICTIM_TEXT = b"ssh-ed25519 AAAA... the user's own file, outside every input\n"


# ------------------------------------------------------------------------------------------ helpers
class Tree:
    """A writable copy of the genuine fixture (a prime-rl run) in its own directory."""

    def __init__(self, root: Path):
        self.root = hu.writable_copy(FIXTURE, root)
        self.trainer = self.root / TRAINER_REL
        self.base = self.root / "base_model"
        self.adapter = self.root / "reference_peft_adapter"
        self.orch = self.root / ORCH_REL


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """One workspace per module; every test takes fresh trees from it (copies are ~9 MB, cheap)."""
    root = tmp_path_factory.mktemp("hostile-files")
    n = [0]

    def tree() -> Tree:
        n[0] += 1
        return Tree(root / f"t{n[0]}")
    tree.root = root
    return tree


def victim(d: Path, name: str = "victim.txt") -> tuple[Path, str]:
    p = d / name
    p.write_bytes(VICTIM_TEXT)
    return p, hu.sha256_file(p)


def run(args, workdir: Path, **kw) -> hu.Measured:
    """One measured run of the CLI in its own process (the warm runner unless fresh=True)."""
    return hu.run_measured(args, workdir=workdir / "runs", **kw)


def many(cases: dict, workdir: Path, **kw) -> dict[str, hu.Measured]:
    return hu.run_measured_many(cases, workdir=workdir / "runs", **kw)


def point(trainer: Path, key: str, raw: bytes, chunk: int | None = None) -> None:
    hu.point_item_at(trainer, key, raw, chunk=chunk)


def replace_in_metadata(trainer: Path, placeholder: str, opcodes: bytes, place) -> int:
    """Rewrite `.metadata` with `place(md, placeholder)` done, then swap the placeholder string's
    opcode (BINUNICODE; protocol 2, which has no frames whose lengths the swap would break) for raw
    `opcodes` building another object in its place. Returns the new metadata's size."""
    md = hu.load_metadata(trainer)
    place(md, placeholder)
    data = pickle.dumps(md, protocol=2)
    token = b"X" + struct.pack("<I", len(placeholder)) + placeholder.encode()
    assert data.count(token) == 1
    data = data.replace(token, opcodes)
    (trainer / ".metadata").write_bytes(data)
    return len(data)


def victim_unchanged(v: Path, sha: str) -> None:
    assert hu.sha256_file(v) == sha, f"{v} was changed"
    hu.record("hostile_files", victims_unchanged=1)


def inputs_unchanged(before: dict, *roots: Path) -> None:
    assert hu.diff_snapshots(before, hu.snapshot(*roots)) == []
    hu.record("hostile_files", inputs_unchanged=len(before))


def deep_json(n: int = 100_000) -> str:
    return "[" * n + "]" * n


def no_traceback(r: hu.Measured) -> None:
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    hu.assert_bounded(r)


# ============================================================================ 1. writes outside, inputs destroyed
def test_in_place_set_lr_never_writes_through_a_planted_metadata_tmp(space):
    t = space()
    v, h = victim(t.root.parent, f"{t.root.name}-authorized_keys")
    (t.trainer / ".metadata.tmp").symlink_to(v)
    r = run(["set-lr", t.trainer, "--scale", "0.5", "--in-place"], t.root)
    no_traceback(r)
    assert r.exit_code == 0, r.output
    victim_unchanged(v, h)
    assert (t.trainer / ".metadata").is_file() and not (t.trainer / ".metadata").is_symlink()
    assert os.readlink(t.trainer / ".metadata.tmp") == str(v)     # the planted link is left alone
    assert not [n for n in os.listdir(t.trainer) if n.startswith(".metadata.tmp-")]
    hu.record("hostile_files", attacks=1)


def test_lock_files_are_never_written_through_or_reused(space):
    t = space()
    v, h = victim(t.root.parent, f"{t.root.name}-lock-victim")
    v2, h2 = victim(t.root.parent, f"{t.root.name}-lock-victim2")
    lock = t.trainer.parent / ".trainer.lock"           # an in-place command's lock, shipped inside the run
    lock.symlink_to(v)
    out = t.root / "slim-out"
    (t.root / ".slim-out.lock").symlink_to(v)           # OUT's lock in OUT's parent
    out2 = t.root / "slim-out2"
    os.link(v2, t.root / ".slim-out2.lock")              # a stale "lock" that is a hard link to a victim
    before = hu.snapshot(t.trainer)
    rs = many({"in-place": ["set-lr", t.trainer, "--scale", "0.5", "--in-place"],
               "slim": ["slim", t.trainer, out], "stale": ["slim", t.trainer, out2]}, t.root)
    hu.assert_safe_refusal(rs["in-place"], names=lock, expect="symlink")
    hu.assert_safe_refusal(rs["slim"], names=t.root / ".slim-out.lock", expect="symlink")
    no_traceback(rs["stale"])
    assert rs["stale"].exit_code == 0, rs["stale"].output     # replaced (unlinked), never written
    victim_unchanged(v, h)
    victim_unchanged(v2, h2)
    assert not out.exists() and out2.is_dir()
    inputs_unchanged(before, t.trainer)
    hu.record("hostile_files", attacks=3)


def test_out_may_not_be_or_be_inside_any_input_whatever_flag_named_it(space):
    t = space()
    base2 = t.root / "base-copy"
    shutil.copytree(t.base, base2)
    cfg = t.root / "rl.toml"
    cfg.write_text('[model]\nname = "base_model"\n\n[trainer.optim]\nlr = 0.01\n')
    before = hu.snapshot(t.trainer, base2, t.base)
    rs = many({
        "slim OUT=--base": ["slim", t.trainer, base2, "--base", base2, "--overwrite"],
        "slim OUT in --base": ["slim", t.trainer, base2 / "x", "--base", base2],
        "restart-prep --config-out in CKPT": ["restart-prep", t.trainer, t.root / "merged", "--base", t.base,
                                              "--lr", "1e-5", "--config", cfg, "--config-out", t.trainer / "x.toml"],
        "merge OUT in --config-from": ["merge", "--base-from-checkpoint", t.trainer, base2 / "merged",
                                       "--config-from", base2, "--run-config", t.orch],
    }, t.root)
    for name, r in rs.items():
        hu.assert_safe_refusal(r, expect="inside input|is inside", code=2)
    inputs_unchanged(before, t.trainer, base2, t.base)
    assert not (t.root / "merged").exists() and not (t.trainer / "x.toml").exists()
    hu.record("hostile_files", attacks=len(rs))


def test_symlinks_out_of_a_tree_are_refused_unless_followed_on_purpose(space):
    t = space()
    secret = t.root.parent / f"{t.root.name}-secret.distcp"
    shutil.copy(t.trainer / "__1_0.distcp", secret)     # a real data file, outside the checkpoint
    (t.trainer / "__1_0.distcp").unlink()
    (t.trainer / "__1_0.distcp").symlink_to(secret)
    v, h = victim(t.root.parent, f"{t.root.name}-readme-victim")
    (t.base / "README.md").symlink_to(v)
    t2 = space()
    outside_md = t2.root.parent / f"{t2.root.name}-outside.metadata"
    shutil.move(t2.trainer / ".metadata", outside_md)
    (t2.trainer / ".metadata").symlink_to(outside_md)
    rs = many({
        "slim": ["slim", t.trainer, t.root / "slim-out"],
        "merge": ["merge", t.base, t.adapter, t.root / "merged"],
        "inspect": ["inspect", t2.trainer],
        "followed": ["--follow-symlinks", "slim", t.trainer, t.root / "slim-followed"],
    }, t.root)
    hu.assert_safe_refusal(rs["slim"], names=t.trainer / "__1_0.distcp", expect="outside")
    hu.assert_safe_refusal(rs["merge"], names=t.base / "README.md", expect="outside")
    hu.assert_safe_refusal(rs["inspect"], names=t2.trainer / ".metadata", expect="outside")
    assert not (t.root / "slim-out").exists() and not (t.root / "merged").exists()
    no_traceback(rs["followed"])
    assert rs["followed"].exit_code == 0, rs["followed"].output    # --follow-symlinks: the documented way
    hu.record("hostile_files", genuine_runs=1)
    victim_unchanged(v, h)
    hu.record("hostile_files", attacks=3)


def _hf_cache_copy(base: Path, cache: Path) -> Path:
    """`base` laid out as huggingface_hub's cache does: snapshot files are symlinks into ../../blobs."""
    repo = cache / "models--org--tiny"
    snap = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(base.iterdir()):
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_the_rules_refuse_nothing_genuine(space):
    """No false refusals: an HF cache snapshot (all symlinks into blobs/) is one tree; OUT beside the
    checkpoint inside the run's outputs dir is fine (a config read there is an input, not the dir)."""
    t = space()
    snap = _hf_cache_copy(t.base, t.root / "hub")
    outputs = t.root / "outputs"
    rs = many({
        "merge from a cache snapshot": ["merge", snap, t.trainer, t.root / "merged", "--run-config", t.orch],
        "set-lr beside the checkpoint": ["set-lr", t.trainer, outputs / "checkpoints" / "step_3b" / "trainer",
                                         "--scale", "0.5"],
        "merge into the outputs dir": ["merge", t.base, t.trainer, outputs / "merged"],
    }, t.root)
    for name, r in rs.items():
        no_traceback(r)
        assert r.exit_code == 0, f"{name}: {r.output}"
    assert load_file(t.root / "merged" / "model.safetensors").keys() == \
        load_file(outputs / "merged" / "model.safetensors").keys()
    hu.record("hostile_files", genuine_runs=len(rs))


# ============================================================================ 2. resource bombs, hangs
def test_a_stride0_item_is_refused_and_verify_deep_reports_it(space):
    """A 1.5 KB torch.save of an expanded (stride-0) tensor declared as a 4 GiB fp32 chunk."""
    t = space()
    rows, cols = 1 << 18, 4096
    item = hu.torch_save_bytes(torch.zeros(1).expand(rows, cols))
    assert len(item) < 4096
    md = hu.load_metadata(t.trainer)
    md.state_dict_metadata[BASE_KEY] = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size([rows, cols]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([rows, cols]))])
    for idx in [i for i in md.storage_data if i.fqn == BASE_KEY]:
        del md.storage_data[idx]
    (t.trainer / "__9_0.distcp").write_bytes(item)
    md.storage_data[MetadataIndex(BASE_KEY, torch.Size([0, 0]), 0)] = _StorageInfo("__9_0.distcp", 0, len(item))
    hu.write_metadata(t.trainer, md)
    before = hu.snapshot(t.trainer)
    rs = many({"slim": ["slim", t.trainer, t.root / "slim-out"], "verify": ["verify", t.trainer, "--deep"]}, t.root)
    hu.assert_safe_refusal(rs["slim"], names=BASE_KEY, expect="stride-0")
    v = rs["verify"]
    no_traceback(v)
    assert v.exit_code == 1 and "FAILED" in v.stdout and "stride-0" in v.stdout and BASE_KEY in v.stdout, v.output
    inputs_unchanged(before, t.trainer)
    assert not (t.root / "slim-out").exists()
    hu.record("hostile_files", attacks=2)


def _deflate_bomb(n: int) -> bytes:
    """A torch.save archive (zipfile) of a uint8 tensor of `n` zeros whose data/0 record is
    DEFLATE'd: a few MB on disk, `n` bytes once torch.load inflates it."""
    marker = object()

    class _Tensor:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2, (marker, 0, (n,), (1,), False, collections.OrderedDict()))

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.ByteStorage, "0", "cpu", n) if obj is marker else None

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_Tensor())
    template = zipfile.ZipFile(io.BytesIO(hu.torch_save_bytes(torch.zeros(1, dtype=torch.uint8))))
    zeros = bytes(1 << 22)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)   # byte-aligned, no back-references out of it
    final = c.flush()

    class _Repeat:
        """zipfile's compressor for data/0: deflating the same 4 MiB of zeros again gives the same
        full-flushed block, so it is computed once (building 2 GiB of DEFLATE takes seconds)."""
        def compress(self, data):
            assert data == zeros
            return block

        def flush(self):
            return final

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in template.infolist():
            name = info.filename
            if name.endswith("/data/0"):
                zi = zipfile.ZipInfo(name)
                zi.compress_type = zipfile.ZIP_DEFLATED
                with z.open(zi, "w", force_zip64=True) as f:
                    f._compressor = _Repeat()   # (zipfile has no public way to supply the stream)
                    for _ in range(n // len(zeros)):
                        f.write(zeros)
            else:
                z.writestr(name, buf.getvalue() if name.endswith("/data.pkl") else template.read(info))
    return out.getvalue()


@pytest.fixture(scope="module")
def deflate_bomb():
    n = 3 << 29    # 1.5 GiB inflated
    raw = _deflate_bomb(n)
    info = next(i for i in zipfile.ZipFile(io.BytesIO(raw)).infolist() if i.filename.endswith("/data/0"))
    assert info.compress_type == zipfile.ZIP_DEFLATED and info.file_size == n and len(raw) < 8 << 20
    return raw


def test_a_compressed_item_is_refused_before_it_is_inflated(space, deflate_bomb):
    t = space()
    point(t.trainer, STEP_KEY, deflate_bomb)
    r = run(["inspect", t.trainer], t.root)
    hu.assert_safe_refusal(r, names=STEP_KEY, expect="compressed")
    hu.record("hostile_files", attacks=1)


def test_sparse_files_are_not_read_whole(space):
    t = space()
    os.truncate(t.trainer / ".metadata", 3 << 30)
    lora = t.root / BIN_ADAPTER_REL
    os.truncate(lora / "adapter_model.bin", 3 << 30)
    assert os.stat(t.trainer / ".metadata").st_blocks * 512 < 1 << 20
    rs = many({"metadata": ["inspect", t.trainer], "bin": ["inspect", lora]}, t.root)
    hu.assert_safe_refusal(rs["metadata"], names=t.trainer / ".metadata", expect="sparse")
    hu.assert_safe_refusal(rs["bin"], names=lora / "adapter_model.bin", expect="sparse")
    hu.record("hostile_files", attacks=2)


def test_a_shared_reference_dag_in_the_metadata_is_refused_quickly(space):
    """52 bytes of pickle: [x, x] nested 40 deep (2^40 strings when walked or printed)."""
    t = space()
    md = hu.load_metadata(t.trainer)
    x = ["key"]
    for _ in range(40):
        x = [x, x]
    md.version = x
    data = pickle.dumps(md, protocol=4)
    (t.trainer / ".metadata").write_bytes(data)
    r = run(["set-lr", t.trainer, t.root / "out", "--scale", "0.5"], t.root)
    hu.assert_safe_refusal(r, names=t.trainer / ".metadata", expect="expand")
    assert not (t.root / "out").exists()
    hu.record("hostile_files", attacks=1)


@pytest.mark.parametrize("levels,cmd", [(31, "inspect"), (60, "verify")])
def test_a_tuple_dag_dict_key_costs_nothing_to_refuse(space, levels, cmd):
    """A planner_data key that is a tuple DAG, 2 bytes per level: hashing it inside the C unpickler
    costs 2^N (N=31: 44 s; N=60: forever, and signals are not delivered meanwhile)."""
    t = space()
    replace_in_metadata(t.trainer, "ZZPLACEHOLDERZZ", b")" + b"2\x86" * levels,
                        lambda md, ph: md.planner_data.__setitem__(ph, ("x",)))
    r = run([cmd, t.trainer], t.root, timeout=60)
    if cmd == "verify":
        no_traceback(r)
        assert r.exit_code == 1 and "refusing to unpickle" in r.stdout, r.output
    else:
        hu.assert_safe_refusal(r, names=t.trainer / ".metadata", expect="refusing to unpickle")
    hu.record("hostile_files", attacks=1)


def test_fifos_are_refused_before_any_open_that_could_block(space):
    t = space()
    (t.trainer / "__2_0.distcp").unlink()
    os.mkfifo(t.trainer / "__2_0.distcp")
    t2 = space()
    t2.orch.unlink()
    os.mkfifo(t2.orch)
    t3 = space()
    (t3.root / BROADCAST_REL / "adapter_config.json").unlink()
    os.mkfifo(t3.root / BROADCAST_REL / "adapter_config.json")
    t4 = space()
    os.mkfifo(t4.trainer / "notes.fifo")
    before = hu.snapshot(t.trainer, t2.trainer, t3.trainer, t4.trainer, t.base)
    rs = many({
        "slim rank file": ["slim", t.trainer, t.root / "slim-out"],
        "merge rank file": ["merge", t.base, t.trainer, t.root / "merged", "--run-config", t.orch],
        "inspect orch.toml": ["inspect", t2.trainer],
        "inspect broadcast config": ["inspect", t3.trainer],
        "set-lr extra entry": ["set-lr", t4.trainer, t4.root / "setlr", "--scale", "0.5"],
        "slim extra entry": ["slim", t4.trainer, t4.root / "slim-out"],
    }, t.root, timeout=40)
    for name in ("slim rank file", "merge rank file"):
        hu.assert_safe_refusal(rs[name], names=t.trainer / "__2_0.distcp", expect="FIFO")
    hu.assert_safe_refusal(rs["inspect orch.toml"], names=t2.orch, expect="FIFO")
    b = rs["inspect broadcast config"]     # only a cross-check reads it: a warning naming it, no hang
    no_traceback(b)
    assert b.exit_code == 0 and "FIFO" in b.stderr and "adapter_config.json" in b.stderr, b.output
    for name in ("set-lr extra entry", "slim extra entry"):
        hu.assert_safe_refusal(rs[name], names=t4.trainer / "notes.fifo", expect="FIFO")
    assert not (t.root / "merged").exists() and not (t4.root / "setlr").exists()
    inputs_unchanged(before, t.trainer, t2.trainer, t3.trainer, t4.trainer, t.base)
    hu.record("hostile_files", attacks=len(rs))


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_any_signal_during_start_up_ends_with_one_line(space, sig, code):
    """Ctrl-C or SIGTERM while click and torch are still being imported: one line, no traceback.
    (extract-adapter: its command imports torch, seconds of start-up; `inspect` no longer does.) The
    signal is sent at points of the start-up read from the kernel (/proc's SigBlk: the child holds the
    signal while it imports, then releases it), so the test does not depend on the machine's load: while
    the signal is held (delivered when the imports are done), and after (the command is starting). A
    signal at a fixed delay may also land while the interpreter itself is still starting (its `site`
    import, runpy locating the package, before any code of ours runs): Python's to report, not counted."""
    t = space()
    bit = 1 << (sig - 1)
    phases = {
        "held": lambda p: p.wait_until(lambda m: m & bit),
        "released": lambda p: p.wait_until(lambda m: m & bit) and p.wait_until(lambda m: not m & bit),
        **{f"after {d} s": (lambda p, d=d: time.sleep(d) or True) for d in (0.05, 0.3, 0.8)},
    }
    outcomes = {}
    for name, reach in phases.items():
        p = hu.MeasuredRun(
            ["extract-adapter", t.trainer, t.root / f"x{len(outcomes)}", "--dry-run"],
            workdir=t.root / "runs",
            timeout=60,
        )
        reached = reach(p)
        p.signal(sig)
        r = p.result()
        if name in ("held", "released"):
            assert reached, f"the start-up never reached {name}: {r.output}"
        # the signal came while the interpreter itself was starting (site, or runpy for `-m`): before any line of ours
        if not name.startswith(("held", "released")) and (
            "init_import_site" in r.stderr or "<frozen runpy>" in r.stderr or "Could not import runpy" in r.stderr
        ):
            outcomes[name] = "before-our-code"
            continue
        no_traceback(r)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        if r.exit_code == 0 and name != "held":  # it finished first: nothing to interrupt
            outcomes[name] = "done"
            continue
        assert r.exit_code in (code, -sig) if name != "held" else r.exit_code == code, (name, r.output)
        assert len(lines) <= 1 and (not lines or lines[0].startswith(("interrupted", "terminated"))), r.stderr
        outcomes[name] = r.exit_code
    assert outcomes["held"] == code and outcomes["released"] in (code, "done"), outcomes
    hu.record("hostile_files", signal_runs=len(outcomes))


def test_a_merge_ends_promptly_on_sigterm_mid_run(space):
    t = space()
    out = t.root / "merged"
    p = hu.MeasuredRun(["merge", t.base, t.trainer, out, "--run-config", t.orch], workdir=t.root / "runs",
                       timeout=60, env={"CKPT_TOOLS_TEST_SLOW_WRITE": "0.5"})
    deadline = time.monotonic() + 40
    while not hu.temp_dirs(out) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hu.temp_dirs(out), "the merge never started writing"
    t0 = time.monotonic()
    p.signal(signal.SIGTERM)
    r = p.result()
    assert time.monotonic() - t0 < 5, "SIGTERM took more than 5 s to end the merge"
    no_traceback(r)
    assert r.exit_code == 143 and not out.exists() and hu.sidecars(out) == [], r.output
    hu.record("hostile_files", attacks=1)


# ============================================================================ 3. silent wrong results
def _adapter_variant(t: Tree, name: str, *, config=None, weights=None) -> Path:
    d = t.root / name
    shutil.copytree(t.adapter, d)
    if config is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        config(cfg)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    if weights is not None:
        sd = load_file(d / "adapter_model.safetensors")
        weights(sd)
        save_file(sd, d / "adapter_model.safetensors", metadata={"format": "pt"})
    return d


def test_merges_that_would_equal_the_base_are_refused_naming_why(space):
    t = space()
    zero_b = _adapter_variant(t, "zero-b", weights=lambda sd: [v.zero_() for k, v in sd.items() if "lora_B" in k])
    cases = {
        "lora_alpha 0": (_adapter_variant(t, "alpha0", config=lambda c: c.update(lora_alpha=0)), [], "lora_alpha"),
        "lora_alpha 1e-30": (_adapter_variant(t, "alpha-tiny", config=lambda c: c.update(lora_alpha=1e-30)), [],
                             "equal to its base"),
        "all-zero lora_B": (zero_b, [], "all-zero lora_A or lora_B"),
        "targets match nothing": (_adapter_variant(t, "no-targets", config=lambda c: c.update(
            target_modules=["nothing_proj"])), [], "target_modules"),
        "--alpha 0": (t.trainer, ["--alpha", "0"], "--alpha"),
    }
    before = hu.snapshot(t.base, t.trainer, *{a for a, _x, _e in cases.values()})
    rs = many({n: ["merge", t.base, a, t.root / f"out-{i}", *extra] for i, (n, (a, extra, _)) in
               enumerate(cases.items())} | {"allowed": ["merge", t.base, zero_b, t.root / "out-allowed",
                                                        "--allow-zero-delta"]}, t.root)
    for i, (name, (_a, _x, expect)) in enumerate(cases.items()):
        hu.assert_safe_refusal(rs[name], expect=expect)
        assert not (t.root / f"out-{i}").exists() and not hu.temp_dirs(t.root / f"out-{i}"), name
    no_traceback(rs["allowed"])
    assert rs["allowed"].exit_code == 0, rs["allowed"].output      # the explicit flag writes it
    hu.record("hostile_files", genuine_runs=1)
    merged = load_file(t.root / "out-allowed" / "model.safetensors")
    assert all(torch.equal(v, load_file(t.base / "model.safetensors")[k]) for k, v in merged.items())
    inputs_unchanged(before, t.base, t.trainer, *{a for a, _x, _e in cases.values()})
    hu.record("hostile_files", attacks=len(cases))


def test_a_dcp_lora_is_not_merged_into_a_different_base_of_the_same_shapes(space):
    t = space()
    other = t.root / "other-base"
    shutil.copytree(t.base, other)
    g = torch.Generator().manual_seed(0)
    sd = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in
          load_file(other / "model.safetensors").items()}
    save_file(sd, other / "model.safetensors", metadata={"format": "pt"})
    before = hu.snapshot(other, t.trainer)
    rs = many({"other": ["merge", other, t.trainer, t.root / "merged", "--run-config", t.orch],
               "right": ["merge", t.base, t.trainer, t.root / "merged-right", "--run-config", t.orch]}, t.root)
    hu.assert_safe_refusal(rs["other"], names=other, expect="not the base the checkpoint trained on")
    no_traceback(rs["right"])
    assert rs["right"].exit_code == 0 and "fp32 masters equal the base" in rs["right"].stdout, rs["right"].output
    hu.record("hostile_files", genuine_runs=1)
    assert not (t.root / "merged").exists()
    inputs_unchanged(before, other, t.trainer)
    hu.record("hostile_files", attacks=1)


def test_alpha_is_only_looked_for_where_prime_rl_writes_run_configs(space):
    t = space()
    dl = t.root / "downloads"
    ckpt = dl / "ckpts" / "step_5" / "trainer"
    shutil.copytree(t.trainer, ckpt)
    mallory = dl / "run_mallory" / "configs" / "orch.toml"     # an unrelated sibling, two levels up
    mallory.parent.mkdir(parents=True)
    mallory.write_text(t.orch.read_text().replace("alpha = 16.0", "alpha = 0.0"))
    rs = many({"inspect": ["inspect", ckpt, "--json"], "merge": ["merge", t.base, ckpt, t.root / "merged"],
               "genuine": ["inspect", t.trainer, "--json"]}, t.root)
    no_traceback(rs["inspect"])
    rep = json_payload(rs["inspect"].stdout)
    assert rep["alpha"] is None and "not in prime-rl's layout" in rep["alpha_unresolved"]
    hu.assert_safe_refusal(rs["merge"], expect="--alpha")
    genuine = json_payload(rs["genuine"].stdout)
    assert genuine["alpha"]["alpha"] == 16.0 and genuine["alpha"]["source"] == f"run config {t.orch.resolve()}"
    hu.record("hostile_files", attacks=1)


def test_numbers_must_be_finite_and_in_range(space):
    t = space()
    point(t.trainer, LR_KEY, hu.torch_save_bytes(float("nan")))
    t2 = space()
    rs = many({
        "set-lr on a NaN lr": ["set-lr", t.trainer, t.root / "out", "--lr", "1e-4"],
        "inspect --json": ["inspect", t.trainer, "--json"],
        "--alpha -1": ["merge", t2.base, t2.trainer, t2.root / "m1", "--alpha", "-1"],
        "--alpha 1e30": ["merge", t2.base, t2.trainer, t2.root / "m2", "--alpha", "1e30"],
        "negative step": ["set", t2.trainer, t2.root / "s", "progress.step=-1"],
        "set a NaN lr": ["set", t2.trainer, t2.root / "s2", f"{LR_KEY}=nan"],
    }, t.root)
    hu.assert_safe_refusal(rs["set-lr on a NaN lr"], names=LR_KEY, expect="nan")
    j = rs["inspect --json"]
    no_traceback(j)

    def strict(name):
        raise ValueError(f"{name} in JSON output")
    assert json.loads(j.stdout, parse_constant=strict)["result"]["lr"] == "NaN"
    for name in ("--alpha -1", "--alpha 1e30", "negative step", "set a NaN lr"):
        hu.assert_safe_refusal(rs[name], code=2)
    hu.record("hostile_files", attacks=len(rs) - 1)


def test_an_fp16_base_stays_fp16(space):
    t = space()
    fp16 = t.root / "base-fp16"
    shutil.copytree(t.base, fp16)
    sd = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in load_file(fp16 / "model.safetensors").items()}
    save_file(sd, fp16 / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp16 / "config.json").read_text())
    cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] = "float16"
    (fp16 / "config.json").write_text(json.dumps(cfg))
    r = run(["merge", fp16, t.adapter, t.root / "merged"], t.root)
    no_traceback(r)
    assert r.exit_code == 0 and "fp16" in r.output, r.output
    merged = load_file(t.root / "merged" / "model.safetensors")
    assert {v.dtype for v in merged.values()} == {torch.float16}
    out_cfg = json.loads((t.root / "merged" / "config.json").read_text())
    assert out_cfg.get("torch_dtype", out_cfg.get("dtype")) == "float16"
    hu.record("hostile_files", attacks=1)


def test_set_lr_copies_what_is_not_a_data_file(space):
    t = space()
    (t.trainer / "NOTES.txt").write_text("mine\n")
    (t.trainer / "dataloader").mkdir()
    (t.trainer / "dataloader" / "rank_0.pt").write_bytes(b"state")
    out = t.root / "out"
    r = run(["set-lr", t.trainer, out, "--scale", "0.5"], t.root)
    no_traceback(r)
    assert r.exit_code == 0, r.output
    for rel in ("NOTES.txt", "dataloader/rank_0.pt"):
        assert (out / rel).stat().st_ino != (t.trainer / rel).stat().st_ino
    with open(out / "NOTES.txt", "a") as f:
        f.write("appended to the copy\n")
    assert (t.trainer / "NOTES.txt").read_text() == "mine\n"
    assert (out / "__0_0.distcp").stat().st_ino == (t.trainer / "__0_0.distcp").stat().st_ino   # data: linked
    hu.record("hostile_files", attacks=1)


# ============================================================================ 4. clean errors
def _bin_adapter_with_int_key(t: Tree) -> Path:
    d = t.root / BIN_ADAPTER_REL
    sd = torch.load(d / "adapter_model.bin", weights_only=True)
    sd[1] = next(iter(sd.values()))
    torch.save(sd, d / "adapter_model.bin")
    return d


def _hf_dir_with_deep_index(t: Tree) -> Path:
    d = t.root / "sharded"
    d.mkdir()
    shutil.copy(t.base / "config.json", d)
    (d / "model.safetensors.index.json").write_text(deep_json())
    return d


def test_every_malformed_input_is_one_clean_line(space):
    t = space()
    deep_cfg_base = t.root / "base-deep-config"
    shutil.copytree(t.base, deep_cfg_base)
    (deep_cfg_base / "config.json").write_text(deep_json())
    deep_adapter = _adapter_variant(t, "deep-adapter")
    (deep_adapter / "adapter_config.json").write_text(deep_json())
    slim = t.root / "slim"
    assert hu.invoke(["slim", t.trainer, slim]).exit_code == 0
    (slim / "ckpt-slim-manifest.json").write_text(deep_json())
    nan_rank = _adapter_variant(t, "nan-rank")
    (nan_rank / "adapter_config.json").write_text(
        (nan_rank / "adapter_config.json").read_text().replace('"rank_pattern": {}', '"rank_pattern": {"q_proj": NaN}'))
    inf_rank = _adapter_variant(t, "inf-rank")
    (inf_rank / "adapter_config.json").write_text(
        (inf_rank / "adapter_config.json").read_text().replace('"rank_pattern": {}',
                                                               '"rank_pattern": {"q_proj": Infinity}'))
    deep_orch, model5, nan_alpha, nul, deep_pickle, huge = (space() for _ in range(6))
    deep_orch.orch.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    model5.orch.write_text("model = 5\n")
    nan_alpha.orch.write_text(nan_alpha.orch.read_text().replace("alpha = 16.0", "alpha = nan"))
    md = hu.load_metadata(nul.trainer)
    idx = hu.storage_index(md, BASE_KEY)
    md.storage_data[idx] = _StorageInfo("__0_0.distcp\0evil", 0, 10)
    hu.write_metadata(nul.trainer, md)
    replace_in_metadata(deep_pickle.trainer, "ZZVERSIONZZ", b"(" * 200_000 + b"]" + b"l" * 200_000,
                        lambda m, ph: setattr(m, "version", ph))
    md = hu.load_metadata(huge.trainer)    # a 4 TiB tensor declared over a genuine 10 KB item
    e = md.state_dict_metadata[BASE_KEY]
    md.state_dict_metadata[BASE_KEY] = TensorStorageMetadata(
        properties=e.properties, size=torch.Size([1 << 20, 1 << 20]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1 << 20, 1 << 20]))])
    keep = hu.storage_index(md, BASE_KEY, tuple(e.chunks[0].offsets))
    info = md.storage_data[keep]
    for i in [i for i in md.storage_data if i.fqn == BASE_KEY]:
        del md.storage_data[i]
    md.storage_data[MetadataIndex(BASE_KEY, torch.Size([0, 0]), 0)] = info
    hu.write_metadata(huge.trainer, md)
    sparse = space()   # and one whose item length agrees with 4 TiB, in a sparse 4 TiB data file
    md = hu.load_metadata(sparse.trainer)
    md.state_dict_metadata[BASE_KEY] = md_huge = TensorStorageMetadata(
        properties=e.properties, size=torch.Size([1 << 20, 1 << 20]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1 << 20, 1 << 20]))])
    for i in [i for i in md.storage_data if i.fqn == BASE_KEY]:
        del md.storage_data[i]
    md.storage_data[MetadataIndex(BASE_KEY, torch.Size([0, 0]), 0)] = _StorageInfo("__9_0.distcp", 0, 4 << 40)
    hu.write_metadata(sparse.trainer, md)
    with open(sparse.trainer / "__9_0.distcp", "wb") as f:
        f.truncate(4 << 40)
    assert md_huge.size.numel() * 4 == 4 << 40
    cfg = t.root / "rl.toml"
    cfg.write_text('[model]\nname = "base_model"\n\n[trainer.optim]\nlr = 0.01\n')
    int_key = _bin_adapter_with_int_key(space())
    cases = {   # name: (args, what the line must name, what it must say)
        "100k-deep config.json": (["merge", deep_cfg_base, t.adapter, t.root / "o1"], deep_cfg_base / "config.json",
                                  "nested"),
        "100k-deep index": (["inspect", _hf_dir_with_deep_index(t)], "model.safetensors.index.json", "nested"),
        "100k-deep adapter_config": (["inspect", deep_adapter], deep_adapter / "adapter_config.json", "nested"),
        "100k-deep slim manifest": (["rehydrate", slim, t.root / "o2", "--base", t.base],
                                    slim / "ckpt-slim-manifest.json", "nested"),
        "deep orch.toml": (["inspect", deep_orch.trainer], deep_orch.orch, "nested"),
        "200k-deep pickle list": (["inspect", deep_pickle.trainer], deep_pickle.trainer / ".metadata", "levels deep"),
        "NUL in relative_path": (["inspect", nul.trainer], BASE_KEY, "not a file name"),
        "model = 5 in orch.toml": (["inspect", model5.trainer], model5.orch, "not a \\[model\\] table"),
        "int key in adapter_model.bin": (["inspect", int_key], int_key / "adapter_model.bin", "name -> tensor"),
        "rank_pattern NaN": (["inspect", nan_rank], nan_rank / "adapter_config.json", "NaN"),
        "rank_pattern Infinity": (["inspect", inf_rank], inf_rank / "adapter_config.json", "Infinity"),
        "orch alpha nan": (["inspect", nan_alpha.trainer], nan_alpha.orch, "finite"),
        "4 TiB tensor, 10 KB item": (["slim", huge.trainer, t.root / "o3"], BASE_KEY, "crafted item"),
        "4 TiB tensor, sparse file": (["slim", sparse.trainer, t.root / "o4"], sparse.trainer / "__9_0.distcp",
                                      "sparse"),
        "restart-prep --config-out nodir/x.toml": (
            ["restart-prep", t.trainer, t.root / "o5", "--base", t.base, "--lr", "1e-5", "--config", cfg,
             "--config-out", t.root / "nodir" / "x.toml"], t.root / "nodir", "does not exist"),
    }
    rs = many({n: c[0] for n, c in cases.items()}, t.root)
    # `inspect` of a checkpoint whose run config does not parse still reports the checkpoint, with the
    # config named as unreadable and why (issue 27); every other command refuses
    reported = {"deep orch.toml", "model = 5 in orch.toml", "orch alpha nan"}
    for name, (_args, named, expect) in cases.items():
        if name in reported:
            r = rs[name]
            no_traceback(r)
            assert r.exit_code == 0 and "unreadable" in r.output and str(named) in r.output, r.output
            assert re.search(expect, r.output), (expect, r.output)
            continue
        hu.assert_safe_refusal(rs[name], names=named, expect=expect)
    for o in ("o1", "o2", "o3", "o4", "o5"):
        assert not (t.root / o).exists(), o
    hu.record("hostile_files", clean_error_cases=len(cases))


def test_json_failures_are_json_too(space):
    t = space()
    r = run(["inspect", t.root / "nothing-here", "--json"], t.root)
    assert r.exit_code == 2 and r.stderr == f"error: no such file or directory: {t.root / 'nothing-here'}\n"
    assert json.loads(r.stdout)["error"]["type"] == "MissingPathError"
    (t.trainer / "__0_0.distcp").unlink()
    os.mkfifo(t.trainer / "__0_0.distcp")
    r = run(["slim", t.trainer, t.root / "out", "--json"], t.root, fresh=True)   # a new interpreter, end to end
    hu.assert_safe_refusal(r, expect="FIFO")
    doc = json.loads(r.stdout)
    err = doc["error"]
    assert err["type"] == "UnsafeInputError" and err["path"] == str(t.trainer / "__0_0.distcp") and err["hint"]
    assert doc["exit_code"] == r.exit_code and doc["ok"] is False and "FIFO" in err["message"]
    hu.record("hostile_files", attacks=1)


def test_a_killed_in_place_set_lr_leaves_nothing_a_rerun_does_not_clean(space):
    t = space()
    f = hu.Forked(["set-lr", t.trainer, "--scale", "0.5", "--in-place"], t.root / "forked",
                  stop_when=lambda label: label == "DcpWriter.finish")   # patch written, backup linked
    assert f.wait_stopped() == "DcpWriter.finish"
    f.kill(signal.SIGKILL)
    f.wait()
    names = os.listdir(t.trainer)
    assert "__patch_0.distcp" in names and [n for n in names if n.startswith(".metadata.bak-")]
    r = run(["set-lr", t.trainer, "--scale", "0.5", "--in-place"], t.root)
    no_traceback(r)
    assert r.exit_code == 0 and "left by a killed in-place run" in r.stderr, r.output
    meta_ino = os.lstat(t.trainer / ".metadata").st_ino
    backups = [n for n in os.listdir(t.trainer) if n.startswith(".metadata.bak-")]
    assert len(backups) == 1 and os.lstat(t.trainer / backups[0]).st_ino != meta_ino
    referenced = {i.relative_path for i in hu.load_metadata(t.trainer).storage_data.values()}
    patches = [n for n in os.listdir(t.trainer) if n.startswith("__patch_")]
    assert patches and set(patches) <= referenced, (patches, referenced)
    hu.record("hostile_files", attacks=1)


def test_cross_filesystem_set_lr_checks_space_for_what_it_copies(space, tmp_path):
    t = space()
    with hu.small_filesystem(tmp_path / "small", 1 << 20) as small:   # 1 MiB: less than the data files
        out = small / "out"
        r = run(["set-lr", t.trainer, out, "--scale", "0.5"], t.root)
        hu.assert_safe_refusal(r, names=out, expect="need")
        assert not out.exists() and hu.sidecars(out) == []
    hu.record("hostile_files", attacks=1)


# ============================================================================ the measured figures
def test_genuine_metadata_is_far_inside_the_pickle_bounds():
    """The bounds of safe_pickle leave headroom on every genuine .metadata in the repository."""
    from ckpt_tools.io import safe_pickle

    sizes = []
    for meta in sorted((FIXTURE.parent).rglob(".metadata")):
        data = meta.read_bytes()
        nodes, depth = safe_pickle.check_pickle_bounds(data, str(meta))
        assert depth * 4 < safe_pickle.MAX_PICKLE_DEPTH
        assert nodes * 4 < safe_pickle.TREE_NODES_PER_BYTE * len(data)
        sizes.append((len(data), nodes, depth))
    assert len(sizes) >= 4
    hu.record("hostile_files", genuine_metadata_checked=len(sizes))

