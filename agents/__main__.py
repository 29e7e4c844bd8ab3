"""``python -m agents serve``: run an agent on this device (this is what gets deployed).

The agent needs the coordinator's CurveZMQ public key (it accepts control from that key
only) and its own keypair, kept in ``--key-file`` (created with mode 0600 on first start;
the public half is also written to ``KEYFILE.pub`` so a deployer can fetch it).
When it is listening it prints one line that launchers parse::

    EDGESHARD-AGENT-READY device=NAME control=PORT data=PORT public_key=KEY pid=PID

SIGTERM / SIGINT close it cleanly. With ``--exit-on-stdin-eof`` it also stops when its
stdin reaches end-of-file: the launcher keeps the write end of a pipe open, and the kernel
closes it when the launcher's *process* dies in any way (even ``kill -9``), whatever thread
started the agent. That is how ``edgeshard cluster local`` leaves no agent behind.

``python -m agents zygote --socket-fd N`` is the fork server local launchers start agents
from (agents/zygote.py): it imports the model code once and forks each agent, which then
runs ``main(["serve", ...])`` as if started on its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING

from agents.arguments import float_in, int_in

if TYPE_CHECKING:
    from agents.emulation import DeviceEmulation

READY_PREFIX = "EDGESHARD-AGENT-READY"

OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def prefer_passive_openmp_wait(environ=os.environ, modules=sys.modules) -> bool:
    """Make torch's OpenMP workers sleep, not spin, between parallel regions, unless the
    operator chose a wait policy (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set) or torch is
    already loaded (libgomp reads its environment once, when torch is imported). True when set.

    Why: torch's CPU wheel runs its intra-op pool on libgomp, whose default spins each worker
    for ~3 ms (300,000 iterations) after every parallel region. An agent's stage computes in
    bursts and then hands off; its spinning workers keep the cores its own libzmq IO thread,
    the next stage's agent on a shared host (local cluster, netns testbed) or any other work
    needs, and under load a preempted worker stalls its team's spin barriers. Measured with
    ``bench/investigations/omp_wait.py`` (docs/runtime.md): 2 torch threads per agent on 2 cores
    cost 4x the CPU per token spinning.
    """
    if any(v in environ for v in OPENMP_WAIT_VARIABLES) or "torch" in modules:
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents", description="EdgeShard agent")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the control and data sockets")
    add_serve_arguments(s)
    z = sub.add_parser("zygote", help="fork server for local agents (agents/zygote.py; started by launchers)")
    z.add_argument("--socket-fd", type=int_in(0, 1 << 20), required=True,
                   help="the launcher's end of a SOCK_SEQPACKET socketpair, inherited")
    return p


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--device", default=socket.gethostname(), help="device name (default: hostname)")
    s.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    s.add_argument("--advertise-host", default=None, help="address peers use to reach this agent")
    s.add_argument("--control-port", type=int_in(0, 65535), default=0, help="0 = any free port")
    s.add_argument("--data-port", type=int_in(0, 65535), default=0, help="0 = any free port")
    s.add_argument("--coordinator-key", required=True, help="the coordinator's CurveZMQ public key (Z85)")
    s.add_argument("--key-file", default=None, help="this agent's keypair file (created if missing)")
    s.add_argument("--threads", type=int_in(0, 1024), default=0, help="torch threads (0 = torch's default)")
    s.add_argument("--link-mbit", type=float_in(0, 1e6), default=0.0, help="emulated bandwidth of the outgoing data link")
    s.add_argument("--link-latency-ms", type=float_in(0, 60_000), default=0.0, help="emulated one-way latency added when sending")
    s.add_argument("--memory-budget-mib", type=float_in(0, 1 << 30), default=0.0,
                   help="emulated memory budget for shard weights; a larger shard is refused (0 = none)")
    s.add_argument("--compute-slowdown", type=float_in(1, 1000), default=1.0,
                   help="emulate a device this many times slower than this machine (>= 1)")
    s.add_argument("--shared-host", action="store_true",
                   help="other agents of this cluster compute on this host between this agent's steps "
                        "(a local cluster, the netns testbed): profile units as cold as runs find them")
    s.add_argument("--weights-dir", default=None,
                   help="where weights sent by the coordinator are kept by content hash "
                        "(default $XDG_CACHE_HOME/edgeshard-agent/weights)")
    s.add_argument("--announce", action="store_true", help="register _edgeshard._tcp over mDNS")
    s.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="stop when stdin closes (the launching process ended); used by `cluster local`")
    s.add_argument("--technique-module", action="append", default=[], metavar="MODULE",
                   help="also run the technique this module defines (its AGENT_TECHNIQUE), imported from this "
                        "machine's Python path; repeatable (and EDGESHARD_AGENT_TECHNIQUES, comma-separated)")
    s.add_argument("--log-level", default="WARNING")


def emulation_from_args(args: argparse.Namespace) -> DeviceEmulation:
    """The device this agent emulates, from ``serve``'s arguments (ValueError on impossible limits)."""
    from agents.emulation import MIB, DeviceEmulation

    return DeviceEmulation(memory_budget_bytes=int(args.memory_budget_mib * MIB),
                           compute_slowdown=args.compute_slowdown, shared_host=args.shared_host)


def serve(args: argparse.Namespace) -> int:
    prefer_passive_openmp_wait()  # before anything imports torch
    from agents.agent import Agent, warm_imports_in_background
    from agents.emulation import MIB, DeviceEmulation
    from agents.protocol import LinkShape
    from agents.transport import CurveKeys, is_z85_key

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if not is_z85_key(args.coordinator_key):
        print("agent: --coordinator-key must be a 40-character Z85 CurveZMQ public key", file=sys.stderr)
        return 2
    try:
        emulation = emulation_from_args(args)
    except ValueError as err:
        print(f"agent: {err}", file=sys.stderr)
        return 2
    import agents.techniques  # noqa: F401  (registers the built-in techniques)
    from agents.heap import return_freed_memory_to_the_os

    return_freed_memory_to_the_os()  # its RSS is what it holds: freed activations go back (agents.heap)
    from agents.registry import TechniqueModuleError, load_technique_modules, technique_module_names

    try:
        load_technique_modules(technique_module_names(getattr(args, "technique_module", ()), os.environ))
    except TechniqueModuleError as err:
        print(f"agent: {err}", file=sys.stderr)
        return 2
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    try:
        keys = CurveKeys.load_or_create(args.key_file) if args.key_file else CurveKeys.generate()
    except (OSError, ValueError) as err:
        print(f"agent: cannot use key file: {err}", file=sys.stderr)
        return 2
    if args.key_file:
        with open(f"{args.key_file}.pub", "w") as f:
            f.write(keys.public + "\n")
    agent = Agent(
        args.device,
        args.coordinator_key,
        keys,
        host=args.host,
        control_port=args.control_port,
        data_port=args.data_port,
        advertise_host=args.advertise_host,
        default_link=LinkShape(bandwidth_mbit_s=args.link_mbit, latency_ms=args.link_latency_ms),
        emulation=emulation,
        weights_dir=args.weights_dir,
    )
    try:
        agent.start()
    except Exception as err:  # e.g. port in use
        print(f"agent: cannot listen: {err}", file=sys.stderr)
        agent.close()
        return 1
    announcer = None
    if args.announce:
        try:
            from agents import announce

            announcer = announce.announce_agent(
                args.advertise_host or args.host, agent.control_port, name=agent.device
            )
        except Exception as err:
            print(f"agent: mDNS announcement failed: {err}", file=sys.stderr)

    def _stop(signum, frame):
        agent._shutdown.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if getattr(args, "exit_on_stdin_eof", False):
        threading.Thread(target=_stop_at_stdin_eof, args=(agent,), name="agent-parent-watch", daemon=True).start()
    # the model code is imported after the agent listens (seconds on a small device), so a
    # launcher sees it ready at once; a load or profile arriving meanwhile waits for it
    warm_imports_in_background(
        lambda err: print(f"agent: cannot import the model code ({err}); loading shards will fail", file=sys.stderr))
    print(
        f"{READY_PREFIX} device={agent.device} control={agent.control_port} data={agent.data_port} "
        f"public_key={keys.public} pid={os.getpid()}",
        flush=True,
    )
    try:
        while not agent.wait(0.5):
            pass
    finally:
        if announcer is not None:
            try:
                announcer.close()
            except Exception:
                pass
        # stopped (SIGTERM, SIGINT, the launcher gone): a work item in flight is abandoned, not
        # awaited — the process ends right after (``exit_now``), and an agent keeps nothing on disk
        agent.close(join_s=STOP_GRACE_S)
    return 0


STOP_GRACE_S = 0.2
"""How long a stopped agent lets its threads end on their own before it exits without them."""


def _stop_at_stdin_eof(agent) -> None:
    """Block reading stdin (GIL released); end-of-file means the launcher is gone."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    agent._shutdown.set()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prefer_passive_openmp_wait()  # before the zygote or the agent imports torch
    if args.command == "zygote":
        from agents.zygote import serve_zygote

        return serve_zygote(args.socket_fd, main)
    return serve(args)


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown: after ``agent.close()`` nothing
    is left to flush but stdio, and tearing down torch + transformers modules takes seconds
    (measured 3-8 s here), which a launcher stopping its agents would wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
