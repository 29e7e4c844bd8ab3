"""Shared fixtures for the devices tests: a netns testbed brought up once per session.

The session testbed has 3 devices (``SESSION_DEVICES`` on a free 10.79.X.0/24, host side
.254) and one shaped link device 1 → device 2 at 10 Mbit/s; its name holds the pid of the
test run, so concurrent runs on one machine do not collide. Tests that break a device (changed host key,
stopped sshd) build their own small testbed instead. Only root can build testbeds:
without root the netns tests are skipped with that reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest



def _free_subnet(first: int) -> str:
    from core.devices.testbed import free_subnet

    return free_subnet(first)


SESSION_TESTBED = f"e{os.getpid():x}x"
"""Unique per test run (pid in hex), so two runs on one machine never share or tear down each
other's namespaces and bridge. It ends in 'x' (never a hex digit): no session's name followed
by a device number can match another's (testbed_down removes ``es-NAME<digits>``)."""
SESSION_SUBNET = _free_subnet(os.getpid())
SESSION_DEVICES = tuple(f"{SESSION_TESTBED}{i}" for i in (1, 2, 3))
SHAPED_LINK = (SESSION_DEVICES[0], SESSION_DEVICES[1], 10.0)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces (CI runs as root)")


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    """3 emulated devices with sshd + mDNS; removed (and checked clean) at the end."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces (CI runs as root)")
    from core.devices import testbed as tb
    from core.devices.testbed import LinkCap, LinksFile, leftovers

    _remove_testbeds_of_dead_runs(tb)
    root = tmp_path_factory.mktemp("testbed-state")
    links = LinksFile(links=(LinkCap(src=SHAPED_LINK[0], dst=SHAPED_LINK[1], bandwidth_mbit_s=SHAPED_LINK[2]),))
    state = tb.testbed_up(3, links=links, name=SESSION_TESTBED, subnet=SESSION_SUBNET, state_root=Path(root))
    yield state
    tb.testbed_down(SESSION_TESTBED, state_root=Path(root))
    assert leftovers(SESSION_TESTBED) == []


def _remove_testbeds_of_dead_runs(tb) -> None:
    """A crashed run cannot take its session testbed down; its pid names it, so the next run
    removes it once that pid is gone (a live pid may be another run: never touched)."""
    import re
    import subprocess

    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for pid_hex in sorted({m.group(1) for m in re.finditer(r"^es-e([0-9a-f]+)x\d+", out, re.M)}):
        if not Path(f"/proc/{int(pid_hex, 16)}").exists():
            tb.testbed_down(f"e{pid_hex}x")


@pytest.fixture
def workspace(tmp_path):
    """A workspace directory (its own known_hosts lives here)."""
    ws = tmp_path / "workspace"
    ws.mkdir()
    return ws


_BUS_CONF = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={sock}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/><allow own="*"/><allow send_destination="*"/><allow receive_sender="*"/>
  </policy>
</busconfig>
"""

_AVAHI_CONF = """[server]
host-name={host}
use-ipv4=yes
use-ipv6=no
allow-interfaces=eth0
enable-dbus=yes
[wide-area]
enable-wide-area=no
[publish]
publish-aaaa-on-ipv4=no
publish-hinfo=no
publish-workstation=no
"""

_SSH_SERVICE = """<?xml version="1.0" standalone='no'?>
<!DOCTYPE service-group SYSTEM "avahi-service.dtd">
<service-group>
  <name>{name}</name>
  <service><type>_ssh._tcp</type><port>22</port></service>
</service-group>
"""


class AvahiPeer:
    """avahi-daemon 0.8 in its own namespace on the testbed bridge, with a private D-Bus."""

    def __init__(self, address: str, host: str, service_name: str, bus: Path):
        self.address, self.host, self.service_name, self.bus = address, host, service_name, bus

    def browse(self, service_type: str, timeout_s: float = 8.0) -> str:
        import subprocess

        env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=f"unix:path={self.bus}")
        proc = subprocess.run(["avahi-browse", "-prt", service_type], env=env, capture_output=True,
                              text=True, timeout=timeout_s + 5)
        return proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def avahi_peer(testbed, tmp_path_factory):
    """A real avahi-daemon publishing a static ``_ssh._tcp`` service on the testbed bridge.

    Recipe from PLATFORM-NOTES: private dirs bind-mounted over /etc/avahi/services and a
    tmpfs /run inside ``ip netns exec``'s own mount namespace; D-Bus is a private daemon
    on a unix socket so ``avahi-browse`` can talk to it. The namespace is named like a
    testbed device so the testbed's ``down`` also removes it if this fixture crashes.
    """
    import shutil
    import subprocess
    import time

    if not (shutil.which("avahi-daemon") and shutil.which("dbus-daemon") and shutil.which("avahi-browse")):
        pytest.skip("avahi-daemon, dbus-daemon and avahi-browse are needed (scripts/install-system-deps.sh)")
    d = tmp_path_factory.mktemp("avahi")
    (d / "services").mkdir()
    host = f"{SESSION_TESTBED}avahi"
    (d / "services" / "ssh.service").write_text(_SSH_SERVICE.format(name="avahi-published-box"))
    (d / "avahi.conf").write_text(_AVAHI_CONF.format(host=host))
    bus = d / "bus"
    (d / "bus.conf").write_text(_BUS_CONF.format(sock=bus))
    ns, veth = f"es-{SESSION_TESTBED}9", f"es{SESSION_TESTBED}9"
    address = SESSION_SUBNET.replace(".0/24", ".9")
    run = lambda *a: subprocess.run(list(a), check=True, capture_output=True, timeout=30)  # noqa: E731
    run("ip", "netns", "add", ns)
    procs: list[subprocess.Popen] = []
    try:
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
        run("ip", "link", "set", veth + "p", "netns", ns)
        run("ip", "link", "set", veth, "master", testbed.bridge, "up")
        run("ip", "netns", "exec", ns, "ip", "link", "set", veth + "p", "name", "eth0")
        run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
        run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        dbus_log = open(d / "dbus.log", "wb")
        procs.append(subprocess.Popen(["dbus-daemon", "--nofork", f"--config-file={d / 'bus.conf'}"],
                                      stdout=dbus_log, stderr=dbus_log))
        for _ in range(100):
            if bus.exists():
                break
            time.sleep(0.05)
        script = (f"mount --bind {d / 'services'} /etc/avahi/services && "
                  "mount -t tmpfs edgeshard-avahi /run && mkdir /run/avahi-daemon && "
                  f"exec avahi-daemon --no-drop-root --no-chroot --no-rlimits -f {d / 'avahi.conf'}")
        log = open(d / "avahi.log", "wb")
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "sh", "-c", script], stdout=log, stderr=log,
                                      env=dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=f"unix:path={bus}")))
        deadline = time.monotonic() + 30  # an upper bound: room for a loaded host
        while b"successfully established" not in (d / "avahi.log").read_bytes():
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                pytest.fail("avahi-daemon did not start:\n" + (d / "avahi.log").read_text(errors="replace"))
            time.sleep(0.1)
        yield AvahiPeer(address, host, "avahi-published-box", bus)
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)


class DeployedAgents:
    """Agents deployed over SSH to the session testbed's devices."""

    def __init__(self, testbed, workspace: Path, remote_root: Path, results: dict):
        self.testbed, self.workspace, self.remote_root, self.results = testbed, workspace, remote_root, results

    def options(self, **kw):
        import sys

        from core.devices.deploy import DeployOptions

        return DeployOptions(python=sys.executable, remote_dir=str(self.remote_root / "{device}"), **kw)

    def target(self, name: str):
        from core.devices.deploy import SshTarget

        d = self.testbed.device(name)
        return SshTarget(d.name, d.address, d.ssh_port, self.testbed.ssh_user)

    def conn(self) -> dict:
        """Connection keyword arguments for core.devices.deploy's status_of / logs_of / stop."""
        return dict(key_file=self.testbed.operator_key, workspace=self.workspace, use_agent=False,
                    user_known=Path("/nonexistent"))


@pytest.fixture(scope="session")
def deployed(testbed, tmp_path_factory):
    """The agent deployed to all 3 session devices in parallel (key auth; host keys
    pre-trusted from the testbed's own host key files, as an operator who checked them)."""
    from core.devices.deploy import SshTarget, deploy_many

    ws = tmp_path_factory.mktemp("workspace")
    (ws / "known_hosts").write_text("\n".join(testbed.known_hosts_lines()) + "\n")
    remote = tmp_path_factory.mktemp("remote")
    agents = DeployedAgents(testbed, ws, remote, {})
    targets = [SshTarget(d.name, d.address, d.ssh_port, testbed.ssh_user) for d in testbed.devices]
    results = deploy_many(targets, key_file=testbed.operator_key, workspace=ws, options=agents.options(),
                          use_agent=False, user_known=Path("/nonexistent"))
    failed = {k: v for k, v in results.items() if isinstance(v, Exception)}
    if failed:
        pytest.fail(f"deploy failed: {failed}")
    agents.results = results
    return agents
