"""The command line: BATON_* environment defaults, grouped help, offline generate."""

from __future__ import annotations

import pytest

from baton.services.cli import apply_env_defaults, build_parser, main


def _parse(argv: list[str]):  # type: ignore[no-untyped-def]
    parser = build_parser(argv[0])
    apply_env_defaults(parser)
    return parser.parse_args(argv)


def test_env_sets_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_PAGE_SIZE", "16")
    monkeypatch.setenv("BATON_DISABLE_OVERLAP", "true")
    monkeypatch.setenv("BATON_TRANSFER_BACKEND", "ucx")
    args = _parse(["decode"])
    assert (args.page_size, args.disable_overlap, args.transfer_backend) == (16, True, "ucx")
    args = _parse(["decode", "--page-size", "4"])
    assert args.page_size == 4


def test_bad_env_value_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATON_PAGE_SIZE", "sixteen")
    with pytest.raises(SystemExit):
        _parse(["worker"])
    assert "BATON_PAGE_SIZE" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["worker", "prefill", "decode", "up", "bootstrap", "router"])
def test_help_groups_flags_by_topic(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: a `python -m` child spent ~5 s importing torch per command, and the
    # integration tests start `python -m baton.services.cli` for real.
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "network:" in out
    assert "[env BATON_HOST]" in out


def test_generate_prints_text(tiny_model, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_model),
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "5",
            "--ignore-eos",
        ]
    )
    assert rc == 0
    assert "(length, 5 tokens)" in capsys.readouterr().out


def test_make_model_command(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rc = main(["make-model", str(tmp_path / "m"), "--arch", "qwen3", "--layers", "1"])
    assert rc == 0
    assert (tmp_path / "m" / "config.json").exists()
