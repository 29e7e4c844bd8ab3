"""The deploy dialog's SSH functions, backed by core.deploy.

Kept apart from the dialog so the dialog stays free of SSH code and the adapter is
the one place that follows core.deploy's API.
"""

from __future__ import annotations

from core.errors import DeployError
from core.reporting import Reporter
from gui.deploy_dialog import Credentials, HostKeyProbe


def _core_deploy():
    try:
        from core import deploy
    except ImportError:
        raise DeployError("studio", "SSH deployment (core.deploy) is not part of this build",
                          hint="deploy with `edgeshard deploy` once available, or use `edgeshard studio --demo`") from None
    return deploy


class CoreDeployFunctions:
    def probe_host_key(self, reporter: Reporter, record, credentials: Credentials) -> HostKeyProbe:
        deploy = _core_deploy()
        reporter.status("checking host key")
        info = deploy.probe_host_key(record.address, record.ssh_port)
        return HostKeyProbe(device=record.id, key_type=info.key_type, fingerprint=info.fingerprint,
                            known=info.known, changed=info.changed)

    def deploy_agent(self, reporter: Reporter, record, credentials: Credentials, trusted: HostKeyProbe) -> str:
        deploy = _core_deploy()
        result = deploy.deploy_agent(
            reporter, record.to_device(), user=credentials.user, key_file=credentials.key_file or None,
            password=credentials.password or None, trusted_fingerprint=trusted.fingerprint,
        )
        return str(getattr(result, "summary", "") or "agent running")
