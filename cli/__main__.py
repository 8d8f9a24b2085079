from evocache.cli.app import main

main()
