"""Where runs are tracked, and the MLflow client settings every tracking command shares.

`tracking_uri()` is the one place that decides the store: `MLFLOW_TRACKING_URI` when set (a server),
otherwise `sqlite:///<cwd>/mlflow.db` with artifacts in `<cwd>/mlartifacts` (MLflow 3 refuses the
old `./mlruns` file store without an opt-in). `fleetwise train`, `ui`, `compare` and `sync` all use it,
so they all see the same runs.

mlflow is imported inside functions only: `fleetwise validate`/`plan` must never pay ~2.5 s for it.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

DB_FILE = "mlflow.db"
ARTIFACT_DIR = "mlartifacts"

# MLflow's limits (mlflow.utils.validation); copied so that code which only prepares data need not
# import mlflow. tests/unit/tracking/test_params.py checks them against the installed MLflow.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_KEY = 250
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100

# A dead server must cost seconds, not minutes: MLflow's defaults (7 retries with exponential
# back-off, 120 s timeout) would stall the launcher for ~4 minutes per call. The tracker keeps its
# own spool and back-off, so it needs no HTTP-level retries (which would also log a urllib3
# warning per attempt). Values the user exported win.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")

# How MLflow's client authenticates to a server. Only the launcher talks to MLflow: ranks never get
# these (launch.py drops them from their environment), so no rank log or crash dump can show them.
CREDENTIAL_VARS = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
)
AUTH_CHECK_TIMEOUT_S = 10.0


def without_credentials(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in CREDENTIAL_VARS}


def credentials_problem(uri: str, experiment: str) -> tuple[str, str] | None:
    """(message, fix) when a tracking server refuses this client's credentials (HTTP 401/403), so
    that `fleetwise train` stops before launch instead of training into a spool nobody can deliver.
    An unreachable server is not a problem here: the spool covers outages. The password is never
    part of a message. Plain urllib: mlflow is not imported for this (~2.5 s)."""
    import base64
    import urllib.error
    import urllib.parse
    import urllib.request

    if not uri.startswith(("http://", "https://")):
        return None
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD")
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    query = urllib.parse.urlencode({"experiment_name": experiment})
    request = urllib.request.Request(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?{query}")
    if user is not None and password is not None:
        basic = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {basic}")
    elif token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=AUTH_CHECK_TIMEOUT_S):
            return None
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError):  # unreachable, or not an HTTP server: the tracker reports it
        return None
    who = f"user {user!r}" if user else ("a token" if token else "no credentials")
    if status == 401:
        given = "" if (user or token) else " (MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD are not set)"
        return (
            f"the MLflow server {uri} refused {who}: HTTP 401 Unauthorized{given}",
            "export MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD of an account on that server "
            "(or MLFLOW_TRACKING_TOKEN), or train without tracking: tracking.enabled=false",
        )
    if status == 403:
        return (
            f"the MLflow server {uri} denies {who} access to experiment {experiment!r}: HTTP 403 Forbidden",
            "ask its admin for READ/EDIT permission on the experiment, or log elsewhere: "
            "tracking.experiment=NAME",
        )
    return None


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(the URI without its user:password@, user, password) of an http(s) tracking URI."""
    import urllib.parse

    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri, None, None
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    plain = urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return plain, urllib.parse.unquote(user) or None, urllib.parse.unquote(password) if password else None


def adopt_uri_credentials() -> None:
    """A MLFLOW_TRACKING_URI with `user:password@` becomes the URI without them plus
    MLFLOW_TRACKING_USERNAME/PASSWORD (values already exported win), in this process's environment:
    MLflow's client authenticates the same, and the password never reaches what fleetwise writes or
    says (tracking.json, sweep.json, messages, logs) nor a child process (ranks, torchrun, the UI's
    server: CREDENTIAL_VARS are dropped from theirs). `fleetwise` calls it first thing."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    plain, user, password = split_credentials(uri.strip())
    if user is None and password is None:
        return
    if user is not None:
        os.environ.setdefault("MLFLOW_TRACKING_USERNAME", user)
    if password is not None:
        os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", password)
    os.environ["MLFLOW_TRACKING_URI"] = plain


def tracking_uri(cwd: Path | None = None) -> str:
    """The MLflow store every fleetwise command uses (see the module docstring); never with the
    credentials a URI may carry (adopt_uri_credentials)."""
    adopt_uri_credentials()
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        return f"sqlite:///{(cwd or Path.cwd()).resolve() / DB_FILE}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        # A relative sqlite path is relative to the cwd of whoever opens it; `fleetwise sync` may
        # run elsewhere, so record it absolute.
        return f"sqlite:///{(cwd or Path.cwd()).resolve() / uri[len('sqlite:///') :]}"
    return uri


def is_local(uri: str) -> bool:
    return uri.startswith("sqlite:")


def artifact_root(uri: str) -> Path | None:
    """Artifacts of a local sqlite store live next to the database; a server decides for itself."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///") :]).parent / ARTIFACT_DIR


def configure_http() -> None:
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def client(uri: str) -> MlflowClient:
    configure_http()
    # creating a fresh sqlite store logs two INFO lines per process (schema migration): not news
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def ensure_experiment(mlflow_client: MlflowClient, name: str, uri: str) -> str:
    """The id of experiment `name`, created (or restored from the bin) when needed."""
    from mlflow.exceptions import MlflowException

    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            mlflow_client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    root = artifact_root(uri)
    location = (root / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)).as_uri() if root else None
    try:
        return mlflow_client.create_experiment(name, artifact_location=location)
    except MlflowException:
        # Two jobs of a sweep may race to create it; the loser reads the winner's.
        exp = mlflow_client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def clean_key(key: str) -> str:
    """A metric/param key MLflow accepts: its allowed characters, no path tricks, ≤ 250 chars."""
    key = _BAD_KEY_CHARS.sub("_", key)[:MAX_KEY]
    if key in ("", ".") or posixpath.normpath(key) != key or key.startswith(("/", "..")):
        key = key.replace("/", "_").strip(".") or "_"
    return key


def rejected(exc: BaseException) -> bool:
    """True when MLflow refused the data itself (HTTP 400): retrying the same request cannot help."""
    status = getattr(exc, "get_http_status_code", None)
    return callable(status) and status() == 400


def describe(exc: BaseException) -> str:
    """One line about a failure, without MLflow's multi-line request dump."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for marker in ("Caused by ", "failed with exception "):
        if marker in text:
            text = text.split(marker, 1)[1]
    return text[:200]
