from ondevice.cli import main

main()
