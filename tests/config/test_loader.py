"""YAML + overrides -> typed config; every problem is one line naming the field."""
import dataclasses
import inspect
from pathlib import Path

import pytest

from mcore_rl.config import RLConfig, load_config
from mcore_rl.config import sections
from mcore_rl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_values_and_overrides_reach_the_typed_fields(tmp_path):
    path = write(tmp_path, "parallel:\n  tp: 2\noptimizer:\n  lr: 1e-5\n")
    cfg = load_config(path, ["parallel.pp=2", "rollout.temperature=0.7", "model.path=/x"])
    assert (cfg.parallel.tp, cfg.parallel.pp) == (2, 2)
    assert cfg.optimizer.lr == 1e-5 and isinstance(cfg.optimizer.lr, float)  # YAML reads 1e-5 as str
    assert cfg.rollout.temperature == 0.7
    assert cfg.model.path == "/x"
    assert cfg.train.steps == RLConfig().train.steps  # untouched defaults stay


def test_unknown_key_suggests_the_closest_valid_one(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'parallel.tpp'; did you mean 'tp'\?"):
        load_config(write(tmp_path, "parallel:\n  tpp: 2\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'optimiser'; did you mean 'optimizer'\?"):
        load_config(None, ["optimiser.lr=1"])


@pytest.mark.parametrize("override, message", [
    ("parallel.tp=two", r"parallel.tp: expected int, got 'two'"),
    ("parallel.tp=1.5", r"parallel.tp: expected int, got 1.5"),
    ("model.tie_word_embeddings=3", r"model.tie_word_embeddings: expected bool"),
    ("rollout.placement=colo", r"rollout.placement: must be one of 'colocated', 'separate', 'fused', got 'colo'"),
    ("parallel.vpp=x", r"parallel.vpp: expected int \| null, got 'x'"),
])
def test_wrong_types_name_the_field_and_expected_type(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_section_given_a_scalar_is_rejected():
    with pytest.raises(ConfigError, match="parallel: expected a mapping"):
        load_config(None, ["parallel=3"])


def test_missing_and_malformed_files_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML at line 2"):
        load_config(write(tmp_path, "a: 1\n b: [\n"))


def _fields_without_docstring(cls) -> list[str]:
    """Fields of a dataclass not followed by a string literal in its class body (what the
    docs' config reference shows for each field)."""
    from mcore_rl.config.reference import field_docs

    documented = field_docs(cls)
    return [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls) if f.name not in documented]


def test_every_config_field_has_a_docstring_and_a_default():
    classes = [c for _, c in inspect.getmembers(sections, inspect.isclass)
               if dataclasses.is_dataclass(c) and c.__module__ == sections.__name__]
    assert len(classes) >= 11
    missing = [m for c in classes for m in _fields_without_docstring(c)]
    assert not missing, f"fields without docstring: {missing}"
    RLConfig()  # every field has a default


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    from mcore_rl.roles.rules import check_config

    check_config(load_config(path))


def test_a_mapping_field_takes_yaml_and_overrides_and_names_the_bad_key(tmp_path):
    cfg = load_config(write(tmp_path, "reward:\n  weights:\n    math: 1\n    code: 0.5\n"),
                      ["reward.weights.exact=0.25", "reward.weights.code=2"])
    assert cfg.reward.weights == {"math": 1.0, "code": 2.0, "exact": 0.25}
    assert all(isinstance(v, float) for v in cfg.reward.weights.values())
    assert RLConfig().reward.weights == {} and RLConfig().reward.weights is not RLConfig().reward.weights
    with pytest.raises(ConfigError, match=r"^reward.weights.math: expected float, got 'high'"):
        load_config(None, ["reward.weights.math=high"])
    with pytest.raises(ConfigError, match=r"^reward.weights: expected a mapping of str to float"):
        load_config(None, ["reward.weights=[1, 2]"])
    with pytest.raises(ConfigError, match=r"^reward.weights.pkg: expected float, got a mapping .* "
                                          r"a key with dots goes in the YAML file"):
        load_config(None, ["reward.weights.pkg.mod:fn=1"])


def test_a_list_field_takes_yaml_lists_and_comma_overrides_and_names_the_bad_item(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("logging:\n  backends: [jsonl, wandb]\n")
    assert load_config(path).logging.backends == ["jsonl", "wandb"]
    assert load_config(path, ["logging.backends=tensorboard,mlflow"]).logging.backends == \
        ["tensorboard", "mlflow"]
    assert load_config(None, ["logging.backends=[]"]).logging.backends == []
    assert load_config(None).logging.backends == ["jsonl", "tensorboard"]
    with pytest.raises(ConfigError, match=r"logging.backends\[1\]: expected str, got \[1\]"):
        load_config(None, ["logging.backends=[jsonl, [1]]"])
    with pytest.raises(ConfigError, match="logging.backends: expected a list of str"):
        load_config(None, ["logging.backends={a: 1}"])
