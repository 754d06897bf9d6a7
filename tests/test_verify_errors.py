"""``rlrepro verify`` refuses a run directory it cannot read with a message naming the file (exit 2)."""
from rlrepro.orchestration.verify import main_verify
from test_repro_diff import make_run


def test_a_corrupt_config_yaml_is_an_error_naming_the_file(tmp_path, capsys):
    run = make_run(tmp_path / "y", steps=2)
    (run / "config.yaml").write_text("run: [unclosed\n")
    assert main_verify([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlrepro verify: {run / 'config.yaml'}: cannot parse the run's config (ParserError: ")
    assert "Traceback" not in err
    (run / "config.yaml").write_text("- just\n- a list\n")
    assert main_verify([str(run)]) == 2
    assert (f"rlrepro verify: {run / 'config.yaml'}: expected a mapping at the top level, got list"
            in capsys.readouterr().err)
