from ondevice.cli.entry import run

run()
