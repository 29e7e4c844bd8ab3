"""`edgeshard` sub-commands for devices: testbed, discover, deploy, agents, profile.

Thin argparse fronts over core.devices.testbed, core.devices.discovery, core.devices.deploy and core.devices.profiling;
every user error is an EdgeShardError (printed, non-zero exit, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import msgspec

from core.arguments import PORT, THREADS, float_in, int_in
from core.errors import EdgeShardError


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's sub-commands to the CLI."""
    _register_testbed(sub)
    _register_discover(sub)
    _register_deploy(sub)
    _register_agents(sub)
    _register_profile(sub)


# testbed ---------------------------------------------------------------------------
def _register_testbed(sub) -> None:
    p = sub.add_parser("testbed", help="emulated devices in network namespaces (root)")
    tsub = p.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)
    up = tsub.add_parser("up", help="build N devices on a bridge with sshd, mDNS and shaped links")
    up.add_argument("--devices", "-n", type=int_in(1, 64), required=True)
    shape = up.add_mutually_exclusive_group()
    shape.add_argument("--bandwidth", type=float_in(0, 1e6, lo_open=True), metavar="MBIT", help="cap every ordered pair at MBIT Mbit/s")
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
    from core.devices.testbed import state_as_json

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
    from core.devices.testbed import load_links_file, testbed_up

    links = load_links_file(args.links) if args.links else None
    state = testbed_up(args.devices, bandwidth_mbit_s=args.bandwidth, links=links, name=args.name,
                       subnet=args.subnet, advertise_mdns=not args.no_mdns, reporter=TerminalReporter())
    _print_testbed(state, args.json)
    return 0


def _testbed_down(args) -> int:
    from core.devices.testbed import testbed_down

    removed = testbed_down(args.name)
    print(f"testbed {args.name}: " + ("removed" if removed else "nothing to remove"))
    return 0


def _testbed_status(args) -> int:
    from core.devices.testbed import testbed_status

    state = testbed_status(args.name)
    if state is None:
        print(f"testbed {args.name}: not running")
        return 1
    _print_testbed(state, args.json)
    return 0


# discover --------------------------------------------------------------------------
def _register_discover(sub) -> None:
    p = sub.add_parser("discover", help="find devices and agents over mDNS")
    p.add_argument("--timeout", type=float_in(0, 3600, lo_open=True), default=3.0, help="seconds to browse (default 3)")
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

    from core.devices.discovery import DeviceDiscovery

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


# deploy / agents ---------------------------------------------------------------------
def _add_ssh_arguments(p) -> None:
    p.add_argument("hosts", nargs="*", metavar="[NAME=][USER@]HOST[:PORT]",
                   help="devices to act on (NAME defaults to HOST)")
    p.add_argument("--testbed", metavar="NAME", help="all devices of a running netns testbed (its operator key)")
    p.add_argument("--user", "-u", default=None, help="SSH login (default: from HOST, else $USER)")
    p.add_argument("--key", "-k", default=None, metavar="FILE", help="private key file")
    p.add_argument("--password", action="store_true", help="ask for a password (used once, never stored)")
    p.add_argument("--no-ssh-agent", action="store_true", help="do not try ssh-agent keys")
    p.add_argument("--trust-new-host-keys", action="store_true",
                   help="accept host keys not yet known (their SHA256 fingerprints are printed)")
    p.add_argument("--home", "--workspace", dest="workspace", metavar="DIR", default=None,
                   help="folder for the coordinator key, known_hosts and agents.json "
                        "(default: $EDGESHARD_HOME or ~/.edgeshard; --workspace is the old name)")
    p.add_argument("--remote-dir", default=None,
                   help="agent directory on the device, relative to home ({device} = device name; "
                        "default .edgeshard-agent/{device})")


def _targets(args) -> tuple[list, str | None]:
    """(targets, key file) from host specs and/or --testbed."""
    from core.devices.deploy import SshTarget

    targets = []
    key = args.key
    if args.testbed:
        from core.devices.testbed import testbed_status

        state = testbed_status(args.testbed)
        if state is None:
            raise EdgeShardError(f"testbed {args.testbed!r} is not running (edgeshard testbed up)")
        targets += [SshTarget(d.name, d.address, d.ssh_port, args.user or state.ssh_user) for d in state.devices]
        key = key or state.operator_key
    for spec in args.hosts:
        name, _, rest = spec.rpartition("=")
        user, host, port = parse_host_spec(rest)
        targets.append(SshTarget(name or host, host, port, args.user or user))
    if not targets:
        raise EdgeShardError("no devices given: name hosts ([USER@]HOST[:PORT]) or --testbed NAME")
    return targets, key


def _conn_kwargs(args, key) -> dict:
    import getpass

    password = getpass.getpass("SSH password: ") if args.password else None
    trust = True if args.trust_new_host_keys else (_prompt_trust if sys.stdin.isatty() else False)
    kw = dict(key_file=key, password=password, use_agent=not args.no_ssh_agent, trust_new_host_keys=trust)
    if args.workspace:
        kw["workspace"] = Path(args.workspace).expanduser()
    return kw


_PROMPT_LOCK = threading.Lock()


def _prompt_trust(info) -> bool:
    """Up to ten deploy threads ask at once: one question at a time (the lock spans print and
    input), and the question itself names host and fingerprint, so a "y" answers only it."""
    with _PROMPT_LOCK:
        print(f"The host {info.host_label} is not known.\n  {info.key_type} key fingerprint is {info.fingerprint}",
              file=sys.stderr, flush=True)
        answer = input(f"Trust {info.host_label} with {info.key_type} key {info.fingerprint}? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _register_deploy(sub) -> None:
    p = sub.add_parser("deploy", help="install and start the agent on devices over SSH")
    _add_ssh_arguments(p)
    p.add_argument("--python", default="python3", help="Python on the device (default python3)")
    p.add_argument("--control-port", type=PORT, default=47000)
    p.add_argument("--data-port", type=PORT, default=47001)
    p.add_argument("--no-announce", action="store_true", help="agent does not register _edgeshard._tcp")
    p.add_argument("--threads", type=THREADS, default=0)
    p.set_defaults(func=_deploy)


class _PrefixReporter:
    """Per-device lines on stderr: ``[device] step``."""

    def __init__(self, device: str):
        self.device = device

    def status(self, text: str) -> None:
        print(f"[{self.device}] {text}", file=sys.stderr, flush=True)

    def progress(self, done: float, total: float) -> None:
        pass

    def partial_result(self, value) -> None:
        pass

    def cancel_requested(self) -> bool:
        return False


def _deploy(args) -> int:
    from core.devices.deploy import DEFAULT_REMOTE_DIR, DeployOptions, deploy_many

    targets, key = _targets(args)
    opts = DeployOptions(python=args.python, remote_dir=args.remote_dir or DEFAULT_REMOTE_DIR,
                         control_port=args.control_port, data_port=args.data_port,
                         announce=not args.no_announce, threads=args.threads)
    kw = _conn_kwargs(args, key)
    results = deploy_many(targets, _PrefixReporter, options=opts, **kw)
    failed = 0
    for name in sorted(results):
        r = results[name]
        if isinstance(r, Exception):
            failed += 1
            print(f"{name}: FAILED: {r}")
        else:
            print(f"{name}: {r.summary}")
    ws = kw.get("workspace") or __import__("core.devices.deploy", fromlist=["x"]).default_workspace()
    if len(results) > failed:
        print(f"agents file: {Path(ws) / 'agents.json'}")
    return 1 if failed else 0


def _register_agents(sub) -> None:
    p = sub.add_parser("agents", help="status, logs, stop or upgrade deployed agents")
    asub = p.add_subparsers(dest="agents_command", metavar="ACTION", required=True)
    for action, text in (("status", "is the agent running, which version, pid"),
                         ("logs", "tail of the agent's log"),
                         ("stop", "stop the agent (idempotent)"),
                         ("upgrade", "deploy this version where another runs (same as deploy)")):
        a = asub.add_parser(action, help=text)
        _add_ssh_arguments(a)
        if action == "logs":
            a.add_argument("--lines", "-n", type=int_in(1, 100_000), default=100)
        if action == "upgrade":
            a.add_argument("--python", default="python3")
            a.add_argument("--control-port", type=PORT, default=47000)
            a.add_argument("--data-port", type=PORT, default=47001)
            a.add_argument("--no-announce", action="store_true")
            a.add_argument("--threads", type=THREADS, default=0)
            a.set_defaults(func=_deploy)
        else:
            a.set_defaults(func=_agents)


def _agents(args) -> int:
    from core.devices import deploy
    targets, key = _targets(args)
    kw = _conn_kwargs(args, key)
    remote = args.remote_dir or deploy.DEFAULT_REMOTE_DIR
    rc = 0
    for t in targets:
        try:
            if args.agents_command == "status":
                st = deploy.status_of(t, remote_dir=remote, **kw)
                if isinstance(st, deploy.AgentRunning):
                    r = st.record
                    print(f"{t.device}: running pid {r.pid}, {r.bundle_stamp}, {r.control_address}, log {r.log_path}")
                elif isinstance(st, deploy.AgentStopped):
                    print(f"{t.device}: stopped (last pid {st.record.pid}, log {st.record.log_path})")
                    rc = max(rc, 1)
                else:
                    print(f"{t.device}: no agent deployed")
                    rc = max(rc, 1)
            elif args.agents_command == "logs":
                print(f"==> {t.device} <==")
                print(deploy.logs_of(t, lines=args.lines, remote_dir=remote, **kw), end="")
            elif args.agents_command == "stop":
                stopped = deploy.stop(t, remote_dir=remote, **kw)
                print(f"{t.device}: " + ("stopped" if stopped else "was not running"))
        except EdgeShardError as err:
            print(f"{t.device}: error: {err}", file=sys.stderr)
            rc = 2
    return rc


# profile ------------------------------------------------------------------------------
def _register_profile(sub) -> None:
    p = sub.add_parser("profile", help="measure compute per unit and every link, write a profile for `plan`")
    p.add_argument("--agents", required=True, metavar="agents.json",
                   help="agents file (written by `edgeshard deploy` or `edgeshard cluster local`)")
    p.add_argument("--model", required=True, metavar="DIR|config.json",
                   help="the model's HF config (a checkpoint dir or its config.json); no weights needed")
    p.add_argument("--out", "-o", required=True, metavar="profile.json")
    p.add_argument("--name", default="", help="model name recorded in the profile")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--prompt-tokens", type=int_in(1, 1 << 20), default=32)
    p.add_argument("--batch-sizes", default="1,2,4", help="decode batch sizes (comma separated)")
    p.add_argument("--repeats", type=int_in(1, 1000), default=5)
    p.add_argument("--headroom-mib", type=int_in(0, 1 << 30), default=512, help="memory each device keeps free")
    p.add_argument("--threads", type=THREADS, default=0, help="torch threads on the devices (0: default)")
    p.add_argument("--no-network", action="store_true", help="skip the link measurements")
    p.add_argument("--no-gpu", action="store_true", help="time units on each agent's CPU only, not on its GPU")
    p.add_argument("--weight-times", default="", metavar="int8,int4",
                   help="also time each device's decoder block at these weight precisions (its own ratio over fp)")
    p.add_argument("--link-seconds", type=float_in(0, 600, lo_open=True), default=1.0, help="duration of each bandwidth probe")
    p.add_argument("--draft", metavar="DIR", default=None,
                   help="also time this speculative draft's token on every device (what --speculate auto and "
                        "compare --draft cost it by; the same path on each device's disk)")
    p.set_defaults(func=_profile)


def _profile(args) -> int:
    from core.runs.coordinator import Coordinator
    from core.errors import FormatError
    from core.devices.local_cluster import load_agents_file
    from core.devices.profiling import check_weight_times, profile_cluster
    from core.formats import check_writable
    from core.models.units import model_spec_from_config
    from core.reporting import TerminalReporter

    cfg_path = Path(args.model)
    if cfg_path.is_dir():
        cfg_path = cfg_path / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except OSError as err:
        raise FormatError(str(cfg_path), f"cannot read ({err.strerror or err})") from None
    except ValueError as err:
        raise FormatError(str(cfg_path), f"not valid JSON ({err})") from None
    try:
        batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        raise EdgeShardError(f"--batch-sizes must be integers like 1,2,4, got {args.batch_sizes!r}") from None
    if not batch_sizes or min(batch_sizes) < 1 or args.prompt_tokens < 1 or args.repeats < 1:
        raise EdgeShardError("--batch-sizes, --prompt-tokens and --repeats must be >= 1")
    model_spec_from_config(config, dtype=args.dtype)  # an unsupported family: before connecting to any agent
    weight_times = tuple(w.strip() for w in args.weight_times.split(",") if w.strip())
    check_weight_times(config, weight_times)
    check_writable(args.out)  # written after profiling: refused before it
    if args.draft is not None and not (Path(args.draft) / "config.json").is_file():
        raise EdgeShardError(f"--draft {args.draft}: no config.json: name the draft's checkpoint directory")
    endpoints, keys = load_agents_file(args.agents)
    with Coordinator(endpoints, keys, heartbeat_timeout_s=30.0) as coord:
        coord.link.answering()
        result = profile_cluster(coord, config, model_name=args.name or Path(args.model).name, dtype=args.dtype,
                                 prompt_tokens=args.prompt_tokens, batch_sizes=batch_sizes, repeats=args.repeats,
                                 headroom_bytes=args.headroom_mib << 20, threads=args.threads,
                                 network=not args.no_network, link_target_s=args.link_seconds,
                                 reporter=TerminalReporter(), out_path=args.out, gpus=not args.no_gpu,
                                 weight_times=weight_times, draft_dir=args.draft)
    prof = result.profile
    print(f"{'DEVICE':<14} {'MEMORY BUDGET':>14} {'DECODE/TOKEN (b=1)':>19} {'PREFILL':>10}")
    for t in prof.times:
        dev = prof.cluster.device(t.device)
        dec = sum(u[0] for u in t.decode_s)
        pre = sum(u[0] for u in t.prefill_s)
        print(f"{t.device:<14} {dev.memory_bytes / 2**30:>12.2f} G {dec * 1e3:>16.2f} ms {pre * 1e3:>7.1f} ms")
    for a in prof.accelerator_times:
        print(f"{a.device:<14} {a.torch_device}: {a.memory_bytes / 2**30:.2f} G, "
              f"{sum(u[0] for u in a.times.decode_s) * 1e3:.2f} ms decode/token (b=1)"
              + "".join(f", {t.weights} blocks {t.decode_time_ratio:.2f}x" for t in a.precision_times))
    for t in prof.precision_times:
        print(f"{t.device:<14} {t.weights} blocks: {t.decode_time_ratio:.2f}x decode, "
              f"{t.prefill_time_ratio:.2f}x prefill of fp")
    for d in prof.draft_times:
        print(f"{d.device:<14} draft {d.draft}: {d.token_s * 1e3:.2f} ms a proposed token")
    for m in result.links:
        print(f"link {m.src} -> {m.dst}: {m.bandwidth_mbit_s:9.1f} Mbit/s, one-way {m.one_way_ms:.3f} ms")
    print(f"profile written to {args.out}")
    return 0

