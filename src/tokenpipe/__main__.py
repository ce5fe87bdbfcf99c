from tokenpipe.cli import main

main()
