"""rlrepro.data.specs: the one rule by which reward.fn, env.fn and the workers' import directories split and
import a ``pkg.module:attr`` spec."""
import json

import pytest

from rlrepro.data.specs import SpecError, import_spec, split_spec
from rlrepro.orchestration.import_path import module_dirs


def test_split_at_the_first_colon_else_at_the_last_dot():
    assert split_spec("pkg.mod:Class.attr") == ("pkg.mod", "Class.attr")
    assert split_spec("pkg.mod.fn") == ("pkg.mod", "fn")
    assert split_spec(":fn") == ("", "fn") and split_spec("pkg.mod:") == ("pkg.mod", "")
    with pytest.raises(SpecError) as e:
        split_spec("exactmatch")
    assert e.value.problem == "no_path" and isinstance(e.value, ValueError)


def test_import_spec_resolves_and_says_what_went_wrong():
    assert import_spec("json:dumps") is json.dumps
    assert import_spec("json.dumps") is json.dumps
    assert import_spec("json:JSONDecoder.decode") is json.JSONDecoder.decode
    for spec in (":dumps", "json:", "."):
        with pytest.raises(SpecError) as e:
            import_spec(spec)
        assert e.value.problem == "malformed"
    with pytest.raises(SpecError) as e:
        import_spec("no_such_module_xyz:fn")
    assert e.value.problem == "import" and e.value.module_name == "no_such_module_xyz"
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    with pytest.raises(SpecError) as e:
        import_spec("json:JSONDecoder.missing")
    assert (e.value.problem, e.value.attr, e.value.owner, e.value.owner_name) == \
        ("attribute", "missing", json.JSONDecoder, "JSONDecoder")


def test_module_dirs_splits_as_the_loaders_do(tmp_path, monkeypatch):
    (tmp_path / "my_spec_mod.py").write_text("def fn(completion, record):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_dirs(["exact_match", None, "", "my_spec_mod:fn", "my_spec_mod.fn"]) == [str(tmp_path)]
