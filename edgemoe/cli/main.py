"""edgemoe command line: a thin click layer over edgemoe's Python API.

The root group and the one place where every command group's commands are registered;
the command modules (model, analysis, calibrate, bench) never import this module.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any

import click

from .. import __version__
from ..errors import EdgeMoeError
from ..plan.request import PlacementError
from . import analysis, bench, calibrate, doctor, model, perf, serve
from .flags import cli_text


class EdgeMoeGroup(click.Group):
    """Turns library errors into one-line messages that name the CLI's flags (cli/flags.py); tracebacks only
    with --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PlacementError as err:  # options that cannot run together: a usage error (exit 2)
            raise click.UsageError(cli_text(str(err))) from err
        except EdgeMoeError as err:
            if ctx.meta.get("edgemoe.debug"):
                traceback.print_exc()
            raise click.ClickException(cli_text(str(err))) from err
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001 - the CLI edge: never show a raw traceback by default
            if ctx.meta.get("edgemoe.debug"):
                raise
            raise click.ClickException(
                f"unexpected {type(err).__name__}: {err} (run `edgemoe --debug ...` for the traceback "
                "and please report it)"
            ) from err


@click.group(cls=EdgeMoeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edgemoe")
@click.option(
    "--debug", is_flag=True, envvar="EDGEMOE_DEBUG", help="show llama.cpp's log and full tracebacks"
)
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """edgemoe: run GGUF Mixture-of-Experts models fast on a CPU + GPU."""
    ctx.meta["edgemoe.debug"] = debug
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not debug:
        logging.getLogger("edgemoe.llama_cpp").setLevel(logging.CRITICAL)
    if debug:  # native aborts with ggml's backtrace; edgemoe.runtime.native reads this when it loads
        os.environ["EDGEMOE_DEBUG"] = "1"
        if "edgemoe.runtime.native" in sys.modules:
            sys.modules["edgemoe.runtime.native"].set_native_debug(True)


COMMANDS: tuple[click.Command, ...] = (
    model.inspect,
    model.generate,
    model.chat,
    serve.serve,
    analysis.trace,
    analysis.trace_stats,
    analysis.trace_synth,
    analysis.verify,
    analysis.perplexity,
    calibrate.calibrate,
    calibrate.predict_eval,
    bench.bench,
    perf.profile,
    perf.simulate,
    perf.plan,
    doctor.doctor,
)
for _command in COMMANDS:
    cli.add_command(_command)


def main() -> None:
    try:
        cli(prog_name="edgemoe", standalone_mode=False)
    except click.exceptions.Exit as err:
        raise SystemExit(err.exit_code) from None
    except click.ClickException as err:
        err.show()
        raise SystemExit(err.exit_code) from None
    except (click.Abort, KeyboardInterrupt):
        click.echo("Interrupted.", err=True)
        raise SystemExit(130) from None  # the shell's convention for SIGINT
