"""--trust / --require-signed (every command that loads a bundle: run, serve, chat, calibrate) and --plan (run,
serve, chat)."""
from __future__ import annotations

import click


def trust_options(f):
    f = click.option("--require-signed", is_flag=True,
                     help="refuse a bundle without a valid signature by a trusted key")(f)
    return click.option("--trust", "trust", multiple=True, type=click.Path(),
                        help="public key (KEYFILE.pub from `helmc keygen`) whose signature is accepted; repeatable; "
                             "also every .pub in the directory HELMC_TRUSTED_KEYS names. Implies --require-signed: "
                             "naming the signers you trust refuses unsigned bundles")(f)


def plan_option(f):
    """--plan FILE: run the bundle with a plan made for this machine (`helmc plan BUNDLE hardware.json -o FILE`)."""
    return click.option("--plan", "plan_file", default=None, type=click.Path(dir_okay=False),
                        help="run with this plan instead of the bundle's own: `helmc profile` here, then `helmc plan "
                             "BUNDLE hardware.json -o FILE` (no compiling: the placement changes, not the code)")(f)
