"""A tiny mDNS responder process: advertises one service until SIGTERM.

The netns testbed runs one per namespace (``ip netns exec NS python -m core.devices.mdns_advertiser``)
so each emulated device announces ``_ssh._tcp`` on its own address, like Avahi does on a
real Linux box. It binds only to the given address: it never sends on other interfaces.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading

from zeroconf import IPVersion, ServiceInfo, Zeroconf


def advertise(address: str, instance: str, service_type: str, port: int, hostname: str,
              properties: dict[str, str], stop: threading.Event) -> None:
    """Register the service, block until ``stop`` is set, then send goodbyes."""
    zc = Zeroconf(interfaces=[address], ip_version=IPVersion.V4Only)
    try:
        info = ServiceInfo(
            service_type,
            f"{instance}.{service_type}",
            addresses=[socket.inet_aton(address)],
            port=port,
            properties=properties,
            server=f"{hostname}.local.",
        )
        zc.register_service(info)
        stop.wait()
        zc.unregister_service(info)
    finally:
        zc.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m core.devices.mdns_advertiser")
    p.add_argument("--address", required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--hostname", required=True)
    p.add_argument("--type", default="_ssh._tcp.local.")
    p.add_argument("--port", type=int, default=22)
    p.add_argument("--txt", action="append", default=[], help="KEY=VALUE")
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    props = dict(kv.split("=", 1) for kv in args.txt)
    advertise(args.address, args.instance, args.type, args.port, args.hostname, props, stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
