"""The `calexec` dispatcher: every listed command resolves to a module with main(argv)."""

import importlib

from calexec import cli


def test_every_command_resolves_to_a_main():
    for name, (module, help_text) in cli.COMMANDS.items():
        assert callable(importlib.import_module(module).main), name
        assert help_text


def test_help_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0 and "serve" in capsys.readouterr().out
    assert cli.main([]) == 2
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
