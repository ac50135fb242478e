from workers.cli.main import main

main()
