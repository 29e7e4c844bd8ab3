"""EDGESHARD_HOME is the deployment folder, EDGESHARD_WORKSPACE the sessions SQLite file."""

from __future__ import annotations

import pytest

from core.devices import deploy

from core import paths

from core.sessions import store
from core.errors import EdgeShardError, StoreError


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(paths.ENV_HOME, raising=False)
    monkeypatch.delenv(paths.ENV_WORKSPACE, raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    return tmp_path


def test_each_variable_names_its_own_kind_of_path_for_every_reader(clean_env, monkeypatch):
    tmp = clean_env
    assert deploy.default_workspace() == tmp / "home" / ".edgeshard"
    assert store.default_workspace_path() == tmp / "home" / ".local/share/edgeshard/workspace.sqlite"
    monkeypatch.setenv(paths.ENV_HOME, str(tmp / "keys"))
    monkeypatch.setenv(paths.ENV_WORKSPACE, str(tmp / "ws.sqlite"))
    assert deploy.default_workspace() == tmp / "keys"
    assert store.default_workspace_path() == tmp / "ws.sqlite"


def test_a_sqlite_workspace_in_the_environment_leaves_deploy_its_own_folder(clean_env, monkeypatch):
    ws = clean_env / "x" / "ws.sqlite"
    monkeypatch.setenv(paths.ENV_WORKSPACE, str(ws))
    with store.SessionStore(store.default_workspace_path()) as s:
        s.create_session("lab")
    home = paths.home_folder()
    keys = deploy.coordinator_keypair(home)  # was a FileExistsError: the home was the SQLite file
    assert (home / "coordinator.key").is_file() and len(keys.public) == 40
    with store.SessionStore(store.default_workspace_path()) as s:
        assert [x.name for x in s.sessions()] == ["lab"]


def test_a_file_given_as_the_home_or_a_folder_as_the_workspace_is_a_clear_error(clean_env, monkeypatch):
    f = clean_env / "ws.sqlite"
    f.write_bytes(b"")
    with pytest.raises(EdgeShardError, match="must be a folder.*EDGESHARD_HOME"):
        deploy.deploy_agent(None, deploy.SshTarget("d", "127.0.0.1", 1), workspace=f)
    monkeypatch.setenv(paths.ENV_HOME, str(f))
    with pytest.raises(EdgeShardError, match="EDGESHARD_WORKSPACE"):
        paths.home_folder()
    monkeypatch.setenv(paths.ENV_WORKSPACE, str(clean_env))
    with pytest.raises(StoreError, match="EDGESHARD_HOME"):
        store.SessionStore(store.default_workspace_path())
