"""pace_core.model.reference: a model's source as text."""

from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.model.reference import looks_like_path, portable_reference
from pace_core.version import REPO_ROOT


def test_portable_reference_names_repository_folders_relative_to_the_repository(tmp_path, monkeypatch):
    """The embedded model (as loaded: its absolute path) is named by its repository path; a hub id, a folder
    outside the repository (absolute or relative) and a relative path inside it are given as they are."""
    assert portable_reference(str(DEFAULT_MODEL_DIR)) == "data/models/pace-tiny-qwen35"
    assert portable_reference(str(REPO_ROOT / "data" / "models" / ".." / "models" / "x")) == "data/models/x"
    assert portable_reference("Qwen/Qwen3.5-4B") == "Qwen/Qwen3.5-4B"
    assert portable_reference(str(tmp_path)) == str(tmp_path)
    monkeypatch.chdir(REPO_ROOT)
    assert portable_reference("./data/models/pace-tiny-qwen35") == "data/models/pace-tiny-qwen35"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    assert portable_reference("m") == "m" and portable_reference("../elsewhere/m") == "../elsewhere/m"


def test_a_hub_id_is_one_name_or_owner_and_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not looks_like_path("Qwen/Qwen3.5-4B") and not looks_like_path("model")
    for path in ("/abs/m", "./m", "~/m", "a/b/c", "m/", str(tmp_path)):
        assert looks_like_path(path), path
    (tmp_path / "here").mkdir()
    assert looks_like_path("here")
