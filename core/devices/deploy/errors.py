"""The deploy failures an operator can act on: each a ``DeployError`` with a hint.

The two host-key refusals (``UnknownHostKey``, ``HostKeyMismatch``) live in ``host_keys`` with
the ``HostKeyInfo`` they carry."""

from __future__ import annotations

from core.errors import DeployError


class HostUnreachable(DeployError):
    """No route, DNS failure or timeout."""


class ConnectionRefused(DeployError):
    """The host answered but nothing listens on the SSH port."""


class AuthenticationFailed(DeployError):
    """The server rejected every credential offered."""


class MissingPackages(DeployError):
    """The device's Python lacks modules the agent needs; ``missing`` maps module → pip package."""

    def __init__(self, device: str, python: str, missing: dict[str, str]):
        self.missing = dict(missing)
        pkgs = " ".join(sorted(set(missing.values())))
        lines = "; ".join(f"{m} (pip install {p})" for m, p in sorted(missing.items()))
        super().__init__(device, f"{python} cannot import: {lines}",
                         f"install them on the device: {python} -m pip install {pkgs}")


class PythonTooOld(DeployError):
    """No usable Python on the device."""


class NoDiskSpace(DeployError):
    """Not enough free space in the remote directory."""


class AgentDidNotStart(DeployError):
    """The agent exited or never answered; ``log_tail`` is the end of its log."""

    def __init__(self, device: str, message: str, log_tail: str):
        self.log_tail = log_tail
        super().__init__(device, f"{message}\n--- agent log (tail) ---\n{log_tail.rstrip()}",
                         "read the log above; `edgeshard agents logs` shows more")
