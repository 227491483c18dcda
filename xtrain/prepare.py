"""`python -m xtrain.prepare`: the command lives in xtrain/commands/prepare.py."""

from xtrain.commands.prepare import main

if __name__ == "__main__":
    main()
