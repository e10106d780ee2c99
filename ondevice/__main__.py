from ondevice.cli import run

run()
