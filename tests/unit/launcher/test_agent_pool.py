"""Which launches a warm pool process may serve (launcher/agent_pool.py); the jobs themselves are
in tests/integration/test_agent_pool.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from fleetwise.launcher import agent_pool
from fleetwise.launcher.agent_pool import POOL_VAR, signature, start_pooled


def test_the_signature_is_the_environment_read_as_the_interpreter_and_torch_start():
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "MALLOC_ARENA_MAX": "2"}
    same = signature(base)
    assert signature({**base, "PATH": "/bin", "PYTEST_CURRENT_TEST": "x", "RANDOM_VAR": "1"}) == same
    # set by torch in a process once anything asks for inductor's cache (a test process, after its
    # first parity row): the same pool process still serves it, not a second one for the same start-up
    assert signature({**base, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root"}) == same
    for key, value in (("OMP_NUM_THREADS", "2"), ("OMP_WAIT_POLICY", "ACTIVE"), ("MALLOC_ARENA_MAX", "4"),
                       ("PYTHONHASHSEED", "0"), ("TORCH_SHOW_CPP_STACKTRACES", "1"), ("LD_PRELOAD", "x.so"),
                       ("LANG", "C"), ("LC_ALL", "C")):  # fmt: skip
        assert signature({**base, key: value}) != same, key


def test_no_pool_without_the_variable_nor_from_other_namespaces_unless_root(tmp_path, monkeypatch):
    monkeypatch.setenv(POOL_VAR, "")
    assert start_pooled(["python", "-m", "agent"], {}, 1) is None
    agent_pool.open_pool(tmp_path)
    assert agent_pool.pool_directory(dict(os.environ)) == tmp_path
    (tmp_path / agent_pool.NAMESPACES_FILE).write_text(json.dumps({"net": "net:[1]", "mnt": "mnt:[1]"}))
    # a test's network namespace as a host: served where a forked child can enter the launcher's
    # namespaces (root, with nsenter to start the server where the owner is), else a new
    # interpreter, and no pool process started for it
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(agent_pool.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert agent_pool.pool_directory(dict(os.environ)) == tmp_path
    monkeypatch.setattr(agent_pool.shutil, "which", lambda name: None)
    assert agent_pool.pool_directory(dict(os.environ)) is None
    monkeypatch.setattr(agent_pool.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert start_pooled(["python", "-m", "agent"], {}, 1) is None
    assert not list(tmp_path.glob("*.sock"))


# a pool server whose children print their network and mount namespaces, working directory and
# how many objects the garbage collector leaves alone (agent_pool._fork's gc.freeze)
SERVER = (
    "import gc, json, os, sys\n"
    "from fleetwise.launcher import agent_pool\n"
    "def child(request):\n"
    "    print(json.dumps([agent_pool.namespaces(), os.getcwd(), gc.get_freeze_count()]), flush=True)\n"
    "    os._exit(0)\n"
    "agent_pool.serve(sys.argv[1], int(sys.argv[2]), [], child)\n"
)
# a requester: asks the server at argv[1] for a child (its stdout this process's), prints what the
# child printed and this process's own namespaces
REQUEST = (
    "import json, os, sys\n"
    "from fleetwise.launcher import agent_pool\n"
    "me = os.getpid()\n"
    "request = {'argv': [], 'env': dict(os.environ), 'cwd': sys.argv[2], 'namespaces_of': me}\n"
    "r, w = os.pipe()\n"
    "conn, pid = agent_pool.request_fork(agent_pool.Path(sys.argv[1]), [], {}, request, [w])\n"
    "os.close(w)\n"
    "print(os.read(r, 4096).decode().strip())\n"
    "print(json.dumps(agent_pool.namespaces()))\n"
)


def test_a_server_survives_a_probe_and_its_children_enter_the_requesters_namespaces(tmp_path):
    """A probe (`_start_server`: a connection that sends nothing) is not a request: the server goes
    on (it died of it, and its agents were reported killed, when two launches started it at once). A
    requester in other namespaces (a test's host: `unshare --net --mount` here) gets a child in its
    own network and mount namespaces, in the working directory it asked for. A child's garbage
    collector leaves the objects inherited from the server alone (a launcher's CPU -40%)."""
    sock = tmp_path / "s.sock"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(sock), str(os.getpid())], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(sock))
        here = subprocess.run([sys.executable, "-c", REQUEST, str(sock), "/"], capture_output=True, text=True)
        assert here.returncode == 0 and server.poll() is None, here.stderr
        (child, cwd, frozen), mine = json.loads(here.stdout.splitlines()[0]), json.loads(here.stdout.splitlines()[1])
        assert child == mine == agent_pool.namespaces() and cwd == "/"
        assert frozen > 1000  # the server's objects (its imports), out of the child's collections
        inside = subprocess.run(
            ["unshare", "--net", "--mount", sys.executable, "-c", REQUEST, str(sock), str(tmp_path)],
            capture_output=True,
            text=True,
        )
        if inside.returncode and "unshare failed" in inside.stderr:
            pytest.skip(f"no namespaces here: {inside.stderr.strip()}")
        assert inside.returncode == 0, inside.stderr
        (child, cwd, _), theirs = json.loads(inside.stdout.splitlines()[0]), json.loads(inside.stdout.splitlines()[1])
        assert child == theirs and theirs["net"] != mine["net"] and theirs["mnt"] != mine["mnt"]
        assert cwd == str(tmp_path)
    finally:
        server.kill()
        server.wait()
