from tokenpipe.launch import main

main()
