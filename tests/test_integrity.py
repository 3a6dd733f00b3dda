"""Damaged bytes never make a wrong output, and the outputs carry digests you can check.

Every damaged input here is built from the genuine prime-rl fixture in a temp dir (one flipped bit
in a stored payload): every command that decodes or copies a DCP item refuses it by the item's zip
CRC-32, naming the file, the key and the fix; a slim's kept items are proven against its manifest on
rehydrate; the HF dirs merge and export write carry SHA256SUMS (which `sha256sum -c` reads), and
`verify --deep` proves them, a Hub cache snapshot by its blob names, and says plainly when nothing
can be proven."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import threading
import zlib
from pathlib import Path

import pytest

from ckpt_tools.io.owned import OUTPUT_MARKER
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_tools.cli import main
from ckpt_tools.core.crc import PieceChecker, crc32_combine
from ckpt_tools.core.errors import ChecksumError
from ckpt_tools.formats.dcp import item as dcp_item
from ckpt_tools.formats.dcp.model import TensorEntry
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.formats.hf_dir.digests import SUMS_NAME, parse_sums
from ckpt_tools.formats.slim.manifest import SLIM_MANIFEST, kept_item_id
from ckpt_tools.ops.merge import produce

from . import hardening_util as hu
from .conftest import BASE, FIXTURE, TRAINER, json_payload

REL = Path("outputs/checkpoints/step_3/trainer")
LORA_KEY = "app.model.model.layers.0.self_attn.q_proj.lora_B.0"
BASE_KEY = "app.model.model.layers.1.mlp.up_proj.weight"
EXPECTED = FIXTURE / "expected_merged_hf"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def payload_of(trainer: Path, key: str) -> tuple[str, int, int]:
    """(data file, absolute offset, size) of the payload of the first non-empty chunk of `key`."""
    ck = DcpCheckpoint.open(trainer)
    e = ck.entries[key]
    ch = next(c for c in e.chunks if c.numel)
    dec = ck.decode_chunk(key, ch)
    ck.close()
    return ch.file, ch.offset + dec.payload_offset, dec.payload_size


def flip_bit(path: Path, pos: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ mask]))


def damage(trainer: Path, key: str) -> Path:
    """Flip one bit in the middle of `key`'s stored payload; returns the data file."""
    rel, pos, size = payload_of(trainer, key)
    flip_bit(trainer / rel, pos + size // 2)
    return trainer / rel


def assert_refused(r, file: Path, key: str) -> None:
    """A damaged DCP item refused: exit 1, one line naming the file, the key, the CRC and the fix.
    Counted for docs/reliability.md (`hu.record("integrity")`)."""
    hu.record("integrity", damaged_runs=1)
    assert r.exit_code == 1, r.output
    assert "CRC-32" in r.output and str(file) in r.output and repr(key) in r.output, r.output
    assert "re-copy" in r.output, r.output       # the fix
    assert "Traceback" not in r.output
    hu.record("integrity", refused_naming_file_key=1)


# ------------------------------------------------------------------------------------ the CRC math
@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=4000), st.lists(st.integers(1, 3999), max_size=12), st.randoms())
def test_pieces_in_any_order_prove_the_record_and_a_flipped_bit_in_any_piece_fails_it(data, cuts, rnd):
    points = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    pieces = list(zip(points, points[1:])) or [(0, 0)]
    rnd.shuffle(pieces)
    good = PieceChecker()
    assert all(good.feed("r", len(data), zlib.crc32(data), s, data[s:e]) for s, e in pieces)
    assert good.checked == 1 and good.unchecked() == []
    if data:
        bad, hit = PieceChecker(), rnd.randrange(len(data))
        broken = bytearray(data)
        broken[hit] ^= 1 << rnd.randrange(8)
        assert not all(bad.feed("r", len(data), zlib.crc32(data), s, bytes(broken[s:e])) for s, e in pieces)


def test_crc32_combine_equals_zlib_over_the_concatenation_and_threads_feed_one_checker():
    rnd = random.Random(7)
    for _ in range(50):
        a, b = rnd.randbytes(rnd.randrange(3000)), rnd.randbytes(rnd.randrange(3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    data = rnd.randbytes(1 << 20)
    checker, results = PieceChecker(), []
    blocks = [(s, min(s + 4096, len(data))) for s in range(0, len(data), 4096)]
    rnd.shuffle(blocks)

    def feed(part):
        results.extend(checker.feed("r", len(data), zlib.crc32(data), s, data[s:e]) for s, e in part)
    threads = [threading.Thread(target=feed, args=(blocks[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results) and checker.checked == 1


# ------------------------------------------------------------------------------ a damaged LoRA item
COMMANDS = {
    "merge": lambda fx, out: ("merge", fx / "base_model", fx / REL, out),
    "merge --base-from-checkpoint": lambda fx, out: ("merge", "--base-from-checkpoint", fx / REL, out,
                                                     "--config-from", fx / "base_model"),
    "export": lambda fx, out: ("export", fx / REL, out),
    "extract-adapter": lambda fx, out: ("extract-adapter", fx / REL, out),
    "slim": lambda fx, out: ("slim", fx / REL, out),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_flipped_bit_in_a_stored_lora_payload_is_refused_naming_file_key_and_fix(command, fixture_copy, tmp_path):
    file = damage(fixture_copy / REL, LORA_KEY)
    out = tmp_path / "out"
    assert_refused(run(*COMMANDS[command](fixture_copy, out)), file, LORA_KEY)
    assert not out.exists()


def test_the_refusal_is_a_checksum_error_under_json(fixture_copy, tmp_path):
    file = damage(fixture_copy / REL, LORA_KEY)
    r = run("merge", fixture_copy / "base_model", fixture_copy / REL, tmp_path / "out", "--json")
    assert r.exit_code == 1
    err = json.loads(r.stdout)["error"]
    assert err["type"] == "ChecksumError" and err["path"] == str(file) and err["key"] == LORA_KEY
    assert "CRC-32" in err["message"] and err["hint"]


def test_diff_vs_base_refuses_a_damaged_adapter_instead_of_judging_a_merge_with_it(fixture_copy):
    intact = run("diff-vs-base", EXPECTED, fixture_copy / "base_model", "--adapter", fixture_copy / REL)
    assert intact.exit_code == 0, intact.output            # the control: the genuine merge is proven
    file = damage(fixture_copy / REL, LORA_KEY)
    r = run("diff-vs-base", EXPECTED, fixture_copy / "base_model", "--adapter", fixture_copy / REL)
    assert_refused(r, file, LORA_KEY)


def test_adapter_to_dcp_refuses_a_damaged_optimizer_from_checkpoint(fixture_copy, tmp_path):
    key = "app.optimizers.state.model.layers.0.self_attn.q_proj.lora_B.0.exp_avg"
    ck = DcpCheckpoint.open(fixture_copy / REL)
    if key not in ck.entries:   # the optimizer key spelling of this generation
        key = next(k for k in ck.entries if "exp_avg" in k and "q_proj.lora_B" in k and "layers.0." in k)
    ck.close()
    file = damage(fixture_copy / REL, key)
    r = run("adapter-to-dcp", FIXTURE / "reference_peft_adapter", tmp_path / "out", "--base", BASE,
            "--optimizer-from", fixture_copy / REL, "--world-size", "1")
    assert_refused(r, file, key)


# ------------------------------------------------------------------ payloads streamed in pieces
def test_streamed_payloads_are_checked_piece_by_piece_and_an_intact_one_gives_the_same_bytes(
        fixture_copy, tmp_path, monkeypatch):
    trainer = fixture_copy / REL
    assert run("export", trainer, tmp_path / "whole").exit_code == 0
    # every item now takes the large-item path (parsed from its tail, payload read by extents), and the
    # export's casts read 4 KiB row blocks: each payload arrives in pieces, out of order across workers
    monkeypatch.setattr(dcp_item, "SMALL_ITEM_BYTES", 0)
    monkeypatch.setattr(produce, "COPY_BLOCK_BYTES", 4096)
    pieces: dict = {}
    real = DcpCheckpoint.check_piece

    def counting(self, rel, at, size, crc, pos, data, key):
        pieces[(rel, at)] = pieces.get((rel, at), 0) + 1
        return real(self, rel, at, size, crc, pos, data, key)
    monkeypatch.setattr(DcpCheckpoint, "check_piece", counting)
    r = run("export", trainer, tmp_path / "pieces")
    assert r.exit_code == 0, r.output
    assert max(pieces.values()) > 1                  # some payload really came in several pieces
    for name in os.listdir(tmp_path / "whole"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "pieces" / name).read_bytes(), name
    file = damage(trainer, BASE_KEY)
    r = run("export", trainer, tmp_path / "damaged")
    assert_refused(r, file, BASE_KEY)
    assert not (tmp_path / "damaged").exists()


def test_a_whole_tensor_read_checks_the_payload_crc(fixture_copy, monkeypatch):
    monkeypatch.setattr(dcp_item, "SMALL_ITEM_BYTES", 0)
    trainer = fixture_copy / REL
    damage(trainer, BASE_KEY)
    with pytest.raises(ChecksumError, match="CRC-32"):
        DcpCheckpoint.open(trainer).read_tensor(BASE_KEY)


# ------------------------------------------------------------------------------ slim -> rehydrate
@pytest.fixture(scope="module")
def slim_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("slim") / "slim"
    r = run("slim", TRAINER, out, "--base", BASE)
    assert r.exit_code == 0, r.output
    return out


def writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        os.chmod(p, 0o644 if p.is_file() else 0o755)
    return dst


def test_the_slim_manifest_records_the_crc32_of_every_kept_item(slim_dir):
    m = json.loads((slim_dir / SLIM_MANIFEST).read_text())
    items = m["kept_crc32"]["items"]
    src = DcpCheckpoint.open(TRAINER)
    want = {}
    dropped = {d["key"] for d in m["dropped"]}
    for key, e in src.entries.items():
        if key in dropped:
            continue
        if isinstance(e, TensorEntry):
            for c in e.chunks:
                want[kept_item_id(key, c.offsets)] = zlib.crc32(src.read_item_bytes(c.file, c.offset, c.length, key))
        else:
            want[kept_item_id(key, None)] = zlib.crc32(src.read_item_bytes(e.file, e.offset, e.length, key))
    assert items == want and len(items) > 500


def test_a_damaged_slim_never_rehydrates(slim_dir, tmp_path):
    slim = writable_copy(slim_dir, tmp_path / "slim")
    file = damage(slim, LORA_KEY)
    out = tmp_path / "full"
    r = run("rehydrate", slim, out, "--base", BASE)
    assert_refused(r, file, LORA_KEY)
    assert "resumable" not in r.output and not out.exists()


def _rewrite_item_consistently(slim: Path, key: str) -> Path:
    """Change `key`'s payload AND fix its zip CRC in the central directory: the item is self-consistent,
    only the manifest knows it is not what slim copied."""
    ck = DcpCheckpoint.open(slim)
    ch = next(c for c in ck.entries[key].chunks if c.numel)
    dec = ck.decode_chunk(key, ch)
    ck.close()
    path = slim / ch.file
    raw = bytearray(path.read_bytes())
    item = raw[ch.offset:ch.offset + ch.length]
    p = dec.payload_offset
    item[p + 3] ^= 0x20
    new_crc = zlib.crc32(bytes(item[p:p + dec.payload_size]))
    at = item.find(b"PK\x01\x02")
    while at != -1:                       # the central directory entry of data/0
        name_len = struct.unpack_from("<H", item, at + 28)[0]
        if bytes(item[at + 46:at + 46 + name_len]).endswith(b"/data/0"):
            struct.pack_into("<I", item, at + 16, new_crc)
        at = item.find(b"PK\x01\x02", at + 4)
    raw[ch.offset:ch.offset + ch.length] = item
    path.write_bytes(bytes(raw))
    return path


def test_a_self_consistent_replaced_kept_item_is_caught_by_the_manifest(slim_dir, tmp_path):
    slim = writable_copy(slim_dir, tmp_path / "slim")
    file = _rewrite_item_consistently(slim, LORA_KEY)
    assert DcpCheckpoint.open(slim).read_tensor(LORA_KEY) is not None    # its own CRC now passes
    r = run("rehydrate", slim, tmp_path / "full", "--base", BASE)
    hu.record("integrity", damaged_runs=1)
    assert r.exit_code == 1 and "manifest recorded" in r.output and str(file) in r.output, r.output
    assert not (tmp_path / "full").exists()
    hu.record("integrity", refused_naming_file_key=1, self_consistent_replacements_caught=1)


def test_an_old_manifest_without_kept_crcs_still_rehydrates_saying_so_and_still_checks_zip_crcs(slim_dir, tmp_path):
    slim = writable_copy(slim_dir, tmp_path / "slim")
    m = json.loads((slim / SLIM_MANIFEST).read_text())
    del m["kept_crc32"]
    (slim / SLIM_MANIFEST).write_text(json.dumps(m, indent=1))
    r = run("rehydrate", slim, tmp_path / "full", "--base", BASE, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert any("records no CRC-32 of the kept items" in w for w in doc["warnings"]), doc["warnings"]
    assert doc["plan"]["kept_items_in_manifest"] is False
    file = damage(slim, LORA_KEY)
    assert_refused(run("rehydrate", slim, tmp_path / "full2", "--base", BASE), file, LORA_KEY)


# ------------------------------------------------------------------------- digests of HF outputs
@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("outs")
    made = {"merged": ("merge", BASE, TRAINER, d / "merged"), "exported": ("export", TRAINER, d / "exported"),
            "adapter": ("extract-adapter", TRAINER, d / "adapter")}
    for name, args in made.items():
        r = run(*args)
        assert r.exit_code == 0, r.output
    return {name: d / name for name in made}


WEIGHTS = {"merged": "model.safetensors", "exported": "model.safetensors", "adapter": "adapter_model.safetensors"}


@pytest.mark.parametrize("which", list(WEIGHTS))
def test_written_hf_dirs_carry_sha256sums_of_every_other_file_and_sha256sum_reads_it(outputs, which):
    out = outputs[which]
    sums = parse_sums((out / SUMS_NAME).read_text(), out / SUMS_NAME)
    # every file but the digest file itself and the hidden output marker (the tool's record of what it wrote,
    # added when OUT is committed: io/owned.py)
    assert set(sums) == set(os.listdir(out)) - {SUMS_NAME, OUTPUT_MARKER}
    for name, digest in sums.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    if shutil.which("sha256sum"):
        r = subprocess.run(["sha256sum", "-c", SUMS_NAME], cwd=out, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_the_written_files_are_unchanged_by_the_digest_file(outputs):
    for name in os.listdir(EXPECTED):
        assert (outputs["merged"] / name).read_bytes() == (EXPECTED / name).read_bytes(), name
    ref = FIXTURE / "reference_peft_adapter" / "adapter_model.safetensors"
    from safetensors.torch import load_file
    got, want = load_file(outputs["adapter"] / WEIGHTS["adapter"]), load_file(ref)
    assert sorted(got) == sorted(want)


@pytest.mark.parametrize("which", list(WEIGHTS))
def test_a_flipped_bit_in_a_written_hf_dir_fails_verify_deep_naming_the_file(outputs, which, tmp_path):
    clean = json_payload(run("verify", outputs[which], "--deep", "--json").stdout)
    assert clean["ok"] and clean["integrity"]["proven"] and clean["integrity"]["by"] == [SUMS_NAME]
    hu.record("digests", intact_outputs_proven=1)
    d = writable_copy(outputs[which], tmp_path / which)
    shard = d / WEIGHTS[which]
    flip_bit(shard, shard.stat().st_size - 100, 0x01)      # inside a tensor; a value that stays finite
    r = run("verify", d, "--deep")
    hu.record("digests", damaged_outputs=1)
    assert r.exit_code == 1 and f"problem: {shard}: sha256" in r.output, r.output
    hu.record("digests", damaged_outputs_failed_naming_file=1)
    rep = json_payload(run("verify", d, "--deep", "--json").stdout)
    assert not rep["ok"] and not rep["integrity"]["proven"]
    assert [p["file"] for p in rep["problems"]] == [str(shard)]


def make_hub_cache(root: Path, src: Path, repo: str = "org/tiny") -> Path:
    """An HF cache repo holding `src` as huggingface_hub lays it out: weights as LFS blobs named by their
    sha256, other files as git blobs named by their git blob id; the snapshot's files link to them."""
    rdir = root / ("models--" + repo.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    (rdir / "blobs").mkdir(parents=True)
    snap = rdir / "snapshots" / rev
    snap.mkdir(parents=True)
    (rdir / "refs").mkdir()
    (rdir / "refs" / "main").write_text(rev)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else \
            hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (rdir / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snap / f.name)
    return snap


@pytest.mark.parametrize("target", ["model.safetensors", "config.json"])
def test_a_hub_cache_model_is_checked_against_its_blob_names(tmp_path, target):
    snap = make_hub_cache(tmp_path / "hub", BASE)
    clean = json_payload(run("verify", snap, "--deep", "--json").stdout)
    assert clean["ok"] and clean["integrity"]["proven"], clean
    assert clean["integrity"]["by"] == ["Hub cache blob names"]
    blob = Path(os.path.realpath(snap / target))
    flip_bit(blob, blob.stat().st_size - 200 if target.endswith(".safetensors") else 10, 0x01)
    hu.record("digests", intact_outputs_proven=1)
    r = run("verify", snap, "--deep")
    hu.record("digests", damaged_outputs=1)
    assert r.exit_code == 1 and f"problem: {snap / target}:" in r.output and "blob name" in r.output, r.output
    hu.record("digests", damaged_outputs_failed_naming_file=1)


def test_an_undigested_dir_is_never_called_ok_for_integrity():
    r = run("verify", BASE, "--deep")
    assert r.exit_code == 0
    assert not r.stdout.startswith("OK") and "INTEGRITY NOT PROVEN" in r.stdout
    assert "structure and finite values only" in r.stdout
    rep = json_payload(run("verify", BASE, "--deep", "--json").stdout)
    assert rep["ok"] and rep["integrity"]["proven"] is False and rep["integrity"]["by"] is None
    assert "structure and finite values only" in rep["integrity"]["statement"]
    hu.record("digests", undigested_said_so=1)
