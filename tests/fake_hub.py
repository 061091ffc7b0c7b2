"""A local stand-in for the Hugging Face Hub's HTTP API, on 127.0.0.1 in a thread: just the endpoints that
huggingface_hub's client calls for a push (whoami, create repo, repo info, create branch, validate-yaml,
preupload, the LFS batch API with basic PUT uploads, commit), recording every request and every commit; and
dataset repositories whose commits hold files (revision info, tree, paths-info, resolve: what `datasets`
reads to load a hub dataset at a revision).

The client is pointed at it with HF_ENDPOINT (and HF_HUB_DISABLE_XET=1: with hf_xet installed the client
would upload large files through Xet storage, a protocol this fake does not speak; the LFS path it falls
back to is the one the Hub serves to clients without hf_xet). Never a remote address.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

TOKEN = "hf_fake_write_token"
USER = "alice"


@dataclass
class Repo:
    owner: str
    private: bool
    branches: dict[str, list[str]] = field(default_factory=lambda: {"main": []})


@dataclass
class Commit:
    repo_id: str
    revision: str
    create_pr: bool
    message: str
    files: dict[str, bytes]
    lfs: tuple[str, ...]  # the paths committed as LFS pointers


@dataclass
class FakeHub:
    """The Hub's state: repositories (`someone/taken` exists and belongs to another user), LFS objects,
    commits, and the log of requests (method, path, query, JSON body when there is one)."""

    repos: dict[str, Repo] = field(default_factory=lambda: {"someone/taken": Repo("someone", False)})
    lfs: dict[str, bytes] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)
    requests: list[tuple[str, str, dict, object]] = field(default_factory=list)
    lfs_uploads: list[str] = field(default_factory=list)  # oids PUT, in order
    # Dataset repositories: {repo id: {revision: commit sha}} (GET /api/datasets/{repo}/revision/{rev}).
    datasets: dict[str, dict[str, str]] = field(default_factory=dict)
    # The files of each dataset commit: {commit sha: {path: content}}.
    dataset_files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    drop_next_commit: bool = False  # close the connection of the next commit request without answering
    lock: threading.Lock = field(default_factory=threading.Lock)

    def calls(self, method: str, prefix: str) -> list[tuple[str, str, dict, object]]:
        """The recorded requests of `method` whose path starts with `prefix`."""
        return [r for r in self.requests if r[0] == method and r[1].startswith(prefix)]


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    endpoint: str

    def log_message(self, *args):  # keep the test output clean
        pass

    # --- plumbing ---
    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, obj: object = None) -> None:
        data = json.dumps(obj if obj is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self.send_response(status)
        data = json.dumps({"error": message}).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        self._error(401, "Invalid credentials in Authorization header")
        return False

    def _record(self, body: bytes) -> tuple[str, dict]:
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        try:
            payload = (
                json.loads(body)
                if body and self.headers.get("Content-Type", "").startswith("application/json")
                else None
            )
        except json.JSONDecodeError:
            payload = None
        with self.hub.lock:
            self.hub.requests.append((self.command, unquote(url.path), query, payload))
        return unquote(url.path), query

    # --- verbs ---
    def do_GET(self):
        path, _ = self._record(b"")
        if not self._authorized():
            return
        if path == "/api/whoami-v2":
            return self._send(200, {"type": "user", "name": USER, "orgs": []})
        if path.startswith("/api/models/"):
            repo_id = "/".join(path.split("/")[3:5])
            if repo_id in self.hub.repos:
                return self._send(
                    200, {"id": repo_id, "sha": "0" * 40, "private": self.hub.repos[repo_id].private}
                )
            return self._error(404, "Repository not found")
        if path.startswith(("/api/datasets/", "/datasets/")):
            return self._dataset(path, b"")
        self._error(404, f"no fake for GET {path}")

    def do_HEAD(self):
        path, _ = self._record(b"")
        if not path.startswith("/datasets/"):
            return self.send_error(501, "Unsupported method ('HEAD')")  # as before datasets were served
        if self._authorized():
            self._dataset(path, b"", head=True)

    def _dataset(self, path: str, body: bytes, head: bool = False) -> None:
        """A dataset repository: /api/datasets/REPO/{revision,tree,paths-info}/REV[/PATH], or the file
        /datasets/REPO/resolve/REV/PATH (REV: a branch or tag, or a commit sha)."""
        parts = path.split("/")
        api = parts[1] == "api"
        repo_id, action = "/".join(parts[2 + api : 4 + api]), (parts[4 + api : 5 + api] or ["revision"])[0]
        revision, rest = (parts[5 + api : 6 + api] or ["main"])[0], "/".join(parts[6 + api :])
        revisions = self.hub.datasets.get(repo_id, {})
        sha = revisions.get(revision) or (revision if revision in revisions.values() else None)
        if sha is None:
            return self._error(404, "Repository or revision not found")
        files = self.hub.dataset_files.get(sha, {})
        entries = [
            {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
            for f, b in files.items()
        ]
        if action == "revision":
            siblings = [{"rfilename": f} for f in files]
            return self._send(200, {"id": repo_id, "sha": sha, "private": False, "siblings": siblings})
        if action == "tree":  # the files under `rest` (all of them: every listing here is recursive)
            return self._send(
                200, [e for e in entries if e["path"].startswith(rest.rstrip("/") + "/" if rest else "")]
            )
        if action == "paths-info":
            wanted = set(parse_qs(body.decode()).get("paths", []))
            return self._send(200, [e for e in entries if e["path"] in wanted])
        if action != "resolve":
            return self._error(404, f"no fake for {path}")
        self.send_response(200 if rest in files else 404)
        if rest not in files:  # what the client reads as "no such file in this commit"
            self.send_header("X-Error-Code", "EntryNotFound")
            files = {rest: b""}
        for name, value in (("X-Repo-Commit", sha), ("ETag", f'"{hashlib.sha1(files[rest]).hexdigest()}"')):
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(files[rest])))
        self.end_headers()
        if not head:
            self.wfile.write(files[rest])

    def do_PUT(self):
        body = self._body()
        path, _ = self._record(b"")
        if path.startswith("/lfs-upload/"):
            oid = path.rsplit("/", 1)[-1]
            if hashlib.sha256(body).hexdigest() != oid:
                return self._error(400, "sha256 mismatch")
            with self.hub.lock:
                self.hub.lfs[oid] = body
                self.hub.lfs_uploads.append(oid)
            return self._send(200)
        self._error(404, f"no fake for PUT {path}")

    def do_POST(self):
        body = self._body()
        path, query = self._record(body)
        if not self._authorized():
            return
        if path == "/api/validate-yaml":
            return self._send(200, {"errors": [], "warnings": []})
        if path == "/api/repos/create":
            return self._create_repo(json.loads(body))
        if path.endswith(".git/info/lfs/objects/batch"):
            return self._lfs_batch(json.loads(body))
        if path.startswith("/api/datasets/"):
            return self._dataset(path, body)
        parts = path.split("/")
        # /api/models/OWNER/NAME/{preupload,commit,branch}/REVISION
        if len(parts) >= 7 and parts[1:3] == ["api", "models"]:
            repo_id, action, revision = f"{parts[3]}/{parts[4]}", parts[5], "/".join(parts[6:])
            repo = self.hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "Repository not found")
            pr = query.get("create_pr") == "1"
            if repo.owner != USER and not pr:
                return self._error(403, "You don't have the rights to write to this repository")
            if action == "preupload":
                files = json.loads(body)["files"]
                modes = [
                    {
                        "path": f["path"],
                        "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                        "shouldIgnore": False,
                    }
                    for f in files
                ]
                return self._send(200, {"files": modes, "commitOid": "0" * 40})
            if action == "branch":
                if revision in repo.branches:
                    return self._error(409, "Branch already exists")
                repo.branches[revision] = []
                return self._send(200)
            if action == "commit":
                return self._commit(repo_id, repo, revision, pr, body)
        self._error(404, f"no fake for POST {path}")

    def _create_repo(self, payload: dict) -> None:
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        if (payload.get("organization") or USER) != USER:
            return self._error(403, "You don't have the rights to create a model under this namespace")
        if repo_id in self.hub.repos:  # the Hub answers a conflict with the repository's url too
            return self._send(
                409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"}
            )
        self.hub.repos[repo_id] = Repo(USER, payload.get("visibility") == "private")
        self._send(200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id})

    def _lfs_batch(self, payload: dict) -> None:
        objects = []
        for o in payload["objects"]:
            entry = {"oid": o["oid"], "size": o["size"]}
            if o["oid"] not in self.hub.lfs:  # an object the Hub holds already is not sent again
                entry["actions"] = {"upload": {"href": f"{self.endpoint}/lfs-upload/{o['oid']}"}}
            objects.append(entry)
        self._send(200, {"transfer": "basic", "objects": objects})

    def _commit(self, repo_id: str, repo: Repo, revision: str, pr: bool, body: bytes) -> None:
        if self.hub.drop_next_commit:
            self.hub.drop_next_commit = False
            self.close_connection = True  # the connection drops before the Hub answers: no commit
            return
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        files, lfs = {}, []
        for x in lines:
            v = x["value"]
            if x["key"] == "file":
                files[v["path"]] = base64.b64decode(v["content"])
            elif x["key"] == "lfsFile":
                if v["oid"] not in self.hub.lfs:
                    return self._error(422, f"LFS object {v['oid']} was never uploaded")
                files[v["path"]], lfs = self.hub.lfs[v["oid"]], [*lfs, v["path"]]
        if revision not in repo.branches:
            return self._error(404, f"Invalid rev id: {revision}")
        oid = hashlib.sha1(body).hexdigest()
        with self.hub.lock:
            self.hub.commits.append(Commit(repo_id, revision, pr, header["summary"], files, tuple(lfs)))
        answer = {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid}
        if pr:
            answer["pullRequestUrl"] = f"{self.endpoint}/{repo_id}/discussions/1"
        self._send(200, answer)


class FakeHubServer:
    """`with FakeHubServer() as server:` serves a FakeHub (`server.hub`) at `server.url` until the block ends."""

    def __init__(self):
        self.hub = FakeHub()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        handler = type("Handler", (_Handler,), {"hub": self.hub, "endpoint": self.url})
        self._server.RequestHandlerClass = handler
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def client_env(base: dict[str, str], endpoint: str, hf_home, token: str | None = TOKEN) -> dict[str, str]:
    """An environment pointing huggingface_hub at `endpoint` with `token` (None: no token at all), its own
    HF_HOME (no token stored by a login on this machine), online, LFS uploads (see the module docstring)."""
    env = {k: v for k, v in base.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_XET="1")
    if token is not None:
        env["HF_TOKEN"] = token
    return env
