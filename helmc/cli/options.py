"""Options every command spells the same way: -h / --help, -o / --output, --weights."""
from __future__ import annotations

import click

CONTEXT = {"help_option_names": ["-h", "--help"]}     # subcommands inherit it from the group's context


class _AliasOption(click.Option):
    """An option with names kept working but left out of --help (an earlier spelling scripts may still use)."""

    def __init__(self, *args, hidden_names: tuple[str, ...] = (), **kw):
        super().__init__(*args, **kw)
        self.hidden_names = hidden_names

    def get_help_record(self, ctx):
        shown = self.opts
        self.opts = [o for o in shown if o not in self.hidden_names]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = shown


def output_option(dest: str, help: str, old_out: bool = False, **kw):
    """-o / --output (and, where a command spelled it so, --out kept as a hidden alias)."""
    names = ("-o", "--output") + (("--out",) if old_out else ())
    return click.option(*names, dest, cls=_AliasOption, hidden_names=("--out",), help=help, **kw)


def weights_option(f):
    return click.option("--weights", "weights_dir", default=None, type=click.Path(),
                        help="model directory (or GGUF file) overriding the bundle's; relative to the current "
                             "directory")(f)
