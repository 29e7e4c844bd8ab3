# The two commands of the README. Both work from a clean clone on Debian 12 / Python 3.11.
PY ?= python3
PIP = $(PY) -m pip

.PHONY: run test install install-test

install:
	$(PIP) install -q torch==2.13.0          # the CPU wheel on disk; install first so nothing pulls a CUDA build
	$(PIP) install -q -e .

install-test: install
	bash scripts/install-system-deps.sh
	$(PIP) install -q -e '.[test]'

run: install
	edgeshard compare resources/scenarios/edgeshard-paper.json

test: install-test
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q
