"""Finding devices on the local network over mDNS (python-zeroconf), plus hand-added hosts.

Two kinds of records are browsed: machines without an agent yet (``_ssh._tcp``,
``_sftp-ssh._tcp``, ``_workstation._tcp`` — what Avahi and macOS advertise) and running
agents (``_edgeshard._tcp`` with TXT records, see agents/announce.py). All records that
point at one host are merged into one ``DiscoveredDevice``. A device whose records go
away is kept and marked offline (the operator may still want its logs, or it rebooted).

Vanished devices: a host that dies sends no goodbye, and python-zeroconf stretches the
lifetime of cached records (>= 1125 s), so waiting for them to expire takes ~19 minutes.
Instead every known service is re-queried actively (an SRV question with no known
answers, every ``recheck_s``); a service that leaves ``misses_to_offline`` questions in a
row unanswered is dropped, so its device is shown offline within ~``recheck_s`` x
(misses + 1) seconds. It keeps being asked, and comes back online when it answers.

Interface choice: zeroconf is bound to the addresses of the chosen interfaces only, so no
packet is ever sent on an interface the operator excluded (multicast may be forbidden or
costly there). Changes are delivered through ``on_change`` on zeroconf's thread: the
callback must be thread-safe (the GUI forwards it through a queued signal).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import ifaddr
import msgspec
from zeroconf import (DNSOutgoing, DNSQuestion, IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf,
                      current_time_millis)
from zeroconf.const import _CLASS_IN, _FLAGS_QR_QUERY, _TYPE_SRV

from agents import announce
from core.devices.cluster import Device
from core.errors import EdgeShardError

SSH_SERVICE_TYPES = ("_ssh._tcp.local.", "_sftp-ssh._tcp.local.", "_workstation._tcp.local.")
AGENT_SERVICE_TYPE = announce.SERVICE_TYPE
ALL_SERVICE_TYPES = (*SSH_SERVICE_TYPES, AGENT_SERVICE_TYPE)
log = logging.getLogger("edgeshard.discovery")


class DiscoveryError(EdgeShardError):
    """Discovery cannot start (no usable interface, unknown interface name)."""


class AgentAnnouncement(msgspec.Struct, frozen=True, kw_only=True):
    """What a running agent says about itself in its TXT records (validated)."""

    agent_version: str
    protocol_version: int
    arch: str
    cores: int
    memory_bytes: int
    accelerator: str
    control_port: int


class ServiceRecord(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    name: str
    host: str
    addresses: tuple[str, ...]
    port: int
    txt: tuple[tuple[str, str], ...] = ()
    problem: str = ""
    """Why the record's TXT was rejected ("" when valid)."""


class DiscoveredDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One host, merged from all its records; ``id`` is its mDNS host name (or address)."""

    id: str
    addresses: tuple[str, ...] = ()
    ssh_port: int | None = None
    ssh_user: str = ""
    services: tuple[ServiceRecord, ...] = ()
    agent: AgentAnnouncement | None = None
    online: bool = True
    manual: bool = False
    last_seen: float = 0.0
    problems: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        return self.addresses[0] if self.addresses else ""

    def to_cluster_device(self, memory_bytes: int | None = None) -> Device:
        """The planner's view; memory defaults to what the agent announced."""
        a = self.agent
        return Device(
            id=self.id,
            name=self.id,
            memory_bytes=memory_bytes if memory_bytes is not None else (a.memory_bytes if a else 0),
            address=self.address,
            ssh_port=self.ssh_port or 22,
            ssh_user=self.ssh_user,
            arch=a.arch if a else "",
            cores=a.cores if a else 0,
            accelerator=a.accelerator if a else "",
        )


def parse_agent_txt(txt: dict[str, str]) -> AgentAnnouncement:
    """Validate an ``_edgeshard._tcp`` TXT record; raises ValueError naming the bad key."""
    missing = [k for k in announce.TXT_KEYS if k not in txt]
    if missing:
        raise ValueError(f"TXT record lacks {', '.join(missing)}")

    def integer(key: str, lo: int, hi: int) -> int:
        raw = txt[key]
        if not raw.isdigit() or not lo <= int(raw) <= hi:
            raise ValueError(f"TXT {key}={raw!r} is not an integer in [{lo}, {hi}]")
        return int(raw)

    return AgentAnnouncement(
        agent_version=txt[announce.TXT_AGENT_VERSION][:64],
        protocol_version=integer(announce.TXT_PROTOCOL_VERSION, 1, 10_000),
        arch=txt[announce.TXT_ARCH][:64],
        cores=integer(announce.TXT_CORES, 0, 1_000_000),
        memory_bytes=integer(announce.TXT_MEMORY, 0, 1 << 60),
        accelerator=txt[announce.TXT_ACCELERATOR][:200],
        control_port=integer(announce.TXT_CONTROL_PORT, 1, 65535),
    )


def _decode_txt(props: dict) -> tuple[tuple[str, str], ...]:
    out = []
    for k, v in props.items():
        key = k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)
        val = "" if v is None else (v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v))
        out.append((key, val))
    return tuple(sorted(out))


def list_interfaces() -> dict[str, tuple[str, ...]]:
    """Interface name → its IPv4 addresses."""
    out: dict[str, tuple[str, ...]] = {}
    for adapter in ifaddr.get_adapters():
        ips = tuple(ip.ip for ip in adapter.ips if isinstance(ip.ip, str))
        if ips:
            out[adapter.nice_name] = ips
    return out


def select_interfaces(include: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> list[str]:
    """IPv4 addresses to bind to: the named interfaces (names or addresses), or all
    non-loopback ones, minus the excluded ones (names or addresses)."""
    table = list_interfaces()
    by_addr = {ip: name for name, ips in table.items() for ip in ips}
    for item in [*(include or ()), *exclude]:
        if item not in table and item not in by_addr:
            raise DiscoveryError(f"unknown interface {item!r} (known: {', '.join(sorted(table))})")
    excluded_names = {by_addr.get(x, x) for x in exclude}
    if include:
        chosen = []
        for item in include:
            chosen += list(table[item]) if item in table else [item]
    else:
        chosen = [ip for name, ips in table.items() for ip in ips if not ip.startswith("127.")]
    chosen = [ip for ip in chosen if by_addr.get(ip) not in excluded_names and ip not in exclude]
    if not chosen:
        raise DiscoveryError("no interface left to browse on; check --interface / --exclude-interface")
    return sorted(set(chosen))


class DeviceDiscovery:
    """Browse mDNS and keep the merged device list; ``on_change(device)`` on every change.

    Use as a context manager or call ``start()``/``stop()``. Thread-safe.
    """

    def __init__(
        self,
        on_change: Callable[[DiscoveredDevice], None] | None = None,
        *,
        interfaces: Sequence[str] | None = None,
        exclude_interfaces: Sequence[str] = (),
        service_types: Iterable[str] = ALL_SERVICE_TYPES,
        resolve_timeout_s: float = 3.0,
        recheck_s: float = 2.0,
        misses_to_offline: int = 2,
    ) -> None:
        if not (recheck_s > 0 and misses_to_offline >= 1):
            raise DiscoveryError(f"recheck_s must be > 0 and misses_to_offline >= 1, got {recheck_s}, "
                                 f"{misses_to_offline}")
        self._on_change = on_change
        self._interfaces = interfaces
        self._exclude = tuple(exclude_interfaces)
        self._types = tuple(service_types)
        self._resolve_ms = int(resolve_timeout_s * 1000)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._devices: dict[str, DiscoveredDevice] = {}
        self._service_owner: dict[tuple[str, str], str] = {}
        self._zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self.bound_addresses: list[str] = []
        self._recheck_s, self._misses_to_offline = recheck_s, misses_to_offline
        self._misses: dict[tuple[str, str], int] = {}
        self._vanished: set[tuple[str, str]] = set()
        self._stopping = threading.Event()
        self._prober: threading.Thread | None = None

    # lifecycle -----------------------------------------------------------------
    def start(self) -> DeviceDiscovery:
        self.bound_addresses = select_interfaces(self._interfaces, self._exclude)
        self._zc = Zeroconf(interfaces=self.bound_addresses, ip_version=IPVersion.V4Only)
        self._browser = ServiceBrowser(self._zc, list(self._types), handlers=[self._on_service])
        self._stopping.clear()
        self._prober = threading.Thread(target=self._probe_loop, name="mdns-recheck", daemon=True)
        self._prober.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._prober is not None:
            self._prober.join()
            self._prober = None
        if self._browser is not None:
            self._browser.cancel()
            self._browser = None
        if self._zc is not None:
            self._zc.close()
            self._zc = None

    def __enter__(self) -> DeviceDiscovery:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # queries -------------------------------------------------------------------
    def devices(self) -> tuple[DiscoveredDevice, ...]:
        with self._lock:
            return tuple(sorted(self._devices.values(), key=lambda d: d.id))

    def wait_for(self, predicate: Callable[[tuple[DiscoveredDevice, ...]], bool], timeout_s: float) -> bool:
        """Block until ``predicate(devices)`` holds or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                devs = tuple(sorted(self._devices.values(), key=lambda d: d.id))
                if predicate(devs):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    def add_manual(self, address: str, port: int = 22, user: str = "", name: str | None = None) -> DiscoveredDevice:
        """A host where multicast is blocked; merged with mDNS records of the same address."""
        if not 1 <= port <= 65535:
            raise DiscoveryError(f"port must be in 1..65535, got {port}")
        with self._lock:
            existing = self._find(None, (address,))
            dev = self._devices.get(existing) if existing else None
            if dev is None:
                dev = DiscoveredDevice(id=name or address, addresses=(address,), ssh_port=port, ssh_user=user,
                                       manual=True, online=True, last_seen=time.time())
            else:
                dev = msgspec.structs.replace(dev, manual=True, ssh_port=port, ssh_user=user or dev.ssh_user)
            self._devices[dev.id] = dev
            self._cond.notify_all()
        self._emit(dev)
        return dev

    # zeroconf side ---------------------------------------------------------------
    def _find(self, host: str | None, addresses: Iterable[str]) -> str | None:
        """Records merge by host name; a hand-added host (known only by address) also
        absorbs the records of its address. Two names on one address stay two devices."""
        if host and host in self._devices:
            return host
        addrs = set(addresses)
        for d in self._devices.values():
            if (d.manual or host is None) and addrs & set(d.addresses):
                return d.id
        return None

    def _on_service(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            self._remove(service_type, name)
            return
        try:
            info = zeroconf.get_service_info(service_type, name, timeout=self._resolve_ms)
        except Exception as err:  # a malformed record from the network must not stop browsing
            log.warning("cannot resolve %s: %s", name, err)
            return
        if info is None:
            return
        host = (info.server or name).rstrip(".")
        if host.endswith(".local"):
            host = host[: -len(".local")]
        host = host.lower()
        addresses = tuple(info.parsed_addresses(IPVersion.V4Only))
        txt = _decode_txt(info.properties or {})
        problem = ""
        agent = None
        if service_type == AGENT_SERVICE_TYPE:
            try:
                agent = parse_agent_txt(dict(txt))
            except ValueError as err:
                problem = f"ignored agent record {name}: {err}"
        rec = ServiceRecord(type=service_type, name=name, host=host, addresses=addresses,
                            port=int(info.port or 0), txt=txt, problem=problem)
        self._upsert(rec, agent)

    def _probe_loop(self) -> None:
        """Ask every known (and every vanished) service again; see the module docstring."""
        while not self._stopping.is_set():
            zc = self._zc
            if zc is None:
                return
            with self._lock:
                keys = set(self._service_owner) | self._vanished
            if not keys:
                self._stopping.wait(self._recheck_s)
                continue
            asked_ms = current_time_millis()
            try:
                out = DNSOutgoing(_FLAGS_QR_QUERY)
                for _stype, name in sorted(keys):
                    out.add_question(DNSQuestion(name, _TYPE_SRV, _CLASS_IN))
                zc.send(out)
            except Exception as err:  # a closed socket while stopping, an interface gone
                log.warning("mDNS re-query failed: %s", err)
                self._stopping.wait(self._recheck_s)
                continue
            # Responders answer after up to ~1 s (aggregation delays), so the whole
            # interval is the window.
            if self._stopping.wait(self._recheck_s):
                return
            for key in sorted(keys):
                rec = zc.cache.get_by_details(key[1], _TYPE_SRV, _CLASS_IN)
                self._after_probe(zc, key, answered=rec is not None and rec.created >= asked_ms)

    def _after_probe(self, zc: Zeroconf, key: tuple[str, str], answered: bool) -> None:
        if answered:
            self._misses.pop(key, None)
            if key in self._vanished:
                self._vanished.discard(key)
                log.info("%s answers again", key[1])
                self._on_service(zc, key[0], key[1], ServiceStateChange.Added)
            return
        if key in self._vanished:
            return
        self._misses[key] = self._misses.get(key, 0) + 1
        if self._misses[key] >= self._misses_to_offline:
            self._misses.pop(key, None)
            self._vanished.add(key)
            log.info("%s did not answer %d re-queries: offline", key[1], self._misses_to_offline)
            self._remove(*key)

    def _upsert(self, rec: ServiceRecord, agent: AgentAnnouncement | None) -> None:
        with self._lock:
            key = self._service_owner.get((rec.type, rec.name)) or self._find(rec.host, rec.addresses) or rec.host
            dev = self._devices.get(key) or DiscoveredDevice(id=key)
            services = tuple(s for s in dev.services if (s.type, s.name) != (rec.type, rec.name)) + (rec,)
            dev = self._merged(dev, services, agent_hint=agent)
            self._devices[key] = dev
            self._service_owner[(rec.type, rec.name)] = key
            self._vanished.discard((rec.type, rec.name))
            self._cond.notify_all()
        self._emit(dev)

    def _remove(self, service_type: str, name: str) -> None:
        with self._lock:
            key = self._service_owner.pop((service_type, name), None)
            dev = self._devices.get(key) if key else None
            if dev is None:
                return
            services = tuple(s for s in dev.services if (s.type, s.name) != (service_type, name))
            dev = self._merged(dev, services, agent_hint=None)
            self._devices[key] = dev
            self._cond.notify_all()
        self._emit(dev)

    @staticmethod
    def _merged(dev: DiscoveredDevice, services: tuple[ServiceRecord, ...],
                agent_hint: AgentAnnouncement | None) -> DiscoveredDevice:
        addresses = list(dev.addresses)
        for s in services:
            addresses += [a for a in s.addresses if a not in addresses]
        ssh = next((s for s in services if s.type in SSH_SERVICE_TYPES[:2]), None)
        agent = None
        for s in services:
            if s.type == AGENT_SERVICE_TYPE and not s.problem:
                agent = agent_hint if agent_hint is not None else parse_agent_txt(dict(s.txt))
        return msgspec.structs.replace(
            dev,
            addresses=tuple(addresses),
            ssh_port=ssh.port if ssh and not dev.manual else dev.ssh_port,
            services=services,
            agent=agent,
            online=bool(services) or dev.manual,
            last_seen=time.time() if services else dev.last_seen,
            problems=tuple(s.problem for s in services if s.problem),
        )

    def _emit(self, dev: DiscoveredDevice) -> None:
        if self._on_change is not None:
            self._on_change(dev)


def discover(timeout_s: float = 3.0, **kwargs) -> tuple[DiscoveredDevice, ...]:
    """Browse for ``timeout_s`` and return what was found (the CLI's one-shot listing)."""
    with DeviceDiscovery(**kwargs) as disc:
        time.sleep(timeout_s)
        return disc.devices()
