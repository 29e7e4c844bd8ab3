import atexit
import os
import shutil
import tempfile
from pathlib import Path

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
