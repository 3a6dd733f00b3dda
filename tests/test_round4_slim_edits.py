"""Round 4 (issue 32), items 1 and 2: a slim stays a slim through `set-lr` and `set`, and gc slims the
steps ckpt-tools itself wrote.

Item 1: set-lr / set on a slim (made by `ckpt slim` from the factory's 4-rank FSDP2 run, and by `ckpt gc`
from HEAD's genuine E_head_dense steps), to a new OUT and `--in-place`, then `set`: the slim rehydrates,
and torch's own DCP reader (`dcp_to_torch_save`) finds every value of the result equal, bit for bit, to
the same edits made on the full checkpoint. A slim whose manifest cannot be read is refused before
anything is written.

Figures for docs/reliability.md: `hu.record("round4", tried=, fixed=, held=)`: a case is fixed when it failed
on the code before this round, held when that code already passed it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from . import hardening_util as hu
from .test_gc import OLD, make_run
from .test_gc_loss import gc
from .test_slim_rehydrate import bits, surgery_run

MANIFEST = "ckpt-slim-manifest.json"


def age(root: Path) -> None:
    """Every entry under `root` older than gc's --min-age."""
    for p in [root, *root.rglob("*")]:
        os.utime(p, (OLD, OLD), follow_symlinks=False)


def ok(*args) -> hu.Result:
    r = hu.invoke([str(a) for a in args])
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    return r


def torch_values(ckpt: Path, tmp: Path) -> dict[str, object]:
    """Every value of a DCP checkpoint as torch's own reader loads it (dcp_to_torch_save), flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp.mkdir(parents=True, exist_ok=True)
    f = tmp / f"{ckpt.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(f))
    sd = torch.load(f, weights_only=False)
    flat: dict[str, object] = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, (dict, list)) and v:
            for k, x in v.items() if isinstance(v, dict) else enumerate(v):
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            flat[prefix] = v

    walk("", sd)
    return flat


def same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(bits(a), bits(b))
    return type(a) is type(b) and repr(a) == repr(b)


def assert_equal_checkpoints(got: Path, want: Path, tmp: Path) -> int:
    """`got` and `want` hold the same keys and every value bit-equal, as torch's DCP reader loads them."""
    g, w = torch_values(got, tmp / "got"), torch_values(want, tmp / "want")
    assert sorted(g) == sorted(w)
    bad = [k for k in w if not same(g[k], w[k])]
    assert bad == [], bad[:5]
    return len(w)


def edit(ckpt: Path, out: Path | None, how: str) -> Path:
    """One of the edits, to `out` or in place (`out` None; `set` always writes an OUT): the edited dir."""
    where = ["--in-place"] if out is None else [out]
    if how == "lr":
        ok("set-lr", ckpt, *where, "--lr", "2e-3")
    elif how == "scale":
        ok("set-lr", ckpt, *where, "--scale", "0.5")
    else:
        assert out is not None
        ok("set", ckpt, out, "app.progress.step=7")
    return ckpt if out is None else out


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    paths = surgery_run(tmp_path_factory)
    root = tmp_path_factory.mktemp("r4-slim")
    slim = root / "slim"
    ok("slim", paths.checkpoint, slim, "--base", paths.base_model)
    return paths, slim, root


@pytest.mark.parametrize("mode", ["out", "in-place", "in-place then set"])
def test_set_lr_on_a_slim_rehydrates_to_the_full_checkpoint_with_the_new_lr(factory, tmp_path, mode):
    paths, slim0, _root = factory
    slim, full = tmp_path / "slim", tmp_path / "full"
    shutil.copytree(slim0, slim, symlinks=True)
    shutil.copytree(paths.checkpoint, full, symlinks=True)
    edits = {"out": ["lr"], "in-place": ["scale"], "in-place then set": ["scale", "set"]}[mode]
    for n, how in enumerate(edits):
        to_out = mode == "out" or how == "set"
        slim = edit(slim, tmp_path / f"slim-{n}" if to_out else None, how)
        full = edit(full, tmp_path / f"full-{n}" if to_out else None, how)
    assert (slim / MANIFEST).is_file() and ok("verify", slim)
    doc = json.loads((slim / MANIFEST).read_text())
    assert doc["version"] == 3 and doc["patched_crc32"]["files"], doc.get("patched_crc32")
    out = tmp_path / "rehydrated"
    ok("rehydrate", slim, out, "--base", paths.base_model)
    ok("verify", out, "--deep")
    n = assert_equal_checkpoints(out, full, tmp_path / "pt")
    # the edit is there: the lr moved from the run's own
    lr = torch_values(out, tmp_path / "pt2")["app.optimizers.param_groups.0.lr"]
    was = torch_values(paths.checkpoint, tmp_path / "pt3")["app.optimizers.param_groups.0.lr"]
    assert lr != was, (lr, was)
    assert n > 50
    hu.record("round4", tried=1, fixed=1)


def test_a_killed_in_place_edit_of_a_slim_leaves_a_slim_that_rehydrates(factory, tmp_path, monkeypatch):
    """A new manifest is renamed in before `.metadata` is swapped: killed between the two, the slim holds
    the old `.metadata` and a manifest that fits it (and a rerun cleans the orphan patch file)."""
    import ckpt_tools.formats.dcp.patch as patch_mod

    paths, slim0, _root = factory
    slim = tmp_path / "slim"
    shutil.copytree(slim0, slim, symlinks=True)
    replaced = []
    real = patch_mod.atomic_write_bytes

    def stop_after(path, data, **kw):  # the manifest written, then the run stops before the swap
        real(path, data, **kw)
        replaced.append(path)
        raise KeyboardInterrupt

    monkeypatch.setattr(patch_mod, "atomic_write_bytes", stop_after)
    r = hu.invoke(["set-lr", str(slim), "--in-place", "--scale", "0.5"])
    monkeypatch.undo()
    assert r.exit_code == 130 and replaced, r.output
    assert not [n for n in os.listdir(slim) if n.startswith(".metadata.bak")]
    out = tmp_path / "rehydrated"
    ok("rehydrate", slim, out, "--base", paths.base_model)
    assert_equal_checkpoints(out, paths.checkpoint, tmp_path / "pt")
    edit(slim, None, "scale")   # the rerun: the orphan patch name is reused, the manifest entry replaced
    out2 = tmp_path / "rehydrated2"
    ok("rehydrate", slim, out2, "--base", paths.base_model)
    full = tmp_path / "full"
    shutil.copytree(paths.checkpoint, full, symlinks=True)
    edit(full, None, "scale")
    assert_equal_checkpoints(out2, full, tmp_path / "pt2")
    hu.record("round4", tried=1, fixed=1)


def test_set_lr_refuses_a_slim_whose_manifest_it_cannot_read_and_changes_nothing(factory, tmp_path):
    _paths, slim0, _root = factory
    slim = tmp_path / "slim"
    shutil.copytree(slim0, slim, symlinks=True)
    doc = json.loads((slim / MANIFEST).read_text())
    doc["kept_crc32"]["items"] = ["not", "a", "map"]
    (slim / MANIFEST).write_text(json.dumps(doc))
    before = hu.snapshot(slim)
    for args in (["set-lr", slim, "--in-place", "--lr", "1e-3"], ["set-lr", slim, tmp_path / "o", "--lr", "1e-3"]):
        r = hu.invoke([str(a) for a in args])
        hu.assert_clean_error(r, expect="kept_crc32.items")
        assert MANIFEST in r.output, r.output
    assert hu.diff_snapshots(before, hu.snapshot(slim)) == [] and not (tmp_path / "o").exists()
    hu.record("round4", tried=1, fixed=1)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out"])
def test_set_lr_on_a_step_gc_slimmed_rehydrates_with_the_new_lr(tmp_path, in_place):
    ck = make_run(tmp_path / "run", steps=(1, 2))
    original = tmp_path / "original"
    shutil.copytree(ck / "step_1" / "trainer", original)
    r, doc = gc(ck, "--keep-full", "1", "--min-age", "0")
    assert r.exit_code == 0 and doc["result"]["slimmed"] == [1], r.output
    slim = ck / "step_1" / "trainer"
    full = tmp_path / "full"
    shutil.copytree(original, full)
    for name, d in (("slim", slim), ("full", full)):
        d = edit(d, None if in_place else tmp_path / f"{name}-lr", "lr")
        d = edit(d, tmp_path / f"{name}-set", "set")
    slim, full = tmp_path / "slim-set", tmp_path / "full-set"
    out = tmp_path / "rehydrated"
    ok("rehydrate", slim, out, "--base", ck.parent.parent / "base_model")
    assert_equal_checkpoints(out, full, tmp_path / "pt")
    hu.record("round4", tried=1, fixed=1)


# ============================================================================ item 2: gc of our own outputs
def test_gc_slims_steps_ckpt_tools_wrote_and_each_rehydrates_exactly(tmp_path):
    """restart-prep --mode adapter (moved where its note says), adapter-to-dcp, and a set-lr OUT that is its
    step's own copy: each carries our `.ckpt-tools-output`, and gc used to leave them full for ever. Now each
    is slimmed, its marker carried byte for byte, and each rehydrates to exactly the step it was."""
    from ckpt_tools.io.owned import OUTPUT_MARKER

    ck = make_run(tmp_path / "run", steps=(1, 2, 3, 4))
    base = ck.parent.parent / "base_model"
    t = {n: ck / f"step_{n}" / "trainer" for n in (1, 2, 3)}
    made = tmp_path / "made"
    ok("restart-prep", t[1], made / "rp", "--base", base, "--lr", "5e-3", "--mode", "adapter")
    ok("extract-adapter", t[2], made / "adapter")
    ok("adapter-to-dcp", made / "adapter", made / "a2d", "--base", base, "--lr", "5e-3", "--step", "2")
    ok("set-lr", t[3], made / "lr", "--lr", "1e-3")
    originals = tmp_path / "originals"
    for n, name in ((1, "rp"), (2, "a2d"), (3, "lr")):
        shutil.rmtree(t[n])
        os.rename(made / name, t[n])  # the step is now our output (set-lr's links: its only copy)
        shutil.copytree(t[n], originals / str(n))
    markers = {n: (t[n] / OUTPUT_MARKER).read_bytes() for n in (1, 2, 3)}
    age(ck.parent.parent)
    r, doc = gc(ck, "--keep-full", "1")
    assert r.exit_code == 0, r.output
    assert doc["result"]["slimmed"] == [1, 2, 3], [(s["step"], s["result"], s["reason"]) for s in doc["result"]["steps"]]
    for n in (1, 2, 3):
        assert (t[n] / MANIFEST).is_file() and (t[n] / OUTPUT_MARKER).read_bytes() == markers[n]
        out = tmp_path / "rehydrated" / str(n)
        ok("rehydrate", t[n], out, "--base", base)
        assert_equal_checkpoints(out, originals / str(n), tmp_path / "pt" / str(n))
        hu.record("round4", tried=1, fixed=1)
    # a marker that is not a regular file is not ours to carry: that step stays full, named
    shutil.rmtree(t[1])
    shutil.copytree(originals / "1", t[1])
    os.unlink(t[1] / OUTPUT_MARKER)
    os.symlink("/etc/hostname", t[1] / OUTPUT_MARKER)
    age(ck.parent.parent)
    r, doc = gc(ck, "--keep-full", "1")
    s1 = next(s for s in doc["result"]["steps"] if s["step"] == 1)
    assert s1["result"] == "skipped" and OUTPUT_MARKER in s1["reason"], s1
    hu.record("round4", tried=1, held=1)
