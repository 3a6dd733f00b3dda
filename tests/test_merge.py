"""`ckpt merge` on the genuine prime-rl fixture: bit-equality with the shipped ground truth, the
three ways in (DCP adapter, PEFT adapter, --base-from-checkpoint), logits against PEFT, the plan,
refusals, and what is left behind when a merge is killed."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tools.cli import main
from ckpt_tools.core.tensor_math import merge_weight, merge_weight_into
from ckpt_tools.core.progress import ProgressEvent
import ckpt_tools

from .conftest import BASE, FIXTURE, REPO, TRAINER

EXPECTED = FIXTURE / "expected_merged_hf"
PEFT_REF = FIXTURE / "reference_peft_adapter"
WEIGHTS_STEP = FIXTURE / "outputs" / "weights" / "step_3"
REFERENCE = FIXTURE / "reference.safetensors"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tree_digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def assert_tensors_equal_expected(out: Path) -> None:
    got, want = load_file(out / "model.safetensors"), load_file(EXPECTED / "model.safetensors")
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.bfloat16, k
        assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), k


@pytest.fixture(scope="module")
def merged_from_dcp(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("m") / "merged"
    before = tree_digest(FIXTURE / "outputs")
    r = run("merge", BASE, TRAINER, out)
    assert r.exit_code == 0, r.output
    assert tree_digest(FIXTURE / "outputs") == before     # inputs untouched
    return out


# ----------------------------------------------------------------------------- ground truth


def test_merging_the_dcp_checkpoint_reproduces_expected_merged_hf_bit_for_bit(merged_from_dcp):
    assert_tensors_equal_expected(merged_from_dcp)
    # same tensors, same layout and metadata as safetensors' own save_file: the very same bytes
    assert (merged_from_dcp / "model.safetensors").read_bytes() == (EXPECTED / "model.safetensors").read_bytes()
    with safe_open(merged_from_dcp / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # non-weight files come from the base unchanged (it is already bf16)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja"):
        assert (merged_from_dcp / name).read_bytes() == (BASE / name).read_bytes(), name
    assert not list(merged_from_dcp.parent.glob(".merged.*"))   # no temp dir or lock left beside OUT


def test_every_projection_differs_from_the_base_and_nothing_else_does(merged_from_dcp):
    got, base = load_file(merged_from_dcp / "model.safetensors"), load_file(BASE / "model.safetensors")
    changed = {k for k in base if not torch.equal(got[k], base[k])}
    assert changed == {f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight"
                       for i in range(3) for p in PROJ}


def test_merging_the_reference_peft_adapter_gives_the_same_bytes(tmp_path):
    r = run("merge", BASE, PEFT_REF, tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (EXPECTED / "model.safetensors").read_bytes()


def test_base_from_checkpoint_gives_the_same_tensors_with_a_bf16_config(tmp_path):
    out = tmp_path / "out"
    r = run("merge", "--base-from-checkpoint", TRAINER, out, "--config-from", WEIGHTS_STEP)
    assert r.exit_code == 0, r.output
    assert "0 tensors copied, 15 cast" in r.output   # fp32 masters rounded exactly once (exact: bf16 upcasts)
    assert_tensors_equal_expected(out)
    cfg, src = json.loads((out / "config.json").read_text()), json.loads((WEIGHTS_STEP / "config.json").read_text())
    assert src["dtype"] == "float32" and cfg["dtype"] == "bfloat16"
    assert {k: v for k, v in cfg.items() if k != "dtype"} == {k: v for k, v in src.items() if k != "dtype"}
    assert (out / "tokenizer_config.json").read_bytes() == (WEIGHTS_STEP / "tokenizer_config.json").read_bytes()
    assert not (out / "lora_adapters").exists()


def test_rerun_is_byte_identical_including_shards_and_index(tmp_path):
    outs = []
    for i in range(2):
        out = tmp_path / f"o{i}"
        r = run("merge", BASE, TRAINER, out, "--max-shard-size", "120KB", "--threads", str(i + 1))
        assert r.exit_code == 0, r.output
        outs.append(out)
    names = sorted(p.name for p in outs[0].iterdir())
    assert "model.safetensors.index.json" in names and "model-00001-of-00005.safetensors" in names
    assert tree_digest(outs[0]) == tree_digest(outs[1])
    index = json.loads((outs[0] / "model.safetensors.index.json").read_text())
    merged = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load_file(outs[0] / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 120_000 or len(part) == 1
        merged.update(part)
    want = load_file(EXPECTED / "model.safetensors")
    assert merged.keys() == want.keys() and all(torch.equal(merged[k], want[k]) for k in want)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in want.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in want.values())


# ----------------------------------------------------------------------------- logits


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids)).logits


def test_fp32_merge_logits_match_peft_merge_and_unload_within_1e5(tmp_path, merged_from_dcp):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    r = run("merge", BASE, TRAINER, tmp_path / "fp32", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    ids = load_file(REFERENCE)["ref_input_ids"]
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32),
                                     PEFT_REF).merge_and_unload().eval()
    base = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    lo, lp, lb = _logits(ours, ids), _logits(peft, ids), _logits(base, ids)
    assert (lo - lp).abs().max().item() <= 1e-5
    assert (lo - lb).abs().max().item() > 0.1          # the LoRA is really in there
    # our bf16 output, computed in fp32, is the fixture's "merged_hf_bf16weights_fp32compute"
    bf16 = AutoModelForCausalLM.from_pretrained(merged_from_dcp, dtype=torch.float32).eval()
    ref = load_file(REFERENCE)["logits.merged_hf_bf16weights_fp32compute.adapter0"]
    assert (_logits(bf16, ids) - ref).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------- the plan


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    r = run("merge", BASE, TRAINER, out, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    plan = doc["plan"]
    assert doc["dry_run"] is True and not out.exists() and list(tmp_path.iterdir()) == []
    assert plan["merged_modules"] == 21 and plan["counts"] == {"merge": 21, "copy": 15, "cast": 0, "replace": 0}
    assert plan["adapter"]["scale"] == 2.0 and "orch.toml" in plan["adapter"]["alpha_source"]
    merges = {j["module"]: j for j in plan["jobs"] if j["action"] == "merge"}
    assert merges["model.layers.0.mlp.gate_proj"]["rank"] == 8 and merges["model.layers.0.mlp.gate_proj"]["scale"] == 2.0
    assert [s["file_name"] for s in plan["shards"]] == ["model.safetensors"]
    assert plan["write_bytes"] >= (EXPECTED / "model.safetensors").stat().st_size
    assert plan["read_bytes"] >= (BASE / "model.safetensors").stat().st_size - 8 - 4096
    assert 0 < plan["memory_bound_bytes"] < 2 * (BASE / "model.safetensors").stat().st_size
    text = run("merge", BASE, TRAINER, out, "--dry-run")
    assert text.exit_code == 0 and "21 merged, 15 copied verbatim" in text.output and not out.exists()


def test_alpha_flag_overrides_the_run_config(tmp_path):
    r = run("merge", BASE, TRAINER, tmp_path / "o", "--alpha", "8", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]
    assert plan["adapter"]["scale"] == 1.0 and plan["adapter"]["alpha_source"] == "--alpha"


def test_progress_callback_reports_every_tensor_and_all_bytes(tmp_path):
    events: list[ProgressEvent] = []
    plan = ckpt_tools.merge(BASE, PEFT_REF, tmp_path / "o", progress=events.append, max_shard_size="150KB").plan
    assert [e.done for e in events] == list(range(len(plan.jobs) + 1))
    assert events[-1].bytes_done == events[-1].bytes_total == sum(j.out_bytes for j in plan.jobs)


def test_no_tensor_is_read_whole_merges_go_in_row_blocks_untouched_ones_by_the_kernel(tmp_path, monkeypatch):
    from ckpt_tools.formats.safetensors.writer import StreamingSafetensorsWriter
    from ckpt_tools.formats.hf_dir.model_dir import HFModelDir

    reads, copied = [], []
    real_read, real_copy = HFModelDir.read_into, StreamingSafetensorsWriter.copy_range_from
    monkeypatch.setattr(HFModelDir, "read_into", lambda self, name, buf, rows=None: reads.append((name, rows)) or
                        real_read(self, name, buf, rows))
    monkeypatch.setattr(StreamingSafetensorsWriter, "copy_range_from", lambda self, n, *a, **kw:
                        copied.append((n, real_copy(self, n, *a, **kw))))
    monkeypatch.setattr("ckpt_tools.ops.merge.plan.MERGE_BLOCK_ELEMS", 64 * 64)   # 64-row blocks here
    plan = ckpt_tools.merge(BASE, PEFT_REF, tmp_path / "o").plan
    merged = {j.name: j for j in plan.jobs if j.action == "merge"}
    assert {n for n, _ in reads} == set(merged) and len(merged) == 21      # only merged weights are read
    for name, j in merged.items():   # in row blocks of 64 (a tail under 64 rows joins the last block)
        blocks = [r for n, r in reads if n == name]
        rows = j.shape[0]
        assert [s for s, _ in blocks] == [sum(c for _, c in blocks[:k]) for k in range(len(blocks))]
        assert sum(c for _, c in blocks) == rows, (name, blocks)
        assert all(64 <= c < 128 for _, c in blocks) if rows >= 64 else blocks == [(0, rows)], (name, blocks)
    assert any(len([r for n, r in reads if n == name]) > 1 for name in merged)
    copies = {n for n, _ in copied}
    assert copies == {j.name for j in plan.jobs if j.action == "copy"} >= {"model.embed_tokens.weight", "lm_head.weight"}
    assert {m for _, m in copied} == {"copy_file_range"}                   # in the kernel, on this machine
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == (EXPECTED / "model.safetensors").read_bytes()


def test_copy_range_falls_back_to_pread_pwrite_where_the_kernel_refuses(tmp_path, monkeypatch):
    import errno

    from ckpt_tools.core.errors import TruncatedFileError
    from ckpt_tools.io.copy import copy_range

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(bytes(range(256)) * 1000)
    fs, fd = os.open(src, os.O_RDONLY), os.open(dst, os.O_CREAT | os.O_WRONLY)
    try:
        assert copy_range(fs, 1000, fd, 8, 100_000, path=src, block_bytes=4096) == "copy_file_range"

        def refuse(*a):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", refuse)
        assert copy_range(fs, 1000, fd, 100_008, 100_000, path=src, block_bytes=4096) == "pread+pwrite"
    finally:
        os.close(fd)
    data = src.read_bytes()
    assert dst.read_bytes() == b"\0" * 8 + data[1000:101_000] + data[1000:101_000]
    fd = os.open(tmp_path / "short", os.O_CREAT | os.O_WRONLY)
    try:   # the source ends inside the range: a named error, not a short copy
        with pytest.raises(TruncatedFileError, match="ended"):
            copy_range(fs, 200_000, fd, 0, 100_000, path=src, block_bytes=4096)
    finally:
        os.close(fs), os.close(fd)


def test_blocked_merge_is_bit_identical_to_merge_weight():
    torch.manual_seed(0)
    for shape, r, fifo in (((162, 64), 8, False), ((64, 162), 8, False), ((64, 162), 4, True), ((7, 3), 1, False)):
        w = torch.randn(shape).to(torch.bfloat16)
        out_f, in_f = (shape[1], shape[0]) if fifo else shape
        a, b = torch.randn(r, in_f), torch.randn(out_f, r)
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            want = merge_weight(w, a, b, 0.37, out_dtype=dt, fan_in_fan_out=fifo)
            for block in (1, 100, 1 << 18):
                got = merge_weight_into(torch.empty(shape, dtype=dt), w, a, b, 0.37, fan_in_fan_out=fifo,
                                        block_elems=block, scratch=torch.empty(shape[0] * shape[1] + 3))
                assert torch.equal(got, want), (shape, dt, block)


# ----------------------------------------------------------------------------- refusals


def test_missing_alpha_is_an_error_that_says_how_to_pass_it(tmp_path):
    ckpt = tmp_path / "trainer"
    shutil.copytree(TRAINER, ckpt)            # no orch.toml anywhere near it
    r = run("merge", BASE, ckpt, tmp_path / "out")
    assert r.exit_code == 1
    assert "--alpha" in r.output and "--run-config" in r.output and not (tmp_path / "out").exists()


def test_adapter_from_another_model_is_refused_naming_the_mismatch(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(BASE)
    cfg.intermediate_size = 96
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / "other")
    r = run("merge", tmp_path / "other", PEFT_REF, tmp_path / "out")
    assert r.exit_code == 1
    assert "does not fit this base" in r.output and "mlp.gate_proj.weight" in r.output and "[96, 64]" in r.output
    r = run("merge", tmp_path / "other", TRAINER, tmp_path / "out")
    assert r.exit_code == 1 and "not trained on this base" in r.output
    assert not (tmp_path / "out").exists()


def test_dora_adapter_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)).save_pretrained(tmp_path / "dora")
    r = run("merge", BASE, tmp_path / "dora", tmp_path / "out")
    assert r.exit_code == 1 and "use_dora" in r.output and not (tmp_path / "out").exists()


def test_non_finite_merge_result_is_refused_naming_the_tensor(tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(PEFT_REF, bad)
    sd = load_file(bad / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    sd[key][3, 2] = float("inf")
    save_file(sd, bad / "adapter_model.safetensors", metadata={"format": "pt"})
    r = run("merge", BASE, bad, tmp_path / "out")
    assert r.exit_code == 1
    assert "model.layers.1.mlp.up_proj.weight" in r.output and "non-finite" in r.output
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [bad]


def test_truncated_base_shard_is_refused_before_writing(fixture_copy, tmp_path):
    st = fixture_copy / "base_model" / "model.safetensors"
    with open(st, "r+b") as f:
        f.truncate(st.stat().st_size - 100)
    r = run("merge", fixture_copy / "base_model", PEFT_REF, tmp_path / "out")
    assert r.exit_code == 1 and "model.safetensors" in r.output and "truncated" in r.output
    assert not (tmp_path / "out").exists()


def test_output_rules_existing_inside_input_and_missing_config_from(tmp_path):
    (tmp_path / "exists").mkdir()
    r = run("merge", BASE, TRAINER, tmp_path / "exists")
    assert r.exit_code == 1 and "already exists" in r.output
    r = run("merge", BASE, PEFT_REF, PEFT_REF / "merged")
    assert r.exit_code == 2 and "inside input" in r.output and not (PEFT_REF / "merged").exists()
    r = run("merge", "--base-from-checkpoint", TRAINER, tmp_path / "o")
    assert r.exit_code == 2 and "--config-from" in r.output and "weights/step_3" in r.output
    r = run("merge", TRAINER, tmp_path / "o")
    assert r.exit_code == 2 and "BASE ADAPTER OUT" in r.output


def test_hub_id_is_resolved_from_the_local_cache_only(tmp_path, monkeypatch):
    # the cache layout huggingface_hub reads (refs/main -> snapshots/<rev>/ symlinks into blobs/)
    cache = tmp_path / "cache"
    repo = cache / "models--acme--tiny"
    rev = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    (repo / "snapshots" / rev).mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in BASE.iterdir():
        shutil.copyfile(f, repo / "blobs" / f.name)
        (repo / "snapshots" / rev / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))     # read at import time, maybe already
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    r = run("merge", "acme/tiny", TRAINER, tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (EXPECTED / "model.safetensors").read_bytes()
    assert not (tmp_path / "out" / "config.json").is_symlink()
    r = run("merge", "Qwen/Qwen3-NotDownloaded", PEFT_REF, tmp_path / "out2")
    assert r.exit_code == 1 and "Qwen/Qwen3-NotDownloaded" in r.output and "download" in r.output


# ----------------------------------------------------------------------------- interruption


def _spawn(out: Path, *extra: str, slow: str = "0.5") -> subprocess.Popen:
    env = dict(os.environ, CKPT_TOOLS_TEST_SLOW_WRITE=slow, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "ckpt_tools", "merge", str(BASE), str(TRAINER), str(out),
                             "--max-shard-size", "100KB", "--json", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_temp(out: Path, proc: subprocess.Popen) -> Path:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        tmps = [p for p in out.parent.glob(f".{out.name}.tmp-*") if any(p.glob("model-*.safetensors"))]
        if tmps:
            return tmps[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the merge never started writing")


def test_killed_merge_leaves_no_output_and_a_rerun_matches_a_clean_run(tmp_path):
    out = tmp_path / "merged"
    proc = _spawn(out)
    tmp = _wait_for_temp(out, proc)
    proc.kill()                                   # SIGKILL: no cleanup code runs at all
    proc.wait()
    assert not out.exists() and tmp.exists()      # a hidden temp dir, never a partial OUT
    r = run("merge", BASE, TRAINER, out, "--max-shard-size", "100KB")
    assert r.exit_code == 0, r.output
    assert not tmp.exists()                       # the dead run's temp dir was cleaned up
    clean = tmp_path / "clean"
    assert run("merge", BASE, TRAINER, clean, "--max-shard-size", "100KB").exit_code == 0
    assert tree_digest(out) == tree_digest(clean)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean", "merged"]


def test_terminated_merge_removes_its_temp_dir(tmp_path):
    out = tmp_path / "merged"
    proc = _spawn(out)
    _wait_for_temp(out, proc)
    proc.send_signal(signal.SIGTERM)          # Ctrl-C takes the same path (KeyboardInterrupt)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert b"nothing was written" in err
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- the script


def test_merge_lora_script_is_the_same_command(tmp_path, capsys):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    script = REPO / "scripts" / "merge_lora.py"
    p = subprocess.run([sys.executable, str(script), "--base-from-checkpoint", str(TRAINER), str(tmp_path / "o"),
                        "--config-from", str(WEIGHTS_STEP), "--json"], env=env, capture_output=True, text=True,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["result"]["merged_modules"] == 21
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == (EXPECTED / "model.safetensors").read_bytes()
    # its error edge, in process: one line, the exit code of the error
    import runpy

    script_main = runpy.run_path(str(script))["main"]
    assert script_main([str(BASE), str(TRAINER), str(tmp_path / "o")]) == 1
    assert script_main(["--bogus"]) == 2
    assert "already exists" in capsys.readouterr().err
