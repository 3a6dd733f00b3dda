"""The bytes and requests each command fetches from a URL of the genuine `primerl-tiny` fixture, as counted
by the tests' own range-capable HTTP server (tests/remote_servers.py): the table "What each command fetches"
of docs/remote.md. Run from the repository root: `PYTHONPATH=. .venv/bin/python bench/remote_fixture_bytes.py`.
(The tests hold these to their budgets; this prints the figures.)"""
import sys
import tempfile
from pathlib import Path
from click.testing import CliRunner
from ckpt_tools.cli import main
from ckpt_tools.io import remote
from tests.remote_servers import HttpServer
FX = Path(__file__).resolve().parents[1] / Path("tests/fixtures/primerl-tiny"); BASE = FX/"base_model"
srv = HttpServer(FX/"outputs/checkpoints/step_3")
url = f"{srv.url}/trainer"
t = Path(tempfile.mkdtemp())
cases = {
 "inspect": ["inspect", url],
 "extract-adapter": ["extract-adapter", url, t/"a", "--alpha", "16"],
 "slim --base": ["slim", url, t/"s", "--base", BASE],
 "slim": ["slim", url, t/"s2"],
 "merge": ["merge", BASE, url, t/"m", "--alpha", "16"],
 "export": ["export", url, t/"e", "--alpha", "16", "--config-from", BASE],
 "verify": ["verify", url],
 "verify --deep": ["verify", url, "--deep"],
 "diff-vs-base": ["diff-vs-base", url, BASE],
}
for name, args in cases.items():
    srv.counter.reset(); remote.reset()
    r = CliRunner().invoke(main, [str(a) for a in args])
    print(f"{name:18} exit={r.exit_code} bytes={srv.counter.bytes:,} requests={len(srv.counter.requests)}")
srv.close()
sys.exit(0)
