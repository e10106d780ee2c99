"""The console script's entry point, kept apart from ``ondevice.cli.main`` so that it imports nothing heavy."""


def run() -> None:
    """Console-script entry point: a Ctrl-C while the command's modules import (typer, rich: the first tenth of
    a second) exits 130 quietly, as one during the command does, instead of printing an import traceback."""
    try:
        from ondevice.cli.main import main
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    main()
