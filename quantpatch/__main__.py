from quantpatch.cli import main

main()
