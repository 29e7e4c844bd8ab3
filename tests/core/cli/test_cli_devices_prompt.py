"""The CLI's host-key question, asked by parallel deploy threads, answers only the key it shows."""

from __future__ import annotations

import re
import sys
import threading

from core.cli.devices import _prompt_trust
from core.devices.deploy import HostKeyInfo

GOOD = HostKeyInfo(host="10.0.0.1", port=22, key_type="ssh-ed25519", fingerprint="SHA256:goodgoodgood", known=False)
EVIL = HostKeyInfo(host="10.0.0.2", port=22, key_type="ssh-ed25519", fingerprint="SHA256:evilevilevil", known=False)


class _Operator:
    """A terminal (stdin, stdout, stderr in one) and the operator at it, who answers "y" when the
    fingerprint last shown is the one they checked. The first fingerprint shown waits briefly for
    a second thread to print too, the interleaving a real terminal gets at random."""

    def __init__(self, trusted: str):
        self.trusted, self.screen, self._lock = trusted, "", threading.Lock()
        self._both_printed = threading.Barrier(2, timeout=0.5)

    def write(self, text: str) -> int:
        with self._lock:
            self.screen += text
        if "fingerprint is" in text:
            try:
                self._both_printed.wait()
            except threading.BrokenBarrierError:
                pass
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        with self._lock:
            shown = re.findall(r"SHA256:\w+", self.screen)
        return "y\n" if shown and shown[-1] == self.trusted else "n\n"


def test_parallel_trust_prompts_never_let_one_answer_approve_another_hosts_key(monkeypatch):
    term = _Operator(trusted=GOOD.fingerprint)
    for stream in ("stdin", "stdout", "stderr"):
        monkeypatch.setattr(sys, stream, term)
    answers = {}

    def ask(info):
        answers[info.host] = _prompt_trust(info)

    threads = [threading.Thread(target=ask, args=(info,)) for info in (GOOD, EVIL)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert answers == {GOOD.host: True, EVIL.host: False}
    # each question names its host and fingerprint together
    assert f"Trust {GOOD.host_label} with ssh-ed25519 key {GOOD.fingerprint}?" in term.screen
    assert f"Trust {EVIL.host_label} with ssh-ed25519 key {EVIL.fingerprint}?" in term.screen
