"""Where a Ray cluster's token lives, and the switch that keeps a local one on loopback: what the drivers
(runtime.init_ray) and the ops tools (ops/local_cluster.py) both need, in a module of the core package so that
the core imports nothing from ops."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

# Ray's own single-machine mode (the default on macOS and Windows): the node's address is 127.0.0.1, so the
# GCS, raylet, object manager, agents and the metrics port all listen on loopback, and no other machine can join.
LOOPBACK_ONLY_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Where Ray reads the token (in this order): the token itself, a file named by a variable, ~/.ray/auth_token.
TOKEN_VAR = "RAY_AUTH_TOKEN"
TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"


def token_file(env: Mapping[str, str]) -> Path | None:
    """The file this environment's Ray reads its token from; None when RAY_AUTH_TOKEN holds the token itself."""
    if env.get(TOKEN_VAR):
        return None
    if env.get(TOKEN_PATH_VAR):
        return Path(env[TOKEN_PATH_VAR]).expanduser()
    return Path(env.get("HOME") or Path.home()) / ".ray" / "auth_token"


def ensure_private_token(env: Mapping[str, str]) -> Path | None:
    """Make sure the token file of `env` exists and only its owner can read it; returns it (None: no file).

    `ray get-auth-token --generate` and a new local `ray.init()` write the token with the umask's mode (0644
    under the usual umask: readable by every user of the machine, and anyone holding it can run code on the
    cluster). So a missing token is made here as Ray makes one (256 random bits, hex), but created 0600 in a
    0700 directory, and a token readable by others is made private.
    """
    path = token_file(env)
    if path is None:
        return None
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            path.chmod(0o600)
            logger.warning("the Ray token %s was readable by others (mode %o); made it 0600", path, mode)
        return path
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(32))
    logger.info("made a Ray token in %s (mode 600)", path)
    return path
