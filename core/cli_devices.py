"""`edgeshard` sub-commands for devices: testbed, discover, deploy, agents, profile.

Thin argparse fronts over core.testbed, core.discovery, core.deploy and core.profiling;
every user error is an EdgeShardError (printed, non-zero exit, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from core.errors import EdgeShardError


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's sub-commands to the CLI."""
    _register_testbed(sub)
    _register_discover(sub)
    try:
        from core import cli_deploy
    except ImportError:  # pragma: no cover - deploy lands separately
        return
    cli_deploy.register(sub)


# testbed ---------------------------------------------------------------------------
def _register_testbed(sub) -> None:
    p = sub.add_parser("testbed", help="emulated devices in network namespaces (root)")
    tsub = p.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)
    up = tsub.add_parser("up", help="build N devices on a bridge with sshd, mDNS and shaped links")
    up.add_argument("--devices", "-n", type=int, required=True)
    shape = up.add_mutually_exclusive_group()
    shape.add_argument("--bandwidth", type=float, metavar="MBIT", help="cap every ordered pair at MBIT Mbit/s")
    shape.add_argument("--links", metavar="FILE", help="JSON caps per ordered pair (docs/devices.md)")
    up.add_argument("--name", default="edge", help="testbed name; devices are NAME1..NAMEn (default: edge)")
    up.add_argument("--subnet", default="10.77.0.0/24")
    up.add_argument("--no-mdns", action="store_true", help="do not advertise _ssh._tcp in the namespaces")
    up.add_argument("--json", action="store_true")
    up.set_defaults(func=_testbed_up)
    down = tsub.add_parser("down", help="remove the testbed (idempotent)")
    down.add_argument("--name", default="edge")
    down.set_defaults(func=_testbed_down)
    st = tsub.add_parser("status", help="show the running testbed")
    st.add_argument("--name", default="edge")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_testbed_status)


def _print_testbed(state, as_json: bool) -> None:
    from core.testbed import state_as_json

    if as_json:
        print(state_as_json(state))
        return
    print(f"testbed {state.name}: bridge {state.bridge}, host side {state.host_address}")
    print(f"operator key: {state.operator_key}  (ssh user {state.ssh_user})")
    for d in state.devices:
        print(f"  {d.name:<10} {d.address:<15} ns {d.namespace:<12} sshd pid {d.sshd_pid}")
    for l in state.links:
        print(f"  link {l.src} -> {l.dst}: {l.bandwidth_mbit_s:g} Mbit/s")
    if not state.links:
        print("  links: unshaped")


def _testbed_up(args) -> int:
    from core.reporting import TerminalReporter
    from core.testbed import load_links_file, testbed_up

    links = load_links_file(args.links) if args.links else None
    state = testbed_up(args.devices, bandwidth_mbit_s=args.bandwidth, links=links, name=args.name,
                       subnet=args.subnet, advertise_mdns=not args.no_mdns, reporter=TerminalReporter())
    _print_testbed(state, args.json)
    return 0


def _testbed_down(args) -> int:
    from core.testbed import testbed_down

    removed = testbed_down(args.name)
    print(f"testbed {args.name}: " + ("removed" if removed else "nothing to remove"))
    return 0


def _testbed_status(args) -> int:
    from core.testbed import testbed_status

    state = testbed_status(args.name)
    if state is None:
        print(f"testbed {args.name}: not running")
        return 1
    _print_testbed(state, args.json)
    return 0


# discover --------------------------------------------------------------------------
def _register_discover(sub) -> None:
    p = sub.add_parser("discover", help="find devices and agents over mDNS")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to browse (default 3)")
    p.add_argument("--interface", "-i", action="append", default=None,
                   help="browse only on this interface (name or IPv4 address); repeatable")
    p.add_argument("--exclude-interface", "-x", action="append", default=[],
                   help="never send on this interface; repeatable")
    p.add_argument("--add", action="append", default=[], metavar="[USER@]HOST[:PORT]",
                   help="add a host by hand (where multicast is blocked)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_discover)


def parse_host_spec(spec: str) -> tuple[str, str, int]:
    """``[user@]host[:port]`` → (user, host, port)."""
    user, _, rest = spec.rpartition("@")
    host, _, port = rest.partition(":")
    if not host:
        raise EdgeShardError(f"bad host {spec!r}: expected [USER@]HOST[:PORT]")
    try:
        p = int(port) if port else 22
    except ValueError:
        raise EdgeShardError(f"bad port in {spec!r}") from None
    if not 1 <= p <= 65535:
        raise EdgeShardError(f"bad port in {spec!r}")
    return user, host, p


def _discover(args) -> int:
    import time

    from core.discovery import DeviceDiscovery

    with DeviceDiscovery(interfaces=args.interface, exclude_interfaces=args.exclude_interface) as disc:
        for spec in args.add:
            user, host, port = parse_host_spec(spec)
            disc.add_manual(host, port, user)
        time.sleep(args.timeout)
        devices = disc.devices()
    if args.json:
        print(json.dumps(msgspec.to_builtins(devices), indent=2))
        return 0
    if not devices:
        print("no devices found", file=sys.stderr)
        return 1
    print(f"{'DEVICE':<16} {'ADDRESS':<16} {'SSH':<5} {'AGENT':<8} {'ARCH':<8} {'CORES':>5} {'MEMORY':>9}  STATE")
    for d in devices:
        a = d.agent
        mem = f"{a.memory_bytes / 2**30:.1f}G" if a else "-"
        state = ("online" if d.online else "offline") + (" manual" if d.manual else "")
        print(f"{d.id:<16} {d.address:<16} {d.ssh_port or '-'!s:<5} {a.agent_version if a else '-':<8} "
              f"{a.arch if a else '-':<8} {a.cores if a else '-'!s:>5} {mem:>9}  {state}")
        for p in d.problems:
            print(f"  warning: {p}")
    return 0


def _path(p: str | None) -> Path | None:
    return Path(p).expanduser() if p else None
