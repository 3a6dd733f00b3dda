"""`ckpt set-lr` and `ckpt set` on verl's FSDP checkpoints (tests/fixtures/verl-*: written by verl 0.9.1's own
FSDPCheckpointManager): the lr fields of every rank's optimizer and extra-state file changed where they lie,
data.pkl's CRC-32 fixed, every other byte kept; read back by torch.load and by our reader. verl's own loading
code resumes the result in `make test-trainers` (tests/test_trainer_tools.py). torchtitan is refused."""

from __future__ import annotations

import errno
import json
import hashlib
import os
import pickle
import pickletools
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from ckpt_tools.io import staging
from ckpt_tools.io.pickle_paths import encode_in_place, scalar_map

from .conftest import FIXTURES, json_payload
from .test_head_fixtures import run

LORA = FIXTURES / "verl-fsdp2-lora"
LORA1 = FIXTURES / "verl-fsdp1-lora"
FULL = FIXTURES / "verl-fsdp2-full"
TITAN = FIXTURES / "torchtitan-llama3-debug" / "checkpoint" / "step-3"
ACTOR = Path("checkpoints") / "global_step_2" / "actor"
RANKS = [f"{k}_world_size_2_rank_{r}.pt" for k in ("optim", "extra_state") for r in (0, 1)]


def envelope(r) -> dict:
    return json.loads(r.stdout)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tree_hashes(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): sha(p) for p in sorted(d.rglob("*")) if p.is_file()}


def data_pkl(p: Path) -> bytes:
    with zipfile.ZipFile(p) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def load(p: Path):
    return torch.load(p, weights_only=False)  # our own fixture: trusted


def assert_only_pickle_args_and_crcs_differ(a: Path, b: Path) -> int:
    """b is a's bytes but inside data.pkl (its opcodes the same, at the same places) and where a holds
    data.pkl's CRC-32 (there b holds the new pickle's); returns how many 4-byte CRC fields changed."""
    x, y = a.read_bytes(), b.read_bytes()
    assert len(x) == len(y)
    pa, pb = data_pkl(a), data_pkl(b)
    start = x.index(pa)
    assert y[start : start + len(pb)] == pb
    assert [(op.name, pos) for op, _a, pos in pickletools.genops(pa)] == [
        (op.name, pos) for op, _a, pos in pickletools.genops(pb)
    ]
    crc_a, crc_b = struct.pack("<I", zlib.crc32(pa)), struct.pack("<I", zlib.crc32(pb))
    outside = {i for i in range(len(x)) if x[i] != y[i] and not start <= i < start + len(pa)}
    fields = [i for i in range(len(x) - 3) if x[i : i + 4] == crc_a and not start <= i < start + len(pa)]
    for i in fields:
        assert y[i : i + 4] == crc_b
        outside -= set(range(i, i + 4))
    assert outside == set(), "bytes outside data.pkl changed that are not its CRC-32"
    return len(fields)


@pytest.mark.parametrize("fixture", [LORA, LORA1, FULL], ids=lambda p: p.name)
def test_set_lr_scales_every_lr_field_of_every_rank_and_keeps_every_other_byte(fixture, tmp_path):
    src = fixture / ACTOR
    before = tree_hashes(fixture / "checkpoints")
    out = tmp_path / "global_step_2"
    r = run("set-lr", fixture / "checkpoints", out, "--scale", "2", "--json")
    assert r.exit_code == 0, r.output
    rep = envelope(r)
    assert {c["key"] for c in rep["plan"]["changes"]} == {
        "optim.param_groups.0.lr",
        "optim.param_groups.0.initial_lr",
        "extra_state.lr_scheduler.base_lrs",
        "extra_state.lr_scheduler._last_lr",
    }
    assert rep["plan"]["scheduler"] == "LambdaLR" and rep["result"]["files"] == sorted(RANKS)
    assert tree_hashes(fixture / "checkpoints") == before  # the input is untouched
    new = out / "actor"
    for name in os.listdir(src):
        if name in RANKS:
            assert assert_only_pickle_args_and_crcs_differ(src / name, new / name) == 2  # descriptor, directory
            with zipfile.ZipFile(new / name) as z:
                assert z.testzip() is None
        elif (src / name).is_file():
            assert os.stat(src / name).st_ino == os.stat(new / name).st_ino  # hard-linked, not copied
    for r_ in (0, 1):
        a = load(src / f"optim_world_size_2_rank_{r_}.pt")
        b = load(new / f"optim_world_size_2_rank_{r_}.pt")
        for ga, gb in zip(a["param_groups"], b["param_groups"]):
            assert gb["lr"] == 2 * ga["lr"] and gb["initial_lr"] == 2 * ga["initial_lr"]
            assert {k: v for k, v in ga.items() if "lr" not in k} == {k: v for k, v in gb.items() if "lr" not in k}
        assert a["state"].keys() == b["state"].keys()
        for pid, st in a["state"].items():
            for k, v in st.items():
                assert torch.equal(v.to_local() if hasattr(v, "to_local") else v, _local(b["state"][pid][k])), k
        ea = load(src / f"extra_state_world_size_2_rank_{r_}.pt")
        eb = load(new / f"extra_state_world_size_2_rank_{r_}.pt")
        sa, sb = ea["lr_scheduler"], eb["lr_scheduler"]
        assert sb["base_lrs"] == [2 * v for v in sa["base_lrs"]] and sb["_last_lr"] == [2 * v for v in sa["_last_lr"]]
        assert {k: v for k, v in sa.items() if "lr" not in k} == {k: v for k, v in sb.items() if "lr" not in k}
        assert torch.equal(ea["rng"]["cpu"], eb["rng"]["cpu"]) and ea["rng"]["random"] == eb["rng"]["random"]
    back = json_payload(run("inspect", out, "--json").output)
    assert back["optimizer"]["lr"] == 2 * json_payload(run("inspect", src, "--json").output)["optimizer"]["lr"]
    assert run("verify", "--deep", out).exit_code == 0


def _local(v):
    return v.to_local() if hasattr(v, "to_local") else v


def test_lr_sets_the_current_lr_exactly_and_the_dry_run_writes_nothing(tmp_path):
    r = run("set-lr", LORA / ACTOR, tmp_path / "out", "--lr", "3e-3", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json_payload(r.output)
    assert plan["lr_before"] == 0.01 and plan["lr_after"] == 3e-3
    assert plan["output"]["exists"] is False and not (tmp_path / "out").exists()
    r = run("set-lr", LORA / ACTOR, tmp_path / "out", "--lr", "3e-3")
    assert r.exit_code == 0, r.output
    assert load(tmp_path / "out" / "optim_world_size_2_rank_1.pt")["param_groups"][0]["lr"] == 3e-3
    # the role dir given: OUT is a role dir (the model files beside, linked)
    assert set(os.listdir(tmp_path / "out")) == set(os.listdir(LORA / ACTOR)) | {".ckpt-tools-output"}


def test_in_place_switches_the_role_dir_atomically_and_keeps_the_old_one_as_a_backup(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(LORA / "checkpoints", run_dir)
    actor = run_dir / "global_step_2" / "actor"
    old = tree_hashes(actor)
    r = run("set-lr", run_dir, "--in-place", "--scale", "0.5", "--json")
    assert r.exit_code == 0, r.output
    res = json_payload(r.output)
    backup = Path(res["backup"])
    assert res["in_place"] and backup.parent == actor.parent and backup.name.startswith("actor.bak-")
    assert tree_hashes(backup) == old  # the old tree, whole
    assert sorted(os.listdir(actor.parent)) == ["actor", backup.name]  # no temp dir, no lock left
    for name in os.listdir(actor):
        if name.startswith("model_"):
            assert os.stat(actor / name).st_ino == os.stat(backup / name).st_ino
    # the same bytes as a new OUT gets
    assert run("set-lr", LORA / ACTOR, tmp_path / "out", "--scale", "0.5").exit_code == 0
    for name in RANKS:
        assert sha(actor / name) == sha(tmp_path / "out" / name)
    assert json_payload(run("inspect", run_dir, "--json").output)["optimizer"]["lr"] == 0.005


def test_in_place_without_an_atomic_exchange_renames_twice(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(LORA / "checkpoints", run_dir)

    def no_exchange(a, b):
        raise OSError(errno.ENOSYS, "no renameat2")

    monkeypatch.setattr(staging, "exchange_paths", no_exchange)
    assert run("set-lr", run_dir, "--in-place", "--scale", "2").exit_code == 0
    step = run_dir / "global_step_2"
    assert sorted(n for n in os.listdir(step) if not n.startswith("actor.bak-")) == ["actor"]
    assert load(step / "actor" / "optim_world_size_2_rank_0.pt")["param_groups"][0]["lr"] == 0.02


def test_a_failure_before_the_switch_leaves_the_dir_as_it_was(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(LORA / "checkpoints", run_dir)
    step = run_dir / "global_step_2"
    old = tree_hashes(step)

    def broken(a, b):
        raise OSError(errno.EIO, "the disk went away")

    monkeypatch.setattr(staging, "exchange_paths", broken)
    r = run("set-lr", run_dir, "--in-place", "--scale", "2")
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert tree_hashes(step) == old and sorted(os.listdir(step)) == ["actor"]


def test_set_changes_scheduler_and_optimizer_fields_on_every_rank(tmp_path):
    out = tmp_path / "global_step_2"
    r = run("set", LORA / "checkpoints", out, "lr_scheduler.last_epoch=3", "param_groups.0.weight_decay=0.1")
    assert r.exit_code == 0, r.output
    for rank in (0, 1):
        assert load(out / "actor" / f"extra_state_world_size_2_rank_{rank}.pt")["lr_scheduler"]["last_epoch"] == 3
        assert load(out / "actor" / f"optim_world_size_2_rank_{rank}.pt")["param_groups"][0]["weight_decay"] == 0.1
    r = run("set", out, tmp_path / "x", "optim.param_groups.0.amsgrad=true", "--dry-run", "--json")
    assert json_payload(r.output)["changes"] == [
        {"key": "optim.param_groups.0.amsgrad", "before": False, "after": True}
    ]


def test_set_refuses_what_it_cannot_write_in_place_naming_the_key(tmp_path):
    r = run("set", LORA / "checkpoints", tmp_path / "o", "lr_scheduler.last_epoch=300")
    assert r.exit_code == 2 and "extra_state.lr_scheduler.last_epoch" in r.output and "BININT1" in r.output
    r = run("set", LORA / "checkpoints", tmp_path / "o", "weight_decy=0.1")
    assert r.exit_code == 2 and "did you mean optim.param_groups.0.weight_decay" in r.output
    r = run("set", LORA / "checkpoints", tmp_path / "o", "lr_scheduler.last_epoch=2.5")
    assert r.exit_code == 2 and "expected an int" in r.output
    r = run("set", LORA / "checkpoints", tmp_path / "o", "rng.cpu=1")
    assert r.exit_code == 2 and "not the per-parameter state nor the RNG states" in r.output
    assert not (tmp_path / "o").exists()


def test_ranks_that_disagree_are_refused_naming_the_rank_file(tmp_path):
    assert run("set", LORA / ACTOR, tmp_path / "wd", "param_groups.0.weight_decay=0.5").exit_code == 0
    mixed = tmp_path / "mixed"
    shutil.copytree(LORA / ACTOR, mixed)
    os.unlink(mixed / "optim_world_size_2_rank_1.pt")
    shutil.copy(tmp_path / "wd" / "optim_world_size_2_rank_1.pt", mixed / "optim_world_size_2_rank_1.pt")
    r = run("set-lr", mixed, tmp_path / "o", "--scale", "2", "--json")
    err = envelope(r)["error"]
    assert r.exit_code == 1 and err["path"].endswith("optim_world_size_2_rank_1.pt")
    assert "rank 1 holds 0.5 where rank 0 holds 0.01" in err["message"] and not (tmp_path / "o").exists()


def test_min_lr_and_torchtitan_are_refused_with_the_reason_and_what_to_do(tmp_path):
    r = run("set-lr", LORA / "checkpoints", tmp_path / "o", "--scale", "2", "--min-lr", "1e-4")
    assert r.exit_code == 2 and "min_lr_ratio" in r.output and not (tmp_path / "o").exists()
    for cmd in (["set-lr", TITAN, tmp_path / "t", "--lr", "1e-4"], ["set", TITAN, tmp_path / "t", "x=1"]):
        r = run(*cmd)
        assert r.exit_code == 2 and "--optimizer.lr" in r.output and not (tmp_path / "t").exists()
    r = run("set-lr", TITAN, tmp_path / "t", "--lr", "1e-4")
    assert len(r.output.splitlines()) == 1  # one line: why, and (in its parentheses) what to do instead
    assert "only last_epoch" in r.output and "config is the setting" in r.output


# ---- the opcode map the edits come from ------------------------------------------------------------------
@pytest.mark.parametrize("proto", [2, 3, 4, 5])
def test_the_scalar_map_agrees_with_the_unpickler_on_every_scalar(proto):
    obj = {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "amsgrad": False, "step": 300, "name": "x",
                             "big": 1 << 40, "neg": -5, "none": None}], "lr_scheduler": {"base_lrs": [1e-3, 2e-3]}}
    data = pickle.dumps(obj, protocol=proto)
    m = scalar_map(data)
    for path, s in m.scalars.items():
        v = obj
        for p in path:
            v = v[p]
        assert v == s.value and type(v) is type(s.value), path
    assert len(m.scalars) == 11 and not m.shared
    # each edit in place decodes as the new value, everything else unchanged
    for path, new in [(("param_groups", 0, "lr"), 0.5), (("param_groups", 0, "step"), 7),
                      (("param_groups", 0, "amsgrad"), True), (("lr_scheduler", "base_lrs", 1), 4e-3)]:
        at, raw = encode_in_place(m.scalars[path], new)
        got = pickle.loads(data[:at] + raw + data[at + len(raw):])
        v = got
        for p in path[:-1]:
            v = v[p]
        assert v[path[-1]] == new and type(v[path[-1]]) is type(new)
    assert encode_in_place(m.scalars[("param_groups", 0, "step")], 70000) is None  # wider than its opcode
    assert encode_in_place(m.scalars[("param_groups", 0, "lr")], 1) is None  # another type


def test_a_memo_shared_float_is_marked_and_set_lr_refuses_to_change_it():
    # {"lr": 0.01, "weight_decay": <the same float, by memo>}: pickle never writes this, a crafted file can
    data = (b"\x80\x02}q\x00(X\x02\x00\x00\x00lrq\x01G" + struct.pack(">d", 0.01)
            + b"q\x02X\x0c\x00\x00\x00weight_decayq\x03h\x02u.")
    assert pickle.loads(data) == {"lr": 0.01, "weight_decay": 0.01}
    m = scalar_map(data)
    assert m.scalars[("lr",)].pos in m.shared


def test_a_data_pkl_whose_directory_crc_disagrees_is_refused_before_anything_is_written(tmp_path):
    bad = tmp_path / "actor"
    shutil.copytree(LORA / ACTOR, bad)
    f = bad / "extra_state_world_size_2_rank_0.pt"
    raw = bytearray(f.read_bytes())
    crc = struct.pack("<I", zlib.crc32(data_pkl(f)))
    at = raw.rindex(crc)  # the central directory's copy
    raw[at] ^= 0xFF
    os.unlink(f)
    f.write_bytes(bytes(raw))
    r = run("set-lr", bad, tmp_path / "o", "--scale", "2", "--json")
    err = envelope(r)["error"]
    assert r.exit_code == 1 and err["path"].endswith("extra_state_world_size_2_rank_0.pt")
    assert "CRC" in err["message"] and not (tmp_path / "o").exists()
