from macaron.cli import main

main()
