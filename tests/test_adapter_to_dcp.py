"""`ckpt adapter-to-dcp`: the checkpoint it writes is loaded by torch's DCP loader with the default
(strict) planner into a 4-rank FSDP2 model holding the prime-rl LoRA wrapper, AdamW and the
scheduler (`tests.factory.fsdp_check.load_strict`), and every restored value is compared.
Also: `primerl_state` reproduces the genuine checkpoint's non-tensor state, round trips, errors."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_tools.cli import main
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.formats.dcp.model import TensorEntry
from ckpt_tools.formats.dcp.layout import data_file_name, row_chunks
from ckpt_tools.core.keys import classify
from ckpt_tools.core.primerl_state import SchedulerSpec, build_optim_state, flat_key, flatten_state, optimizer_param_order, progress_state

from .conftest import BASE, FIXTURE, TRAINER, json_payload
from .test_extract_adapter import other_base  # noqa: F401

REF_ADAPTER = FIXTURE / "reference_peft_adapter"
REFERENCE = FIXTURE / "reference.safetensors"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _spec(scheduler: str):
    from tests.factory.factory import FactorySpec

    return FactorySpec(num_layers=3, scheduler=scheduler)   # the genuine fixture's shapes, LoRA r=8


def _base_fp32() -> dict[str, torch.Tensor]:
    with safe_open(str(BASE / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k).float() for k in f.keys()}


def _adapter_as_primerl() -> dict[str, torch.Tensor]:
    pre = "base_model.model."
    return {k[len(pre):].replace(".lora_A.weight", ".lora_A.0").replace(".lora_B.weight", ".lora_B.0"): v
            for k, v in load_file(str(REF_ADAPTER / "adapter_model.safetensors")).items()}


def _check_model(model: dict[str, torch.Tensor]) -> None:
    expected = {**_base_fp32(), **_adapter_as_primerl()}
    assert set(model) == set(expected)
    for k, v in expected.items():
        assert model[k].dtype == torch.float32 and torch.equal(model[k], v), k


# ------------------------------------------------------------------------------------ fresh
@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    from tests.factory.fsdp_check import load_strict

    out = tmp_path_factory.mktemp("a2d") / "step_3" / "trainer"
    r = run("adapter-to-dcp", REF_ADAPTER, out, "--base", BASE, "--lr", "1e-3", "--step", "3",
            "--scheduler", "linear", "--warmup-steps", "2", "--scheduler-step", "0", "--json")
    assert r.exit_code == 0, r.output
    return out, json_payload(r.stdout), load_strict(out, BASE, _spec("linear"), world_size=4, steps_after=3)


def test_fresh_checkpoint_loads_strictly_into_4_rank_fsdp2_with_every_value_exact(fresh):
    out, rep, loaded = fresh
    _check_model(loaded["model"])
    optim = loaded["optim"]
    assert len(optim) == 3 * 42
    for k, v in optim.items():
        assert torch.count_nonzero(v) == 0, k          # zero moments, step 0: a never-stepped AdamW
    assert loaded["progress"] == {"step": 3, "total_tokens": 0, "total_samples": 0}
    (group,) = loaded["param_groups"]
    assert group["initial_lr"] == 1e-3 and group["weight_decay"] == 0.01 and group["betas"] == [0.9, 0.999]
    assert group["eps"] == 1e-8 and group["decoupled_weight_decay"] is True
    # the warmup restarts at the resume: lr 1e-3 * 1e-8 now, then torch's own LinearLR sequence
    assert loaded["lr"] == rep["lr_now"] == pytest.approx(1e-11)
    assert loaded["lr_trace"] == rep["lr_next"][:3]
    assert loaded["scheduler"]["last_epoch"] == 0 and loaded["scheduler"]["total_iters"] == 2


def test_fresh_checkpoint_has_the_genuine_key_set_and_world_size_row_chunks(fresh):
    out, rep, _ = fresh
    ours, genuine = DcpCheckpoint.open(out), DcpCheckpoint.open(TRAINER)
    assert set(ours.entries) == set(genuine.entries)        # 229 keys, the same as prime-rl's own save
    for k, e in ours.entries.items():
        g = genuine.entries[k]
        assert type(e) is type(g) and e.path == g.path, k
        if isinstance(e, TensorEntry):
            assert e.shape == g.shape and e.dtype == g.dtype == "float32", k
            if e.shape:
                want = [(s, n) for s, n in row_chunks(e.shape[0], 4)]
                assert [(c.offsets[0], c.sizes[0]) for c in e.chunks] == want, k
                assert [c.file for c in e.chunks] == [data_file_name(i) for i in range(len(want))], k
    raw = (out / ".metadata").read_bytes()
    assert b"pathlib" not in raw and ours.metadata.storage_meta.checkpoint_id is None


def test_adapter_to_dcp_then_extract_adapter_round_trips_bit_exactly(fresh, tmp_path):
    out, _, _ = fresh
    r = run("extract-adapter", out, tmp_path / "back", "--alpha", "16", "--base", BASE)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "back/adapter_model.safetensors").read_bytes() == \
        (REF_ADAPTER / "adapter_model.safetensors").read_bytes()
    cfg = json.loads((tmp_path / "back/adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0


# ------------------------------------------------------------------------------------ carried optimizer
@pytest.fixture(scope="module")
def carried(tmp_path_factory):
    from tests.factory.fsdp_check import load_strict

    out = tmp_path_factory.mktemp("a2d_opt") / "trainer"
    r = run("adapter-to-dcp", REF_ADAPTER, out, "--base", BASE, "--optimizer-from", TRAINER, "--lr", "5e-3",
            "--step", "7", "--world-size", "3", "--json")
    assert r.exit_code == 0, r.output
    return out, json_payload(r.stdout), load_strict(out, BASE, _spec("constant"), world_size=4, steps_after=2)


def test_optimizer_from_carries_the_source_moments_exactly(carried):
    out, rep, loaded = carried
    _check_model(loaded["model"])
    with safe_open(str(REFERENCE), "pt") as f:
        ref = {k[len("optim.adapter0."):]: f.get_tensor(k) for k in f.keys() if k.startswith("optim.adapter0.")}
    assert set(loaded["optim"]) == set(ref) and len(ref) == 126
    for k, v in ref.items():
        assert torch.equal(loaded["optim"][k], v), k
    assert float(loaded["optim"]["model.layers.0.self_attn.q_proj.lora_A.0.step"]) == 3.0
    assert loaded["lr"] == 5e-3 and loaded["lr_trace"] == [5e-3, 5e-3]
    assert set(loaded["scheduler"]) >= {"factor", "total_iters"} and loaded["scheduler"]["last_epoch"] == 7
    assert loaded["progress"]["step"] == 7
    # written for 3 ranks, loaded by 4: DCP reshards; the chunks are the 3-rank ones
    e = DcpCheckpoint.open(out).entries["app.model.model.layers.0.mlp.gate_proj.weight"]
    assert [c.sizes[0] for c in e.chunks] == [54, 54, 54]


# ------------------------------------------------------------------------------------ primerl_state
def test_primerl_state_reproduces_the_genuine_checkpoints_param_groups_scheduler_and_order():
    ck = DcpCheckpoint.open(TRAINER)
    by_group: dict[str, dict] = {"param_groups": {}, "scheduler": {}, "progress": {}}
    for k, e in ck.entries.items():
        info = classify(k, e.path)
        if info.group in by_group:
            by_group[info.group][info.field] = ck.read_object(k)
    ost = build_optim_state(0.01, SchedulerSpec("linear", warmup_steps=2), 3)   # fixture A: lr 1e-2, warmup 2
    genuine_group = dict(by_group["param_groups"])
    params = genuine_group.pop("params")
    assert ost.param_group == genuine_group
    assert ost.scheduler == by_group["scheduler"]
    modules = sorted({classify(k, e.path).module for k, e in ck.entries.items() if classify(k, e.path).group == "lora"})
    assert optimizer_param_order(modules) == params
    assert progress_state(3, 192, 6) == by_group["progress"]


def test_flatten_state_makes_the_same_keys_and_paths_as_dcp():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    ost = build_optim_state(1e-5, SchedulerSpec("cosine", warmup_steps=2, max_steps=10), 4)
    state = {"app": {"optimizers": {"param_groups": [dict(ost.param_group, params=["a.lora_A.0"])]},
                     "scheduler": ost.scheduler, "progress": progress_state(4)}}
    flat, mapping = flatten_state_dict(state)
    ours = flatten_state(state)
    assert {flat_key(p): v for p, v in ours} == flat
    assert {flat_key(p): p for p, _ in ours} == mapping


@pytest.mark.parametrize("spec,msg", [
    (dict(kind="linear"), "needs warmup steps or decay steps"),
    (dict(kind="linear", decay_steps=3), "needs max_steps"),
    (dict(kind="cosine", warmup_steps=2), "needs max_steps"),
    (dict(kind="constant", warmup_steps=2), "no warmup"),
    (dict(kind="wsd"), "is not one of"),
])
def test_scheduler_specs_are_validated_with_prime_rls_rules(spec, msg):
    with pytest.raises(ValueError, match=msg):
        SchedulerSpec(**spec)


def test_a_wsd_schedule_at_a_later_position_matches_torch_stepping():
    ost = build_optim_state(2e-5, SchedulerSpec("linear", warmup_steps=2, decay_steps=4, max_steps=10), 7)
    assert ost.scheduler["_milestones"] == [2, 6] and ost.scheduler["last_epoch"] == 7
    assert ost.lr_now < 2e-5 and ost.lr_next[0] < ost.lr_now
    assert math.isclose(ost.param_group["initial_lr"], 2e-5)


# ------------------------------------------------------------------------------------ refusals
def _bad_adapter(tmp_path, **changes):
    import shutil

    d = tmp_path / "adapter"
    shutil.copytree(REF_ADAPTER, d)
    for p in d.iterdir():
        p.chmod(0o644)
    cfg = json.loads((d / "adapter_config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes,msg", [
    ({"r": None}, "has no 'r'"),
    ({"peft_type": "LOHA"}, "peft_type 'LOHA' is not supported"),
    ({"use_dora": True}, "use_dora=True"),
    ({"lora_bias": True}, "lora_bias=True"),
    ({"r": 4}, "config's rank for it is 4"),
], ids=["missing_r", "unknown_peft_type", "dora", "lora_bias", "rank_mismatch"])
def test_bad_adapters_get_one_clear_error_and_nothing_is_written(changes, msg, tmp_path):
    ad = _bad_adapter(tmp_path, **changes)
    r = run("adapter-to-dcp", ad, tmp_path / "out", "--base", BASE, "--lr", "1e-4")
    assert r.exit_code == 1 and msg in r.output, r.output
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_an_adapter_that_does_not_fit_the_base_is_refused(tmp_path, other_base):  # noqa: F811
    r = run("adapter-to-dcp", REF_ADAPTER, tmp_path / "out", "--base", other_base, "--lr", "1e-4")
    assert r.exit_code == 1 and "0 of 21 LoRA modules match the base" in r.output
    assert not (tmp_path / "out").exists()


def test_usage_errors(tmp_path):
    r = run("adapter-to-dcp", REF_ADAPTER, tmp_path / "out", "--base", BASE)
    assert r.exit_code == 2 and "--lr" in r.output
    r = run("adapter-to-dcp", REF_ADAPTER, tmp_path / "out", "--base", BASE, "--lr", "1e-4", "--scheduler", "linear")
    assert r.exit_code == 2 and "warmup" in r.output
    assert not (tmp_path / "out").exists()


def test_dry_run_plans_every_key_and_writes_nothing(tmp_path):
    out = tmp_path / "step_5" / "trainer"
    r = run("adapter-to-dcp", REF_ADAPTER, out, "--base", BASE, "--lr", "1e-4", "--step", "4", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json_payload(r.stdout)
    assert plan["keys"] == 228 and len(plan["tensors"]) == 36 + 42 + 126 and plan["required_orch_alpha"] == 16.0
    assert "step_5/trainer" in r.stderr and "--step 5" in r.stderr       # dir name vs progress.step
    assert not out.exists()
