"""What lorakit lets out of the process: no secret in any text it writes or prints, and files as readable
as the user's umask says, no more.

`redact` is the one redaction function; every writer of a run directory (rundir.write_text: summary.json,
trackers.json, the resolved recipe, exit.json), the pushed card and recipe, the trackers' parameters and
the console (error messages, tracker lines and warnings) pass their text through it. It hides:
- the password (or the lone token) of a URL's user part: `https://user:pw@host` -> `https://user:***@host`,
  `postgresql://user:pw@db/mlflow` -> `postgresql://user:***@db/mlflow`, `https://TOKEN@host` -> `https://***@host`;
- the value of a query parameter that carries a credential (`?token=`, `access_token`, `api_key`, `sig`, ...);
- Hugging Face tokens (`hf_...`) wherever they appear;
- the value of every secret-named environment variable (HF_TOKEN, WANDB_API_KEY, MLFLOW_TRACKING_PASSWORD,
  anything ending in _TOKEN, _API_KEY, _SECRET, _PASSWORD, ...) wherever it appears verbatim.

`format_exception` is the traceback of an error that is not lorakit's own (a tokenizer's, datasets', a
tracker's), as the CLIs print it and as a worker leaves it for torchrun: Python's text, redacted, with the
home directory written as `~` (tracebacks get pasted into issues and CI logs; the user's name is no help).
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Mapping
from typing import Any

MASK = "***"

# scheme://user:password@ or scheme://token@ (the part before the first '@' of the authority); also with
# one slash, as a URL reads once a library took it for a path and normalised it (`/data/https:/u:pw@host`).
_USERINFO = re.compile(
    r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*:/{1,2})(?P<user>[^/\s:@?#]*)(?::(?P<pw>[^/\s@?#]*))?@"
)
_QUERY_KEYS = (
    "token|access_token|auth_token|id_token|refresh_token|api_key|apikey|key|password|passwd|pwd|secret|"
    "client_secret|sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token|code"
)
_QUERY = re.compile(rf"(?P<lead>[?&;](?:{_QUERY_KEYS})=)(?P<value>[^&#\s\"']+)", re.IGNORECASE)
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
# Environment variables whose values are credentials, by name.
_SECRET_NAME = re.compile(
    r"(^|_)(TOKEN|API_KEY|APIKEY|SECRET|SECRET_KEY|SECRET_ACCESS_KEY|PASSWORD|PASSWD|ACCESS_KEY)$",
    re.IGNORECASE,
)
# Shorter values are not replaced wherever they occur: "1234" would blank out numbers.
_MIN_SECRET_CHARS = 8


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the secret-named variables of `environ` (default: this process's), longest first."""
    env = os.environ if environ is None else environ
    found = {v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= _MIN_SECRET_CHARS}
    return sorted(found, key=len, reverse=True)


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with every credential it holds replaced by `***` (see the module docstring)."""
    for value in secret_values(environ):
        text = text.replace(value, MASK)
    text = _USERINFO.sub(_hide_userinfo, text)
    text = _QUERY.sub(lambda m: m["lead"] + MASK, text)
    return _HF_TOKEN.sub("hf_" + MASK, text)


def format_exception(error: BaseException, environ: Mapping[str, str] | None = None) -> str:
    """The traceback Python would print for `error` (its causes included), redacted, the home directory
    (HOME of `environ`, default this process's) written as `~`."""
    text = redact("".join(traceback.format_exception(error)), environ)
    home = (os.environ if environ is None else environ).get("HOME", "").rstrip("/")
    if home:
        text = re.sub(rf"(?<![\w.~/-]){re.escape(home)}(?![\w.-])", "~", text)
    return text


def _hide_userinfo(m: re.Match) -> str:
    if m["pw"] is not None:
        return f"{m['scheme']}{m['user']}:{MASK}@"
    # A lone user part is a token more often than a name (https://TOKEN@github.com).
    return f"{m['scheme']}{MASK}@" if m["user"] else m[0]


def redact_data(obj: Any, environ: Mapping[str, str] | None = None) -> Any:
    """`obj` (JSON-like: dicts, lists, strings, numbers) with `redact` applied to every string in it."""
    if isinstance(obj, str):
        return redact(obj, environ)
    if isinstance(obj, Mapping):
        return {k: redact_data(v, environ) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact_data(v, environ) for v in obj]
    return obj


def umask() -> int:
    """This process's umask (read without changing it where Linux says it in /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and put back at once
    os.umask(mask)
    return mask


def file_mode(directory: bool = False) -> int:
    """The mode a plain `open(path, "w")` would give a new file: 0o666 less the umask (a directory:
    0o777 less the umask, as mkdir gives it). For files written
    through a temp file (mkstemp makes them 0o600), so they end up as readable as any other file the user
    writes: a private umask (077) keeps them private, a shared one (022) lets the group read them."""
    return (0o777 if directory else 0o666) & ~umask()
