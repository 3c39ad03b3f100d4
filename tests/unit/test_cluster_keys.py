"""Key folders (foundation.cluster_keys) and how a process chooses to speak (zmq_auth)."""

from __future__ import annotations

import os

import pytest

from foundation import cluster_keys, zmq_auth
from foundation.cluster_keys import ClusterKeyError


@pytest.fixture
def restore_security():
    before = zmq_auth.current()
    yield
    zmq_auth.configure(before.keys, before.identity, before.transfer_encryption)


def test_init_writes_private_keys_of_both_roles_and_never_overwrites(tmp_path):
    folder = cluster_keys.init(tmp_path / "keys")
    keys = cluster_keys.load(folder)
    assert keys.holds("orchestrator") and keys.holds("worker") and len(keys.salt_secret) == 32
    assert keys.public("orchestrator") != keys.public("worker")
    assert keys.role_of(keys.public("worker")) == "worker" and keys.role_of(b"x" * 40) is None
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert all(os.stat(path).st_mode & 0o077 == 0 for path in folder.iterdir())
    with pytest.raises(ClusterKeyError, match="never overwritten"):
        cluster_keys.init(folder)
    assert cluster_keys.load(folder).public("worker") == keys.public("worker")


def test_two_clusters_have_different_keys_and_salt_secrets(tmp_path):
    first, second = (cluster_keys.load(cluster_keys.init(tmp_path / name)) for name in ("a", "b"))
    assert first.public("worker") != second.public("worker") and first.salt_secret != second.salt_secret


def test_a_worker_set_cannot_speak_as_the_orchestrator(tmp_path, restore_security):
    workers = cluster_keys.load(cluster_keys.worker_set(cluster_keys.init(tmp_path / "all"), tmp_path / "workers"))
    assert workers.holds("worker") and not workers.holds("orchestrator") and workers.salt_secret is None
    zmq_auth.configure(workers, "worker")
    with pytest.raises(ClusterKeyError, match="orchestrator.key_secret"):
        zmq_auth.configure(workers, "orchestrator")


def test_a_folder_others_can_read_is_refused(tmp_path):
    folder = cluster_keys.init(tmp_path / "keys")
    os.chmod(folder / "worker.key_secret", 0o644)
    with pytest.raises(ClusterKeyError, match="chmod"):
        cluster_keys.load(folder)


@pytest.mark.parametrize("make, message", [
    (lambda path: path, "does not exist"),
    (lambda path: (path.mkdir(mode=0o700), path)[1], "not a kvroute key folder"),
])
def test_missing_or_foreign_folders_say_how_to_make_one(tmp_path, make, message):
    with pytest.raises(ClusterKeyError, match=message) as refused:
        cluster_keys.load(make(tmp_path / "keys"))
    assert "kvroute keys init" in str(refused.value)


def test_a_process_needs_exactly_one_of_keys_and_insecure(tmp_path, restore_security, caplog):
    folder = str(cluster_keys.init(tmp_path / "keys"))
    with pytest.raises(ClusterKeyError, match="--insecure-no-auth"):
        zmq_auth.configure_from_flags("", False, "worker")
    with pytest.raises(ClusterKeyError, match="exclude each other"):
        zmq_auth.configure_from_flags(folder, True, "worker")
    assert zmq_auth.configure_from_flags(folder, False, "worker").enabled
    insecure = zmq_auth.configure_from_flags("", True, "worker")
    assert not insecure.enabled
    assert "authentication is OFF" in caplog.text


def test_serve_without_keys_makes_a_folder_for_its_run_and_removes_it():
    from kvroute.serve import run_keys
    from orchestrator.settings import OrchestratorSettings

    with run_keys(OrchestratorSettings()) as settings:
        folder = settings.cluster_keys
        keys = cluster_keys.load(folder)
        assert keys.holds("orchestrator") and keys.holds("worker") and keys.salt_secret
    assert not os.path.exists(folder)
    given = OrchestratorSettings(cluster_keys="/etc/kvroute/keys")
    with run_keys(given) as settings:
        assert settings is given
    with run_keys(OrchestratorSettings(insecure_no_auth=True)) as settings:
        assert settings.cluster_keys == ""


def secret_volume(tmp_path, keys):
    """A key folder laid out as kubelet mounts a Secret for a pod with an fsGroup: a folder
    anyone may list (0777), each file a link into ``..data``, the files group-readable (0440)."""
    mount = tmp_path / "secret"
    data = mount / "..2024_01_01_00_00_00.000000001"
    data.mkdir(parents=True)
    for path in keys.iterdir():
        (data / path.name).write_bytes(path.read_bytes())
        os.chmod(data / path.name, 0o440)
    (mount / "..data").symlink_to(data.name)
    for path in keys.iterdir():
        (mount / path.name).symlink_to(f"..data/{path.name}")
    os.chmod(mount, 0o777)
    return mount


def test_install_makes_a_loadable_private_copy_of_a_secret_volume(tmp_path):
    keys = cluster_keys.worker_set(cluster_keys.init(tmp_path / "all"), tmp_path / "workers")
    mount = secret_volume(tmp_path, keys)
    with pytest.raises(ClusterKeyError, match="open to other users"):
        cluster_keys.load(mount)  # why the pods install a copy rather than read the mount
    copy = cluster_keys.install(mount, tmp_path / "run" / "keys")
    assert sorted(path.name for path in copy.iterdir()) == sorted(path.name for path in keys.iterdir())
    assert os.stat(copy).st_mode & 0o777 == 0o700
    assert all(os.lstat(path).st_mode & 0o777 == 0o600 for path in copy.iterdir())
    assert cluster_keys.load(copy).public("worker") == cluster_keys.load(keys).public("worker")
    with pytest.raises(ClusterKeyError, match="never overwritten"):
        cluster_keys.install(mount, copy)


def test_install_refuses_a_folder_without_keys_and_leaves_nothing_of_a_broken_one(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ClusterKeyError, match="not a kvroute key folder"):
        cluster_keys.install(tmp_path / "empty", tmp_path / "copy")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "worker.key_secret").write_text("not a key")
    with pytest.raises(ClusterKeyError, match="no orchestrator.key"):
        cluster_keys.install(broken, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
