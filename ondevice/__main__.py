from ondevice.cli.main import main

main()
