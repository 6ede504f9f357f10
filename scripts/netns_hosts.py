"""Several "hosts" on one Linux box: network namespaces with their own addresses on one switch.

Try a multi-node fleetwise job on one machine (root, or CAP_NET_ADMIN + CAP_SYS_ADMIN):

    sudo .venv/bin/python scripts/netns_hosts.py 2 -- \\
        .venv/bin/fleetwise train recipe=gpt/tiny hardware.nodes=2 hardware.devices_per_node=2 \\
        'launch.node_rank={rank}' 'launch.rdzv_endpoint={addr0}:29555' 'run.dir=/tmp/fw/{rank}'

runs the command once per host, inside that host's namespace, with {rank}, {addr} (this host's
address) and {addr0} (host 0's) filled in, waits for all of them and exits with the first non-zero
exit status (`--shape 1gbit,0.5ms`, given before the host count, gives every link between hosts
1 Gbit/s each way and 0.5 ms one way, through the user-space switch scripts/netns_link.py). Without
a command it creates the hosts, prints how to enter them (`ip netns exec NAME
...`) and keeps them until Ctrl-C or SIGTERM.

Layout: a namespace "switch" holding a bridge, and per host a namespace with a veth pair whose
one end (eth0, 10.77.0.<i+1>/24) is in the host and whose other end is a port of the bridge. The
machine's own network stack is never touched. Names carry a per-run id, so runs side by side do
not collide. Teardown -- on exit, exception, SIGTERM, SIGINT -- kills every process inside the
namespaces (SIGTERM, then SIGKILL) and deletes them (which deletes their links); a run killed with
SIGKILL leaves its namespaces behind, and the next run removes those of dead creators.

`tests/conftest.py`'s `netns_hosts` fixture is this module's `Hosts`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "fwns"  # every namespace this tool creates: fwns<creator pid>x<random>-<role>
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")
IP = "/usr/sbin/ip" if Path("/usr/sbin/ip").exists() else "ip"
LINK_SCRIPT = Path(__file__).with_name("netns_link.py")
SHAPED_MTU = 65000


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no `ip`, a sandbox without them)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([IP, *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def namespaces() -> list[str]:
    r = subprocess.run([IP, "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def pids_in(ns: str) -> list[int]:
    """Every process whose network namespace is `ns`."""
    r = subprocess.run([IP, "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def kill_all_in(ns: str, grace_s: float = 5.0) -> None:
    """SIGTERM every process in `ns`, then SIGKILL what is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = pids_in(ns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pids_in(ns):
            time.sleep(0.1)


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose creating process is gone (killed with SIGKILL)."""
    removed = []
    for ns in namespaces():
        m = _NAME.match(ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            kill_all_in(ns, grace_s=1.0)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    return removed


def probe() -> str | None:
    """Why namespaces cannot be created here, or None when they can."""
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces"
    try:
        subprocess.run([IP, "-V"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "the `ip` command (iproute2) is not installed"
    name = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    r = subprocess.run([IP, "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed ({r.stderr.strip()}): network namespaces need root or CAP_SYS_ADMIN"
    _ip("netns", "del", name, check=False)
    return None


class Hosts:
    """N hosts as network namespaces on one bridge; use as a context manager.

    hosts.names[i], hosts.addrs[i] ("10.77.0.<i+1>"), hosts.iface ("eth0", the same on every host);
    hosts.popen(i, argv, ...) starts a process in host i; hosts.link(i, up) takes its link down or
    up; hosts.wire(i, j) adds a second network between two hosts; hosts.shape(rate, delay) shapes every link (scripts/netns_link.py), hosts.unshape() undoes it;
    hosts.leftover() lists
    processes still inside any namespace; close() kills them all and deletes the namespaces."""

    iface = "eth0"

    def __init__(self, n: int, subnet: str = "10.77.0", prefix_len: int = 24):
        if not 1 <= n <= 250:
            raise ValueError(f"1..250 hosts, not {n}")
        self.n = n
        self.run_id = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{self.run_id}-sw"
        self.names = [f"{self.run_id}-h{i}" for i in range(n)]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(n)]
        self.prefix_len = prefix_len
        self.procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self.shaper: subprocess.Popen | None = None

    def __enter__(self) -> Hosts:
        why = probe()
        if why:
            raise NetnsUnavailable(why)
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            self._add_ns(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            self._plug_veth(i)

    def _plug_veth(self, i: int) -> None:
        """Host i's eth0 as one end of a veth pair whose other end is port p<i> of the bridge."""
        ns, port = self.names[i], f"p{i}"
        # both ends are born in the switch; one moves into the host and becomes its eth0
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", f"h{i}")
        _ip("-n", self.switch, "link", "set", f"h{i}", "netns", ns)
        self._configure_eth0(i, f"h{i}")
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")

    def _configure_eth0(self, i: int, dev: str, mtu: int | None = None) -> None:
        ns = self.names[i]
        _ip("-n", ns, "link", "set", dev, "name", self.iface)
        if mtu:
            _ip("-n", ns, "link", "set", self.iface, "mtu", str(mtu))
        _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/{self.prefix_len}", "dev", self.iface)
        _ip("-n", ns, "link", "set", self.iface, "up")

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)

    def wire(self, i: int, j: int, subnet: str = "10.78.0") -> tuple[str, str]:
        """A second network, a cable between hosts i and j only (eth1 on both, SUBNET.1 on i and
        .2 on j): a machine with two networks, of which a job uses one. Returns the two addresses."""
        a, b = self.names[i], self.names[j]
        _ip("-n", a, "link", "add", "eth1", "type", "veth", "peer", "name", "eth1j")
        _ip("-n", a, "link", "set", "eth1j", "netns", b)
        _ip("-n", b, "link", "set", "eth1j", "name", "eth1")
        for ns, addr in ((a, f"{subnet}.1"), (b, f"{subnet}.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth1")
            _ip("-n", ns, "link", "set", "eth1", "up")
        return f"{subnet}.1", f"{subnet}.2"

    def command(self, i: int, argv: list[str]) -> list[str]:
        """argv run inside host i."""
        return [IP, "netns", "exec", self.names[i], *argv]

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(i, argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(i, argv), **kwargs)

    def link(self, i: int, up: bool) -> None:
        """Take host i's cable out (down) or plug it back in (up): its switch port (on a shaped
        link, the host's eth0, as a NIC sees a pulled cable)."""
        if self.shaper is None:
            _ip("-n", self.switch, "link", "set", f"p{i}", "up" if up else "down")
        else:
            _ip("-n", self.names[i], "link", "set", self.iface, "up" if up else "down")

    def shape(self, rate: str = "1gbit", delay: str = "0.5ms", mtu: int = SHAPED_MTU) -> dict:
        """Every link between hosts at `rate` each way with `delay` one way (a round trip sees two);
        traffic inside a host (lo) is not shaped. The kernel is not asked (tc netem is missing
        from many, this CI's included): each host's eth0 becomes a TAP device served by
        scripts/netns_link.py, a user-space switch in the switch namespace that delays and
        paces every frame. `mtu` is the links' MTU (large: Python forwards ~50k frames/s at
        best). Returns what was applied: {"shaper", "rate", "delay", "mtu"}."""
        self.unshape()
        for ns in self.names:  # deleting one end of a veth pair deletes both
            _ip("-n", ns, "link", "del", self.iface)
        taps = [f"t{i}" for i in range(self.n)]
        argv = [sys.executable, str(LINK_SCRIPT), "--rate", rate, "--delay", delay, "--mtu", str(mtu), *taps]
        self.shaper = subprocess.Popen(
            [IP, "netns", "exec", self.switch, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = self.shaper.stdout.readline().strip()
        if ready != "ready":
            err = self.shaper.communicate(timeout=10)[1]
            self.shaper = None
            raise RuntimeError(f"netns_link.py did not start: {err.strip() or ready}")
        for i, (ns, tap) in enumerate(zip(self.names, taps, strict=True)):
            _ip("-n", self.switch, "link", "set", tap, "netns", ns)  # its open file keeps working
            self._configure_eth0(i, tap, mtu)
        return {"shaper": "netns_link.py", "rate": rate, "delay": delay, "mtu": mtu}

    def unshape(self) -> dict | None:
        """Back to plain veth links on the bridge; returns the shaper's counters (frames, bytes,
        dropped, longest queueing wait) when the links were shaped."""
        if self.shaper is None:
            return None
        self.shaper.terminate()
        try:
            err = self.shaper.communicate(timeout=10)[1]
        except subprocess.TimeoutExpired:
            self.shaper.kill()
            err = self.shaper.communicate()[1]
        self.shaper = None
        m = re.search(r"netns_link: (\{.*\})", err)
        stats = ast.literal_eval(m.group(1)) if m else None
        for i, ns in enumerate(self.names):  # the TAP devices went with the shaper's files
            _ip("-n", ns, "link", "del", self.iface, check=False)
            self._plug_veth(i)
        return stats

    def leftover(self) -> dict[str, list[int]]:
        """Processes still inside any of the namespaces (name -> pids)."""
        out = {}
        for ns in self._created:
            pids = pids_in(ns)
            if pids:
                out[ns] = pids
        return out

    def close(self) -> None:
        if self.shaper is not None:  # killed with the switch namespace's processes below
            self.procs.append(self.shaper)
            self.shaper = None
        for ns in self._created:
            kill_all_in(ns)
        for proc in self.procs:  # the `ip netns exec` children we started, reaped
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        for ns in reversed(self._created):
            _ip("netns", "del", ns, check=False)
        self._created = []


def _raise_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hosts", type=int, help="number of hosts (namespaces)")
    parser.add_argument(
        "--shape",
        metavar="RATE,DELAY",
        help="e.g. 1gbit,0.5ms: every link between hosts at RATE each way, DELAY one way",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- ARGV run once per host ({rank}, {addr}, {addr0})"
    )
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    signal.signal(signal.SIGTERM, _raise_on_signal)  # teardown runs on SIGTERM as on Ctrl-C
    signal.signal(signal.SIGHUP, _raise_on_signal)
    try:
        with Hosts(args.hosts) as hosts:
            if args.shape:
                rate, _, delay = args.shape.partition(",")
                print(f"links shaped: {hosts.shape(rate, delay or '0ms')}", flush=True)
            for i, (ns, addr) in enumerate(zip(hosts.names, hosts.addrs, strict=True)):
                print(f"host {i}: {addr} on {hosts.iface}   ip netns exec {ns} COMMAND", flush=True)
            if not command:
                print("Ctrl-C (or SIGTERM) removes the hosts", flush=True)
                while True:
                    time.sleep(3600)
            fill = {"addr0": hosts.addrs[0]}
            procs = [
                hosts.popen(i, [a.format(rank=i, addr=hosts.addrs[i], **fill) for a in command])
                for i in range(hosts.n)
            ]
            codes = [p.wait() for p in procs]
            print(f"exit codes per host: {codes}", flush=True)
            return next((c for c in codes if c != 0), 0)
    except NetnsUnavailable as err:
        print(f"netns_hosts: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
