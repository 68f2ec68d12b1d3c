"""Tests of ``fedprivacy data download`` against fixture archives on a local HTTP server (no internet)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import lzma
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from fedprivacy.cli import main
from fedprivacy.config import DataConfig
from fedprivacy.data import download as dl
from fedprivacy.data.synthetic import generate
from fedprivacy.stackoverflow_tasks import load_task

CLIENTS = 8


class _Server:
    """Serves ``files`` (name -> bytes) with ``Range`` support; records each request's path and range.

    ``cut_after[name] = n`` closes the connection after ``n`` bytes of the first response for ``name``
    (promising the full length); ``ignore_range`` answers every request with the whole file (200).
    """

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.cut_after: dict[str, int] = {}
        self.ignore_range = False
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name = self.path.lstrip("/")
                server.requests.append((name, self.headers.get("Range")))
                if name not in server.files:
                    self.send_error(404)
                    return
                data = server.files[name]
                start = 0
                if self.headers.get("Range") and not server.ignore_range:
                    start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                cut = server.cut_after.pop(name, None)
                self.wfile.write(data[start:] if cut is None else data[start:start + cut])
                if cut is not None:
                    self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def count(self, name: str) -> int:
        return sum(n == name for n, _ in self.requests)


def _tar_bz2(path: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:bz2") as tar:
        tar.add(path, arcname=path.name)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic StackOverflow set in TFF's SQLite format: the files the archives hold."""
    return generate(tmp_path_factory.mktemp("original"), num_clients=CLIENTS, seed=3).sqlite.parent


@pytest.fixture(scope="module")
def archives(originals: Path) -> dict[str, bytes]:
    """The served archives, named as on TFF's server."""
    return {"stackoverflow.sqlite.lzma": lzma.compress((originals / "stackoverflow.sqlite").read_bytes()),
            "stackoverflow.word_count.tar.bz2": _tar_bz2(originals / "stackoverflow.word_count"),
            "stackoverflow.tag_count.tar.bz2": _tar_bz2(originals / "stackoverflow.tag_count")}


@pytest.fixture
def server(archives: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> Iterator[_Server]:
    """A running server; the manifest's SHA-256 sums are the fixtures', its timeout short."""
    monkeypatch.setitem(dl.MANIFEST, "tff-sqlite", tuple(
        dataclasses.replace(a, sha256=hashlib.sha256(archives[a.name]).hexdigest()) for a in dl.MANIFEST["tff-sqlite"]))
    monkeypatch.setattr(dl, "TIMEOUT", 5.0)
    srv = _Server(archives)
    thread = threading.Thread(target=srv.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.httpd.shutdown()
        srv.httpd.server_close()
        thread.join(timeout=5)


def _download(out: Path, server: _Server) -> int:
    return main(["data", "download", "--out", str(out), "--base-url", server.url])


def test_cut_connection_resumes_with_range_and_leaves_a_data_path(server: _Server, originals: Path, tmp_path: Path,
                                                                   capsys) -> None:
    server.cut_after["stackoverflow.sqlite.lzma"] = 1000
    out = tmp_path / "so"
    assert _download(out, server) == 0
    written = json.loads(capsys.readouterr().out)
    assert sorted(written) == ["stackoverflow.sqlite", "stackoverflow.tag_count", "stackoverflow.word_count"]
    assert ("stackoverflow.sqlite.lzma", "bytes=1000-") in server.requests
    for name, path in written.items():
        assert Path(path).read_bytes() == (originals / name).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == [dl.RECORD, *sorted(written)]
    assert all(entry["verified"] for entry in json.loads((out / dl.RECORD).read_text()).values())

    assert main(["data", "stats", "--source", "tff-sqlite", "--path", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out)["splits"]
    assert stats["train"]["clients"] == CLIENTS
    assert load_task(DataConfig(path=out, generate_if_missing=False)).population == CLIENTS

    requests = len(server.requests)
    assert _download(out, server) == 0  # everything there and verified: nothing fetched
    assert len(server.requests) == requests
    assert capsys.readouterr().err.count("already downloaded and verified") == 3


def test_server_ignoring_range_restarts_and_an_unpublished_hash_warns(server: _Server, archives: dict[str, bytes],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path, capsys) -> None:
    sqlite, *counts = dl.MANIFEST["tff-sqlite"]
    monkeypatch.setitem(dl.MANIFEST, "tff-sqlite", (dataclasses.replace(sqlite, sha256=None), *counts))
    server.ignore_range = True
    server.cut_after["stackoverflow.sqlite.lzma"] = 1000
    assert _download(tmp_path / "so", server) == 0
    err = capsys.readouterr().err
    assert "ignored the Range request" in err
    assert f"could not be verified; its SHA-256 is {hashlib.sha256(archives[sqlite.name]).hexdigest()}" in err
    assert server.count("stackoverflow.sqlite.lzma") == 2
    assert json.loads((tmp_path / "so" / dl.RECORD).read_text())[sqlite.name]["verified"] is False


def test_wrong_checksum_deletes_the_download_and_names_file_and_sums(server: _Server, archives: dict[str, bytes],
                                                                     tmp_path: Path, capsys) -> None:
    name = "stackoverflow.word_count.tar.bz2"
    served = bytearray(archives[name])
    served[len(served) // 2] ^= 0xFF  # always a different file (a fixed last byte may equal the original's)
    server.files = {**archives, name: bytes(served)}
    out = tmp_path / "so"
    assert _download(out, server) == 1
    err = capsys.readouterr().err
    expected = hashlib.sha256(archives[name]).hexdigest()
    got = hashlib.sha256(server.files[name]).hexdigest()
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (f"fedprivacy: error: {server.url}{name}: SHA-256 mismatch: expected {expected}, "
                                    f"got {got} (the download was deleted; rerun to fetch it again)")
    assert not (out / dl.PARTIAL_DIR / name).exists() and not (out / "stackoverflow.word_count").exists()
    assert (out / "stackoverflow.sqlite").is_file()  # the archive before it stays done


def test_http_404_is_one_line_naming_the_url(server: _Server, tmp_path: Path, capsys) -> None:
    server.files = {}
    assert _download(tmp_path / "so", server) == 1
    err = capsys.readouterr().err
    assert err == f"fedprivacy: error: {server.url}stackoverflow.sqlite.lzma: HTTP 404 Not Found\n"


def test_refuses_a_folder_of_synthetic_data(server: _Server, tmp_path: Path, capsys) -> None:
    generate(tmp_path, num_clients=2, seed=0)
    assert _download(tmp_path, server) == 1
    assert "synthetic" in capsys.readouterr().err and server.requests == []


@pytest.mark.parametrize("kept", [1000, None], ids=["part", "all"])
def test_a_rerun_resumes_the_partial_file_of_an_earlier_run(server: _Server, archives: dict[str, bytes],
                                                           originals: Path, tmp_path: Path, kept: int | None) -> None:
    name = "stackoverflow.sqlite.lzma"
    (tmp_path / dl.PARTIAL_DIR).mkdir()
    (tmp_path / dl.PARTIAL_DIR / name).write_bytes(archives[name][:kept])
    assert _download(tmp_path, server) == 0
    assert server.requests[0] == (name, f"bytes={kept or len(archives[name])}-")
    assert server.count(name) == 1
    assert (tmp_path / "stackoverflow.sqlite").read_bytes() == (originals / "stackoverflow.sqlite").read_bytes()
    assert not (tmp_path / dl.PARTIAL_DIR).exists()


def test_a_local_error_is_one_line_naming_the_path(server: _Server, tmp_path: Path, capsys) -> None:
    out = tmp_path / "a_file"
    out.write_text("")
    assert _download(out, server) == 1
    assert capsys.readouterr().err == f"fedprivacy: error: {out / dl.PARTIAL_DIR}: Not a directory\n"


def test_progress_bar_on_a_terminal(server: _Server, tmp_path: Path) -> None:
    screen = io.StringIO()
    dl.download(tmp_path, base_url=server.url, console=Console(file=screen, force_terminal=True, width=100))
    assert "stackoverflow.sqlite.lzma" in screen.getvalue() and (tmp_path / "stackoverflow.sqlite").is_file()


def test_decompressing_advances_a_bar_over_every_compressed_byte_on_a_terminal_only(server: _Server, tmp_path: Path,
                                                                                      monkeypatch) -> None:
    bars: list[dict] = []
    real = dl.progress_bar

    @contextlib.contextmanager
    def recorded(description, total, unit, console):
        bars.append({"total": total, "done": 0, "terminal": console.is_terminal})
        with real(description, total, unit, console) as advance:
            def counted(n: int) -> None:
                bars[-1]["done"] += n
                advance(n)
            yield counted

    monkeypatch.setattr(dl, "progress_bar", recorded)
    screen = io.StringIO()
    dl.download(tmp_path / "tty", base_url=server.url, console=Console(file=screen, force_terminal=True, width=100))
    sizes = [len(server.files[archive.name]) for archive in dl.MANIFEST["tff-sqlite"]]
    assert bars == [{"total": n, "done": n, "terminal": True} for n in sizes]
    assert "decompressing" in screen.getvalue()
    plain = io.StringIO()
    dl.download(tmp_path / "plain", base_url=server.url, console=Console(file=plain, width=100))
    assert "\x1b" not in plain.getvalue() and "━" not in plain.getvalue()  # no bar, only the plain lines


def test_hdf5_format_takes_only_the_listed_files_from_the_tar(server: _Server, archives: dict[str, bytes],
                                                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys) -> None:
    h5 = generate(tmp_path / "original_h5", num_clients=CLIENTS, seed=3, format="tff-h5").h5
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:bz2") as tar:
        for path in h5.values():
            tar.add(path, arcname=f"./{path.name}")
        tar.add(h5["train"], arcname="../escaped.h5")
    server.files = {**archives, "stackoverflow.tar.bz2": buffer.getvalue()}
    _, *counts = dl.MANIFEST["tff-sqlite"]
    main_archive = dataclasses.replace(dl.MANIFEST["tff-h5"][0],
                                       sha256=hashlib.sha256(buffer.getvalue()).hexdigest())
    monkeypatch.setitem(dl.MANIFEST, "tff-h5", (main_archive, *counts))
    out = tmp_path / "out" / "so"
    assert main(["data", "download", "--out", str(out), "--format", "tff-h5", "--base-url", server.url]) == 0
    written = sorted(json.loads(capsys.readouterr().out))
    assert written == sorted([*(p.name for p in h5.values()), "stackoverflow.tag_count", "stackoverflow.word_count"])
    assert not (tmp_path / "out" / "escaped.h5").exists() and not (out / "escaped.h5").exists()
    assert main(["data", "stats", "--source", "tff-h5", "--path", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["splits"]["train"]["clients"] == CLIENTS


def test_an_unverifiable_corrupt_archive_fails_naming_it(server: _Server, archives: dict[str, bytes],
                                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys) -> None:
    sqlite, *counts = dl.MANIFEST["tff-sqlite"]
    monkeypatch.setitem(dl.MANIFEST, "tff-sqlite", (dataclasses.replace(sqlite, sha256=None), *counts))
    server.files = {**archives, sqlite.name: b"not lzma at all"}
    assert _download(tmp_path, server) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"fedprivacy: error: {tmp_path / dl.PARTIAL_DIR / sqlite.name}: cannot decompress")
    assert not (tmp_path / "stackoverflow.sqlite").exists()
