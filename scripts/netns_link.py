"""A shaped Ethernet switch in user space: TAP ports, a one-way delay and a rate per link.

For kernels without `tc netem` (sch_netem): scripts/netns_hosts.py runs this inside its "switch"
namespace, moves each TAP device into a host namespace as its eth0, and every frame a host sends
reaches the other host(s) through this process:

    python scripts/netns_link.py --rate 1gbit --delay 0.5ms --mtu 65000 t0 t1 [t2 ...]

creates one TAP device per name (in the calling process's network namespace; the open file keeps
working after the device is moved to another namespace), prints "ready" on stdout, and forwards
until SIGTERM/SIGINT (then prints its counters on stderr). It is a learning switch: a frame goes to
the port its destination MAC was last seen on, else (broadcast, unknown) to every other port.

The link model, per frame of L bytes from host i to host j:
- host i's uplink and host j's downlink each carry `rate` bits/s, cut-through: the frame starts on
  the downlink when it starts on the uplink, or when the downlink is free, whichever is later, and
  takes L*8/rate to serialize (so one host sending to two shares its uplink; two sending to one
  share the downlink);
- it arrives `delay` after its last bit left (one delay per direction: a round trip sees two);
- a frame that would wait more than `--queue` (default 50ms) for the downlink is dropped (a tail
  drop, as a switch buffer would), which TCP answers by slowing down.
A large MTU (65000) keeps the frame rate low enough for Python (a frame costs ~10-30 us here).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import heapq
import os
import re
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
PR_SET_TIMERSLACK = 29
BROADCAST_BIT = 0x01  # the first octet's low bit: a group (broadcast/multicast) address

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """Bits per second from tc-style text: 1gbit, 100mbit, 500kbit, 1e9 (bit/s); 0 or "" = unlimited."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?)(bit|bps)?\s*", text.lower())
    if not m:
        raise ValueError(f"rate {text!r}: expected e.g. 1gbit, 100mbit, 500kbit")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    return value * 8 if m.group(3) == "bps" else value  # tc: "bps" is bytes per second


def parse_delay(text: str) -> float:
    """Seconds from tc-style text: 0.5ms, 500us, 1s, 2 (seconds)."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*(s|ms|us|usec|msec|sec)?\s*", text.lower())
    if not m:
        raise ValueError(f"delay {text!r}: expected e.g. 0.5ms, 500us, 1s")
    scale = {None: 1, "s": 1, "sec": 1, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
    return float(m.group(1)) * scale[m.group(2)]


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Switch:
    def __init__(self, fds: list[int], rate_bps: float, delay_s: float, queue_s: float, mtu: int):
        self.fds = fds
        self.byte_time = 8 / rate_bps if rate_bps else 0.0  # seconds per byte on a link
        self.delay = delay_s
        self.queue = queue_s
        self.bufsize = mtu + 14 + 4  # Ethernet header (+ a VLAN tag)
        n = len(fds)
        self.up_free = [0.0] * n  # when each host's uplink / downlink is next idle
        self.down_free = [0.0] * n
        self.macs: dict[bytes, int] = {}
        self.pending: list[tuple[float, int, int, bytes]] = []  # (deliver at, seq, port, frame)
        self.seq = 0
        self.stats = {"frames": 0, "bytes": 0, "flooded": 0, "dropped": 0, "max_wait_s": 0.0}

    def receive(self, port: int, frame: bytes, now: float) -> None:
        if len(frame) < 14:
            return
        self.macs[frame[6:12]] = port
        dst = frame[0:6]
        out = self.macs.get(dst) if not dst[0] & BROADCAST_BIT else None
        ports = [out] if out is not None and out != port else [p for p in range(len(self.fds)) if p != port]
        if out is None:
            self.stats["flooded"] += 1
        ser = len(frame) * self.byte_time
        start_up = max(now, self.up_free[port])
        self.up_free[port] = start_up + ser
        for j in ports:
            start = max(start_up, self.down_free[j])
            wait = start - now
            if wait > self.queue:
                self.stats["dropped"] += 1
                continue
            self.stats["max_wait_s"] = max(self.stats["max_wait_s"], wait)
            self.down_free[j] = start + ser
            self.seq += 1
            heapq.heappush(self.pending, (start + ser + self.delay, self.seq, j, frame))
        self.stats["frames"] += 1
        self.stats["bytes"] += len(frame)

    def deliver_due(self, now: float) -> None:
        pending = self.pending
        while pending and pending[0][0] <= now:
            _, _, j, frame = heapq.heappop(pending)
            try:
                os.write(self.fds[j], frame)
            except OSError:  # the host's side is down or gone: the frame is lost, as on a wire
                self.stats["dropped"] += 1

    def run(self, stop: list[bool]) -> None:
        port_of = {fd: i for i, fd in enumerate(self.fds)}
        clock = time.monotonic
        while not stop[0]:
            timeout = max(0.0, self.pending[0][0] - clock()) if self.pending else 1.0
            try:
                ready, _, _ = select.select(self.fds, [], [], timeout)  # microsecond timeouts
            except InterruptedError:
                continue
            for fd in ready:
                port = port_of[fd]
                for _ in range(64):  # drain a burst, but let deliveries interleave
                    try:
                        frame = os.read(fd, self.bufsize)
                    except (BlockingIOError, OSError):
                        break
                    self.receive(port, frame, clock())
            self.deliver_due(clock())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("taps", nargs="+", help="TAP device names to create, one per host")
    parser.add_argument("--rate", default="0", help="per-link rate, e.g. 1gbit (0: unlimited)")
    parser.add_argument("--delay", default="0ms", help="one-way delay, e.g. 0.5ms")
    parser.add_argument("--queue", default="50ms", help="longest wait for a busy link before a drop")
    parser.add_argument("--mtu", type=int, default=65000)
    args = parser.parse_args(argv)
    rate, delay, queue = parse_rate(args.rate), parse_delay(args.delay), parse_delay(args.queue)
    with contextlib.suppress(OSError, AttributeError):  # wake on time: 50 us default timer slack
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    fds = [open_tap(name) for name in args.taps]
    stop = [False]

    def _stop(*_):
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    switch = Switch(fds, rate, delay, queue, args.mtu)
    print("ready", flush=True)
    switch.run(stop)
    print(f"netns_link: {switch.stats}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
