"""`ckpt export` of a tied full fine-tune (factory `fullft-tied`: G's settings with tie_word_embeddings, 2 gloo
FSDP2 ranks): lm_head is the embedding Parameter, so the optimizer holds its state only under
model.embed_tokens.weight while the DCP lists both names. The export follows the config's tie: one
embedding, tie_word_embeddings true, loaded by transformers equal to the plain-torch truth."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli import main
from tests.factory.head_factory import make_head_run
from tests.factory.head_spec import HeadSpec


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    spec = HeadSpec.g_fullft_tied()
    return spec, make_head_run(tmp_path_factory.mktemp("tied-fullft") / "run", spec)


def test_the_tied_run_trains_lm_head_only_as_the_embedding(tied):
    from torch.distributed.checkpoint import FileSystemReader

    _, paths = tied
    md = FileSystemReader(str(paths.checkpoint)).read_metadata().state_dict_metadata
    assert "app.model.lm_head.weight" in md and "app.model.model.embed_tokens.weight" in md
    assert not any(k.startswith("app.optimizers.state.lm_head.weight.") for k in md)
    assert "app.optimizers.state.model.embed_tokens.weight.exp_avg" in md


def test_export_writes_the_trained_model_tied_and_transformers_loads_the_truth(tied, tmp_path):
    from transformers import AutoModelForCausalLM

    _, paths = tied
    r = run("export", paths.checkpoint, tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "lm_head.weight" not in got   # the tied alias, written once as the embedding
    ref = load_file(str(paths.reference))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.bfloat16)
    truth = {k[len("trained_bf16."):]: v for k, v in ref.items() if k.startswith("trained_bf16.")}
    sd = model.state_dict()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(sd["lm_head.weight"], ref["live_fp32.model.embed_tokens.weight"].to(torch.bfloat16))
    assert [k for k in truth if not torch.equal(sd[k], truth[k])] == []
    assert len(truth) == len(sd)   # every weight of the model checked (lm_head is the embedding)
    base = load_file(str(paths.base_model / "model.safetensors"))
    assert not torch.equal(sd["model.embed_tokens.weight"], base["model.embed_tokens.weight"])   # trained


def test_an_untied_config_for_a_tied_run_is_refused(tied, tmp_path):
    _, paths = tied
    cfg_dir = tmp_path / "untied"
    shutil.copytree(paths.base_model, cfg_dir)
    cfg = json.loads((cfg_dir / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    r = run("export", paths.checkpoint, tmp_path / "out", "--config-from", cfg_dir)
    assert r.exit_code == 1 and "lm_head.weight has no optimizer state" in r.output
    assert "tie_word_embeddings=False" in r.output and not (tmp_path / "out").exists()
