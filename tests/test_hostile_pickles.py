"""Hostile pickles never run: `.metadata`, DCP byte items, tensor items, `adapter_model.bin` and
prime-rl's `dataloader/rank_N.pt` carrying payloads that call os.system / subprocess / eval / exec
/ getattr chains / nested pickle.loads / torch.load(weights_only=False). Each payload creates a
canary file when unpickled by a plain unpickler (checked first: the corpus is live); every
library entry point and every command that reads the input refuses it with one clear line, and
the canary proves nothing ran. `--trust-remote-pickle` is the only way through, and says so."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.core.errors import CkptError, UnsafePickleError
from ckpt_tools.formats.peft.adapter import open_peft_adapter

from . import hardening_util as hu
from .conftest import FIXTURE, TRAINER

PAYLOADS = hu.payload_names()
ALL_COMMAND_PAYLOADS = ("os.system (p2)", "p0 INST os.system", "p4 STACK_GLOBAL dotted torch.serialization/os.system")
REFUSAL = r"refusing to unpickle|unsafe|not allowed|weights_only"

# Where a payload hides inside an otherwise valid Metadata object.
NESTED_SITES = ("storage_meta.modules", "storage_meta.checkpoint_id", "planner_data value",
                "tensor properties.dtype", "chunk sizes", "storage_info.relative_path",
                "state_dict_metadata key", "version")

# Byte items / tensor chunks a payload replaces, with the commands that must read them.
ITEM_SITES = {
    "app.progress.step": None,                                  # byte item (inspect reads it)
    "app.optimizers.param_groups.0.lr": None,                   # byte item (set-lr reads it)
    "app.scheduler._last_lr": None,
    "app.model.model.layers.0.self_attn.q_proj.lora_A.0": 0,   # tensor chunk 0
    "app.model.model.layers.1.mlp.down_proj.weight": 1,               # frozen base tensor, chunk 1
}


# (command, key): the command must decode this item, so it must refuse the payload.
MUST_REFUSE = {
    ("inspect", "app.progress.step"),
    ("set", "app.progress.step"),
    ("set-lr", "app.optimizers.param_groups.0.lr"),
    ("set-lr", "app.scheduler._last_lr"),
    ("extract-adapter", "app.model.model.layers.0.self_attn.q_proj.lora_A.0"),
    ("merge", "app.model.model.layers.0.self_attn.q_proj.lora_A.0"),
    ("restart-prep", "app.model.model.layers.0.self_attn.q_proj.lora_A.0"),
    ("diff-vs-base", "app.model.model.layers.1.mlp.down_proj.weight"),
}


def dcp_invocations(ckpt: Path, out: Path) -> dict[str, list]:
    """How each command that reads a DCP checkpoint is run on `ckpt` (only those that exist run)."""
    base = FIXTURE / "base_model"
    run_cfg = FIXTURE / "outputs" / "run_default" / "configs" / "orch.toml"
    inv = {
        "inspect": ["inspect", ckpt],
        "verify": ["verify", ckpt],
        "merge": ["merge", base, ckpt, out / "merged", "--run-config", run_cfg],
        "extract-adapter": ["extract-adapter", ckpt, out / "adapter", "--run-config", run_cfg],
        "diff-vs-base": ["diff-vs-base", ckpt, base],
        "slim": ["slim", ckpt, out / "slim"],
        "rehydrate": ["rehydrate", ckpt, out / "rehydrated", "--base", base],
        "set-lr": ["set-lr", ckpt, out / "setlr", "--scale", "0.5"],
        "set": ["set", ckpt, out / "set", "progress.step=5"],
        "restart-prep": ["restart-prep", ckpt, out / "restart", "--base", base, "--lr", "1e-5",
                         "--run-config", run_cfg],
        "adapter-to-dcp": ["adapter-to-dcp", FIXTURE / "reference_peft_adapter", out / "a2d", "--base", base,
                           "--optimizer-from", ckpt],
    }
    have = hu.commands()
    return {k: v for k, v in inv.items() if k in have}


@pytest.fixture(scope="module")
def trainer_copy_factory(tmp_path_factory):
    n = [0]

    def make() -> Path:
        n[0] += 1
        return hu.writable_copy(TRAINER, tmp_path_factory.mktemp("hostile") / f"trainer{n[0]}")
    return make


def test_every_invocation_works_on_genuine_inputs(trainer_copy_factory, tmp_path):
    """Control for the refusals below: the same command lines succeed on clean inputs (so a
    non-zero exit there is the payload's doing, not a bad argument)."""
    d = trainer_copy_factory()
    for cmd, args in dcp_invocations(d, tmp_path / "dcp").items():
        if cmd == "rehydrate":
            continue  # takes a slim checkpoint; here it must fail cleanly, which the tests check
        r = hu.invoke(args)
        assert r.exit_code in ((0, 3) if cmd == "diff-vs-base" else (0,)), f"{cmd}: {r.output}"
    a = _adapter_with_bin(tmp_path, None)
    for cmd, args in adapter_invocations(a, tmp_path / "peft").items():
        r = hu.invoke(args)
        assert r.exit_code in ((0, 3) if cmd == "diff-vs-base" else (0,)), f"{cmd}: {r.output}"


def test_the_payload_corpus_is_live(tmp_path):
    """Every payload does create its canary under a plain pickle.loads: absence means refusal."""
    assert hu.assert_payloads_are_live(tmp_path) == len(PAYLOADS) >= 20


# ------------------------------------------------------------------------------------------ .metadata
@pytest.mark.parametrize("payload", PAYLOADS)
def test_metadata_that_is_a_payload_is_refused_everywhere(payload, trainer_copy_factory, tmp_path):
    d = trainer_copy_factory()
    canary = tmp_path / "canary"
    (d / ".metadata").write_bytes(hu.payload_bytes(canary)[payload])
    with pytest.raises(UnsafePickleError, match="refusing to unpickle|cannot parse"):
        DcpCheckpoint.open(d)
    tried = 1
    # Every command opens .metadata through the same allow-list loader: the whole corpus goes
    # through the library and `inspect`, three payloads (one per pickle dialect) through all.
    cmds = dcp_invocations(d, tmp_path / "out")
    if payload not in ALL_COMMAND_PAYLOADS:
        cmds = {k: v for k, v in cmds.items() if k == "inspect"}
    for name, args in cmds.items():
        r = hu.invoke(args)
        hu.assert_refused(r, expect="refusing to unpickle|cannot parse DCP metadata")
        tried += 1
    executed = canary.exists()
    hu.record("hostile", tried=tried, executed=executed)
    assert not executed, f"payload {payload} ran"
    assert not (tmp_path / "out").exists()


def _nest(md, site: str, evil):
    key = sorted(md.state_dict_metadata)[0]
    tkey = next(k for k, v in sorted(md.state_dict_metadata.items()) if hasattr(v, "chunks"))
    if site == "storage_meta.modules":
        md.storage_meta.modules = [evil]
    elif site == "storage_meta.checkpoint_id":
        md.storage_meta.checkpoint_id = evil
    elif site == "planner_data value":
        md.planner_data[key] = evil
    elif site == "tensor properties.dtype":
        md.state_dict_metadata[tkey].properties.dtype = evil
    elif site == "chunk sizes":
        md.state_dict_metadata[tkey].chunks[0].sizes = evil
    elif site == "storage_info.relative_path":
        idx = next(iter(md.storage_data))
        md.storage_data[idx].relative_path = evil
    elif site == "state_dict_metadata key":
        md.state_dict_metadata[evil] = md.state_dict_metadata[key]
    elif site == "version":
        md.version = evil
    else:
        raise AssertionError(site)
    return md


@pytest.mark.parametrize("site", NESTED_SITES)
def test_payload_nested_inside_valid_metadata_is_refused(site, trainer_copy_factory, tmp_path):
    d = trainer_copy_factory()
    canary = tmp_path / "canary"
    objs = hu.payload_objects(canary)
    tried = 0
    genuine = (TRAINER / ".metadata").read_bytes()
    for i, (name, evil) in enumerate(objs.items()):
        md = pickle.loads(genuine)  # the genuine fixture's metadata: trusted
        (d / ".metadata").write_bytes(pickle.dumps(_nest(md, site, evil), protocol=2 + 2 * (i % 2)))
        with pytest.raises(UnsafePickleError, match="refusing to unpickle"):
            DcpCheckpoint.open(d)
        tried += 1
        if i == 0:  # commands, with one payload per site (they share the opening code)
            cmds = dcp_invocations(d, tmp_path / "out")
            if site not in NESTED_SITES[:3]:
                cmds = {k: v for k, v in cmds.items() if k in ("inspect", "verify")}
            for cmd, args in cmds.items():
                hu.assert_refused(hu.invoke(args), expect="refusing to unpickle")
                tried += 1
    hu.record("hostile", tried=tried, executed=canary.exists())
    assert not canary.exists()


# ------------------------------------------------------------------------------------------ DCP items
# The whole corpus at one byte item and one tensor chunk (the reader's two decoding paths); a
# sample at the others.
FULL_CORPUS_KEYS = ("app.progress.step", "app.model.model.layers.0.self_attn.q_proj.lora_A.0")


@pytest.mark.parametrize("key", list(ITEM_SITES))
def test_item_payloads_are_refused_by_the_reader(key, trainer_copy_factory, tmp_path):
    """torch.save'd payloads (DCP writes items with torch.save) and raw pickles as data.pkl."""
    canary = tmp_path / "canary"
    items = {f"torch.save({n})": hu.torch_save_bytes(o) for n, o in hu.payload_objects(canary).items()}
    items.update({f"data.pkl={n}": hu.torch_item_with_pickle(b) for n, b in hu.payload_bytes(canary).items()})
    if key not in FULL_CORPUS_KEYS:
        items = dict(list(items.items())[::8])
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    d = trainer_copy_factory()
    need = hu.chunk_bytes(d, key, ITEM_SITES[key])   # a chunk item holds at least its elements' bytes
    items = {n: hu.pad_item(raw, need) for n, raw in items.items()}
    md = pickle.loads((d / ".metadata").read_bytes())  # the genuine fixture's metadata: trusted
    offs = None if ITEM_SITES[key] is None else tuple(md.state_dict_metadata[key].chunks[ITEM_SITES[key]].offsets)
    idx = hu.storage_index(md, key, offs)
    evil = d / "__evil_0.distcp"
    tried = 0
    for name, raw in items.items():
        # .metadata parsing is covered above: point the key at the payload in memory
        start = evil.stat().st_size if evil.exists() else 0
        with open(evil, "ab") as f:
            f.write(raw)
        md.storage_data[idx] = _StorageInfo(evil.name, start, len(raw))
        ck = DcpCheckpoint(d, md)
        with pytest.raises(CkptError) as ei:
            if ck.entries[key].is_tensor:
                ck.read_tensor(key)
            else:
                ck.read_object(key)
        # raw pickles that are not even valid torch archives may be FormatErrors; payloads are refused
        assert isinstance(ei.value, UnsafePickleError) or "cannot decode" in str(ei.value), (name, ei.value)
        assert key in str(ei.value)
        ck.close()
        tried += 1
        assert not canary.exists(), f"{name} at {key} ran"
    hu.record("hostile", tried=tried, executed=canary.exists())


@pytest.mark.parametrize("key", [k for k in ITEM_SITES if k != "app.scheduler._last_lr"])
def test_item_payloads_never_run_through_any_command(key, trainer_copy_factory, tmp_path):
    """Every command on a checkpoint with a poisoned item: the payload never runs; a command that
    reads the item refuses with one line; one that copies bytes verbatim may succeed."""
    canary = tmp_path / "canary"
    d = trainer_copy_factory()
    hu.point_item_at(d, key, hu.pad_item(hu.torch_save_bytes(hu.payload_objects(canary)["os.system"]),
                                         hu.chunk_bytes(d, key, ITEM_SITES[key])), chunk=ITEM_SITES[key])
    tried = 0
    for cmd, args in dcp_invocations(d, tmp_path / f"out{tried}").items():
        r = hu.invoke(args)
        tried += 1
        assert r.exc is None and "Traceback" not in r.output and "internal error" not in r.output, r.output
        if (cmd, key) in MUST_REFUSE:
            hu.assert_refused(r, expect=REFUSAL)
            assert key in r.output
        elif r.exit_code not in (0, 3):  # diff-vs-base exits 3 for "identical to base"
            hu.assert_refused(r)   # e.g. rehydrate: "not a slim checkpoint"
        assert not canary.exists(), f"{cmd} ran the payload at {key}"
    hu.record("hostile", tried=tried, executed=canary.exists())
    assert tried >= 1


def test_inspect_refuses_a_poisoned_step_item(trainer_copy_factory, tmp_path):
    canary = tmp_path / "canary"
    d = trainer_copy_factory()
    hu.point_item_at(d, "app.progress.step", hu.torch_save_bytes(hu.payload_objects(canary)["os.system"]))
    line = hu.assert_clean_error(hu.invoke(["inspect", d]), expect="refusing to unpickle item")
    assert "app.progress.step" in line and "--trust-remote-pickle" in line
    assert not canary.exists()


# ------------------------------------------------------------------------------------------ trust flag
def test_trust_remote_pickle_is_the_only_way_through_and_says_so(trainer_copy_factory, tmp_path):
    """The same payload that is refused by default does run with --trust-remote-pickle (proving
    the refusal above is what kept the canary away), with a loud warning first."""
    canary = tmp_path / "canary"
    d = trainer_copy_factory()
    hu.point_item_at(d, "app.progress.step", hu.torch_save_bytes(hu.payload_objects(canary)["os.system"]))
    r = hu.invoke(["inspect", d])
    assert r.exit_code == 1 and not canary.exists()
    r = hu.invoke(["inspect", "--trust-remote-pickle", d])
    assert canary.exists(), "with --trust-remote-pickle the item is unpickled as stock DCP would"
    assert "WARNING: --trust-remote-pickle" in r.stderr and "run any code" in r.stderr
    assert r.stderr.index("WARNING") < max(r.stderr.find("error"), 0) or "error" not in r.stderr


def test_trusted_metadata_payload_runs_only_with_the_flag(trainer_copy_factory, tmp_path):
    canary = tmp_path / "canary"
    d = trainer_copy_factory()
    (d / ".metadata").write_bytes(hu.payload_bytes(canary)["os.system (p2)"])
    hu.assert_clean_error(hu.invoke(["inspect", d]), expect="refusing to unpickle global posix.system")
    assert not canary.exists()
    r = hu.invoke(["inspect", "--trust-remote-pickle", d])
    assert canary.exists() and "WARNING: --trust-remote-pickle" in r.stderr
    hu.assert_clean_error(r, expect="malformed DCP metadata|not a|metadata")  # an int is no Metadata


# ------------------------------------------------------------------------------------------ adapters
def _adapter_with_bin(tmp: Path, evil) -> Path:
    """A PEFT adapter dir (the reference adapter's config) whose weights are an adapter_model.bin
    holding the real tensors plus `evil`."""
    from safetensors.torch import load_file

    src = FIXTURE / "reference_peft_adapter"
    d = tmp / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    sd = load_file(src / "adapter_model.safetensors")
    sd = {k: v for k, v in sd.items()}
    if evil is not None:
        sd["zz.evil"] = evil
    torch.save(sd, d / "adapter_model.bin")
    return d


def adapter_invocations(adapter: Path, out: Path) -> dict[str, list]:
    base = FIXTURE / "base_model"
    inv = {
        "inspect": ["inspect", adapter],
        "verify": ["verify", adapter],
        "merge": ["merge", base, adapter, out / "merged"],
        "fix-adapter": ["fix-adapter", adapter, out / "fixed", "--alpha", "16"],
        "adapter-to-dcp": ["adapter-to-dcp", adapter, out / "dcp", "--base", base, "--lr", "1e-5"],
        "diff-vs-base": ["diff-vs-base", base, base, "--adapter", adapter],
    }
    have = hu.commands()
    return {k: v for k, v in inv.items() if k in have}


@pytest.mark.parametrize("payload", list(hu.payload_objects(Path("/nonexistent/c"), plant=False)))
def test_adapter_bin_payloads_are_refused(payload, tmp_path):
    canary = tmp_path / "canary"
    d = _adapter_with_bin(tmp_path, hu.payload_objects(canary)[payload])
    with pytest.raises(UnsafePickleError):
        open_peft_adapter(d)
    tried = 1
    for cmd, args in adapter_invocations(d, tmp_path / "out").items():
        hu.assert_refused(hu.invoke(args), expect=REFUSAL)
        tried += 1
    hu.record("hostile", tried=tried, executed=canary.exists())
    assert not canary.exists()


def test_prime_rl_export_adapter_bin_is_real_and_loads_without_trust(tmp_path):
    """Control: the genuine prime-rl adapter_model.bin is a plain dict of tensors and is accepted
    by the allow-list (so the refusals above are about the payloads, not about .bin files)."""
    a = open_peft_adapter(FIXTURE / "outputs" / "weights" / "step_3" / "lora_adapters", strict=False)
    assert a.unrecognized and a.weights_path.name == "adapter_model.bin"


# ------------------------------------------------------------------------------------------ dataloader
def test_dataloader_rank_pickles_are_never_unpickled(tmp_path):
    """prime-rl's sft trainer writes step_N/dataloader/rank_N.pt (arbitrary pickles); no command
    may load them. A poisoned one sits in the step dir while every command runs on it."""
    root = hu.writable_copy(FIXTURE / "outputs" / "checkpoints" / "step_3", tmp_path / "step_3")
    canary = tmp_path / "canary"
    (root / "dataloader").mkdir()
    for rank in range(4):
        (root / "dataloader" / f"rank_{rank}.pt").write_bytes(
            hu.torch_save_bytes({"state": hu.payload_objects(canary)["os.system"]}))
    tried = 0
    for cmd, args in dcp_invocations(root, tmp_path / "out").items():
        r = hu.invoke(args)
        assert r.exc is None and "internal error" not in r.output, r.output
        tried += 1
    hu.record("hostile", tried=tried, executed=canary.exists())
    assert tried and not canary.exists()
