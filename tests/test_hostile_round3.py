"""Hostile inputs, round 3 (issue 27: hangs, bombs, injection; clean errors): hash-collision pickles,
JSON/TOML object bombs, hub ids that leave the cache or block on a FIFO, doctor fix lines that a
crafted run name would turn into commands.

Every input is built from the genuine fixture (a copy, in a temp dir) with the real libraries and
run through the real CLI in its own process (`hardening_util.run_measured`: timeout, wait4's peak
RSS). Figures for docs/reliability.md: `hu.record("round3", ...)`.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from . import hardening_util as hu
from .conftest import FIXTURE

TRAINER_REL = Path("outputs/checkpoints/step_3/trainer")
BASE_KEY = "app.model.model.layers.1.mlp.down_proj.weight"
M61 = 2 ** 61 - 1     # hash(k * M61) == 0 for every int k


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    root = tmp_path_factory.mktemp("round3")
    n = [0]

    def tree() -> Path:
        n[0] += 1
        return hu.writable_copy(FIXTURE, root / f"t{n[0]}")
    return tree


def run(args, workdir: Path, **kw) -> hu.Measured:
    return hu.run_measured(args, workdir=workdir / "runs", **kw)


def no_traceback(r: hu.Measured) -> None:
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output


# ============================================================================ pickles: hash work
def colliding_int_dict(n: int) -> bytes:
    """The opcodes of {k * (2**61 - 1): 0 for k in 1..n}: every key hashes to 0. Written as opcodes,
    since building that dict here would cost the test what it costs the unpickler."""
    pairs = b"".join(b"\x8a" + bytes([len(e)]) + e + b"K\x00" for e in (pickle.encode_long(k * M61)
                                                                       for k in range(1, n + 1)))
    return b"}(" + pairs + b"u"


def replace_in_metadata(trainer: Path, opcodes: bytes, place) -> int:
    """`.metadata` rewritten with `place(md, PLACEHOLDER)` done, the placeholder string's opcode
    (BINUNICODE; protocol 2 has no frames whose lengths the swap would break) swapped for `opcodes`."""
    md = hu.load_metadata(trainer)
    ph = "ZZPLACEHOLDERZZ"
    place(md, ph)
    data = pickle.dumps(md, protocol=2)
    token = b"X" + struct.pack("<I", len(ph)) + ph.encode()
    assert data.count(token) == 1
    data = data.replace(token, opcodes)
    (trainer / ".metadata").write_bytes(data)
    return len(data)


def test_int_dict_keys_of_one_hash_in_the_metadata_are_refused_quickly(space):
    """A .metadata holding a dict of 40,000 int keys that all hash to 0 (~0.5 MB): the bounds scan
    vouched for it and the C unpickler took 18 s (quadratic, no signal delivered meanwhile)."""
    root = space()
    trainer = root / TRAINER_REL
    size = replace_in_metadata(trainer, colliding_int_dict(40_000), lambda md, ph: md.planner_data.__setitem__("x", ph))
    assert size > 500_000
    r = run(["inspect", trainer], root, timeout=60)
    hu.assert_safe_refusal(r, names=trainer / ".metadata", expect="hashes")
    assert r.wall_s < 10, r.wall_s
    hu.record("round3", hash_pickles=1, refused=1)


def test_sigterm_ends_a_run_on_a_hash_bomb_metadata_at_once(space):
    """SIGTERM 1.5 s into `verify` of 60,000 colliding int keys (the warm runner: imports done, so the
    run is past its scan by then): exit 143 or the refusal, within seconds (the unpickler held the
    signal for 27-41 s)."""
    root = space()
    trainer = root / TRAINER_REL
    replace_in_metadata(trainer, colliding_int_dict(60_000), lambda md, ph: setattr(md.storage_meta, "modules", [ph]))
    p = hu.WarmRun(["verify", trainer], workdir=root / "runs", timeout=90)
    time.sleep(1.5)
    t0 = time.monotonic()
    p.signal(signal.SIGTERM)
    r = p.result()
    assert time.monotonic() - t0 < 5, f"SIGTERM honoured after {time.monotonic() - t0:.1f} s"
    no_traceback(r)
    assert r.exit_code in (1, 143), r.output
    hu.record("round3", hash_pickles=1, signal_runs=1)


class _BigSize(tuple):
    """Pickles as torch.Size(dims) with dims past int64 (the stand-in's `_size` accepts any int);
    hashed here by identity, so that building the test's own dict costs nothing."""

    def __reduce__(self):
        return (torch.Size, (tuple(self),))

    def __hash__(self):
        return id(self)


def test_storage_keys_of_one_hash_cost_nothing_to_build(space):
    """10,000 MetadataIndex keys of one fqn at offsets k * (2**61 - 1): equal hashes, 5e7 `__eq__`
    calls to build the dict (30 s) before any check could look at the offsets."""
    root = space()
    trainer = root / TRAINER_REL
    md = hu.load_metadata(trainer)
    info = next(iter(md.storage_data.values()))
    for k in range(1, 10_001):
        idx = object.__new__(MetadataIndex)
        for name, v in (("fqn", BASE_KEY), ("offset", _BigSize((k * M61, 0))), ("index", None)):
            object.__setattr__(idx, name, v)
        md.storage_data[idx] = _StorageInfo(info.relative_path, info.offset, info.length)
    hu.write_metadata(trainer, md)
    r = run(["inspect", trainer], root, timeout=90)
    no_traceback(r)
    assert not r.timed_out and r.wall_s < 10, f"{r.wall_s:.1f} s"
    assert r.exit_code == 1 and "share the hash" in r.output, r.output
    hu.record("round3", hash_pickles=1)


# ============================================================================ JSON / TOML: object counts
ORCH_REL = Path("outputs/run_default/configs/orch.toml")


def test_a_config_json_of_millions_of_objects_is_refused_before_it_is_parsed(space):
    """39 MB of `{}` in a model's config.json: 13M dicts, 1.85 GiB of RSS and 18 s to parse (the size
    limit is 256 MB). Refused from a count on the text, naming the file; the index of a model may
    hold more values than a config (MAX_TABLE_VALUES), so a genuine one still opens."""
    root = space()
    base = root / "base_model"
    cfg = base / "config.json"
    genuine = cfg.read_text()
    cfg.write_text('{"bomb": [' + ",".join(["{}"] * 13_000_000) + "]}")
    assert cfg.stat().st_size > 38_000_000
    r = run(["inspect", base], root, timeout=60)
    hu.assert_safe_refusal(r, names=cfg, expect="values")
    assert r.rss_bytes < 600 << 20 and r.wall_s < 10, (r.rss_bytes >> 20, r.wall_s)
    cfg.write_text(genuine)
    ok = run(["inspect", base], root, timeout=60)
    assert ok.exit_code == 0, ok.output
    hu.record("round3", json_toml_bombs=1, refused=1, genuine_ok=1)


def test_a_toml_integer_past_4300_digits_is_a_clean_error_and_inspect_still_reports(space):
    """Python refuses to convert an int of more than 4,300 digits (ValueError, not TOMLDecodeError):
    every command reading the run's config ended in an internal error, `inspect` too."""
    root = space()
    trainer, orch = root / TRAINER_REL, root / ORCH_REL
    orch.write_text(orch.read_text() + "\nbig = " + "1" * 5000 + "\n")
    rs = hu.run_measured_many({
        "inspect": ["inspect", trainer],
        "merge": ["merge", root / "base_model", trainer, root / "merged"],
        "doctor": ["doctor", root / "outputs"],
    }, workdir=root / "runs", timeout=60)
    i = rs["inspect"]
    no_traceback(i)
    assert i.exit_code == 0 and "unreadable" in i.output and str(orch) in i.output, i.output
    hu.assert_safe_refusal(rs["merge"], names=orch, expect="4300 digits")
    no_traceback(rs["doctor"])
    assert "4300 digits" in rs["doctor"].output, rs["doctor"].output
    assert not (root / "merged").exists()
    hu.record("round3", json_toml_bombs=1, refused=2, runs=3)


# ============================================================================ hub ids: refs and revisions
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_hub_refs_and_revisions_are_read_through_the_input_checks(space):
    """A FIFO as refs/main blocked every hub-id command (huggingface_hub opened it); a revision with
    `..`, or a ref holding a path, resolved a hub id to a model outside the cache; a ref that is a
    directory or not UTF-8 ended in an internal error. The genuine layout still resolves."""
    root = space()
    outside = root / "outside_model"          # what an attacker would have a hub id resolve to
    shutil.copytree(root / "base_model", outside)
    caches = {}

    def case(name: str, edit) -> Path:
        cache = root / "caches" / name / "hub"
        folder = hu.hf_cache(root / "base_model", cache, COMMIT)
        edit(folder)
        caches[name] = cache
        return folder

    def fifo(folder):
        (folder / "refs" / "main").unlink()
        os.mkfifo(folder / "refs" / "main")

    def dotdot_revision(folder):
        # org/tiny@../../../evilref: refs/../../../evilref is a file beside the cache naming `outside`
        (folder.parent.parent / "evilref").write_text("../../../../outside_model")

    def snapshot_outside(folder):
        snap = folder / "snapshots" / COMMIT
        shutil.rmtree(snap)
        snap.symlink_to(outside)

    edits = {
        "genuine": lambda folder: None,
        "fifo ref": fifo,
        "dotdot revision": dotdot_revision,
        "ref holds a path": lambda folder: (folder / "refs" / "main").write_text("../../../../../outside_model"),
        "ref is a directory": lambda folder: ((folder / "refs" / "main").unlink(), (folder / "refs" / "main").mkdir()),
        "ref is not utf-8": lambda folder: (folder / "refs" / "main").write_bytes(b"\xff\xfe" + COMMIT.encode()),
        "snapshot outside": snapshot_outside,
    }
    folders = {name: case(name, edit) for name, edit in edits.items()}
    spec = {"dotdot revision": "org/tiny@../../../evilref"}
    rs = {}
    for name in edits:   # each with its own HF_HUB_CACHE
        rs[name] = run(["inspect", spec.get(name, "org/tiny")], root, timeout=30,
                       env={"HF_HUB_CACHE": str(caches[name]), "HF_HUB_OFFLINE": "1"}, fresh=True)
    g = rs.pop("genuine")
    assert g.exit_code == 0 and COMMIT in g.output, g.output
    hu.assert_safe_refusal(rs["fifo ref"], names=folders["fifo ref"] / "refs" / "main", expect="FIFO")
    hu.assert_safe_refusal(rs["dotdot revision"], expect="'..'", code=2)
    hu.assert_safe_refusal(rs["ref holds a path"], expect="not a commit hash")
    hu.assert_safe_refusal(rs["ref is a directory"], expect="a directory")
    hu.assert_safe_refusal(rs["ref is not utf-8"], expect="not UTF-8")
    hu.assert_safe_refusal(rs["snapshot outside"], expect="outside")
    for name, r in rs.items():
        assert str(outside) not in r.stdout, f"{name}: resolved outside the cache: {r.output}"
    hu.record("round3", hub_cases=len(rs), refused=len(rs), genuine_ok=1)


# ============================================================================ doctor: fix lines, odd configs
ORCH_NAME = 'name = "base_model"'


def test_doctor_fix_lines_pasted_into_sh_run_no_command_from_the_run(space, tmp_path):
    """A downloaded run whose model.name is `base_model;touch${IFS}PWNED;` (and a directory of that name
    beside it, so the base resolves and the weights-are-base fix names it): every `ckpt ...` fix line
    doctor prints, run with sh (a dummy `ckpt` on PATH), must create no PWNED file."""
    root = space()
    evil = "base_model;touch${IFS}PWNED;"
    orch = root / ORCH_REL
    text = orch.read_text()
    assert text.count(ORCH_NAME) == 1
    orch.write_text(text.replace(ORCH_NAME, f'name = "{evil}"'))
    shutil.copytree(root / "base_model", root / evil)
    r = run(["doctor", "--json", root / "outputs"], root, timeout=60)
    no_traceback(r)
    fixes = [f["fix"] for f in json.loads(r.stdout)["result"]["findings"]]
    lines = [ln for fix in fixes for ln in fix.splitlines() if ln.startswith("ckpt ")]
    assert any(evil in ln for ln in lines), fixes     # the finding that names the base is there
    bin_dir, work = tmp_path / "bin", tmp_path / "sh-work"
    bin_dir.mkdir()
    work.mkdir()
    (bin_dir / "ckpt").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "ckpt").chmod(0o755)
    for ln in lines:
        subprocess.run(["sh", "-c", ln], cwd=work, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "IFS": " "},
                       capture_output=True, timeout=30)
    assert not list(work.iterdir()), f"a fix line ran a command of the run: {sorted(work.iterdir())} from {lines}"
    hu.record("round3", doctor_cases=1, injections_run=0)


@pytest.mark.parametrize("alpha", ["1979-05-27T07:32:00", "[1, 2]", "{ x = 1 }", "true"])
def test_doctor_on_an_alpha_that_is_not_a_number_is_one_clean_line(space, alpha):
    root = space()
    orch = root / ORCH_REL
    text = orch.read_text()
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("[model.lora]"))
    lines.insert(at + 1, f"alpha = {alpha}")
    orch.write_text("\n".join(ln for i, ln in enumerate(lines) if i == at + 1 or not (
        i > at + 1 and ln.startswith("alpha ="))) + "\n")
    rs = hu.run_measured_many({c: [c, root / TRAINER_REL] if c == "inspect" else [c, root / "outputs"]
                               for c in ("doctor", "inspect")}, workdir=root / "runs", timeout=60)
    for name, r in rs.items():
        no_traceback(r)
        assert r.exit_code in (0, 1, 3) and "alpha" in r.output, f"{name}: {r.output}"
    assert "not a finite number" in rs["doctor"].output, rs["doctor"].output
    hu.record("round3", doctor_cases=1, runs=2)


def test_doctor_on_a_symlink_loop_in_toml_files_is_one_clean_line(tmp_path):
    from .conftest import FIXTURES
    cfg = tmp_path / "rl.toml"
    cfg.write_text('toml_files = ["loop.toml"]\n' + (FIXTURES / "configs" / "good.toml").read_text())
    (tmp_path / "loop.toml").symlink_to("loop2.toml")
    (tmp_path / "loop2.toml").symlink_to("loop.toml")
    r = run(["doctor", cfg], tmp_path, timeout=60)
    hu.assert_safe_refusal(r, names=tmp_path / "loop.toml", expect="symbolic links")
    hu.record("round3", doctor_cases=1, refused=1)
