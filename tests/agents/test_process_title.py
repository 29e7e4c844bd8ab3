"""An agent's name in ps/top: the titles made from its command line, and the fallback
without setproctitle (the process name only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agents.process_title import agent_titles


def test_the_titles_name_the_agent_s_device_and_fit_the_kernel_s_15_bytes():
    title, comm = agent_titles(["serve", "--device", "edge-a", "--host", "127.0.0.1"])
    assert (title, comm) == ("edgeshard agent edge-a: python -m agents serve --device edge-a --host 127.0.0.1",
                             "agent edge-a")
    assert agent_titles(["serve", "--device=jetson-orin-lab-3"])[1] == "agent jetson-or"
    assert agent_titles(["zygote", "--socket-fd", "3"])[1] == "agent zygote"  # no device: the role


def test_without_setproctitle_the_process_name_still_changes_and_it_says_how():
    script = ("import sys; sys.modules['setproctitle'] = None\n"  # an import of it fails
              "from agents.process_title import set_process_title\n"
              "print(set_process_title('edgeshard agent x: python -m agents serve', 'agent x'))\n"
              "print(open('/proc/self/comm').read().strip())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split("\n")[:2] == ["prctl", "agent x"]


def test_naming_a_thread_names_that_thread_only():
    script = ("import threading\n"
              "from agents.process_title import name_this_thread\n"
              "got = []\n"
              "def named():\n"
              "    got.append(name_this_thread('agent-control'))\n"
              "    got.append(open(f'/proc/self/task/{threading.get_native_id()}/comm').read().strip())\n"
              "t = threading.Thread(target=named)\n"
              "t.start(); t.join()\n"
              "print(got[0], got[1], open('/proc/self/comm').read().strip(), sep='|')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == f"True|agent-control|{Path(sys.executable).name[:15]}"
