"""`import ckpt_tools` exposes the operations with typed results; docs/api.md's examples run as written."""
from __future__ import annotations

import re
import subprocess
import sys

import ckpt_tools

from .conftest import REPO


def test_the_package_exports_every_operation_and_importing_it_needs_no_torch():
    from ckpt_tools.cli import main
    commands = set(main.list_commands(None))
    # one function per command (`ckpt set` is `set_values`: `set` is Python's builtin)
    assert {name.replace("-", "_") for name in commands} - {"set"} | {"set_values"} \
        <= set(ckpt_tools.__all__) - {"__version__", "open"}, commands
    from ckpt_tools import api
    assert set(ckpt_tools.__all__) - {"__version__"} <= set(api.__all__)
    for name in set(ckpt_tools.__all__) - {"__version__"}:
        fn = getattr(ckpt_tools, name)
        assert callable(fn) and fn.__doc__ and "return" in fn.__annotations__, name
    r = subprocess.run([sys.executable, "-c", "import sys, ckpt_tools; ckpt_tools.__version__; "
                        "assert 'torch' not in sys.modules"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_function_takes_its_options_as_named_keywords_and_returns_a_typed_report():
    """One api shape: no `**options` (a typo is a TypeError, not an ignored flag), each function the
    module defines (no rewrite after loading), a report class with `to_json()` (never a dict), and a dry
    run's report with its own `.plan` / `.result` (no attribute forwarding)."""
    import inspect

    from ckpt_tools import api
    from ckpt_tools.api import DryRunReport
    for name in [n for n in api.__all__ if n[0].islower() and n != "doctor_toml_value"]:
        fn = getattr(api, name)
        assert fn.__module__ == "ckpt_tools.api" and fn.__qualname__ == name, name
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds, name
        assert "dict" not in fn.__annotations__["return"], name
        if name != "open":
            assert "download" in inspect.signature(fn).parameters, name
    with pytest.raises(TypeError):
        ckpt_tools.gc(".", keep_full=1, min_age=0)   # the keyword is min_age_s
    assert "__getattr__" not in vars(DryRunReport)


def test_docs_api_examples_run_as_written():
    text = (REPO / "docs" / "api.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) >= 4
    r = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "3 0.01 8 16.0" and out[1] == "(8, 64) torch.float32"
    assert out[2] == "21 16.0" and out[3].startswith("21 {'merge': 21, 'copy': 15")
    assert out[4] == "True"
    assert out[5] == "none True" and out[6] == "21 16.0"
    assert out[7] == "1 already exists pass --overwrite to replace it, or another output path"


# --- each api function is the command: the same outputs, byte for byte -----------------------------------
import hashlib  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from .conftest import BASE, FIXTURE, HEAD_FIXTURES, TRAINER, json_payload  # noqa: E402

G = HEAD_FIXTURES / "G_head_fullft"
G_TRAINER = G / "outputs" / "checkpoints" / "step_3" / "trainer"
BROADCAST = FIXTURE / "outputs/run_default/broadcasts/step_3"


def _tree_digest(root):
    """name -> sha256 of every file under `root` (a DCP .metadata by its decoded content: it carries a
    random save id)."""
    import pickle
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        data = f.read_bytes()
        if f.name == ".metadata":
            md = pickle.loads(data)   # written by the test itself: trusted
            md.storage_meta = None
            data = repr((sorted(md.state_dict_metadata.items(), key=lambda kv: kv[0]),
                         sorted((repr(k), repr(v)) for k, v in md.storage_data.items()))).encode()
        out[str(f.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


def _cli(*args):
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", *map(str, args)], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    return r


CASES = {
    "export": (lambda out: ckpt_tools.export(G_TRAINER, out, config_from=G / "base_model"),
               lambda out: ("export", G_TRAINER, out, "--config-from", G / "base_model")),
    "fix-adapter": (lambda out: ckpt_tools.fix_adapter(BROADCAST, out),
                    lambda out: ("fix-adapter", BROADCAST, out)),
    "adapter-to-dcp": (lambda out: ckpt_tools.adapter_to_dcp(FIXTURE / "reference_peft_adapter", out, base=BASE,
                                                              lr=1e-3, step=3),
                       lambda out: ("adapter-to-dcp", FIXTURE / "reference_peft_adapter", out, "--base", BASE,
                                    "--lr", "1e-3", "--step", "3")),
    "set": (lambda out: ckpt_tools.set_values(TRAINER, out, ["progress.step=7"]),
            lambda out: ("set", TRAINER, out, "progress.step=7")),
    "merge": (lambda out: ckpt_tools.merge(BASE, TRAINER, out), lambda out: ("merge", BASE, TRAINER, out)),
    "extract-adapter": (lambda out: ckpt_tools.extract_adapter(TRAINER, out),
                        lambda out: ("extract-adapter", TRAINER, out)),
    "slim": (lambda out: ckpt_tools.slim(TRAINER, out, base=BASE), lambda out: ("slim", TRAINER, out, "--base", BASE)),
    "set-lr": (lambda out: ckpt_tools.set_lr(TRAINER, out, scale=0.5), lambda out: ("set-lr", TRAINER, out,
                                                                                    "--scale", "0.5")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_api_writes_what_the_command_writes(name, tmp_path):
    by_api, by_cli = CASES[name]
    report = by_api(tmp_path / "api")
    assert hasattr(report, "to_json") and report.to_json()
    r = _cli(*by_cli(tmp_path / "cli"))
    assert r.returncode == 0, r.stderr
    got, want = _tree_digest(tmp_path / "api"), _tree_digest(tmp_path / "cli")
    assert got and got == want


def test_the_api_reports_what_the_command_reports(tmp_path):
    """The report-only commands: the api's report is the command's --json result."""
    doc = ckpt_tools.doctor(FIXTURE / "outputs" / "run_default")
    r = _cli("doctor", FIXTURE / "outputs" / "run_default", "--json")
    assert r.returncode == doc.exit_code
    assert json.loads(r.stdout)["result"] == json.loads(json.dumps(doc.to_json()))
    run = tmp_path / "run"
    import shutil
    shutil.copytree(FIXTURE / "outputs", run / "outputs")
    plan = ckpt_tools.gc(run / "outputs" / "checkpoints", keep_full=1, base=BASE, dry_run=True, min_age_s=0)
    r = _cli("gc", run / "outputs" / "checkpoints", "--keep-full", "1", "--base", BASE, "--dry-run", "--min-age", "0",
             "--json")
    assert r.returncode == 0, r.stderr
    cli_plan, api_plan = json_payload(r.stdout), json.loads(json.dumps(plan.to_json()["plan"]))
    for p in (cli_plan, api_plan):
        p.pop("free_bytes")          # the disk's free space moves between the two calls
    assert cli_plan == api_plan and plan.to_json()["dry_run"]
    prep = ckpt_tools.restart_prep(TRAINER, tmp_path / "m", base=str(BASE), lr=5e-3, dry_run=True)
    r = _cli("restart-prep", TRAINER, tmp_path / "m", "--base", BASE, "--lr", "5e-3", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert json_payload(r.stdout) == json.loads(json.dumps(prep.to_json()))


def test_open_returns_each_formats_one_handle_as_a_context_manager_that_closes_it():
    """`ckpt_tools.open` gives the format's handle (a DCP checkpoint, an HF dir that is a `Source`, a PEFT
    adapter); `with` closes what it opened, and the handle offers the views the ops read through."""
    import torch
    from safetensors import safe_open

    from ckpt_tools.formats.dcp.reader import DcpCheckpoint
    from ckpt_tools.formats.handle import LoraSource, Source
    from ckpt_tools.formats.hf_dir.model_dir import HFModelDir
    from ckpt_tools.formats.peft.adapter import PeftAdapter

    with ckpt_tools.open(TRAINER) as ckpt:
        assert type(ckpt) is DcpCheckpoint
        base = ckpt.base_weights()
        assert isinstance(base, Source) and base.masters and len(base) > 0
        name = base.names()[0]
        assert base.read_tensor(name).shape == base.facts(name).shape
        assert ckpt.files._fds                       # a data file was opened for that read
    assert not ckpt.files._fds                       # and closed on leaving the block
    with ckpt_tools.open(BASE) as hf:
        assert type(hf) is HFModelDir and isinstance(hf, Source) and not hf.masters
        name = hf.disk_order()[0]
        with safe_open(str(hf.path / hf.file_of(name)), "pt") as f:
            assert torch.equal(hf.read_tensor(name), f.get_tensor(name))
        r = hf.copy_range(name)
        assert (r.offset, r.nbytes) == (hf.info(name).begin, hf.facts(name).nbytes)
        assert hf.files._fds
    assert not hf.files._fds
    with ckpt_tools.open(FIXTURE / "reference_peft_adapter") as peft:
        assert type(peft) is PeftAdapter
        lora = peft.lora()
        assert isinstance(lora, LoraSource) and lora.adapter is peft and lora.ckpt is None and lora.modules
        module = sorted(lora.modules)[0]
        a, _b = lora.read_pair(module)
        assert a.dtype == torch.float32 and tuple(a.shape) == lora.modules[module].a_shape


# a dry run: the api's report is the command's --json plan, byte for byte (with what writing OUT would do)
DRY = {
    "merge": (lambda out: ckpt_tools.merge(BASE, TRAINER, out, dry_run=True), lambda out: ("merge", BASE, TRAINER, out)),
    "extract-adapter": (lambda out: ckpt_tools.extract_adapter(TRAINER, out, dry_run=True),
                        lambda out: ("extract-adapter", TRAINER, out)),
    "adapter-to-dcp": (lambda out: ckpt_tools.adapter_to_dcp(FIXTURE / "reference_peft_adapter", out, base=BASE,
                                                              lr=1e-3, dry_run=True),
                       lambda out: ("adapter-to-dcp", FIXTURE / "reference_peft_adapter", out, "--base", BASE, "--lr",
                                    "1e-3")),
    "slim": (lambda out: ckpt_tools.slim(TRAINER, out, base=BASE, dry_run=True), lambda out: ("slim", TRAINER, out, "--base", BASE)),
    "set-lr": (lambda out: ckpt_tools.set_lr(TRAINER, out, lr=5e-3, dry_run=True),
               lambda out: ("set-lr", TRAINER, out, "--lr", "5e-3")),
}


@pytest.mark.parametrize("name", sorted(DRY))
def test_a_dry_run_reports_what_the_commands_dry_run_reports(name, tmp_path):
    from ckpt_tools.cli.render import envelope
    by_api, by_cli = DRY[name]
    out = tmp_path / "out"
    report = by_api(out)
    assert report.plan is not None and not out.exists()       # the report's own attributes, through the wrapper
    assert "output" in report.to_json().get("plan", report.to_json())   # what writing OUT would do
    r = _cli(*by_cli(out), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    cli, api = json.loads(r.stdout), envelope(name, report.to_json(), dry_run=True)
    for doc in (cli, api):
        doc.get("plan", {}).pop("seconds", None)
        (doc["plan"].get("output") or {}).pop("free_bytes", None)
    assert json.dumps(api["plan"], sort_keys=True) == json.dumps(cli["plan"], sort_keys=True)
    assert api["warnings"] == cli["warnings"]


def test_the_run_is_split_over_the_group_it_is_given(tmp_path):
    """`group=`: the ranks' share of the work is the group's (a group of one here; the default is
    `dist.current()`, solo outside torchrun); the ops ask it for their part and agree through it."""
    from ckpt_tools import dist
    asked = []

    class Recording(dist.SoloGroup):
        @property
        def part(self):
            asked.append("part")
            return dist.SOLO

    assert ckpt_tools.verify(TRAINER, deep=True, group=Recording()).ok and asked
    asked.clear()
    slim = ckpt_tools.slim(TRAINER, tmp_path / "s", base=BASE, group=Recording())
    assert slim.result is not None and asked
