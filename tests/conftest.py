import atexit
import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# Tests never touch the real HOME or the user's QSettings: settings, workspaces and SSH files
# go to a throw-away home, set before anything imports Qt (QSettings reads XDG_CONFIG_HOME).
# Caches (the trained demo model, HF) are not settings: they keep pointing at the real cache.
_REAL_HOME = os.environ.get("HOME", str(Path.home()))
os.environ.setdefault("XDG_CACHE_HOME", os.path.join(_REAL_HOME, ".cache"))
_TEST_HOME = tempfile.mkdtemp(prefix="edgeshard-test-home-")
atexit.register(shutil.rmtree, _TEST_HOME, True)
os.environ["HOME"] = _TEST_HOME
os.environ["XDG_CONFIG_HOME"] = os.path.join(_TEST_HOME, ".config")
os.environ["XDG_DATA_HOME"] = os.path.join(_TEST_HOME, ".local", "share")
os.environ.pop("EDGESHARD_HOME", None)
os.environ.pop("EDGESHARD_WORKSPACE", None)


# --- one agents' zygote for the whole session's local clusters (core/devices/local_cluster.py) ---
# Each LocalCluster would start its own (torch + transformers imported again: ~3.3 s of CPU, far
# more under load); they fork their agents from a shared one instead, still one process each,
# stopped by their cluster. A test of the zygote's own life takes ``own_zygote``.
@pytest.fixture(scope="session", autouse=True)
def _shared_zygotes(tmp_path_factory):
    from core.devices import local_cluster

    zygotes = local_cluster.SharedZygotes(tmp_path_factory.mktemp("zygotes"),
                                          ignored_env=("PYTEST_CURRENT_TEST",))  # pytest sets it per test
    local_cluster.share_zygotes(zygotes)
    yield zygotes
    local_cluster.share_zygotes(None)
    zygotes.close()


@pytest.fixture(scope="module")
def own_zygote():
    """Local clusters started in this module start (and end) their own zygote, as outside the
    suite (``pytestmark = pytest.mark.usefixtures("own_zygote")``; module-wide, so a module's
    cluster fixture gets it too)."""
    from core.devices import local_cluster

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_cluster, "_shared_zygotes", None)
        yield


# --- the collected suite is frozen out of the cyclic garbage collector ---
# Collection leaves ~1-2 million long-lived objects (torch, transformers, Qt, every test item);
# each full collection walked all of them: ~0.3-0.8 s for every ``gc.collect()`` the code under
# test makes (agents/profiler.py frees each unit that way: 5 a tiny profile) and for the
# automatic ones. Frozen, a collection walks only what the tests made since. Nothing the tests
# create is frozen: their garbage is collected as before.
@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


# --- `make test-fast`: the tests measured slow are marked `slow` here, from tests/slow_tests.txt ---
# One list instead of a decorator in each module: the list is a measurement (regenerate it with
# scripts/slow_tests.py from a junit report) and its keys, "file name::test name", survive a
# module moving to another folder.
from tests.slow_list import SLOW_LIST, is_listed, read_slow_keys  # noqa: E402


def slow_key(item) -> str:
    """``test_x.py::test_name[param]``: the node id without its folders."""
    return f"{item.path.name}::{item.nodeid.split('::', 1)[1]}"


def folders_left_without_a_quick_test(items, listed: set[str]) -> list[str]:
    """Test folders (packages) the list took every quick test from, netns tests aside (test-fast
    leaves them out anyway). A module that marks itself wholly slow (``pytestmark``) chose so."""
    by_folder: dict[str, list] = {}
    for item in items:
        if item.get_closest_marker("netns") is None:
            by_folder.setdefault(item.nodeid.split("::", 1)[0].rpartition("/")[0], []).append(item)
    return sorted(f for f, its in by_folder.items()
                  if all(it.get_closest_marker("slow") for it in its) and any(it.nodeid in listed for it in its))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    keys = read_slow_keys()
    used: set[str] = set()
    listed: set[str] = set()
    for item in items:
        entry = is_listed(slow_key(item), keys)
        if entry:
            used.add(entry)
            if item.get_closest_marker("slow") is None:  # not marked in its module already
                item.add_marker(pytest.mark.slow)
                listed.add(item.nodeid)
    if config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return  # a chosen file or test: only the whole suite shows every folder and every listed test
    bare = folders_left_without_a_quick_test(items, listed)
    if bare:
        raise pytest.UsageError("every test folder keeps a test that `make test-fast` runs; "
                                f"{SLOW_LIST.name} lists all the tests of: " + ", ".join(bare))
    config.stash[_STALE] = sorted(keys - used)


_STALE = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, config):
    stale = config.stash.get(_STALE, [])
    if stale:
        terminalreporter.write_line(f"{SLOW_LIST.name} names {len(stale)} tests that no longer exist "
                                    f"(renamed or removed: update it): " + ", ".join(stale), yellow=True)
