"""Two hosts on one machine: two network namespaces joined by a veth pair, plus faults.

    with TwoHosts(workdir) as net:                      # creates everything; removes it on exit
        a, b = net.a, net.b                             # Host: .netns .dev .addr
        p = a.popen(["python", "-m", "..."], name="prefill", env=a.env())   # a process on host a
        net.cut(); ...; net.restore()                   # link down / up (both ends lose carrier)
    with TwoHosts(workdir, link="relay") as net:       # taps joined by a user-space relay instead
        with net.delay(20): ...                         # 20 ms one way, each direction
        with net.cut_during(): ...                      # the same, as a block
        timer = net.cut_for(3.0)                        # down now, up again in 3 s (a thread)
        with net.loss(1.0): ...                         # nftables: drop 1% of packets each way
        p.pause(); p.resume(); p.kill()                 # SIGSTOP / SIGCONT / SIGKILL, its log in p.log_path

What it builds (root only; CI runs as root):

* namespaces ``pdwire-<pid>-<n>-a`` and ``...-b`` (the creating pid in the name, so that
  parallel runs never clash and leftovers of a killed run are recognised), each with
  loopback up and one end of a veth pair (``pw<n>a`` / ``pw<n>b``, unique too) carrying
  ``10.251.0.1/24`` and ``10.251.0.2/24``. The pair is a private wire: the namespaces have
  no route to each other but it, nor to anything else (addresses can be the same in every
  instance, since no two instances share a network).
* nothing in the root namespace: deleting the two namespaces deletes the veth pair and any
  nftables table in them.
* with ``link="relay"`` the wire is two tap devices of the same names instead, joined by
  ``tests/support/relay.py`` (a process in the root namespace that copies frames and can
  hold them for a delay); killing the relay removes the taps.

Clean-up: :meth:`TwoHosts.close` (the context manager's exit, and an ``atexit`` hook for a
run that never reaches it) kills every process started through :meth:`Host.popen` (its
whole process group, also when stopped), then every process still inside the namespaces,
then deletes both namespaces. A new instance first deletes the namespaces of runs whose pid
is gone (a test run killed with SIGKILL).

Faults, without netem (this kernel has none):

* link cut: ``ip link set <dev> down`` on host a's end (both ends lose carrier; TCP
  connections survive a short cut and resume, packets sent meanwhile are retransmitted);
* loss: an nftables rule on each host's veth end that drops a share of the packets it
  receives (``netdev`` ingress, ``numgen random mod 10000 < <per10k> drop``): the sender
  learns nothing, as with loss on a wire (a drop on egress would hand the sending socket an
  error at once);
* delay (``link="relay"``): :meth:`TwoHosts.set_delay` / :meth:`TwoHosts.delay`;
* anything else with :meth:`Host.nft` (a ruleset of your own in a namespace) and
  :meth:`Host.run` (any command inside the namespace), e.g. dropping one port only.

Transfer engines across the namespaces (see ``Host.env``): NIXL/UCX needs
``UCX_NET_DEVICES=<dev>`` and ``UCX_TLS=tcp`` (the namespaces share one kernel and one pid
namespace, so UCX would otherwise pick shared memory or cma, which no network fault
touches); Mooncake needs ``hostname=<addr>``. The ``local`` backend (files in /dev/shm)
crosses namespaces without the network and is no two-host test.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

SUBNET = "10.251.0"
_ROOT = Path(__file__).resolve().parents[2]
_counter = itertools.count()
_NAME = re.compile(r"^pdwire-(\d+)-(\d+)-[ab]$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(netns: str) -> None:
    out = _ip("netns", "pids", netns, check=False).stdout.split()
    for text in out:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(text), signal.SIGCONT)
            os.kill(int(text), signal.SIGKILL)


def reap_stale() -> list[str]:
    """Delete namespaces left by runs of this fixture whose process is gone; their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_netns_pids(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Proc:
    """A process started on a host: its own process group, its output in ``log_path``."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def pause(self) -> None:
        """SIGSTOP the whole group: sockets stay open, nothing is read or written."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (a clean stop), then wait; SIGKILL if it does not exit in time (a hang guard, not
        a speed target: a rank drains its rooms first, slow on a loaded machine). The exit code."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Host:
    name: str  # "a" or "b"
    netns: str
    dev: str
    addr: str
    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(
        self, argv: Sequence[str], *, timeout_s: float = 60, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this host's namespace; with ``check``, a failure names its stderr."""
        out = subprocess.run(
            self.command(argv), capture_output=True, text=True, timeout=timeout_s, input=input, check=False
        )
        if check and out.returncode != 0:
            raise RuntimeError(
                f"host {self.name}: {' '.join(argv)} exited {out.returncode}: {out.stderr.strip()}"
            )
        return out

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a transfer engine needs to use this host's veth end, not loopback."""
        env = dict(os.environ if base is None else base)
        env.update({"UCX_NET_DEVICES": self.dev, "UCX_TLS": "tcp"})
        return env

    def popen(
        self,
        argv: Sequence[str],
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: int | None = subprocess.DEVNULL,
    ) -> Proc:
        """Start ``argv`` inside this host's namespace, in its own process group, logging to a file."""
        log_path = self.workdir / f"{self.name}-{name}-{len(self.procs)}.log"
        with open(log_path, "wb") as log:
            p = subprocess.Popen(
                self.command(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=stdin,
                env=dict(env) if env is not None else self.env(),
                cwd=cwd,
                start_new_session=True,
            )
        proc = Proc(name, p, log_path)
        self.procs.append(proc)
        return proc

    def nft(self, ruleset: str) -> None:
        """Load an nftables ruleset inside this namespace (``nft -f -``)."""
        self.run(["nft", "-f", "-"], input=ruleset)

    def set_link(self, up: bool) -> None:
        _ip("-n", self.netns, "link", "set", self.dev, "up" if up else "down")


class TwoHosts:
    """Two network namespaces joined by a veth pair; see the module docstring."""

    def __init__(self, workdir: str | os.PathLike[str], *, link: str = "veth") -> None:
        if link not in ("veth", "relay"):
            raise ValueError(
                f"link {link!r}: 'veth' (a veth pair) or 'relay' (taps joined by a delaying relay)"
            )
        if os.geteuid() != 0:
            raise RuntimeError("network namespaces need root (CI runs the tests as root)")
        reap_stale()
        n = next(_counter)
        base = f"pdwire-{os.getpid()}-{n}"
        tag = f"{os.getpid() % 100000}{n}"[-9:]
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.a = Host("a", f"{base}-a", f"pw{tag}a", f"{SUBNET}.1", workdir)
        self.b = Host("b", f"{base}-b", f"pw{tag}b", f"{SUBNET}.2", workdir)
        self.link = link
        self.workdir = workdir
        self.relay: Proc | None = None
        self._control = workdir / f"relay-{tag}.sock"
        self._closed = False
        self._timers: list[threading.Thread] = []
        self._lossy = False
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    @property
    def hosts(self) -> tuple[Host, Host]:
        return (self.a, self.b)

    def _create(self) -> None:
        a, b = self.a, self.b
        for h in (a, b):
            _ip("netns", "add", h.netns)
        if self.link == "veth":
            _ip(
                "link",
                "add",
                a.dev,
                "netns",
                a.netns,
                "type",
                "veth",
                "peer",
                "name",
                b.dev,
                "netns",
                b.netns,
            )
        else:
            self._start_relay()
        for h in (a, b):
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
            _ip("-n", h.netns, "link", "set", h.dev, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")

    def _start_relay(self) -> None:
        cmd = [sys.executable, "-u", "-m", "tests.support.relay", self.a.dev, self.b.dev, str(self._control)]
        log_path = self.workdir / f"relay-{self.a.dev}.log"
        with open(log_path, "wb") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=_ROOT, start_new_session=True)
        self.relay = Proc("relay", p, log_path)
        deadline = time.monotonic() + 30
        while "ready" not in self.relay.log():
            if not self.relay.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the relay did not start: {self.relay.log()[-2000:]}")
            time.sleep(0.02)
        for h in self.hosts:  # an open tap keeps working after its move
            _ip("link", "set", h.dev, "netns", h.netns)

    def _relay_command(self, line: str) -> str:
        if self.relay is None:
            raise RuntimeError("delay needs TwoHosts(..., link='relay')")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self._control))
            s.sendall(line.encode())
            answer = s.recv(200).decode().strip()
        if not answer.startswith("ok"):
            raise RuntimeError(f"relay: {answer}")
        return answer

    # ------------------------------------------------------------------ faults

    def set_delay(self, ms: float) -> None:
        """One-way delay of every frame, each direction (``link="relay"`` only)."""
        self._relay_command(f"delay {ms}")

    @contextlib.contextmanager
    def delay(self, ms: float) -> Iterator[None]:
        self.set_delay(ms)
        try:
            yield
        finally:
            self.set_delay(0)

    def relay_stats(self) -> dict[str, int]:
        """Frames and bytes the relay delivered so far."""
        words = self._relay_command("stats").split()[1:]
        return {k: int(v) for k, v in (w.split("=") for w in words)}

    def cut(self) -> None:
        """Take the link down (host a's end; host b's end loses carrier with it)."""
        self.a.set_link(False)

    def restore(self) -> None:
        self.a.set_link(True)

    @contextlib.contextmanager
    def cut_during(self) -> Iterator[None]:
        self.cut()
        try:
            yield
        finally:
            self.restore()

    def cut_for(self, seconds: float) -> threading.Thread:
        """Cut now and restore after ``seconds`` on a thread (join it to wait for the restore)."""
        self.cut()

        def later() -> None:
            time.sleep(seconds)
            if not self._closed:
                self.restore()

        t = threading.Thread(target=later, name="pdwire-netns-restore", daemon=True)
        t.start()
        self._timers.append(t)
        return t

    def set_loss(self, percent: float) -> None:
        """Drop ``percent`` % of the packets each host sends on its veth end (0 removes the rule)."""
        per10k = round(percent * 100)
        if not 0 <= per10k <= 10000:
            raise ValueError(f"loss {percent}% is outside 0..100")
        rule = "drop" if per10k == 10000 else f"numgen random mod 10000 < {per10k} drop"
        for h in self.hosts:
            if self._lossy:
                h.run(["nft", "delete", "table", "netdev", "pdwire_fault"], check=False)
            if per10k:
                h.nft(
                    "table netdev pdwire_fault {\n"
                    "  chain ingress {\n"
                    f'    type filter hook ingress device "{h.dev}" priority 0; policy accept;\n'
                    f"    {rule}\n"
                    "  }\n"
                    "}\n"
                )
        self._lossy = per10k > 0

    @contextlib.contextmanager
    def loss(self, percent: float) -> Iterator[None]:
        self.set_loss(percent)
        try:
            yield
        finally:
            self.set_loss(0)

    # ------------------------------------------------------------------ clean-up

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self.hosts:
            for p in h.procs:
                p.kill()
        if self.relay is not None:
            self.relay.kill()
        for h in self.hosts:
            _kill_netns_pids(h.netns)
            _ip("netns", "del", h.netns, check=False)
        self._control.unlink(missing_ok=True)
        atexit.unregister(self.close)

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
