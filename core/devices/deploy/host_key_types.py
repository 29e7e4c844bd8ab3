"""Which host-key algorithms to ask a known host for, so the key it presents can be compared.

Why: a server with several host keys presents the one the client prefers first. If
known_hosts holds only the host's ECDSA key and the client prefers ed25519, the presented key
has a type with no entry and cannot be verified. OpenSSH solves this by ordering its
HostKeyAlgorithms by the types on file; we restrict them to those types, and treat a host that
offers none of them as a changed key (never as an unknown one a flag could auto-accept).
"""

from __future__ import annotations

from collections.abc import Iterable

import paramiko

_ALGORITHMS_OF_TYPE = {
    "ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"),
}
"""known_hosts key types whose signature algorithms have other names (RSA: SHA-2 variants)."""


def algorithms_for(key_types: Iterable[str], supported: Iterable[str]) -> tuple[str, ...]:
    """The ``supported`` host-key algorithms (in their order) that yield a key of ``key_types``."""
    wanted = {alg for kt in key_types for alg in _ALGORITHMS_OF_TYPE.get(kt, (kt,))}
    return tuple(alg for alg in supported if alg in wanted)


def restrict_to_known_types(transport: paramiko.Transport, key_types: Iterable[str]) -> tuple[str, ...]:
    """Before ``start_client``: accept only host keys of ``key_types`` (no-op when empty).

    Returns the algorithms kept. When none of the known types is supported here, the offer is
    left as is: the presented key then has no entry and is classified as changed.
    """
    types = tuple(key_types)
    if not types:
        return ()
    options = transport.get_security_options()
    keep = algorithms_for(types, options.key_types)
    if keep:
        options.key_types = keep
    return keep
