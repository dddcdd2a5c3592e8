"""`RunCheckpoints.save` of a step that exists already (a resumed run redoing a step): the
step reads as incomplete from the moment its first part is replaced until its run state is
written again, so a kill in between never leaves a mix of old and new parts that resumes."""
from pathlib import Path
from types import SimpleNamespace

from mcore_rl.train import run_checkpoints as rc


class _Engine:
    def __init__(self, tag: str):
        self.tag = tag

    def weights_finite(self) -> bool:
        return True


def test_a_step_saved_again_is_incomplete_while_its_parts_are_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "dist", SimpleNamespace(get_rank=lambda: 0, barrier=lambda: None))
    monkeypatch.setattr(rc.RunCheckpoints, "_check_room", lambda self, step, engines: 1)
    complete_while_writing: list[bool] = []

    def save_engine(engine, path: Path) -> None:
        complete_while_writing.append((path.parent / "run_state.json").exists())
        path.mkdir(parents=True, exist_ok=True)
        (path / "weights").write_text(engine.tag)

    monkeypatch.setattr(rc, "save_engine", save_engine)
    checkpoints = rc.RunCheckpoints(tmp_path, keep_last=5)
    step = checkpoints.save(2, {"actor": _Engine("old"), "critic": _Engine("old")}, {"x": 1})
    assert (step / "run_state.json").is_file() and checkpoints.latest() == step

    complete_while_writing.clear()
    checkpoints.save(2, {"actor": _Engine("new"), "critic": _Engine("new")}, {"x": 2})
    assert complete_while_writing == [False, False]  # a kill there: step 2 is skipped
    assert (step / "run_state.json").read_text() == '{"step": 2, "x": 2}'
    assert (step / "critic" / "weights").read_text() == "new"


def test_the_loops_objects_are_kept_beside_the_run_state_and_absent_ones_load_as_none(
        tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "dist", SimpleNamespace(get_rank=lambda: 0, barrier=lambda: None))
    monkeypatch.setattr(rc.RunCheckpoints, "_check_room", lambda self, step, engines: 1)
    monkeypatch.setattr(rc, "save_engine", lambda engine, path: path.mkdir(parents=True))
    checkpoints = rc.RunCheckpoints(tmp_path)
    first = checkpoints.save(1, {"actor": _Engine("a")}, {}, objects={"pool": {"groups": [3, 4]}})
    second = checkpoints.save(2, {"actor": _Engine("a")}, {})
    assert rc.RunCheckpoints.load_object(first, "pool") == {"groups": [3, 4]}
    assert rc.RunCheckpoints.load_object(second, "pool") is None
    assert not list(first.glob("*.part"))  # written whole, then renamed
