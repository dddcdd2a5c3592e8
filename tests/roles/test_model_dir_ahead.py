"""The random initial model is written while Ray starts (`mcore_rl.roles.graph.ModelDirAhead`);
a start that fails still leaves no ``initial_model/`` behind."""
import pytest

from mcore_rl.cli.main import main
from mcore_rl.flow import ray_shim


def test_a_ray_start_that_fails_leaves_no_initial_model(tmp_path, monkeypatch):
    if ray_shim.require().is_initialized():
        ray_shim.require().shutdown()

    def no_ray(*args, **kwargs):
        raise RuntimeError("Ray could not start")

    monkeypatch.setattr(ray_shim, "start_local", no_ray)
    with pytest.raises(RuntimeError, match="Ray could not start"):
        main(["train", "configs/quickstart.yaml", f"logging.dir={tmp_path}"])
    assert not list(tmp_path.glob("initial_model*"))


def test_the_model_is_written_ahead_once_and_discard_removes_it(tmp_path):
    from mcore_rl.config import load_config
    from mcore_rl.roles.graph import ModelDirAhead

    cfg = load_config("configs/quickstart.yaml", [f"logging.dir={tmp_path}"])
    ahead = ModelDirAhead(cfg)
    assert ahead.fresh
    ahead.wait()
    assert (tmp_path / "initial_model" / "config.json").is_file()
    second = ModelDirAhead(cfg)  # a second start (a resume) finds it written
    second.wait()
    assert not second.fresh
    ahead.discard()
    assert not list(tmp_path.glob("initial_model*"))
