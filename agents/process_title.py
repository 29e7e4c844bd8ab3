"""A forked agent's own name in ``ps`` and ``top`` (it would read ``python -m agents zygote``).

An agent forked by the zygote (agents/zygote.py) inherits the zygote's command line and
process name, so ``ps`` showed three identical ``python -m agents zygote`` lines for three
agents. ``set_process_title`` names the process after the agent it became:

- the kernel's process name (``prctl(PR_SET_NAME)``, /proc/PID/comm, at most 15 bytes: what
  ``top``, ``ps -e`` and ``pgrep`` show), always on Linux: ``agent edge-a``;
- its command line (/proc/PID/cmdline: what ``ps -f``, ``ps aux`` and ``top -c`` show), with
  ``setproctitle`` (PyPI; a dependency of the project, so installed with it). Without it (an
  agent copied alone somewhere) only the process name changes, and ``title_method`` says so.

``name_this_thread`` names one thread: the agent's control thread is ``agent-control`` (``top -H``,
``ps -L``), so a host that places a local cluster's agents can tell it from the stage's compute.

Ships with the agent: standard library, ``setproctitle`` only when importable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

COMM_BYTES = 15
"""The kernel keeps 16 bytes of a process name, its NUL included (TASK_COMM_LEN)."""
PR_SET_NAME = 15
CONTROL_THREAD_NAME = "agent-control"
"""The kernel's name of an agent's control thread (/proc/PID/task/TID/comm; its other threads keep the process
name): what ``core.devices.cpu_placement`` moves off the cores a local cluster's stages compute on, since its
work (replies, heartbeats, forwarding tokens and events) waits on no forward and no forward on it."""


def agent_titles(argv: list[str]) -> tuple[str, str]:
    """(command line, process name) for an agent started with ``python -m agents`` + ``argv``:
    ``edgeshard agent edge-a: python -m agents serve --device edge-a ...`` and ``agent edge-a``
    (``agent <role>`` when the command line names no device)."""
    role = argv[0] if argv else "agent"
    device = ""
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    name = device or role
    return f"edgeshard agent {name}: python -m agents {' '.join(argv)}", f"agent {name}"[:COMM_BYTES]


def prepare_process_titles() -> bool:
    """Set ``setproctitle`` up now, while this process's environment is as it started: it finds the
    command line's memory from the environment's, and a forked agent replaces its environment before
    it names itself (``os.environ`` rewritten: setproctitle set up then changed nothing). The zygote
    calls it before its first fork; its children inherit the set-up. False without setproctitle."""
    try:
        import setproctitle
    except ImportError:
        return False
    setproctitle.getproctitle()  # its first call does the set-up
    return True


def set_process_title(title: str, comm: str) -> str:
    """Name this process ``title`` (command line) and ``comm`` (process name) as far as the
    platform allows; returns how: ``setproctitle+prctl``, ``prctl`` or ``none``."""
    done = []
    try:
        import setproctitle

        setproctitle.setproctitle(title)
        done.append("setproctitle")
    except ImportError:
        pass
    if name_this_thread(comm):
        done.append("prctl")
    return "+".join(done) or "none"


def name_this_thread(comm: str) -> bool:
    """Give the calling thread the kernel's name ``comm`` (``prctl(PR_SET_NAME)`` names its caller only; on the
    main thread that is the process name); False where the platform has no such name."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_NAME, comm.encode()[:COMM_BYTES], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
