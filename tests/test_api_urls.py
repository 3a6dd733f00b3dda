"""The api takes URL strings for its inputs as the CLI does (docs/remote.md): every function, given URLs of
an HTTP server and of an S3 store (moto), writes what the command writes from the same URLs (byte for
byte), reports what it reports, and a URL with nothing at it is the command's own error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

import ckpt_tools  # noqa: E402
from ckpt_tools.core.errors import CkptError  # noqa: E402

from .remote_servers import HttpServer  # noqa: E402
from .test_remote import ckpt, digest, fresh_remote_state, s3, s3_env  # noqa: E402,F401

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "primerl-tiny"
TRAINER = TINY / "outputs/checkpoints/step_3/trainer"
BASE = TINY / "base_model"
ADAPTER = TINY / "reference_peft_adapter"
BROADCAST = TINY / "outputs/run_default/broadcasts/step_3"
E_CKPT = FIXTURES / "primerl-head/E_head_dense/outputs/checkpoints"
SERVED = (TINY, E_CKPT.parent.parent)


@pytest.fixture(scope="module")
def http():
    srv = HttpServer(FIXTURES)
    yield srv
    srv.close()


@pytest.fixture()
def stores(http, s3_env, tmp_path_factory):
    """Each store's `at(path)`: the URL of a fixture file or dir there (the S3 bucket holds copies)."""
    if not getattr(s3_env, "api_uploaded", False):
        for top in SERVED:
            for p in sorted(top.rglob("*")):
                if p.is_file():
                    s3_env.client.upload_file(str(p), "runs", f"fx/{p.relative_to(FIXTURES).as_posix()}")
        s3_env.api_uploaded = True
    return {"http": lambda p: f"{http.url}/{Path(p).relative_to(FIXTURES).as_posix()}",
            "s3": lambda p: f"s3://runs/fx/{Path(p).relative_to(FIXTURES).as_posix()}"}


# name -> (the api call, the command's arguments, what to compare: "tree" (OUT) or "json", the exit code)
A = ckpt_tools
CASES = {
    "inspect": (lambda at, o: A.inspect(at(TRAINER)), lambda at, o: ["inspect", at(TRAINER)], "json", 0),
    "verify": (lambda at, o: A.verify(at(TRAINER)), lambda at, o: ["verify", at(TRAINER)], "json", 0),
    "extract_adapter": (lambda at, o: A.extract_adapter(at(TRAINER), o, alpha=16.0, base=at(BASE)),
                        lambda at, o: ["extract-adapter", at(TRAINER), o, "--alpha", "16", "--base", at(BASE)],
                        "tree", 0),
    "merge": (lambda at, o: A.merge(at(BASE), at(TRAINER), o, alpha=16.0),
              lambda at, o: ["merge", at(BASE), at(TRAINER), o, "--alpha", "16"], "tree", 0),
    "export": (lambda at, o: A.export(at(TRAINER), o, alpha=16.0, config_from=at(BASE)),
               lambda at, o: ["export", at(TRAINER), o, "--alpha", "16", "--config-from", at(BASE)], "tree", 0),
    "adapter_to_dcp": (lambda at, o: A.adapter_to_dcp(at(ADAPTER), o, base=at(BASE), lr=1e-3, step=3),
                       lambda at, o: ["adapter-to-dcp", at(ADAPTER), o, "--base", at(BASE), "--lr", "1e-3",
                                      "--step", "3"], "tree", 0),
    "fix_adapter": (lambda at, o: A.fix_adapter(at(BROADCAST), o, base=at(BASE), alpha=16.0),
                    lambda at, o: ["fix-adapter", at(BROADCAST), o, "--base", at(BASE), "--alpha", "16"], "tree", 0),
    "diff_vs_base": (lambda at, o: A.diff_vs_base(at(TRAINER), at(BASE)),
                     lambda at, o: ["diff-vs-base", at(TRAINER), at(BASE)], "json", 3),
    "slim": (lambda at, o: A.slim(at(TRAINER), o, base=at(BASE)),
             lambda at, o: ["slim", at(TRAINER), o, "--base", at(BASE)], "tree", 0),
    "set_lr": (lambda at, o: A.set_lr(at(TRAINER), o, scale=0.5),
               lambda at, o: ["set-lr", at(TRAINER), o, "--scale", "0.5"], "tree", 0),
    "set_values": (lambda at, o: A.set_values(at(TRAINER), o, ["progress.step=7"]),
                   lambda at, o: ["set", at(TRAINER), o, "progress.step=7"], "tree", 0),
    "restart_prep": (lambda at, o: A.restart_prep(at(TRAINER), o, base=at(BASE), lr=5e-3, alpha=16.0),
                     lambda at, o: ["restart-prep", at(TRAINER), o, "--base", at(BASE), "--lr", "5e-3",
                                    "--alpha", "16"], "tree", 0),
    "doctor": (lambda at, o: A.doctor(at(TINY)), lambda at, o: ["doctor", at(TINY)], "json", 3),
    "average": (lambda at, o: A.average([at(E_CKPT / "step_2/trainer"), at(E_CKPT / "step_3/trainer")], o, ema=0.5),
                lambda at, o: ["average", at(E_CKPT / "step_2/trainer"), at(E_CKPT / "step_3/trainer"), o,
                               "--ema", "0.5"], "tree", 0),
    "resize_adapter": (lambda at, o: A.resize_adapter(at(ADAPTER), o, rank=4),
                       lambda at, o: ["resize-adapter", at(ADAPTER), o, "--rank", "4"], "tree", 0),
    "report": (lambda at, o: A.report(at(E_CKPT), out=o / "page.html", run_config=at(E_CKPT.parent.parent /
                                                                                   "configs/trainer.json")),
               lambda at, o: ["report", at(E_CKPT), "-o", o / "page.html", "--run-config",
                              at(E_CKPT.parent.parent / "configs/trainer.json")], "tree", 0),
}


def _json(doc) -> dict:
    """A report as JSON, its run times dropped (they differ between two runs)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not (k.endswith("seconds") or k.endswith("_s")
                                                               or k in ("rate", "elapsed"))}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(json.loads(json.dumps(doc)))


@pytest.mark.parametrize("store", ["http", "s3"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_api_function_takes_urls_as_the_command_does(stores, store, name, tmp_path):
    by_api, argv, compare, code = CASES[name]
    at = stores[store]
    (tmp_path / "api").mkdir()
    (tmp_path / "cli").mkdir()
    api_out, cli_out = tmp_path / "api" / "out", tmp_path / "cli" / "out"
    if name == "report":  # its OUT is a page in an existing dir
        api_out.mkdir()
        cli_out.mkdir()
    report = by_api(at, api_out)
    r = ckpt(*argv(at, cli_out), "--json", code=code)
    doc = json.loads(r.stdout)
    assert doc["remote"]["bytes_fetched"] > 0
    if compare == "tree":
        assert digest(api_out) == digest(cli_out) and digest(api_out)
    else:
        want = doc["result"] if doc["result"] is not None else doc["plan"]
        assert _json(report.to_json()) == _json(want)


@pytest.mark.parametrize("name", ["inspect", "extract_adapter", "merge", "slim", "verify", "doctor", "average"])
def test_a_url_with_nothing_at_it_is_the_commands_error_from_the_api(stores, name, tmp_path):
    at = stores["http"]
    missing = lambda p: at(TINY) + "/nothing/here" if p in (TRAINER, TINY, E_CKPT / "step_2/trainer") else at(p)  # noqa: E731
    by_api, argv, _compare, _code = CASES[name]
    with pytest.raises(CkptError) as exc:
        by_api(missing, tmp_path / "api")
    r = ckpt(*argv(missing, tmp_path / "cli"), code=2)
    assert r.output.strip().splitlines()[-1] == f"error: {exc.value}"
    assert type(exc.value).exit_code == 2


@pytest.fixture(scope="module")
def slim_served(tmp_path_factory):
    """A slim of the fixture (by the local command), over HTTP."""
    root = tmp_path_factory.mktemp("slim-served")
    ckpt("slim", TRAINER, root / "slim", "--base", BASE)
    srv = HttpServer(root)
    yield srv
    srv.close()


def test_rehydrate_open_and_gc_take_urls_as_the_command_does(slim_served, stores, tmp_path):
    url = f"{slim_served.url}/slim"
    ckpt_tools.rehydrate(url, tmp_path / "api", base=str(BASE))
    ckpt("rehydrate", url, tmp_path / "cli", "--base", BASE)
    assert digest(tmp_path / "api") == digest(tmp_path / "cli")
    with ckpt_tools.open(stores["s3"](TRAINER)) as remote_ckpt, ckpt_tools.open(TRAINER) as local_ckpt:
        assert sorted(remote_ckpt.entries) == sorted(local_ckpt.entries)
        key = next(k for k in local_ckpt.entries if "lora_A" in k)
        assert remote_ckpt.read_tensor(key).equal(local_ckpt.read_tensor(key))
    # gc changes a local checkpoints dir: a URL is refused, by the api as by the command, and nothing is read
    with pytest.raises(CkptError) as exc:
        ckpt_tools.gc(stores["http"](TINY / "outputs/checkpoints"), keep_full=1, dry_run=True)
    r = ckpt("gc", stores["http"](TINY / "outputs/checkpoints"), "--keep-full", "1", "--dry-run", code=2)
    assert r.output.strip().splitlines()[-1] == f"error: {exc.value}" and "at a URL" in str(exc.value)


def _bucket_tree(s3, url: str, dest: Path) -> Path:
    """The objects under the s3:// prefix `url`, as files under `dest`."""
    prefix = url.split("/", 3)[3] + "/"
    for o in s3.client.list_objects_v2(Bucket="runs", Prefix=prefix).get("Contents", []):
        (dest / o["Key"][len(prefix):]).parent.mkdir(parents=True, exist_ok=True)
        (dest / o["Key"][len(prefix):]).write_bytes(s3.client.get_object(Bucket="runs", Key=o["Key"])["Body"].read())
    return dest


@pytest.mark.parametrize("src", ["http", "s3"])
@pytest.mark.parametrize("name", ["extract_adapter", "slim", "set_lr", "merge"])
def test_the_api_reads_urls_and_puts_its_out_at_a_url_as_the_command_does(stores, s3_env, src, name, tmp_path):
    """`ckpt_tools.extract_adapter("s3://...", "s3://...")`: URL inputs and an OUT at a URL in one call put
    the objects the command puts (byte for byte), and the report names the OUT's URL."""
    by_api, argv, _compare, _code = CASES[name]
    at = stores[src]
    api_url, cli_url = f"s3://runs/api-out/{src}/{name}", f"s3://runs/cli-out/{src}/{name}"
    report = by_api(at, api_url)
    doc = json.loads(ckpt(*argv(at, cli_url), "--json").stdout)
    (up,) = doc["remote"]["uploaded"]
    assert up["url"] == cli_url, up
    api_tree, cli_tree = _bucket_tree(s3_env, api_url, tmp_path / "api"), _bucket_tree(s3_env, cli_url, tmp_path / "cli")
    assert digest(api_tree) == digest(cli_tree) and len(digest(api_tree)) >= 3
    assert api_url in json.dumps(report.to_json()) and "ckpt-upload-" not in json.dumps(report.to_json())
