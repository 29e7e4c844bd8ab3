"""An emulated edge testbed: network namespaces on a bridge, each a "device" with its own
address, its own sshd and host key, an mDNS ``_ssh._tcp`` advertisement, and tc-shaped
bandwidth per ordered device pair.

Why namespaces: deployment, discovery and profiling are then tested against real sshd,
real multicast and real shaped TCP, not mocks. Shaping is an htb class per destination on
each namespace's egress, selected by a u32 filter on the destination address, so the link
A→B is capped independently of B→A. This kernel has no netem: added latency must come
from the agent's send-path emulation hook (see docs/devices.md).

The state (namespaces, pids, keys) lives in a small JSON file in the testbed's state
directory, so ``down`` and ``status`` work from another process, and ``up`` first removes
the leftovers of an earlier crash. Everything here needs root.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from core.errors import EdgeShardError, FormatError
from core.reporting import NullReporter, Reporter

DEFAULT_NAME = "edge"
DEFAULT_SUBNET = "10.77.0.0/24"
STATE_ROOT = Path("/run/edgeshard")
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class TestbedError(EdgeShardError):
    """The testbed cannot be built or removed (not root, a command failed, bad links file)."""


class LinkCap(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A bandwidth cap on the directed link src → dst (device names like ``edge1``)."""

    src: str
    dst: str
    bandwidth_mbit_s: float


class LinksFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``--links FILE``: caps per ordered pair; pairs not listed use ``default_mbit_s`` (None: unshaped)."""

    links: tuple[LinkCap, ...] = ()
    default_mbit_s: float | None = None


class TestbedDevice(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    namespace: str
    address: str
    ssh_port: int
    host_key_path: str
    host_veth: str
    sshd_pid: int = 0
    mdns_pid: int = 0


class TestbedState(msgspec.Struct, frozen=True, kw_only=True):
    """What ``up`` built; written to ``testbed.json`` in the state directory."""

    name: str
    state_dir: str
    bridge: str
    subnet: str
    host_address: str
    ssh_user: str
    operator_key: str
    """Private key (ed25519, no passphrase) that every device's sshd accepts."""
    devices: tuple[TestbedDevice, ...]
    links: tuple[LinkCap, ...] = ()

    def device(self, name: str) -> TestbedDevice:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def known_hosts_lines(self) -> list[str]:
        """known_hosts entries for the devices' host keys (for tests and trusted setups)."""
        lines = []
        for d in self.devices:
            pub = Path(d.host_key_path + ".pub").read_text().split()
            host = d.address if d.ssh_port == 22 else f"[{d.address}]:{d.ssh_port}"
            lines.append(f"{host} {pub[0]} {pub[1]}")
        return lines


def free_subnet(first: int, second_octet: int = 79) -> str:
    """A 10.<second_octet>.X.0/24 that no interface of this machine is on (another testbed may be),
    trying X = first, first + 1, … (mod 250)."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
    for k in range(250):
        x = (first + k) % 250
        if f" 10.{second_octet}.{x}." not in used:
            return f"10.{second_octet}.{x}.0/24"
    raise TestbedError(f"every 10.{second_octet}.X.0/24 is in use on this machine: take a testbed down first")


def state_dir_for(name: str = DEFAULT_NAME, root: Path | None = None) -> Path:
    return (root or STATE_ROOT) / f"testbed-{name}"


def _names(name: str, i: int) -> tuple[str, str, str]:
    """(device name, namespace, host-side veth) of device i (1-based); ≤ 15 chars for links."""
    return f"{name}{i}", f"es-{name}{i}", f"es{name}{i}"


def bridge_name(name: str) -> str:
    return f"es{name}br"


def _root_error() -> TestbedError:
    return TestbedError(
        "the netns testbed needs root (network namespaces, a bridge and tc); "
        "without root use `edgeshard cluster local -n N` (agents on loopback with emulated links)"
    )


def _run(*args: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def load_links_file(path: str | os.PathLike) -> LinksFile:
    from core.formats import load

    return load(path, LinksFile)


def resolve_links(devices: list[str], bandwidth_mbit_s: float | None, links: LinksFile | None,
                  source: str = "--links") -> tuple[LinkCap, ...]:
    """Caps for every ordered pair that has one; rejects unknown devices and bad rates."""
    out: dict[tuple[str, str], float] = {}
    default = bandwidth_mbit_s if links is None else links.default_mbit_s
    if default is not None:
        if not default > 0:
            raise FormatError(source, f"bandwidth must be > 0 Mbit/s, got {default}")
        for a in devices:
            for b in devices:
                if a != b:
                    out[(a, b)] = float(default)
    for i, l in enumerate(links.links if links else ()):
        for end in (l.src, l.dst):
            if end not in devices:
                raise FormatError(source, f"unknown device {end!r} (devices: {', '.join(devices)})",
                                  f"$.links[{i}]")
        if l.src == l.dst:
            raise FormatError(source, "a link needs two different devices", f"$.links[{i}]")
        if not l.bandwidth_mbit_s > 0:
            raise FormatError(source, "bandwidth_mbit_s must be > 0", f"$.links[{i}].bandwidth_mbit_s")
        out[(l.src, l.dst)] = float(l.bandwidth_mbit_s)
    return tuple(LinkCap(src=a, dst=b, bandwidth_mbit_s=v) for (a, b), v in sorted(out.items()))


def _write_sshd_config(dev_dir: Path, address: str, port: int, authorized_keys: Path) -> Path:
    conf = dev_dir / "sshd_config"
    conf.write_text(
        "\n".join([
            f"Port {port}",
            f"ListenAddress {address}",
            f"HostKey {dev_dir / 'ssh_host_ed25519_key'}",
            f"PidFile {dev_dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized_keys}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "Subsystem sftp internal-sftp",
            "LogLevel VERBOSE",
            "",
        ])
    )
    return conf


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True, timeout=30)


def _spawn(ns: str, args: list[str], log: Path) -> int:
    """Start a daemon inside ``ns`` in its own session (outlives the CLI that started it)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *args], stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    return proc.pid


def _shape(ns: str, addresses: dict[str, str], caps: list[LinkCap]) -> None:
    """htb on the namespace's egress: one class per capped destination, u32 dst filters."""
    if not caps:
        return
    # One packet per skb (no GSO super-packets) and a bucket of ~1 ms: htb then paces each
    # packet, so a small message on a slow link takes about its size / rate, as on a real
    # link. With GSO and the default burst a 2 KiB message passed at once on a 0.5 Mbit/s
    # cap as long as the average rate stayed under it (docs/devices.md).
    _run("ip", "link", "set", "dev", "eth0", "gso_max_segs", "1", ns=ns)
    _run("tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "999", ns=ns)
    _run("tc", "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:999", "htb",
         "rate", "10gbit", "quantum", "200000", ns=ns)
    for k, cap in enumerate(caps, start=10):
        rate = f"{cap.bandwidth_mbit_s * 1000:.0f}kbit"
        burst = f"{max(100, round(cap.bandwidth_mbit_s * 1e6 / 8 / 1000))}b"  # ~1 ms of the rate
        _run("tc", "class", "add", "dev", "eth0", "parent", "1:", "classid", f"1:{k}", "htb",
             "rate", rate, "ceil", rate, "burst", burst, "cburst", burst, ns=ns)
        _run("tc", "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "ip", "dst", f"{addresses[cap.dst]}/32", "flowid", f"1:{k}", ns=ns)


def _wait_tcp(address: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def testbed_up(
    devices: int,
    *,
    bandwidth_mbit_s: float | None = None,
    links: LinksFile | None = None,
    name: str = DEFAULT_NAME,
    subnet: str = DEFAULT_SUBNET,
    state_root: Path | None = None,
    advertise_mdns: bool = True,
    reporter: Reporter | None = None,
) -> TestbedState:
    """Build the testbed (after removing any leftovers of the same name) and return its state."""
    rep = reporter or NullReporter()
    if os.geteuid() != 0:
        raise _root_error()
    if not _NAME_RE.match(name):
        raise TestbedError(f"testbed name {name!r} must be 1-8 lowercase letters/digits, starting with a letter")
    net = ipaddress.ip_network(subnet, strict=True)
    if not 1 <= devices <= min(64, net.num_addresses - 3):
        raise TestbedError(f"--devices must be between 1 and {min(64, net.num_addresses - 3)}, got {devices}")
    hosts = list(net.hosts())
    names = [_names(name, i)[0] for i in range(1, devices + 1)]
    caps = resolve_links(names, bandwidth_mbit_s, links)

    testbed_down(name=name, state_root=state_root, reporter=rep)
    sdir = state_dir_for(name, state_root)
    sdir.mkdir(parents=True, exist_ok=True)
    os.chmod(sdir, 0o700)
    bridge = bridge_name(name)
    host_address = str(hosts[-1])
    # Record a skeleton first: a crash half-way leaves a state that `down` can clean.
    skeleton = TestbedState(name=name, state_dir=str(sdir), bridge=bridge, subnet=subnet,
                            host_address=host_address, ssh_user="root", operator_key="", devices=(),
                            links=caps)
    _save_state(sdir, skeleton)
    try:
        rep.status(f"bridge {bridge} ({host_address}/{net.prefixlen})")
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{host_address}/{net.prefixlen}", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        key = sdir / "operator_key"
        _keygen(key, f"edgeshard-testbed-{name}")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        addresses = {n: str(hosts[i]) for i, n in enumerate(names)}
        built: list[TestbedDevice] = []
        for i in range(1, devices + 1):
            dev, ns, veth = _names(name, i)
            addr = addresses[dev]
            rep.status(f"{dev}: namespace {ns} at {addr}")
            rep.progress(i - 1, devices)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _run("ip", "link", "set", f"{veth}p", "netns", ns)
            _run("ip", "link", "set", veth, "master", bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "link", "set", f"{veth}p", "name", "eth0", ns=ns)
            _run("ip", "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0", ns=ns)
            _run("ip", "link", "set", "eth0", "up", ns=ns)
            _run("ip", "link", "set", "lo", "up", ns=ns)
            _shape(ns, addresses, [c for c in caps if c.src == dev])
            ddir = sdir / dev
            ddir.mkdir()
            _keygen(ddir / "ssh_host_ed25519_key", f"{dev}-host")
            conf = _write_sshd_config(ddir, addr, 22, Path(str(key) + ".pub"))
            sshd_pid = _spawn(ns, ["/usr/sbin/sshd", "-D", "-e", "-f", str(conf)], ddir / "sshd.log")
            mdns_pid = 0
            if advertise_mdns:
                mdns_pid = _spawn(ns, [sys.executable, str(Path(__file__).with_name("mdns_advertiser.py")), "--address", addr,
                                       "--instance", dev, "--hostname", dev, "--port", "22"],
                                  ddir / "mdns.log")
            built.append(TestbedDevice(name=dev, namespace=ns, address=addr, ssh_port=22,
                                       host_key_path=str(ddir / "ssh_host_ed25519_key"),
                                       host_veth=veth, sshd_pid=sshd_pid, mdns_pid=mdns_pid))
            _save_state(sdir, msgspec.structs.replace(skeleton, operator_key=str(key), devices=tuple(built)))
        for d in built:
            if not _wait_tcp(d.address, d.ssh_port, 10.0):
                log = (sdir / d.name / "sshd.log").read_text(errors="replace")[-2000:]
                raise TestbedError(f"{d.name}: sshd did not start listening on {d.address}:22\n{log}")
        rep.progress(devices, devices)
        state = msgspec.structs.replace(skeleton, operator_key=str(key), devices=tuple(built))
        _save_state(sdir, state)
        return state
    except BaseException:
        testbed_down(name=name, state_root=state_root)
        raise


def _save_state(sdir: Path, state: TestbedState) -> None:
    tmp = sdir / "testbed.json.tmp"
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, sdir / "testbed.json")


def testbed_status(name: str = DEFAULT_NAME, state_root: Path | None = None) -> TestbedState | None:
    """The recorded state of a running testbed, or None when none is up."""
    f = state_dir_for(name, state_root) / "testbed.json"
    if not f.exists():
        return None
    try:
        return msgspec.json.decode(f.read_bytes(), type=TestbedState)
    except msgspec.DecodeError as err:
        raise FormatError(str(f), str(err)) from None


def _namespaces() -> list[str]:
    proc = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            alive.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in alive:
        _reap(pid)


def _alive(pid: int) -> bool:
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of another parent counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def testbed_down(name: str = DEFAULT_NAME, state_root: Path | None = None,
                 reporter: Reporter | None = None) -> bool:
    """Remove every trace of the testbed: processes in its namespaces, namespaces, bridge,
    veths, state directory. Idempotent; returns whether anything was there."""
    rep = reporter or NullReporter()
    if os.geteuid() != 0:
        raise _root_error()
    found = False
    prefix = f"es-{name}"
    state = None
    try:
        state = testbed_status(name, state_root)
    except FormatError:
        pass
    ours = [ns for ns in _namespaces() if re.fullmatch(re.escape(prefix) + r"\d+", ns)]
    pids: list[int] = []
    if state:
        pids += [p for d in state.devices for p in (d.sshd_pid, d.mdns_pid) if p]
    for ns in ours:
        # Everything still running in our namespaces is ours: daemons and deployed agents.
        out = _run("ip", "netns", "pids", ns, check=False).stdout
        pids += [int(p) for p in out.split() if p.isdigit()]
    if pids:
        rep.status(f"stopping {len(set(pids))} processes")
        _kill_pids(sorted(set(pids)))
    for ns in ours:
        found = True
        rep.status(f"removing namespace {ns}")
        _run("ip", "netns", "del", ns, check=False)
    bridge = bridge_name(name)
    if Path(f"/sys/class/net/{bridge}").exists():
        found = True
        _run("ip", "link", "del", bridge, check=False)
    for p in Path("/sys/class/net").iterdir():
        if re.fullmatch(rf"es{re.escape(name)}\d+p?", p.name):
            found = True
            _run("ip", "link", "del", p.name, check=False)
    sdir = state_dir_for(name, state_root)
    if sdir.exists():
        found = True
        shutil.rmtree(sdir, ignore_errors=True)
    return found


def leftovers(name: str = DEFAULT_NAME) -> list[str]:
    """Anything of the testbed still present (namespaces, links, qdiscs): empty when clean."""
    out = [f"namespace {ns}" for ns in _namespaces() if re.fullmatch(rf"es-{re.escape(name)}\d+", ns)]
    for p in Path("/sys/class/net").iterdir():
        if p.name == bridge_name(name) or re.fullmatch(rf"es{re.escape(name)}\d+p?", p.name):
            out.append(f"link {p.name}")
    qd = _run("tc", "qdisc", "show", check=False).stdout
    out += [f"qdisc {line}" for line in qd.splitlines() if f"es{name}" in line]
    return out


def state_as_json(state: TestbedState) -> str:
    return json.dumps(msgspec.to_builtins(state), indent=2)


def reinstall_device(device_name: str, name: str = DEFAULT_NAME, state_root: Path | None = None) -> TestbedState:
    """Give a device a fresh host key and restart its sshd, as a reinstalled machine would
    look (what a changed host key warning is about); returns the updated state."""
    state = testbed_status(name, state_root)
    if state is None:
        raise TestbedError(f"testbed {name} is not running")
    dev = state.device(device_name)
    _kill_pids([dev.sshd_pid])
    key = Path(dev.host_key_path)
    key.unlink(missing_ok=True)
    Path(str(key) + ".pub").unlink(missing_ok=True)
    _keygen(key, f"{dev.name}-host-reinstalled")
    ddir = key.parent
    pid = _spawn(dev.namespace, ["/usr/sbin/sshd", "-D", "-e", "-f", str(ddir / "sshd_config")], ddir / "sshd.log")
    if not _wait_tcp(dev.address, dev.ssh_port, 10.0):
        raise TestbedError(f"{dev.name}: sshd did not come back")
    new = msgspec.structs.replace(dev, sshd_pid=pid)
    state = msgspec.structs.replace(state, devices=tuple(new if d.name == dev.name else d for d in state.devices))
    _save_state(Path(state.state_dir), state)
    return state
