"""Fetching an adapter file over HTTP(S): size-capped, into a temporary file, checked by SHA-256."""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from runtime.errors import DataLossError, InvalidArgumentError, ResourceExhaustedError

_CHUNK = 1 << 20
_GGUF_MAGIC = b"GGUF"  # at byte 0 of every GGUF file
_TFLITE_IDENTIFIER = b"TFL3"  # at byte 4 of every .tflite flatbuffer


def check_sha256(digest: object, field: str = "sha256") -> str:
    """``digest`` in lower case if it is 64 hex digits, else ``InvalidArgumentError``."""
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
        raise InvalidArgumentError(f"{field}={digest!r:.80}: expected 64 hex digits (the file's SHA-256)")
    return digest.lower()


def download(url: str, directory: Path, *, prefix: str, sha256: str, max_bytes: int, timeout_s: float) -> Path:
    """Downloads ``url`` into a new hidden file in ``directory`` (so that renaming it into
    place is atomic) and returns its path. Refuses more than ``max_bytes``; a body whose
    SHA-256 is not ``sha256`` is deleted and reported as ``DataLossError``."""
    expected = check_sha256(sha256)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise InvalidArgumentError(f"url {url!r:.200}: only http:// and https:// URLs can be loaded")
    request = urllib.request.Request(url, headers={"User-Agent": "runtime-serve"})
    handle, name = tempfile.mkstemp(dir=directory, prefix=f".{prefix}.", suffix=".download")
    path = Path(name)
    try:
        with os.fdopen(handle, "wb") as out:
            digest = _copy(request, out, url, max_bytes, timeout_s)
        if digest != expected:
            raise DataLossError(f"{url}: SHA-256 is {digest}, expected {expected}; the download was discarded")
        return path
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def adapter_suffix(path: Path) -> str:
    """``".gguf"`` or ``".tflite"`` from the file's first bytes, else ``InvalidArgumentError``."""
    with open(path, "rb") as file:
        head = file.read(8)
    if head[:4] == _GGUF_MAGIC:
        return ".gguf"
    if head[4:8] == _TFLITE_IDENTIFIER:
        return ".tflite"
    raise InvalidArgumentError("the downloaded file is neither a .tflite LoRA file nor a GGUF LoRA")


def _copy(request: urllib.request.Request, out, url: str, max_bytes: int, timeout_s: float) -> str:
    digest = hashlib.sha256()
    received = 0
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise ResourceExhaustedError(f"{url}: {int(declared):,} bytes exceeds the download cap of {max_bytes:,} bytes")
            while chunk := response.read(_CHUNK):
                received += len(chunk)
                if received > max_bytes:
                    raise ResourceExhaustedError(f"{url}: more than the download cap of {max_bytes:,} bytes")
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as exc:
        raise InvalidArgumentError(f"{url}: the server answered HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InvalidArgumentError(f"{url}: download failed: {reason}") from None
    return digest.hexdigest()
