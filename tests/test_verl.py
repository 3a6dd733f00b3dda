"""verl's FSDP checkpoints (tests/fixtures/verl-*: written by verl 0.9.1's own FSDPCheckpointManager, their
READMEs say how), read through the allow-list as data, every command's result equal to the trainer's truth."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools.core.errors import ChecksumError, FormatError, UnsafePickleError
from ckpt_tools.formats.verl.reader import VerlCheckpoint, chunk_span

from .conftest import FIXTURES, json_payload
from .test_head_fixtures import run

LORA = FIXTURES / "verl-fsdp2-lora"
LORA1 = FIXTURES / "verl-fsdp1-lora"
FULL = FIXTURES / "verl-fsdp2-full"
ACTOR = Path("checkpoints") / "global_step_2" / "actor"
PEFT = "base_model.model."


def hf_truth(fixture: Path) -> dict[str, torch.Tensor]:
    """The trainer's fp32 weights under HF names (PEFT's base_layer and prefix removed), LoRA factors aside."""
    out = {}
    for k, v in load_file(fixture / "truth.safetensors").items():
        if ".lora_" not in k:
            out[k.removeprefix(PEFT).replace(".base_layer.", ".")] = v
    return out


def lora_truth(fixture: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    t = load_file(fixture / "truth.safetensors")
    mods = {k.removeprefix(PEFT).split(".lora_A.")[0] for k in t if ".lora_A." in k}
    return {m: (t[f"{PEFT}{m}.lora_A.default.weight"], t[f"{PEFT}{m}.lora_B.default.weight"]) for m in mods}


def merged_truth(fixture: Path, base: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """bf16(W + s * B @ A) in fp32, one rounding, for every targeted weight; the rest rounded once."""
    out = {k: v.to(torch.float32).to(torch.bfloat16) for k, v in base.items()}
    for m, (a, b) in lora_truth(fixture).items():
        w = base[m + ".weight"].to(torch.float32)
        out[m + ".weight"] = (w + scale * (b @ a)).to(torch.bfloat16)
    return out


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("fixture", [LORA, LORA1, FULL], ids=lambda p: p.name)
def test_every_tensor_assembled_from_the_ranks_shards_is_the_trainers_own(fixture):
    truth = load_file(fixture / "truth.safetensors")
    with VerlCheckpoint.open(fixture / "checkpoints") as ckpt:
        src = ckpt.by_key()
        assert sorted(src.names()) == sorted(truth)
        for k in src.names():
            assert torch.equal(src.read_tensor(k), truth[k]), k
        assert {e.placement for e in ckpt.entries.values()} == {"shard(0)"}


@pytest.mark.parametrize("where", ["checkpoints", "checkpoints/global_step_2", str(ACTOR)])
def test_inspect_names_a_verl_checkpoint_from_its_run_dir_step_dir_or_actor_dir(where):
    r = run("inspect", LORA / where, "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.output)
    assert rep["format"] == "verl" and rep["world_size"] == 2 and rep["fsdp_version"] == 2 and rep["step"] == 2
    assert rep["training"] == "LoRA" and rep["lora"]["modules"] == 14 and rep["lora"]["rank"] == 8
    assert rep["lora"]["alpha"] == 16 and rep["lora"]["alpha_source"].endswith("lora_train_meta.json")
    assert rep["optimizer"]["lr"] == 0.01 and rep["scheduler"]["last_epoch"] == 2


def test_inspect_text_and_keys_of_a_full_fine_tune():
    r = run("inspect", FULL / "checkpoints")
    assert r.exit_code == 0 and "verl (FSDPCheckpointManager) checkpoint" in r.output and "full fine-tune" in r.output
    r = run("inspect", FULL / ACTOR, "--keys", "--json")
    rows = json_payload(r.output)
    assert len(rows) == 27 and all(row["placement"] == "shard(0)" and row["pieces"] == 2 for row in rows)


@pytest.mark.parametrize("fixture", [LORA, FULL], ids=lambda p: p.name)
def test_verify_deep_checks_every_zip_record_of_every_rank_file(fixture):
    r = run("verify", "--deep", fixture / "checkpoints", "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.output)
    assert rep["ok"] and rep["format"] == "verl" and rep["checked"]["records"] > 100


@pytest.mark.parametrize("fixture, alpha", [(LORA, 16), (LORA1, 32)], ids=["fsdp2", "fsdp1"])
def test_extract_adapter_writes_the_trained_factors_with_the_runs_own_alpha(fixture, alpha, tmp_path):
    r = run("extract-adapter", fixture / "checkpoints", tmp_path / "a", "--base", fixture / "base")
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == alpha
    got = load_file(tmp_path / "a" / "adapter_model.safetensors")
    for m, (a, b) in lora_truth(fixture).items():
        assert torch.equal(got[f"{PEFT}{m}.lora_A.weight"], a) and torch.equal(got[f"{PEFT}{m}.lora_B.weight"], b), m


def test_the_extracted_adapter_loads_in_peft_and_gives_the_trainers_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert run("extract-adapter", LORA / "checkpoints", tmp_path / "a", "--base", LORA / "base").exit_code == 0
    model = AutoModelForCausalLM.from_pretrained(LORA / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(model, tmp_path / "a")
    truth = load_file(LORA / "truth.safetensors")
    sd = model.state_dict()
    for k, v in truth.items():
        assert torch.equal(sd[k], v), k


def test_merge_into_the_hf_base_is_bit_exact(tmp_path):
    r = run("merge", LORA / "base", LORA / "checkpoints", tmp_path / "m")
    assert r.exit_code == 0, r.output
    base = load_file(LORA / "base" / "model.safetensors")
    want = merged_truth(LORA, {k: v.float() for k, v in base.items()}, 2.0)
    want.update({k: v for k, v in base.items() if k not in {m + ".weight" for m in lora_truth(LORA)}})
    assert_equal(load_file(tmp_path / "m" / "model.safetensors"), want)


@pytest.mark.parametrize("how", ["export", "merge --base-from-checkpoint"])
def test_merge_from_the_checkpoints_fp32_masters_is_bit_exact(how, tmp_path):
    args = ["export"] if how == "export" else ["merge", "--base-from-checkpoint"]
    r = run(*args, LORA1 / "checkpoints", tmp_path / "m")
    assert r.exit_code == 0, r.output
    assert_equal(load_file(tmp_path / "m" / "model.safetensors"), merged_truth(LORA1, hf_truth(LORA1), 4.0))
    # config and generation config from the run's own huggingface/
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen2"


def test_export_of_a_full_fine_tune_is_the_trained_weights(tmp_path):
    r = run("export", FULL / "checkpoints", tmp_path / "e")
    assert r.exit_code == 0, r.output
    want = {k: v.to(torch.bfloat16) for k, v in hf_truth(FULL).items()}
    assert_equal(load_file(tmp_path / "e" / "model.safetensors"), want)
    r = run("export", FULL / "checkpoints", tmp_path / "f", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    assert_equal(load_file(tmp_path / "f" / "model.safetensors"), hf_truth(FULL))


def test_diff_vs_base_proves_verls_own_merge_left_the_base_unchanged(tmp_path):
    """verl's model_merger (run on this checkpoint: the fixture's verl_merged/) writes the base and splits the
    LoRA off (verl #7285): diff-vs-base says so, exit 3; ours differs; the adapter check fails on verl's."""
    r = run("diff-vs-base", LORA / "verl_merged", LORA / "base")
    assert r.exit_code == 3, r.output
    assert "identical to base" in r.output and "LoRA was not merged" in r.output
    assert run("merge", LORA / "base", LORA / "checkpoints", tmp_path / "m").exit_code == 0
    r = run("diff-vs-base", tmp_path / "m", LORA / "base", "--adapter", LORA / "checkpoints")
    assert r.exit_code == 0, r.output
    r = run("diff-vs-base", LORA / "verl_merged", LORA / "base", "--adapter", LORA / "checkpoints")
    assert r.exit_code == 3 and "the adapter check FAILED (14 targeted tensors are not W0 + s*B@A)" in r.output


def test_diff_vs_base_of_the_checkpoint_itself_reads_its_masters():
    r = run("diff-vs-base", FULL / "checkpoints", FULL / "base", "--json")
    assert r.exit_code == 0, r.output
    assert json_payload(r.output)["verdict"].startswith("differs")


def test_chunk_span_is_torch_chunk():
    for n in (0, 1, 5, 8, 9):
        for world in (1, 2, 3, 4):
            pieces = [chunk_span(n, world, r) for r in range(world)]
            want = [len(c) for c in torch.arange(n).chunk(world)] if n else []
            assert [ln for _s, ln in pieces if ln] == [w for w in want if w]
            assert sum(ln for _s, ln in pieces) == n


def copy_actor(tmp_path: Path, fixture: Path = LORA) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(fixture / "checkpoints", dst)
    for p in dst.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return dst / "global_step_2" / "actor"


def test_without_lora_train_meta_alpha_is_never_guessed(tmp_path):
    actor = copy_actor(tmp_path)
    (actor / "lora_train_meta.json").unlink()
    r = run("extract-adapter", actor, tmp_path / "a")
    assert r.exit_code != 0 and "not alpha" in r.output and "--alpha" in r.output
    r = run("extract-adapter", actor, tmp_path / "a", "--alpha", "16")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["lora_alpha"] == 16


def test_a_damaged_storage_record_is_found_by_verify_and_refused_by_merge(tmp_path):
    actor = copy_actor(tmp_path)
    with VerlCheckpoint.open(actor) as ckpt:
        piece = ckpt.entries[f"{PEFT}model.layers.0.self_attn.q_proj.lora_B.default.weight"].pieces[0]
    f = actor / piece.file
    data = bytearray(f.read_bytes())
    data[piece.record.offset + 4] ^= 0x40
    f.write_bytes(data)
    r = run("verify", "--deep", actor)
    assert r.exit_code != 0 and "CRC-32" in r.output
    with VerlCheckpoint.open(actor) as ckpt, pytest.raises(ChecksumError):
        ckpt.by_key().read_tensor(f"{PEFT}model.layers.0.self_attn.q_proj.lora_B.default.weight")
    r = run("merge", LORA / "base", actor, tmp_path / "m")
    assert r.exit_code != 0 and "CRC-32" in r.output and not (tmp_path / "m").exists()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_rank_file_naming_a_global_outside_the_allow_list_is_refused_before_anything_runs(tmp_path):
    actor = copy_actor(tmp_path, FULL)
    torch.save({"model.norm.weight": _Evil()}, actor / "model_world_size_2_rank_1.pt")
    with pytest.raises(UnsafePickleError, match="refusing to unpickle global posix.system"):
        VerlCheckpoint.open(actor)
    r = run("inspect", actor)
    assert r.exit_code != 0 and "posix.system" in r.output


def test_ranks_that_disagree_and_a_missing_rank_file_are_errors_naming_the_file(tmp_path):
    actor = copy_actor(tmp_path, FULL)
    torch.save({"model.norm.weight": torch.zeros(64)}, actor / "model_world_size_2_rank_1.pt")
    with pytest.raises(FormatError, match="different keys"):
        VerlCheckpoint.open(actor)
    (actor / "model_world_size_2_rank_1.pt").unlink()
    r = run("inspect", actor)
    assert r.exit_code != 0 and "model_world_size_2_rank_1.pt" in r.output


def test_an_unknown_key_layout_is_an_error_naming_the_key(tmp_path):
    actor = copy_actor(tmp_path, FULL)
    for rank in (0, 1):
        torch.save({"model.norm.scale_and_shift": torch.zeros(1)}, actor / f"model_world_size_2_rank_{rank}.pt")
    r = run("inspect", actor)
    assert r.exit_code != 0 and "model.norm.scale_and_shift" in r.output and "key layout" in r.output


@pytest.mark.parametrize("fixture", [LORA, LORA1, FULL, FIXTURES / "verl-fsdp2-hsdp-lora"],
                         ids=["fsdp2-lora", "fsdp1-lora", "fsdp2-full", "fsdp2-hsdp-lora"])
def test_the_format_reference_names_every_file_verl_wrote(fixture):
    """docs/reference/verl-format.md's table of the role dir, against what verl's FSDPCheckpointManager wrote:
    each file matches a row (W and R: the world size and rank), and the JSON files hold the fields it says."""
    doc = (Path(__file__).parent.parent / "docs" / "reference" / "verl-format.md").read_text()
    rows = [line.split("|")[1].strip().strip("`") for line in doc.splitlines() if line.startswith("| `")]
    patterns = [r.replace("W", r"\d+").replace("R", r"\d+").rstrip("/") for r in rows]
    actor = fixture / ACTOR
    for f in sorted(os.listdir(actor)):
        assert any(re.fullmatch(p, f) for p in patterns), f"{f} is in no row of the reference's table: {rows}"
    assert any(re.fullmatch(p, "../../latest_checkpointed_iteration.txt") for p in patterns)
    assert (actor / "../../latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert set(json.loads((actor / "fsdp_config.json").read_text())) == {"FSDP_version", "world_size"}
    if fixture != FULL:
        meta = json.loads((actor / "lora_train_meta.json").read_text())
        assert set(meta) == {"r", "lora_alpha", "task_type"} and type(meta["lora_alpha"]) is int
        assert '`{"r", "lora_alpha", "task_type"}`' in doc


HSDP = FIXTURES / "verl-fsdp2-hsdp-lora"


def test_an_hsdp_checkpoint_is_read_from_one_replicas_shards():
    """verl's HSDP (`fsdp_size` 2 of 4 ranks: `create_device_mesh` -> ("ddp", "fsdp"), each weight
    (Replicate(), Shard(0))): the ddp-0 ranks' shards, placed by each rank's coordinates, are the trainer's
    weights."""
    truth = load_file(HSDP / "truth.safetensors")
    with VerlCheckpoint.open(HSDP / "checkpoints") as ckpt:
        assert ckpt.world_size == 4
        src = ckpt.by_key()
        assert sorted(src.names()) == sorted(truth)
        for k in src.names():
            assert torch.equal(src.read_tensor(k), truth[k]), k
        assert {e.placement for e in ckpt.entries.values()} == {"replicate,shard(0)"}
        assert {tuple(sorted(p.file for p in e.pieces)) for e in ckpt.entries.values()} == {
            ("model_world_size_4_rank_0.pt", "model_world_size_4_rank_1.pt")}


def test_an_hsdp_checkpoint_verifies_extracts_and_merges_exactly(tmp_path):
    r = run("verify", "--deep", HSDP / "checkpoints", "--json")
    assert r.exit_code == 0 and json_payload(r.output)["checked"]["ranks"] == 4, r.output
    r = run("extract-adapter", HSDP / "checkpoints", tmp_path / "a")
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "a" / "adapter_model.safetensors")
    for m, (a, b) in lora_truth(HSDP).items():
        assert torch.equal(got[f"{PEFT}{m}.lora_A.weight"], a) and torch.equal(got[f"{PEFT}{m}.lora_B.weight"], b), m
    r = run("merge", HSDP / "base", HSDP / "checkpoints", tmp_path / "m")
    assert r.exit_code == 0, r.output
    base = load_file(HSDP / "base" / "model.safetensors")
    want = merged_truth(HSDP, {k: v.float() for k, v in base.items()}, 2.0)
    want.update({k: v for k, v in base.items() if k not in {m + ".weight" for m in lora_truth(HSDP)}})
    assert_equal(load_file(tmp_path / "m" / "model.safetensors"), want)


def test_hsdp_rank_files_out_of_place_are_refused_not_misread(tmp_path):
    """Rank 0's and rank 1's model files swapped: each says where on the mesh it was saved, so the shards are
    not placed by the file names."""
    run_dir = tmp_path / "run"
    shutil.copytree(HSDP / "checkpoints", run_dir)
    actor = run_dir / "global_step_2" / "actor"
    r0, r1 = actor / "model_world_size_4_rank_0.pt", actor / "model_world_size_4_rank_1.pt"
    r0.rename(tmp_path / "x")
    r1.rename(r0)
    (tmp_path / "x").rename(r1)
    r = run("inspect", run_dir)
    assert r.exit_code != 0 and "mesh coordinates are (0, 1); rank 0 of mesh [2, 2] is at [0, 0]" in r.output, r.output
