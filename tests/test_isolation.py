"""The suite runs in a throw-away home (tests/conftest.py): a test that saves settings or a
workspace cannot write into the user's real ones."""

import os

from core.paths import workspace_file


def _test_home() -> str:
    home = os.environ["HOME"]
    assert os.path.basename(home).startswith("edgeshard-test-home-"), home
    return home


def test_home_config_and_data_point_into_the_test_home():
    home = _test_home()
    assert os.environ["XDG_CONFIG_HOME"].startswith(home)
    assert os.environ["XDG_DATA_HOME"].startswith(home)


def test_qsettings_are_written_inside_the_test_home(qapp):
    from gui.app import settings

    s = settings()
    s.setValue("isolation-probe", 1)
    s.sync()
    assert s.fileName().startswith(_test_home()), s.fileName()


def test_the_default_workspace_is_inside_the_test_home():
    assert str(workspace_file()).startswith(_test_home())
