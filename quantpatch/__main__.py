from quantpatch.cli import run

run()
