"""The admin plane's bearer token: the one in `admin.token_env`'s variable, else one generated once and kept in a file.

The admin plane always requires a token: a listener on loopback is still reachable from every web page its operator
opens (a cross-site POST, a DNS-rebound name), and every local user. Without `admin.token_env` the gateway makes a
token on its first start, prints it once, and keeps it in `admin.token_file` for later starts and for
`portcullis keys`. By default that file is in the user's state directory, `$XDG_STATE_HOME/portcullis/admin-token`
(`~/.local/state/portcullis/admin-token` where that is unset), not beside the key store in the working directory:
the same user's `portcullis keys` finds it from any directory, and nothing that copies a working directory (a
checkout, an image build, a backup of the SQLite file) takes the credential along.

The file is created whole and never readable by anyone but its owner, even for a moment: written to a temporary file
made with mode 0600 in the same directory, then hard-linked into place, which fails rather than replaces when another
process got there first (that one's token is then read). A token file that its group or others may read is refused,
as ssh refuses such a key.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
import tempfile
from pathlib import Path

from gateway.config import AdminConfig, ConfigError

STATE_ENV = "XDG_STATE_HOME"
MAX_TOKEN_BYTES = 4096


def admin_token(admin: AdminConfig) -> str:
    """The token the admin plane requires, generating (and printing, this once) the file's when there is none."""
    if admin.token_env:
        token = os.environ.get(admin.token_env, "")
        if not token:
            raise ConfigError(f"admin.token_env: environment variable {admin.token_env} is not set")
        _check(token, f"admin.token_env: environment variable {admin.token_env}")
        return token
    path = token_file(admin)
    kept = read_token_file(path, "admin.token_file")
    if kept is not None:
        return kept
    token, created = _create(path, secrets.token_urlsafe(32))
    if created:
        print(
            f"portcullis: generated the admin token, kept in {path} (mode 0600) for later starts and for "
            f"`portcullis keys` on this machine:\n  {token}",
            file=sys.stderr,
            flush=True,
        )
    return token


def token_file(admin: AdminConfig) -> Path:
    """Where the generated token is kept: `admin.token_file`, else the default."""
    return admin.token_file if admin.token_file is not None else default_token_file()


def default_token_file() -> Path:
    """$XDG_STATE_HOME/portcullis/admin-token, else ~/.local/state/portcullis/admin-token (an empty variable is
    unset, as the XDG base directory specification says)."""
    state = os.environ.get(STATE_ENV)
    if state:
        return Path(state) / "portcullis" / "admin-token"
    try:
        home = Path.home()
    except RuntimeError:  # no $HOME and no passwd entry (a container's arbitrary uid)
        raise ConfigError(
            "admin.token_file: no home directory to keep the generated admin token in: set admin.token_file, "
            f"${STATE_ENV} or admin.token_env"
        ) from None
    return home / ".local" / "state" / "portcullis" / "admin-token"


def read_token_file(path: Path, setting: str) -> str | None:
    """The token in `path`; None when there is no such file. `setting` names where the path came from in errors."""
    try:
        with path.open("rb") as source:
            mode = os.fstat(source.fileno()).st_mode
            data = source.read(MAX_TOKEN_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{setting}: {path} may be read or written by others (mode {stat.S_IMODE(mode):04o}): `chmod 600 {path}`"
        )
    if len(data) > MAX_TOKEN_BYTES:
        raise ConfigError(f"{setting}: {path} is over {MAX_TOKEN_BYTES} bytes: not a token")
    token = data.decode("ascii", errors="replace").strip()
    _check(token, f"{setting}: {path}")
    return token


def _check(token: str, where: str) -> None:
    """A token goes in a header as it is: visible ASCII, no spaces."""
    if not token:
        raise ConfigError(f"{where} holds no token")
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"{where}: a token is visible ASCII characters without spaces")


def _create(path: Path, token: str) -> tuple[str, bool]:
    """Write `token` to `path` unless a file is there; returns the token in force and whether it is this one."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".admin-token-")  # mode 0600, O_EXCL
    except OSError as exc:
        raise ConfigError(
            f"admin.token_file: cannot create {path}: {exc.strerror}; set admin.token_file to a writable place, "
            "or admin.token_env"
        ) from None
    try:
        with os.fdopen(descriptor, "w") as out:
            os.fchmod(out.fileno(), 0o600)  # whatever the umask took away: the owner reads it back
            out.write(token + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.link(temporary, path)
    except FileExistsError:  # another gateway starting at the same moment made one first: its token is in force
        existing = read_token_file(path, "admin.token_file")
        if existing is None:
            raise ConfigError(f"admin.token_file: {path} appeared and vanished while starting") from None
        return existing, False
    except OSError as exc:
        raise ConfigError(f"admin.token_file: cannot create {path}: {exc.strerror}") from None
    finally:
        os.unlink(temporary)
    return token, True
