# The two commands of the README. Both work from a clean clone on Debian 12 / Python 3.11.
PY ?= python3
PIP = $(PY) -m pip
# The exact versions the suite passes with (constraints.txt), for every pip line.
PINS = -c constraints.txt

.PHONY: run test test-fast install install-test

install:
	bash scripts/install-system-deps.sh      # Qt's xcb libraries, sshd, avahi, xvfb (only those missing; needs root)
	$(PIP) install -q $(PINS) torch==2.13.0  # the CPU wheel on disk; install first so nothing pulls a CUDA build
	$(PIP) install -q $(PINS) -e .

install-test: install
	$(PIP) install -q $(PINS) -e '.[test]'

# The main job: the studio on a local demo cluster (needs a display; see README for xvfb-run).
run: install
	$(PY) -m core.cli studio --demo

test: install-test
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q

# Contributors' quick check (under 3 minutes on 2 cores, every test folder touched): all but the
# tests measured slow (tests/slow_tests.txt, scripts/slow_tests.py) and the netns ones (root, testbed).
test-fast: install-test
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -m "not slow and not netns"
